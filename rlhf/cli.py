"""What every command-line entry point shares: one kind of usage error, reported once, exit status 2.

A ``UsageError`` message starts with the flag or the ``file[:line]`` at fault
and says what would be valid; :func:`report` prints it as
``<program>: <message>`` on the first rank only (under torchrun every rank
checks the same input and would print the same line) and returns 2.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys


class UsageError(Exception):
    """Bad input from the command line or a file it names (the message names the flag or file)."""


def is_first_rank() -> bool:
    """Rank 0 under torchrun, or a plain process."""
    return os.environ.get("RANK", "0") == "0"


def report(program: str, error: Exception) -> int:
    """Print ``<program>: <error>`` to stderr on the first rank; the exit status of bad input."""
    if is_first_rank():
        print(f"{program}: {error}", file=sys.stderr, flush=True)
    return 2


@contextlib.contextmanager
def quiet_unless_first_rank():
    """Silence stdout and stderr on ranks other than 0 (argparse's own errors and --help print there)."""
    if is_first_rank():
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` that keeps the description's layout and shows every flag's default
    (a help text that explains its default itself keeps its own words)."""

    def _get_help_string(self, action):
        if "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)
