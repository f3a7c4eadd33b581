"""Where model weights and the KV cache live between the stages of an iteration.

RLHFuse (section 6) and HybridFlow (zero redundancy) free what a stage does
not use: this module owns the two reversible moves the trainer makes, the
byte count that shows them and the per-stage bookkeeping of a rank
(:class:`StageMemory`; docs/training.md, "Memory between stages").

* :class:`StorageRelease` frees the storage behind some tensors *in place*
  (each storage resized to 0 bytes) and gives it back, zero-filled, before
  the next use. The tensor objects, their shapes and every reference to them
  stay valid: the engine's decoder holds actor_gen's weights and its KV cache
  by reference, and sees them again once resharding has refilled the weights.
* :class:`ModuleOffloader` keeps a module's parameters and buffers in host
  memory (pinned where an accelerator exists, :func:`rlhf.platform.pin`) and
  puts a copy on the compute device only while the module runs. The host copy
  stays the original and the device copy is dropped, copied back only when
  asked (after loading a checkpoint into it): for frozen modules (the
  reference and reward models). On a CPU-only host the
  compute device is the CPU and the copy is still made, so the round trip is
  the same code on every host.

:func:`storage_bytes` counts bytes per device, each storage once (views and
megatron's contiguous parameter buffers share one). :class:`SavedActivations`
measures the activations a training forward keeps for its backward (autograd's
saved tensors, each storage once), on any device.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterable, Optional

import torch

from rlhf import platform
from rlhf.tasks import FROZEN_TASKS


def module_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """A module's parameters, then its buffers (a fixed order: the offloader pairs them with host copies)."""
    return list(module.parameters()) + list(module.buffers())


