"""Run a function on N gloo ranks in fresh processes and collect what each returns.

Each process pays the megatron import, so a test module launches once and
runs several checks in that launch. Workers are spawned, so they start with
the parent's import path: a target module that the caller can import (a
test's scenario module beside it, a benchmark script) imports in the workers too.
"""

from __future__ import annotations

import importlib
import os
import socket
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, target: str, kwargs: dict, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import torch

        torch.set_num_threads(1)
        from rlhf import platform

        platform.init_distributed(timeout_s=300)
        module, func = target.split(":")
        result = getattr(importlib.import_module(module), func)(**kwargs)
        queue.put((rank, "ok", result))
    except BaseException:  # report every failure to the parent, with its traceback
        queue.put((rank, "error", traceback.format_exc()))


def launch(world_size: int, target: str, timeout_s: float = 300, **kwargs) -> list:
    """Run ``module:function(**kwargs)`` on ``world_size`` ranks; return results by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, target, kwargs, queue))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout_s)
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 30)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("distributed test failed\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
