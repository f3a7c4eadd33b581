"""rlhf/memory.py: byte counts per device, in-place storage release, and the host/device offloader.

On a CPU-only host the compute device is the CPU itself: the offloader still
makes a separate device copy, so its bookkeeping is checked by storage
identity (the parameters point at the copy, then at the host originals
again) and the copy's release by weak references to its storages, which
die exactly when the storage is freed. tests/test_gpu.py checks the same on a GPU by bytes.
"""

import copy
import gc
import weakref

import pytest
import torch

from rlhf.memory import ModuleOffloader, SavedActivations, StorageRelease, module_tensors, storage_bytes

CPU, META = torch.device("cpu"), torch.device("meta")


def _module() -> torch.nn.Module:
    """A module with parameters and buffers (batch norm's running statistics), in eval mode."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
    with torch.no_grad():
        model[1].running_mean.normal_()
        model[1].running_var.uniform_(0.5, 2.0)
    return model.eval()


def _nbytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in module_tensors(model))


def _pointers(model) -> list:
    return [t.data_ptr() for t in module_tensors(model)]


def test_storage_bytes_counts_each_storage_once_per_device():
    a = torch.zeros(10)
    counted = storage_bytes([a, a[2:5], a.view(2, 5), torch.zeros(3, dtype=torch.float64),
                             torch.empty(4, 4, device=META)])
    assert counted == {CPU: 10 * 4 + 3 * 8, META: 16 * 4}


def test_storage_release_frees_in_place_and_restores_zero_filled():
    weight, cache = torch.randn(4, 6), torch.randn(2, 3, 5)
    alias = weight.data[1]  # what a decoder holds: a view taken before the release
    release = StorageRelease([weight, alias, cache])
    assert release.nbytes == (24 + 30) * 4 and not release.released
    release.release()
    release.release()  # idempotent
    assert release.released and storage_bytes([weight, cache]) == {CPU: 0}
    assert weight.shape == (4, 6) and alias.shape == (6,)  # the tensor objects and shapes stay
    release.restore()
    assert storage_bytes([weight, cache]) == {CPU: (24 + 30) * 4}
    assert torch.equal(weight, torch.zeros(4, 6)) and torch.equal(cache, torch.zeros(2, 3, 5))
    weight.copy_(torch.arange(24.0).view(4, 6))  # refilled, as a reshard does
    assert torch.equal(alias, torch.arange(6.0, 12.0))  # the old view sees the restored storage


def test_offloader_frees_the_device_copy_and_points_back_at_the_host_originals():
    model = _module()
    size = _nbytes(model)
    offloader = ModuleOffloader(model, device=CPU)
    host = _pointers(model)
    assert offloader.on_host and offloader.resident_bytes() == 0
    with offloader.on_device():
        assert offloader.resident_bytes() == size  # every parameter and buffer has a device copy
        copies = [weakref.ref(t.untyped_storage()) for t in module_tensors(model)]
        assert all(ref() is not None for ref in copies)
    assert _pointers(model) == host  # the host originals again, not new copies
    assert all(ref() is None for ref in copies)  # the device copies were freed: nothing holds them
    assert offloader.resident_bytes() == 0 and storage_bytes(module_tensors(model)) == {CPU: size}


def test_offloaded_weights_round_trip_bit_for_bit_and_compute_the_same():
    model = _module()
    original = copy.deepcopy(model.state_dict())
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x)
    offloader = ModuleOffloader(model, device=CPU)
    host = _pointers(model)
    for _ in range(2):
        with offloader.on_device(), torch.no_grad():
            loaded = _pointers(model)
            assert not set(loaded) & set(host)  # a separate copy is what runs
            assert torch.equal(model(x), expected)
        assert _pointers(model) == host
    for name, value in model.state_dict().items():
        assert torch.equal(value, original[name]), name


def test_offloader_goes_back_to_the_host_when_the_body_raises():
    model = _module()
    offloader = ModuleOffloader(model, device=CPU)
    with pytest.raises(RuntimeError, match="inference failed"):
        with offloader.on_device():
            raise RuntimeError("inference failed")
    assert offloader.on_host and offloader.resident_bytes() == 0


def test_offloader_keeps_what_was_written_on_the_device_only_with_write_back():
    model = _module()
    offloader = ModuleOffloader(model, device=CPU)
    weight = model[0].weight
    for write_back, expected in ((False, weight.detach().clone()), (True, torch.full_like(weight, 3.0))):
        with offloader.on_device(write_back), torch.no_grad():
            weight.fill_(3.0)  # e.g. a checkpoint loaded into the device copy
        assert torch.equal(weight, expected), write_back


def test_saved_activations_count_each_saved_storage_once_until_its_backward():
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(8, 3))
    meter = SavedActivations([weight])
    losses = []
    with meter:
        for _ in range(2):  # two micro-batches in flight, as a pipeline schedule keeps them
            x = torch.randn(4, 8, requires_grad=True)
            z = (x @ weight).exp()  # mm saves x (128 B) and the weight (excluded); exp saves z (48 B)
            losses.append((z * z[:, :].view(4, 3)).sum())  # saves z and a view of it: one storage
        assert meter.held == meter.peak == 2 * (4 * 8 + 4 * 3) * 4
        losses.pop().backward()  # autograd frees what that micro-batch saved
        assert meter.held == (4 * 8 + 4 * 3) * 4
        losses.pop().backward()
    assert meter.held == 0 and meter.peak == 2 * (4 * 8 + 4 * 3) * 4
    with torch.no_grad(), meter:  # a new measurement
        (torch.randn(4, 8) @ weight).exp()  # nothing is saved without a graph
    assert meter.peak == 0


def test_a_measurement_counts_only_what_was_saved_inside_it():
    meter = SavedActivations()
    with meter:
        left = torch.randn(10, requires_grad=True).sin()  # saves its 40 B input; never backwarded here
    assert meter.peak == meter.held == 40
    with meter:
        assert meter.held == 0  # the graph left alive before does not count
        kept = torch.randn(6, requires_grad=True).sin()
        del left  # releasing an earlier measurement's tensor changes nothing here
        assert meter.held == meter.peak == 24
    del kept  # its graph goes, and with it the saved input
    assert meter.held == 0 and meter.peak == 24


def test_a_graph_never_backwarded_is_freed_under_the_meter():
    """exp saves its output; a metric computed with gradients and detached leaves that graph unreferenced,
    and it must be freed (the meter keeps no reference that would close a cycle through the graph)."""
    meter = SavedActivations()
    with meter:
        y = torch.randn(10, requires_grad=True).exp()
        alive = weakref.ref(y)
        stat = y.sum().detach()
        assert meter.held == 40
        del y
        gc.collect()
        assert alive() is None and meter.held == 0 and meter.peak == 40
        z = torch.randn(10, requires_grad=True)
        (z.exp() * 2).sum().backward()  # backward through the saved output still works
        assert torch.allclose(z.grad, 2 * z.detach().exp()) and meter.held == 0
    assert float(stat) != 0
