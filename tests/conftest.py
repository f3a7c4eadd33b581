"""Suite-wide settings: CPU mode for every process the tests start, and the ``gpu`` marker.

How the suite is laid out:

- ``test_<x>.py`` tests what ``<x>`` names (a module, a tool, a behaviour), never a milestone.
- A multi-rank test launches a ``scenario_<x>.py``: the code that runs on every rank of one gloo
  process set (``rlhf.testing.distributed.launch(n, "scenario_<x>:run")``), returning what the
  tests assert on. Only ``test_<x>*.py`` files use ``scenario_<x>.py`` (``test_fusion_runtime.py``
  and ``test_fusion_transport.py`` share ``scenario_fusion.py``), and they share one launch per
  module (a fixture), since each process pays the megatron import.
- Shared helpers live in ``rlhf/testing/`` (importable; no test edits the import path).

The multi-rank tests run gloo process sets on one host, which a single GPU
cannot serve over NCCL, so ``RLHF_DEVICE=cpu`` is set for the whole session
(spawned workers and subprocesses inherit it). Tests marked ``gpu`` need a
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
