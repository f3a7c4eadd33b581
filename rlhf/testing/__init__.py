"""Shared test helpers: a gloo process launcher, reference implementations, tool loading.

Tests, benchmarks and the scenarios they run in worker processes import these
from the installed package; no script edits the import path.
"""