def storage_bytes(tensors: Iterable[torch.Tensor]) -> dict[torch.device, int]:
    """{device: bytes} of the storages behind ``tensors``, each storage counted once (a released one is 0)."""
    seen, out = set(), {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage._cdata not in seen:
            seen.add(storage._cdata)
            out[t.device] = out.get(t.device, 0) + storage.nbytes()
    return out


class _Held:
    """One tensor autograd saved for backward while :class:`SavedActivations` counts; the count drops when
    autograd lets it go (after the backward that used it, or with its graph).

    It keeps a detached alias (same storage and version counter, no ``grad_fn``): holding the saved tensor
    itself would close a cycle through its graph node (output -> grad_fn -> saved variable -> this ->
    output) that Python's garbage collector cannot see, so a graph never backwarded (a metric computed
    with gradients, then detached) would never be freed."""

    __slots__ = ("tensor", "key", "meter", "session")

    def __init__(self, tensor: torch.Tensor, key, meter: "SavedActivations", session: int):
        self.tensor, self.key, self.meter, self.session = tensor.detach(), key, meter, session

    def __del__(self):
        if self.key is not None:
            self.meter.drop(self.key, self.session)


class SavedActivations:
    """Bytes autograd holds saved for backward, of the tensors saved inside ``with meter:``: the activations
    of the forwards whose backward has not run yet (every micro-batch a pipeline schedule keeps in flight).

    Inside the context every tensor autograd saves passes a ``saved_tensors_hooks`` pack hook: its
    storage counts once however many saved tensors view it, from the first save until the last of them
    is released, and storages of ``exclude`` (the parameters, which a linear layer saves too) never
    count. Each ``with`` block is one measurement: :attr:`peak` is the most bytes held at once since it
    began, :attr:`held` the bytes held now; tensors saved before it (a graph an earlier block left
    alive) do not count. Recomputation shows as fewer saved bytes (a checkpointed chunk saves its input
    only; its recomputed activations count while its backward runs). Backward inside the context gets the
    saved tensors detached, as any pack hook that copies them would: no double backward through them.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self.excluded = {t.untyped_storage()._cdata for t in exclude}
        self._counts: dict = {}  # storage key -> [saved tensors holding it, bytes], of this session
        self._session = 0  # the measurement (with block) a saved tensor belongs to
        self._lock = threading.Lock()  # a backward may release tensors on the autograd engine's threads
        self.held = 0
        self.peak = 0
        self._hooks = None

    def _pack(self, tensor: torch.Tensor) -> _Held:
        try:
            storage = tensor.untyped_storage()
        except (NotImplementedError, RuntimeError):  # no plain storage (sparse, nested): not counted
            return _Held(tensor, None, self, self._session)
        key = storage._cdata
        if key in self.excluded:
            return _Held(tensor, None, self, self._session)
        with self._lock:
            entry = self._counts.setdefault(key, [0, storage.nbytes()])
            entry[0] += 1
            if entry[0] == 1:
                self.held += entry[1]
                self.peak = max(self.peak, self.held)
        return _Held(tensor, key, self, self._session)

    @staticmethod
    def _unpack(held: _Held) -> torch.Tensor:
        return held.tensor

    def drop(self, key, session: int) -> None:
        """One saved tensor on storage ``key`` released (called by autograd's release of it); one of an
        earlier measurement no longer counts."""
        with self._lock:
            if session != self._session:
                return
            entry = self._counts[key]
            entry[0] -= 1
            if entry[0] == 0:
                self.held -= entry[1]
                del self._counts[key]

    def __enter__(self) -> "SavedActivations":
        with self._lock:
            self._session += 1
            self._counts, self.held, self.peak = {}, 0, 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None


class StorageRelease:
    """Frees and restores the storages behind ``tensors`` in place (FSDP's resize trick).

    While released, the tensors keep their shapes but hold no memory; reading
    one is an error. :meth:`restore` gives every storage its size back,
    zero-filled (never uninitialised memory: the KV cache's masked attention
    would turn stray NaN bits into NaN outputs), for the owner to refill.
    """

    def __init__(self, tensors: Iterable[torch.Tensor]):
        storages = {}
        for t in tensors:
            storage = t.untyped_storage()
            storages.setdefault(storage._cdata, (storage, storage.nbytes()))
        self._storages = list(storages.values())
        self.released = False

    @property
    def nbytes(self) -> int:
        """Bytes the tensors hold when restored."""
        return sum(n for _, n in self._storages)

    def release(self) -> None:
        """Free every storage (idempotent)."""
        for storage, _ in self._storages:
            storage.resize_(0)
        self.released = True

    def restore(self) -> None:
        """Reallocate every storage at its former size, zero-filled (no-op unless released)."""
        if not self.released:
            return
        for storage, nbytes in self._storages:
            storage.resize_(nbytes)
            storage.fill_(0)
        self.released = False


class ModuleOffloader:
    """A frozen module's weights in host memory, on ``device`` only inside :meth:`on_device`.

    Built around a module wherever its weights are, it moves them to the host
    at once. ``device`` defaults to :func:`rlhf.platform.device`.
    """

    def __init__(self, module: torch.nn.Module, device: Optional[torch.device] = None):
        self.module = module
        self.device = torch.device(device) if device is not None else platform.device()
        self._host: Optional[list[torch.Tensor]] = None  # the originals while a device copy is in use
        for t in module_tensors(module):
            t.data = platform.pin(t.data.to("cpu"))

    @property
    def on_host(self) -> bool:
        return self._host is None

    def load(self) -> None:
        """Point every parameter and buffer at a fresh copy on the device (asynchronous from pinned memory)."""
        if not self.on_host:
            return
        tensors = module_tensors(self.module)
        self._host = [t.data for t in tensors]
        for t in tensors:
            t.data = t.data.to(self.device, copy=True, non_blocking=True)

    def offload(self, write_back: bool = False) -> None:
        """Point them back at the host originals, into which ``write_back`` first copies the device values
        (else changes made on the device are lost); the device copies are dropped (freed once unreferenced)."""
        if self.on_host:
            return
        for t, host in zip(module_tensors(self.module), self._host):
            if write_back:
                host.copy_(t.data)
            t.data = host
        self._host = None

    @contextlib.contextmanager
    def on_device(self, write_back: bool = False):
        """The module on the device for the body, back on the host after it (also when it raises)."""
        self.load()
        try:
            yield self.module
        finally:
            self.offload(write_back)

    def resident_bytes(self) -> int:
        """Bytes of the module's device copies: 0 while offloaded (host memory is not counted)."""
        return 0 if self.on_host else sum(storage_bytes(module_tensors(self.module)).values())


MEMORY_PARTS = ("parameters", "kv", "gradients", "optimizer")
"""What :meth:`StageMemory.breakdown` counts on a rank: the models' resident weights (parameters and
buffers), the KV cache, the trained models' gradient buffers and their optimizer state."""
TRAINING_PARTS = ("gradients", "optimizer", "activations")
"""The parts reported for the training stage only (gradients and optimizer state stay resident in every
stage; activations exist only there)."""


class StageMemory:
    """This rank's model memory between the stages of a PPO iteration, and the bytes each stage held.

    ``offload_frozen``: the frozen models (reference, reward; rlhf.tasks.FROZEN_TASKS) stay in host
    memory except inside :meth:`on_device`. ``release_generation``: actor_gen's parameters and the
    engine's KV cache (``kv_cache``, None where actor_gen is not placed) are freed now and outside
    generation (:meth:`release_generation`, :meth:`restore_generation`). ``optimizers``: the
    rlhf.optim.ModelOptimizer of each trained task on this rank (their gradient buffers and state are
    counted). :meth:`note` keeps the most :meth:`resident_bytes` seen in a stage and the most of each
    part of :meth:`breakdown`; :meth:`training_activations` measures the training stage's saved
    activations; :meth:`metrics` reports them once per iteration.
    """

    def __init__(self, models: dict, kv_cache: Optional[torch.Tensor], offload_frozen: bool,
                 release_generation: bool, optimizers: Optional[dict] = None):
        self.models = models
        self.kv_cache = kv_cache
        self.optimizers = optimizers or {}
        self.offloaders = ({t: ModuleOffloader(models[t]) for t in FROZEN_TASKS if t in models}
                           if offload_frozen else {})
        self.generation: Optional[StorageRelease] = None
        if release_generation:
            held = [] if kv_cache is None else [*models["actor_gen"].parameters(), kv_cache]
            self.generation = StorageRelease(held)
            self.generation.release()  # the first reshard allocates them again
        self.activations = SavedActivations([p for m in models.values() for p in m.parameters()])
        self._noted: dict = {}  # stage -> the most resident_bytes() noted in it this iteration
        self._parts: dict = {}  # stage -> {part: the most bytes noted}, parts of breakdown() and activations
        self.last: dict = {}  # the same as _noted of the last finished iteration on this rank
        self.last_parts: dict = {}  # the same as _parts of that iteration

    def on_device(self, *tasks: str, write_back: bool = False) -> contextlib.ExitStack:
        """A context with the offloaded models of ``tasks`` on the compute device (others: as they are);
        ``write_back`` keeps what the body wrote into them (a checkpoint load)."""
        stack = contextlib.ExitStack()
        for task in tasks:
            if task in self.offloaders:
                stack.enter_context(self.offloaders[task].on_device(write_back))
        return stack

    @property
    def generation_released(self) -> bool:
        """Whether actor_gen's weights and KV cache are freed now (the same on every rank)."""
        return self.generation is not None and self.generation.released

    def restore_generation(self) -> None:
        """Allocate actor_gen's weights and KV cache again, zero-filled, for the reshard to fill."""
        if self.generation is not None:
            self.generation.restore()

    def release_generation(self) -> None:
        """Free actor_gen's weights and KV cache after generation (with ``release_generation``)."""
        if self.generation is not None:
            self.generation.release()

    def weight_bytes(self) -> int:
        """Bytes of model weights (parameters and buffers) this rank holds where it computes now: an
        offloaded model counts while loaded, released storage as 0."""
        total = 0
        for task, model in self.models.items():
            offloader = self.offloaders.get(task)
            total += offloader.resident_bytes() if offloader else sum(storage_bytes(module_tensors(model)).values())
        return total

    def kv_bytes(self) -> int:
        """Bytes of the engine's KV cache on this rank (0 while released or where actor_gen is not placed)."""
        return 0 if self.kv_cache is None else sum(storage_bytes([self.kv_cache]).values())

    def resident_bytes(self) -> int:
        """Bytes of model weights and KV cache this rank holds where it computes now (:meth:`weight_bytes` +
        :meth:`kv_bytes`; optimizer state and gradients not included)."""
        return self.weight_bytes() + self.kv_bytes()

    def breakdown(self) -> dict:
        """{part: bytes} of :data:`MEMORY_PARTS` held on this rank now (each part's storages counted once)."""
        grads = [t for opt in self.optimizers.values() for t in opt.gradient_buffers()]
        state = [t for opt in self.optimizers.values() for t in opt.state_tensors()]
        return {"parameters": self.weight_bytes(), "kv": self.kv_bytes(),
                "gradients": sum(storage_bytes(grads).values()), "optimizer": sum(storage_bytes(state).values())}

    def note(self, stage: str, activations: Optional[int] = None) -> None:
        """Keep the most :meth:`resident_bytes` and :meth:`breakdown` parts seen in ``stage`` this iteration
        (noted after its loads, before its releases), and ``activations`` bytes when given."""
        self._noted[stage] = max(self._noted.get(stage, 0), self.resident_bytes())
        parts = self._parts.setdefault(stage, {})
        measured = self.breakdown() | ({} if activations is None else {"activations": activations})
        for part, n in measured.items():
            parts[part] = max(parts.get(part, 0), n)

    @contextlib.contextmanager
    def training_activations(self):
        """The body's training forwards and backwards measured (:class:`SavedActivations`); noted as the
        training stage's activations when it ends."""
        with self.activations:
            yield
        self.note("training", activations=self.activations.peak)

    def metrics(self) -> dict:
        """Per noted stage, on its heaviest rank (the metric's name says max): ``memory_<stage>_bytes_max``
        (weights + KV cache), ``memory_<stage>_parameters_bytes_max`` and ``memory_<stage>_kv_bytes_max``;
        for the training stage also its gradients, optimizer and activations parts and
        ``memory_training_total_bytes_max`` (all five parts, summed per rank). On an accelerator
        ``memory_peak_bytes_max``: its allocator's peak since the iteration began
        (rlhf.platform.peak_memory_bytes)."""
        self.last, self._noted = self._noted, {}
        self.last_parts, self._parts = self._parts, {}
        out = {f"memory_{stage}_bytes_max": float(n) for stage, n in self.last.items()}
        for stage, parts in self.last_parts.items():
            shown = [p for p in parts if stage == "training" or p not in TRAINING_PARTS]
            out.update({f"memory_{stage}_{p}_bytes_max": float(parts[p]) for p in shown})
            if stage == "training":
                out["memory_training_total_bytes_max"] = float(sum(parts.values()))
        peak = platform.peak_memory_bytes()
        if peak is not None:
            out["memory_peak_bytes_max"] = float(peak)
        return out
