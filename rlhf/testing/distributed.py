"""Run a function on N gloo ranks in fresh processes and collect what each returns.

Workers are forked from a fork server that imported torch, megatron-core and
the trainer's modules once (multiprocessing's ``forkserver`` start method with
those modules preloaded), so a launch costs a fork per rank instead of a
Python start and the megatron import per rank (about 5 s of CPU each). The
server is a clean process that only imported: nothing in it has run torch
threads or a process group. Each worker starts with the parent's import path
(captured when the server starts) and the parent's environment at the launch,
so a target module that the caller can import (a test's scenario module
beside it, a benchmark script) imports in the workers too. A test module
still launches once and runs several checks in that launch.
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


PRELOAD = ["torch", "megatron.core", "rlhf.ppo.trainer"]
"""What the fork server imports once for every worker it forks."""


def _worker(rank: int, world_size: int, port: int, target: str, kwargs: dict, queue, env: dict) -> None:
    os.environ.clear()
    os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
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
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (the first launch)
    queue = ctx.Queue()
    port = _free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, target, kwargs, queue, env))
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
