"""Collectives that never return: every process group waits at most the run's timeout
(``--distributed-timeout-minutes``), and a collective that fails is reported in one line.

torch gives a group made by ``new_group`` its backend's default timeout (gloo 30 min), not
the one ``init_process_group`` got, so every group of a run is made here with the run's
timeout (:func:`new_group`) and the name of what uses it. When a peer rank dies, the
collective fails at once ("Connection closed by peer"); when it stops answering (a hung
kernel, SIGSTOP, a lost node), the collective fails after the timeout. Either way
:func:`describe_failure` turns the backend's message into a line naming the collective,
its group's ranks and users, and the code that called it. On NCCL the watchdog ends the
process itself after the timeout, with its own line naming the collective
(``WorkNCCL(OpType=...)``).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from rlhf.config import DEFAULT_TIMEOUT_MINUTES

_state = {"timeout": timedelta(minutes=DEFAULT_TIMEOUT_MINUTES)}
_names: dict[int, tuple[list[int], set[str]]] = {}  # id(group) -> (its ranks, what uses it)

PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "pair closure", "Broken pipe")
TIMED_OUT = ("timed out", "timeout")  # matched in lower case


def set_timeout(minutes: float) -> timedelta:
    """Make ``minutes`` the timeout of the default group and of every group :func:`new_group` makes after."""
    _state["timeout"] = timedelta(minutes=minutes)
    return _state["timeout"]


def timeout() -> timedelta:
    """The run's collective timeout."""
    return _state["timeout"]


def new_group(ranks, name: str, backend: str | None = None) -> dist.ProcessGroup:
    """``dist.new_group(ranks)`` with the run's timeout, remembered as used by ``name`` (collective)."""
    group = dist.new_group(sorted(ranks), timeout=timeout(), backend=backend)
    name_group(group, sorted(ranks), name)
    return group


def name_group(group, ranks: list[int], name: str) -> None:
    """Remember that ``name`` (a task's tp, dp, ... group) uses ``group`` over ``ranks``."""
    if group is not None:
        _names.setdefault(id(group), (list(ranks), set()))[1].add(name)


def describe_group(group) -> str:
    """``ranks [0, 1] (actor_train tp, critic_inf tp)``, or ``every rank`` for the default group."""
    if group is None or group is dist.GroupMember.WORLD:
        return "every rank"
    group = getattr(group, "process_group", group)  # a reversed pipeline's logical view (groups.py)
    ranks, users = _names.get(id(group), (None, set()))
    if ranks is None:
        return "a group of this run"
    return f"ranks {ranks}" + (f" ({', '.join(sorted(users))})" if users else "")


def describe_failure(error: BaseException, rank: int) -> str | None:
    """One line for a collective that failed because a peer died or stopped answering, or None when
    ``error`` (or what caused it) is not such a failure."""
    while error is not None and not _is_collective_failure(error):
        error = error.__cause__ or error.__context__
    if error is None:
        return None
    frames = _frames(error)
    op, group = _collective(frames)
    caller = _our_caller(frames)
    minutes = timeout().total_seconds() / 60
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if any(s in text for s in PEER_LOST):
        why = "failed: a rank of that group died (its log says why)"
    else:
        why = (f"did not complete within {minutes:g} min (--distributed-timeout-minutes): a rank of that "
               "group stopped answering or died")
    where = f"{op} on {describe_group(group)}" if op else "a collective's wait"
    return f"rank {rank}: {where} {why}; called from {caller} ({text})"


def _is_collective_failure(error: BaseException) -> bool:
    if not isinstance(error, RuntimeError):
        return False
    text = str(error)
    return (any(s in text for s in PEER_LOST) or any(s in text.lower() for s in TIMED_OUT)) and (
        _collective(_frames(error))[0] is not None or "gloo" in text or "NCCL" in text)


def _frames(error: BaseException) -> list:
    frames, tb = [], error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames


def _collective(frames) -> tuple[str | None, object]:
    """The innermost torch.distributed function among ``frames`` and the group it was given."""
    for frame in reversed(frames):
        if frame.f_code.co_filename.endswith(os.path.join("distributed", "distributed_c10d.py")):
            return frame.f_code.co_name, frame.f_locals.get("group")
    return None, None


def _our_caller(frames) -> str:
    """``file:line (function)`` of the innermost frame outside torch (ours or megatron's), past the hooks
    torch calls on every operation (``__torch_function__``)."""
    torch_dir = os.path.dirname(os.path.dirname(dist.__file__))
    for frame in reversed(frames):
        path = frame.f_code.co_filename
        if not path.startswith(torch_dir) and frame.f_code.co_name != "__torch_function__":
            return f"{_short(path)}:{frame.f_lineno} ({frame.f_code.co_name})"
    return "torch"


def _short(path: str) -> str:
    """A path from the repository or site-packages on, as a log line shows it."""
    for marker in ("site-packages" + os.sep, os.sep + "rlhf" + os.sep):
        if marker in path:
            tail = path.rpartition(marker)[2]
            return tail if marker.startswith("site") else "rlhf" + os.sep + tail
    return os.path.basename(path)
