"""GAE: recursive loop (reference) vs matrix form (rlhf.algorithms.compute_gae).

Prints, side by side in one run: wall time of each (median of repeats), their
ratio, and peak extra memory of each, for B=64 and T in {1024, 4096, 16384}
(mixed response lengths in [T/2, T], with masked spans inside responses).

    python benchmarks/gae.py [--sweep-blocks] [--default-malloc] [--quick]

``--quick`` (a check that it runs, not a measurement) shrinks T to {256, 1024} and
the side-by-side timing to 2 rounds (instead of 10, 6 for T > 4096), and with
--sweep-blocks times each block size 3 times instead of 30.

The last line is the summary: ``gae: T=<T> ratio=<r>x loop_mib=<a> matrix_mib=<b>,
...`` per T, then ``max_rel_err=<e>`` (r: loop time over matrix time, the minima;
a, b: peak MiB per call; e: the largest relative error of the matrix form).

Memory method: a TorchDispatchMode sees every tensor produced by an ATen op
during one call (composite ops included) and counts its storage bytes until
the last Python reference dies; the peak of that running total is reported.
It counts tensor storage only (not kernel-internal scratch or allocator slack)
and excludes the inputs. Python-side objects of the loop (lists) are ignored.

Allocator: glibc returns freed multi-MB blocks to the OS, and on this VM the
page faults on re-allocation dominate and vary 10-100x between runs. Unless
--default-malloc is given, the script re-executes itself with
MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ raised so freed blocks stay in
the heap (the effect of the jemalloc/tcmalloc setups recommended for PyTorch on
CPU); both methods run under the same allocator.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from rlhf.algorithms.gae import DEFAULT_BLOCK, compute_gae
from rlhf.testing.reference import gae_loop

GAMMA, LAM, BATCH = 0.99, 0.95, 64
LENGTHS, QUICK_LENGTHS = (1024, 4096, 16384), (256, 1024)
_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 32)}


class PeakTensorMemory(TorchDispatchMode):
    """Peak bytes of live tensor storage allocated while the mode is active."""

    def __init__(self):
        super().__init__()
        self.live = {}  # storage ptr -> [python refs, nbytes]
        self.current = 0
        self.peak = 0

    def _release(self, key):
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= self.live.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor) or tensor.untyped_storage().data_ptr() == 0:
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key in self.live:
                self.live[key][0] += 1
            else:
                self.live[key] = [1, storage.nbytes()]
                self.current += storage.nbytes()
                self.peak = max(self.peak, self.current)
            weakref.finalize(tensor, self._release, key)
        return out


def make_inputs(length: int, seed: int = 0):
    """[B, T] rewards, values, bool mask: lengths in [T/2, T], a masked span
    (tool output) of up to T/8 tokens inside about half of the responses."""
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(BATCH, length, generator=gen)
    values = torch.randn(BATCH, length, generator=gen)
    pos = torch.arange(length)
    lengths = torch.randint(length // 2, length + 1, (BATCH, 1), generator=gen)
    start = torch.randint(0, max(length // 2, 1), (BATCH, 1), generator=gen)
    span = torch.randint(0, length // 8 + 1, (BATCH, 1), generator=gen) * (torch.rand(BATCH, 1, generator=gen) < 0.5)
    mask = (pos < lengths) & ~((pos >= start) & (pos < start + span))
    return rewards, values, mask


def time_ms(fn, repeats: int) -> tuple[float, float]:
    """(min, median) wall time in ms of ``repeats`` calls after a warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times), 1e3 * statistics.median(times)


