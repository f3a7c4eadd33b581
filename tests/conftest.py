"""Suite-wide settings: CPU mode for every process the tests start, and the ``gpu`` marker.

How the suite is laid out:

- ``test_<x>.py`` tests what ``<x>`` names (a module, a tool, a behaviour), never a milestone.
- A multi-rank test launches a ``scenario_<x>.py``: the code that runs on every rank of one gloo
  process set (``rlhf.testing.distributed.launch(n, "scenario_<x>:run")``), returning what the
  tests assert on. Only ``test_<x>*.py`` files use ``scenario_<x>.py`` (``test_fusion_runtime.py``
  and ``test_fusion_transport.py`` share ``scenario_fusion.py``), and they share one launch per
  module (a fixture), since each process pays the megatron import.
- Shared helpers live in ``rlhf/testing/`` (importable; no test edits the import path).

The budget: ``make test``'s pytest time stays within 15 minutes on an idle 2-core machine
(README.md quotes the last measurement). A new test keeps it there:

- A multi-rank check joins its module's existing launch (one more part of the scenario). A new
  module's launch costs little: ``launch`` forks each rank from a fork server that imported torch,
  megatron-core and the trainer once per session. A ``torchrun`` subprocess (a fresh Python and the
  megatron import on every rank, about 10 s on 2 cores) is for tests of an entry point itself.
- Shapes, iterations and batches are the smallest that make the test's point.
- A launch of the tiny default that trains its reward model reuses the session's cached one
  (``RLHF_CACHE_DIR`` below) unless its reward-inference layout differs; prefer the default layout or
  ``--reward-fn``.
- A benchmark runs in its quick mode (tests/test_benchmarks.py), checked by its summary line, never
  by a time. Print the slowest tests with ``--durations`` and compare before adding a launch.

The multi-rank tests run gloo process sets on one host, which a single GPU
cannot serve over NCCL, so ``RLHF_DEVICE=cpu`` is set for the whole session
(launched workers and subprocesses inherit it). Tests marked ``gpu`` need a
CUDA device, clear it themselves, and are deselected (not skipped) where
CUDA is absent.

``RLHF_CACHE_DIR`` (the tiny default's trained reward model, rlhf/ppo/reward_cache.py) is one fresh
directory per session, inherited the same way: each distinct reward model trains once per session, and no
test reads a user's cache.
"""

import os

import pytest
import torch

os.environ["RLHF_DEVICE"] = "cpu"


@pytest.fixture(scope="session", autouse=True)
def reward_cache_dir(tmp_path_factory):
    os.environ["RLHF_CACHE_DIR"] = str(tmp_path_factory.mktemp("rlhf-cache"))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; deselected where there is none")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]
