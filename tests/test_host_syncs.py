"""rlhf/testing/host_syncs.py: the would-be synchronisations it counts on the CPU, and those it does not; and
that one training and one inference micro-batch make none (tests/scenario_host_syncs.py, on the CPU and on a GPU)."""

import inspect

import pytest
import torch

from rlhf import platform
from rlhf.testing.distributed import launch
from rlhf.testing.host_syncs import HostSyncCounter


def _ops(block) -> list:
    with HostSyncCounter() as counter:
        block()
    return [e.op for e in counter.events]


def test_scalar_reads_and_data_dependent_shapes_are_counted():
    x = torch.tensor([0.5, -1.0, 2.0])
    assert _ops(lambda: x.sum().item()) == ["aten._local_scalar_dense.default"]
    assert _ops(lambda: bool(x.max() > 0)) == ["aten._local_scalar_dense.default"]
    assert _ops(lambda: torch.equal(x, x)) == ["aten.equal.default"]
    assert _ops(lambda: x.nonzero()) == ["aten.nonzero.default"]
    assert _ops(lambda: x[x > 0]) == ["aten.index.Tensor"]
    assert _ops(lambda: x.masked_select(x > 0)) == ["aten.masked_select.default"]
    assert len(_ops(lambda: torch.unique(x))) == 1
    repeats = torch.tensor([1, 2, 0])
    assert _ops(lambda: torch.repeat_interleave(x, repeats)) == ["aten.repeat_interleave.Tensor"]


def test_device_side_work_is_not_counted():
    x, index = torch.randn(4, 3), torch.tensor([2, 0])
    repeats = torch.tensor([1, 2, 0, 1])
    assert _ops(lambda: (x @ x.T).softmax(-1)[index].sum(0)) == []
    assert _ops(lambda: torch.where(x > 0, x, 0.0).masked_fill(x < -1, 0.0)) == []
    assert _ops(lambda: torch.repeat_interleave(x, repeats, dim=0, output_size=4)) == []
    assert _ops(lambda: x.repeat_interleave(2, dim=0)) == []


def test_events_name_the_callers_line_and_exclusions_drop_them():
    x = torch.ones(2)
    with HostSyncCounter() as counter:
        x.sum().item()
        line = inspect.currentframe().f_lineno - 1
    assert [e.where for e in counter.events] == [f"{__file__}:{line}"]
    with HostSyncCounter(exclude=("test_host_syncs.py",)) as counter:
        x.sum().item()
    assert counter.events == []


def test_a_training_and_an_inference_micro_batch_make_no_host_sync():
    """tests/scenario_host_syncs.py: the compute of one micro-batch, padded and packed (the actor's log-probs
    and the critic's values; the actor's full loss and the critic's, with backward) makes none, so on a GPU
    the host can queue micro-batch after micro-batch without waiting for the device."""
    (counts,) = launch(1, "scenario_host_syncs:run")
    for layout in ("padded", "packed"):
        assert set(counts[layout]) == {"inference/actor_train", "inference/critic_inf", "training/actor_train",
                                       "training/critic_train"}
        for part, events in counts[layout].items():
            assert events == [], (layout, part, events)


@pytest.mark.gpu
def test_micro_batches_make_no_host_sync_on_the_gpu():
    """The same scenario on the GPU, under ``torch.cuda.set_sync_debug_mode("error")`` (rlhf.platform.syncs_raise),
    so any synchronising call, blocking host-to-device copies included, fails the launch."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(platform.DEVICE_ENV, "auto")
        (counts,) = launch(1, "scenario_host_syncs:run")
    assert all(events == [] for layout in counts.values() for events in layout.values()), counts
