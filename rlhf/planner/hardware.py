"""The hardware file: what one GPU and its links can do, and the efficiencies the cost model assumes.

JSON, every number in SI units (FLOP/s, bytes/s, bytes, seconds)::

    {"name": "h100-sxm", "gpu_flops": 989e12, "hbm_bandwidth": 3.35e12, "gpu_memory": 85899345920,
     "intra_node_bandwidth": 450e9, "inter_node_bandwidth": 50e9,
     "mfu": 0.45, "hbm_efficiency": 0.6, "call_overhead_s": 0.0, "update_overhead_s": 0.0,
     "layer_overhead_s": 0.0, "host_s": 0.0, "collective_latency_s": 0.0, "shared_cores": 0.0,
     "memory_headroom": 0.9}

``gpu_flops`` is the dense bf16 peak, ``mfu`` the fraction training and
inference reach; ``hbm_efficiency`` the fraction of ``hbm_bandwidth`` a
decode step reaches; bandwidths are per GPU and direction (NVLink inside a
node, the network between nodes); ``call_overhead_s`` is added once per task
call, ``update_overhead_s`` once per training update (the executor's
schedule, gradient reduction and optimizer step), ``layer_overhead_s`` per
layer (one more for the embedding and head) of each sequential step (a decode
step, a micro-batch's pass through a stage: kernel launches and host time,
what dominates tiny models), ``host_s`` once per iteration on every rank
(the gathers between stages, advantages, metrics); ``collective_latency_s`` once
per collective and per pipeline message whatever its size (launch and
synchronisation: microseconds on NVLink, about a millisecond on gloo);
``shared_cores`` > 0 says the ranks of a node share that many compute units
(a CPU host: k busy ranks each run at min(1, shared_cores / k) of their
speed), 0 that every rank has its own device (GPUs); a plan may use
``memory_headroom`` of ``gpu_memory``. rlhf.planner.calibrate fits mfu and
the overheads to a measured run's stage and call times.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

from rlhf.planner.errors import PlannerError

NON_NEGATIVE = ("call_overhead_s", "update_overhead_s", "layer_overhead_s", "host_s", "collective_latency_s",
                "shared_cores")
"""Fields that may be 0 (the rest must be > 0)."""


@dataclass(frozen=True)
class Hardware:
    """One GPU kind and its links (see the module docstring for units)."""

    name: str
    gpu_flops: float
    hbm_bandwidth: float
    gpu_memory: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    mfu: float = 0.45
    hbm_efficiency: float = 0.6
    call_overhead_s: float = 0.0
    update_overhead_s: float = 0.0
    layer_overhead_s: float = 0.0
    host_s: float = 0.0
    collective_latency_s: float = 0.0
    shared_cores: float = 0.0
    memory_headroom: float = 0.9

    def __post_init__(self):
        for f in fields(self):
            if f.name == "name":
                continue
            value = getattr(self, f.name)
            positive = f.name not in NON_NEGATIVE
            fraction = f.name in ("mfu", "hbm_efficiency", "memory_headroom")
            ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                  and (value > 0 if positive else value >= 0) and (value <= 1 or not fraction))
            if not ok:
                valid = "a fraction in (0, 1]" if fraction else ("a number > 0" if positive else "a number >= 0")
                raise PlannerError(f"hardware {self.name!r}: {f.name}={value!r} is invalid; give {valid}")

    def to_dict(self) -> dict:
        return asdict(self)


GiB = 2**30

HARDWARE_PRESETS = {
    "h100": Hardware("h100-sxm", gpu_flops=989e12, hbm_bandwidth=3.35e12, gpu_memory=80 * GiB,
                     intra_node_bandwidth=450e9, inter_node_bandwidth=50e9),
    "a100": Hardware("a100-sxm-80g", gpu_flops=312e12, hbm_bandwidth=2.0e12, gpu_memory=80 * GiB,
                     intra_node_bandwidth=300e9, inter_node_bandwidth=25e9),
    "cpu": Hardware("cpu-gloo", gpu_flops=100e9, hbm_bandwidth=10e9, gpu_memory=8 * GiB,
                    intra_node_bandwidth=2e9, inter_node_bandwidth=2e9),
}
"""Dense bf16 peaks and NVLink / 400 (200) Gb/s-per-GPU network figures of the SXM parts; ``cpu``: one
core per gloo rank (about an AVX-512 core's fp32 peak, a core's share of DRAM bandwidth), a first guess to
calibrate, with ``shared_cores`` set when the ranks share a host's cores."""


def load_hardware(spec: str) -> Hardware:
    """A preset name (h100, a100) or a hardware JSON file; errors name the file and the field."""
    if spec in HARDWARE_PRESETS:
        return HARDWARE_PRESETS[spec]
    path = Path(spec)
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PlannerError(f"hardware file {spec}: {exc} (give a preset: {', '.join(HARDWARE_PRESETS)}, or a JSON "
                           "file of Hardware fields)") from None
    if not isinstance(raw, dict):
        raise PlannerError(f"hardware file {spec}: expected a JSON object of Hardware fields")
    known = {f.name for f in fields(Hardware)}
    required = {f.name for f in fields(Hardware) if f.default is MISSING} - {"name"}
    unknown, missing = set(raw) - known, required - set(raw)
    if unknown or missing:
        raise PlannerError(f"hardware file {spec}: unknown field(s) {sorted(unknown)}, missing field(s) "
                           f"{sorted(missing)}; fields: {', '.join(sorted(known))}")
    raw.setdefault("name", path.stem)
    return Hardware(**raw)


def save_hardware(hw: Hardware, path: str | Path) -> None:
    Path(path).write_text(json.dumps(hw.to_dict(), indent=2) + "\n")
