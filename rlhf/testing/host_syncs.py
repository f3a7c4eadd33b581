"""Count the operations that would make a GPU stream wait for the host, while running on the CPU.

On a GPU a device-to-host synchronisation stalls the host until the queued kernels finish, so a loop of
micro-batches with one in it cannot run ahead of the device. ``torch.cuda.set_sync_debug_mode("error")``
catches them on a GPU; on the CPU there is nothing to wait for, so :class:`HostSyncCounter` (a
``TorchDispatchMode``) records the ATen calls that would synchronise there instead:

- ``_local_scalar_dense``: a tensor read as a Python number (``item``, ``bool``, ``int``, ``float``);
- ``equal``: two tensors compared into a Python bool;
- data-dependent output shapes: ``nonzero``, ``masked_select``, indexing with a boolean mask, ``unique``
  (and its variants), ``repeat_interleave`` without ``output_size``.

What it cannot see on the CPU: ``tolist()``, ``numpy()`` and ``.cpu()`` of a CPU tensor do not reach the
dispatcher; the gpu test under ``set_sync_debug_mode`` covers those. Each event keeps the innermost frame of
the caller's code outside torch (file:line), so a test can say where one came from and leave out a library's
internals (``exclude``: path fragments, e.g. megatron's optimizer).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

ALWAYS_SYNCING = {aten._local_scalar_dense.default, aten.equal.default, aten.nonzero.default,
                  aten.masked_select.default, aten._unique.default, aten._unique2.default, aten.unique_dim.default,
                  aten.unique_consecutive.default}
"""ATen calls whose result the host needs from the device, whatever their arguments."""


def _syncs(func, args, kwargs) -> bool:
    if func in ALWAYS_SYNCING:
        return True
    if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(i is not None and i.dtype == torch.bool for i in indices)
    if func == aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    return False


@dataclass(frozen=True)
class SyncEvent:
    """One would-be synchronisation: the ATen call and where the caller's code made it (file:line)."""

    op: str
    where: str


MODE_HOOKS = ("__torch_function__", "__torch_dispatch__")
"""Frames of a torch mode's hook (this one's, rlhf.platform's CPU adaptation) pass the call on: not its origin."""


def _caller() -> str:
    """The innermost frame outside torch, this module and any mode's hook (file:line)."""
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename
        if "/torch/" not in path and path != __file__ and frame.name not in MODE_HOOKS:
            return f"{path}:{frame.lineno}"
    return "?"


class HostSyncCounter(TorchDispatchMode):
    """``with HostSyncCounter() as syncs: ...`` then ``syncs.events``: the would-be synchronisations of the
    block, but those made from a file whose path contains one of ``exclude``."""

    def __init__(self, exclude: tuple[str, ...] = ()):
        super().__init__()
        self.exclude = exclude
        self.events: list[SyncEvent] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _syncs(func, args, kwargs):
            where = _caller()
            if not any(part in where for part in self.exclude):
                self.events.append(SyncEvent(str(func), where))
        return func(*args, **kwargs)