def time_side_by_side(loop, matrix, rounds: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """Alternate one loop call and ten matrix calls per round, so both see the
    same background load; (min, median) ms of each. Ratios use the minima: the
    runs least disturbed by other processes on a shared machine."""
    loop_times, matrix_times = [], []
    for _ in range(rounds):
        loop_times.append(time_ms(loop, 1)[0])
        matrix_times.append(time_ms(matrix, 10)[0])
    return (min(loop_times), statistics.median(loop_times)), (min(matrix_times), statistics.median(matrix_times))


def peak_mib(fn) -> float:
    with PeakTensorMemory() as tracker:
        fn()
    return tracker.peak / 2**20


def compare(length: int, rounds: int | None = None) -> dict:
    """Print one T's row; returns its ratio, memories and error for the summary line.  ``rounds``:
    side-by-side timing rounds (default 6 for T > 4096, else 10)."""
    rewards, values, mask = make_inputs(length)
    loop = lambda: gae_loop(rewards, values, mask, GAMMA, LAM)  # noqa: E731
    matrix = lambda: compute_gae(rewards, values, mask, GAMMA, LAM)  # noqa: E731
    reference = loop()[0]
    err = (reference - matrix()[0]).abs().max() / reference.abs().max()
    (loop_ms, loop_med), (matrix_ms, matrix_med) = time_side_by_side(
        loop, matrix, rounds or (6 if length > 4096 else 10))
    loop_mem, matrix_mem = peak_mib(loop), peak_mib(matrix)
    print(
        f"{length:>6} | {loop_ms:8.2f} ({loop_med:8.2f}) | {matrix_ms:6.3f} ({matrix_med:6.3f}) | "
        f"{loop_ms / matrix_ms:6.1f}x | {loop_mem:8.2f} | {matrix_mem:8.2f} | {err:.1e}"
    )
    return {"ratio": loop_ms / matrix_ms, "loop_mib": loop_mem, "matrix_mib": matrix_mem, "err": float(err)}


def sweep_blocks(lengths=LENGTHS, repeats: int = 30) -> None:
    print(f"\nmatrix time (ms, min of {repeats}) by block size K")
    blocks = (16, 32, 64, 128, 256)
    print("     T | " + " | ".join(f"K={k:<5}" for k in blocks))
    for length in lengths:
        rewards, values, mask = make_inputs(length)
        row = [time_ms(lambda: compute_gae(rewards, values, mask, GAMMA, LAM, block=k), repeats)[0]
               for k in blocks]
        print(f"{length:>6} | " + " | ".join(f"{ms:7.3f}" for ms in row))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep-blocks", action="store_true",
                        help="also time the matrix form for block sizes 16..256")
    parser.add_argument("--default-malloc", action="store_true",
                        help="keep glibc's default trimming instead of re-executing with raised "
                             "MALLOC_*_THRESHOLD_ (see the module docstring)")
    parser.add_argument("--quick", action="store_true",
                        help="a check that it runs, not a measurement: T in {256, 1024} instead of {1024, 4096, "
                             "16384}, 2 timing rounds per T, 3 repeats per block size with --sweep-blocks")
    args = parser.parse_args()
    lengths = QUICK_LENGTHS if args.quick else LENGTHS
    if not args.default_malloc and any(os.environ.get(k) != v for k, v in _MALLOC_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **_MALLOC_ENV})
    allocator = "glibc default" if args.default_malloc else "glibc, trim/mmap thresholds raised"
    print(
        f"machine: {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, allocator: {allocator}"
    )
    print(f"B={BATCH}, gamma={GAMMA}, lam={LAM}, block={DEFAULT_BLOCK}; memory = peak tensor bytes per call")
    print("load average (1 min) at the start: %.2f" % os.getloadavg()[0])
    print("     T | loop ms min (median) | matrix ms min (median) |  ratio  | loop MiB | matrix MiB | max rel err")
    rows = {length: compare(length, 2 if args.quick else None) for length in lengths}
    print("load average (1 min) at the end: %.2f on %d cores" % (os.getloadavg()[0], os.cpu_count()))
    if args.sweep_blocks:
        sweep_blocks(lengths, 3 if args.quick else 30)
    print("gae: " + ", ".join(f"T={length} ratio={r['ratio']:.1f}x loop_mib={r['loop_mib']:.2f} "
                              f"matrix_mib={r['matrix_mib']:.2f}" for length, r in rows.items())
          + f" max_rel_err={max(r['err'] for r in rows.values()):.1e}")


if __name__ == "__main__":
    main()
