"""RNG state of a process as JSON-safe data: captured into a checkpoint, restored on resume.

Python ``random``, numpy's global RNG and torch's CPU RNG always; any other
generator (the accelerator's, megatron's tracker...) through an :class:`RngHook`.
Storage (:mod:`rlhf.checkpoint.storage`) writes the result as a per-rank JSON
file, e.g. ``json_files={f"rng_rank{r}": capture_rng_state()}``. Of rlhf.checkpoint it imports only
storage's error class.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch

from rlhf.checkpoint.storage import CheckpointError

__all__ = ["RngHook", "accelerator_rng_hook", "capture_rng_state", "restore_rng_state"]


@dataclass(frozen=True)
class RngHook:
    """An extra RNG to capture/restore (accelerator, megatron's tracker...).

    ``get_state()`` returns a JSON-serialisable value; ``set_state(value)``
    restores it.
    """

    name: str
    get_state: Callable[[], Any]
    set_state: Callable[[Any], None]


def accelerator_rng_hook() -> Optional[RngHook]:
    """RNG state of every device of the current accelerator, or ``None`` without one.

    Goes through ``torch.accelerator`` / ``torch.get_device_module`` so the
    code names no device type.
    """
    acc = getattr(torch, "accelerator", None)
    if acc is None or not acc.is_available():
        return None
    device_type = acc.current_accelerator().type
    module = torch.get_device_module(device_type)

    def get_state():
        return {"device_type": device_type,
                "states": [s.cpu().tolist() for s in module.get_rng_state_all()]}

    def set_state(value):
        if value["device_type"] != device_type:
            raise CheckpointError(f"RNG state saved for {value['device_type']!r}, "
                                  f"this process runs on {device_type!r}")
        module.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in value["states"]])

    return RngHook("accelerator", get_state, set_state)


def capture_rng_state(hooks: Sequence[RngHook] = ()) -> dict:
    """Python ``random``, numpy's global RNG, torch CPU, plus ``hooks``, as JSON-safe data.

    Pass ``[accelerator_rng_hook()]`` (when not ``None``) to include the
    accelerator. Store the result per rank, e.g. ``json_files={f"rng_rank{r}": ...}``.
    """
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state(legacy=True)
    state = {
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss},
        "numpy": {"bit_generator": np_state[0], "key": np_state[1].tolist(), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "torch_cpu": torch.get_rng_state().tolist(),
        "hooks": {h.name: h.get_state() for h in hooks},
    }
    return state


def restore_rng_state(state: Mapping[str, Any], hooks: Sequence[RngHook] = ()) -> None:
    """Inverse of :func:`capture_rng_state`; every hook given must have a saved state."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    n = state["numpy"]
    np.random.set_state((n["bit_generator"], np.asarray(n["key"], dtype=np.uint32), n["pos"],
                         n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(torch.tensor(state["torch_cpu"], dtype=torch.uint8))
    saved = state.get("hooks", {})
    for h in hooks:
        if h.name not in saved:
            raise CheckpointError(f"no saved RNG state for hook {h.name!r} "
                                  f"(saved: {sorted(saved) or 'none'})")
        h.set_state(saved[h.name])
