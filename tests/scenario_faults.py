"""pretrain_rlhf.py with faults injected: the torchrun entry script of tests/test_faults.py.

``FAULTS`` lists one fault per launch attempt, ``KIND@ITERATION:RANK`` comma-separated: attempt
``a`` (torchrun's ``TORCHELASTIC_RESTART_COUNT``) meets the a-th fault, so a run restarted N times
meets one fault in each of its first N attempts. Kinds:

- ``kill-generation``: SIGKILL in the 2nd engine step of that iteration's generation;
- ``kill-training``: SIGKILL in that iteration's first optimizer step, before it updates anything;
- ``kill-save``: SIGKILL in that iteration's save, after the rank wrote its first file;
- ``stop-training``: SIGSTOP there instead (the process stays, and answers nothing).

A fault's line (``FAULT <kind> iteration <i> rank <r> at <unix time>``) goes to stderr first.
:func:`recorder` is the run's reward function: the synthetic gold rule, appending each batch's prompts
to ``FAULTS_RECORD`` with the attempt that scored them.
"""

import json
import os
import runpy
import signal
import sys
import time

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
_now = {"iteration": 0, "engine_steps": 0}


def recorder(prompts: list, responses: list) -> list:
    """gold_reward, recording ``{"attempt": a, "prompts": [...]}`` per call in the file ``FAULTS_RECORD``."""
    from rlhf.data.synthetic import gold_reward

    with open(os.environ["FAULTS_RECORD"], "a") as f:
        f.write(json.dumps({"attempt": ATTEMPT, "prompts": prompts}) + "\n")
    return gold_reward(prompts, responses)


def _fault() -> tuple[str, int, int] | None:
    faults = [f for f in os.environ.get("FAULTS", "").split(",") if f]
    if ATTEMPT >= len(faults):
        return None
    kind, _, where = faults[ATTEMPT].partition("@")
    iteration, _, rank = where.partition(":")
    return kind, int(iteration), int(rank)


def _strike(kind: str) -> None:
    print(f"FAULT {kind} iteration {_now['iteration']} rank {os.environ['RANK']} at {time.time():.3f}",
          file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGSTOP if kind.startswith("stop") else signal.SIGKILL)


def _wrap(owner, name: str, before) -> None:
    """Call ``before(*args)`` ahead of ``owner.name`` on every call."""
    original = getattr(owner, name)

    def wrapped(*args, **kwargs):
        before(*args)
        return original(*args, **kwargs)

    setattr(owner, name, wrapped)


def install(kind: str, iteration: int, rank: int) -> None:
    """Arm fault ``kind`` for ``iteration`` on ``rank`` (only there)."""
    from rlhf.checkpoint import storage
    from rlhf.engine.engine import Engine
    from rlhf.optim import ModelOptimizer
    from rlhf.ppo.trainer import Trainer

    def on_iteration(trainer):
        _now.update(iteration=trainer.iteration + 1, engine_steps=0)

    _wrap(Trainer, "step", on_iteration)
    if int(os.environ["RANK"]) != rank:
        return

    def armed(*_):
        return _now["iteration"] == iteration

    def on_engine_step(*_):
        _now["engine_steps"] += 1
        if kind == "kill-generation" and armed() and _now["engine_steps"] == 2:
            _strike(kind)

    def on_optimizer_step(*_):
        if kind in ("kill-training", "stop-training") and armed():
            _strike(kind)

    def on_file_written(*_):
        if kind == "kill-save" and armed():
            _strike(kind)

    _wrap(Engine, "step", on_engine_step)
    _wrap(ModelOptimizer, "step", on_optimizer_step)
    original_write = storage.write_safetensors

    def write_then_strike(*args, **kwargs):
        original_write(*args, **kwargs)
        on_file_written()

    storage.write_safetensors = write_then_strike


if __name__ == "__main__":
    fault = _fault()
    if fault is not None:
        install(*fault)
    runpy.run_path(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pretrain_rlhf.py"),
                   run_name="__main__")  # the program as torchrun would start it, with the fault armed
