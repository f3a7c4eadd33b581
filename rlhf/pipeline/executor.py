"""Instruction executor: runs one rank's compiled program (see compiler.py).

The executor is a ``{kind: handler}`` table over a small per-step state
(received inputs, stage outputs, received output gradients, receives posted
ahead, pending sends).  Receives are posted in each peer's send order (the
compiler's POST_RECVs), so a backend that pairs messages by order (NCCL)
runs every valid schedule; ``tags="per_pair"`` sends every message under one
tag so that gloo pairs them by order too (the tests run both).  Each
instruction names this rank's placement stage of its model (with mixed TP,
one of the ``k`` stages that form a schedule stage).
What a FORWARD/BACKWARD *computes* is a pluggable :class:`Compute`:

* :class:`StageCompute` - megatron GPTModel stages: ``set_input_tensor`` via
  ``stage_forward``, the model's loss on the last stage (divided by the
  micro-batch count, so gradients are a mean over micro-batches whatever
  their order), ``torch.autograd.backward`` with the received gradient,
  gradient accumulation, then the runtime's optimizer (``rlhf.optim.ModelOptimizer``:
  megatron's DP gradient reduction, clipping, update and LR schedule).
* :class:`SleepCompute` - a calibrated sleep of the schedule's cost per
  subtask with dummy activations (benchmarks: timing without compute noise).

:func:`run_step` compiles (refusing a mismatched or cyclic schedule before
any communication), aligns ranks with a barrier, runs, and optionally writes
the Chrome trace of all ranks.
"""
from __future__ import annotations

from collections import Counter
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from rlhf import platform
from rlhf.batch import Batch
from rlhf.models import moe
from rlhf.models.packing import PackedLayout, sequence_shape
from rlhf.schedule.schedule import Schedule

from . import compiler as C
from .p2p import post_recv, post_send, wait_all
from .timeline import Timeline, gather, write_chrome_trace


@dataclass
class ModelRuntime:
    """One model's live objects on this rank.

    ``mesh``: its TaskMesh (placement); ``microbatches``: this rank's data
    replica's micro-batches (``groups.coord.dp``), each a ``rlhf.batch.Batch``
    (its ``tokens`` [b, s] feed the model; ``loss_fn(output, microbatch,
    groups, packed) -> scalar`` reads the fields it needs; ``packed``: the micro-batch's PackedLayout, or
    None when it ran padded).
    ``optimizer``: an object with ``backward_scope(last_microbatch)`` (the context
    of one backward), ``scale_loss(loss)`` (the loss backward starts from: times the
    fp16 loss scale), ``reduce_grads()`` (finish the DP gradient reduction) and
    ``step()`` (update, then zero the gradients) over ``module``'s parameters: a
    ``rlhf.optim.ModelOptimizer`` built on ``module`` and ``groups``.
    ``module``/``groups``/``optimizer``/``loss_fn`` may be None with
    :class:`SleepCompute`. ``packed``: each micro-batch runs as one packed row of
    its samples (rlhf/models/packing.py); ``loss_fn`` then gets the packed output.
    A mixture of experts (rlhf/models/moe.py): ``aux_loss_weights``, per micro-batch, the gradient scale
    of its auxiliary losses (its share of the step's tokens, times the DP replicas the reduction averages
    over); ``routing_replay``: None leaves the micro-batches' ``routing`` unread, False compares the
    model's own top-k with it, True replays it.
    """

    name: str
    mesh: object
    microbatches: Sequence[Batch]
    module: torch.nn.Module | None = None
    groups: object = None
    optimizer: object = None
    loss_fn: Callable | None = None
    hidden_size: int = 0
    packed: bool = False
    aux_loss_weights: Sequence[float] | None = None
    routing_replay: bool | None = None

    def __post_init__(self):
        self._layouts = [PackedLayout.of(mb) for mb in self.microbatches] if self.packed else None

    def layout(self, mb: int) -> PackedLayout | None:
        """Where micro-batch ``mb``'s samples sit in its packed row (None: it runs padded)."""
        return None if self._layouts is None else self._layouts[mb]

    def is_last(self, stage: int) -> bool:
        return stage == self.mesh.strategy.pp - 1


class StageCompute:
    """Real compute on megatron stage modules."""

    def buffer(self, rt: ModelRuntime, mb: int) -> torch.Tensor:
        """An empty [s, b, h] activation (or gradient) of micro-batch ``mb``."""
        s, b = sequence_shape(rt.microbatches[mb].tokens, rt.layout(mb))
        p = next(rt.module.parameters())
        return torch.empty((s, b, rt.hidden_size), dtype=p.dtype, device=p.device)

    def forward(self, rt: ModelRuntime, ins: C.Instr, x):
        """Stage output [s, b, h], or on the last stage this micro-batch's loss share."""
        from rlhf.models.gpt import stage_forward

        data, packed = rt.microbatches[ins.mb], rt.layout(ins.mb)
        padding = data.padding_mask() if rt.aux_loss_weights is not None and packed is None else None
        routing = data.routing if rt.routing_replay is not None else None
        with moe.replayed(rt.module, routing, bool(rt.routing_replay), packed):
            out = stage_forward(rt.module, data.tokens, x, packed, padding)
        if rt.is_last(ins.stage):
            return rt.loss_fn(out, data, rt.groups, packed) / len(rt.microbatches)
        return out

    def backward(self, rt: ModelRuntime, ins: C.Instr, out, grad, x, last: bool):
        """Accumulate parameter grads; return the gradient of the stage input (or None).
        ``last``: this rank's final backward of the model in the step (overlapped DP reduction may start)."""
        if rt.aux_loss_weights is not None:
            weight = torch.tensor(rt.aux_loss_weights[ins.mb], device=platform.device())
            moe.set_aux_loss_scale(rt.optimizer.scale_loss(weight))
        with rt.optimizer.backward_scope(last):
            torch.autograd.backward(rt.optimizer.scale_loss(out) if grad is None else out, grad)
        return None if x is None else x.grad

    def reduce_grads(self, rt: ModelRuntime) -> None:
        rt.optimizer.reduce_grads()

    def step(self, rt: ModelRuntime) -> None:
        rt.optimizer.step()


class SleepCompute:
    """FORWARD/BACKWARD sleep ``cost x seconds_per_unit`` (costs from the schedule's
    problem); activations are small dummy tensors that still travel."""

    def __init__(self, problem, seconds_per_unit: float, act_shape=(8, 1, 16)):
        self.models = {m.name: m for m in problem.models}
        self.unit = seconds_per_unit
        self.shape = tuple(act_shape)
        self.overshoot = _sleep_overshoot()

    def buffer(self, rt, mb: int) -> torch.Tensor:
        return torch.empty(self.shape, device=platform.device())

    def _sleep(self, seconds: float) -> None:
        end = time.perf_counter() + seconds
        time.sleep(max(0.0, seconds - self.overshoot))
        while time.perf_counter() < end - 2e-4:  # finish the last sliver in short sleeps
            time.sleep(1e-4)

    def _cost(self, rt, ins: C.Instr, field: str) -> float:
        """The schedule stage's cost; with mixed TP each of its ``k`` placement
        stages takes it (the cost model's same-work-per-GPU rule)."""
        m = self.models[rt.name]
        return getattr(m, field)[ins.stage * m.pp // rt.mesh.strategy.pp]

    def forward(self, rt, ins: C.Instr, x):
        self._sleep(self._cost(rt, ins, "fwd") * self.unit)
        return torch.zeros((), device=platform.device()) if rt.is_last(ins.stage) else self._dummy()

    def backward(self, rt, ins: C.Instr, out, grad, x, last: bool):
        self._sleep(self._cost(rt, ins, "bwd") * self.unit)
        return None if x is None else self._dummy()

    def _dummy(self) -> torch.Tensor:
        return torch.zeros(self.shape, device=platform.device())

    def reduce_grads(self, rt) -> None:
        pass

    def step(self, rt) -> None:
        pass


def _sleep_overshoot(trials: int = 20, d: float = 2e-3) -> float:
    """Median extra time ``time.sleep(d)`` takes on this machine (seconds)."""
    extra = []
    for _ in range(trials):
        t = time.perf_counter()
        time.sleep(d)
        extra.append(time.perf_counter() - t - d)
    return sorted(extra)[trials // 2]


@dataclass
class _State:
    """Per-step tensors keyed by (model, mb)."""

    inputs: dict = field(default_factory=dict)      # received activations (leaves)
    outputs: dict = field(default_factory=dict)     # stage outputs / loss shares
    out_grads: dict = field(default_factory=dict)   # received gradients of outputs
    in_grads: dict = field(default_factory=dict)    # gradients of inputs, to send
    posted: dict = field(default_factory=dict)      # (peer, tag) -> (requests, buffer) of POST_RECVs
    pending: list = field(default_factory=list)     # outstanding send requests
    losses: dict = field(default_factory=dict)      # model -> summed loss shares (last stage)
    backwards_left: Counter = field(default_factory=Counter)  # model -> BACKWARDs still to run


TAG_MODES = ("per_message", "per_pair")


class Executor:
    """Runs one rank's instruction list; one handler per instruction kind.

    ``tags``: "per_message" sends each message under its own tag (the producing
    subtask's id); "per_pair" sends everything under tag 0, so messages between
    two ranks are paired by order alone, as NCCL pairs them.
    """

    def __init__(self, runtimes: dict, compute=None, tags: str = "per_message"):
        if tags not in TAG_MODES:
            raise ValueError(f"tags={tags!r} must be one of {TAG_MODES}")
        self.runtimes = runtimes
        self.compute = compute or StageCompute()
        self.per_pair = tags == "per_pair"
        self.state = _State()
        self.handlers = {
            C.RECV_ACT: self._recv_act, C.FORWARD: self._forward, C.SEND_ACT: self._send_act,
            C.RECV_GRAD: self._recv_grad, C.BACKWARD: self._backward, C.SEND_GRAD: self._send_grad,
            C.POST_RECV: self._post_recv, C.WAIT_SENDS: self._wait_sends, C.REDUCE_GRADS: self._reduce,
            C.OPTIMIZER_STEP: self._step,
        }

    def run(self, program: Sequence[C.Instr], timeline: Timeline) -> dict:
        """Execute ``program``, recording every instruction; returns {model: loss} (last stages)."""
        self.state = _State(backwards_left=Counter(ins.model for ins in program if ins.kind == C.BACKWARD))
        for ins in program:
            t0 = time.perf_counter()
            self.handlers[ins.kind](self.runtimes.get(ins.model), ins)
            timeline.record(_label(ins), ins.kind, t0, time.perf_counter())
        return self.state.losses

    def _tag(self, ins) -> int:
        return 0 if self.per_pair else ins.tag

    def _post_recv(self, rt, ins):
        buffer = self.compute.buffer(rt, ins.mb)
        self.state.posted[ins.peer, ins.tag] = (post_recv(buffer, ins.peer, self._tag(ins)), buffer)

    def _recv(self, rt, ins) -> torch.Tensor:
        """The message, from a POST_RECV's buffer if it was posted ahead (else posted now)."""
        if (ins.peer, ins.tag) not in self.state.posted:
            self._post_recv(rt, ins)
        requests, buffer = self.state.posted.pop((ins.peer, ins.tag))
        wait_all(requests)
        return buffer

    def _recv_act(self, rt, ins):
        self.state.inputs[ins.model, ins.mb] = self._recv(rt, ins).requires_grad_()

    def _forward(self, rt, ins):
        out = self.compute.forward(rt, ins, self.state.inputs.get((ins.model, ins.mb)))
        self.state.outputs[ins.model, ins.mb] = out
        if rt.is_last(ins.stage):
            self.state.losses[ins.model] = self.state.losses.get(ins.model, 0.0) + out.detach()

    def _send_act(self, rt, ins):
        self.state.pending += post_send(self.state.outputs[ins.model, ins.mb], ins.peer, self._tag(ins))

    def _recv_grad(self, rt, ins):
        self.state.out_grads[ins.model, ins.mb] = self._recv(rt, ins)

    def _backward(self, rt, ins):
        key, st = (ins.model, ins.mb), self.state
        st.backwards_left[ins.model] -= 1
        grad = self.compute.backward(rt, ins, st.outputs.pop(key), st.out_grads.pop(key, None),
                                     st.inputs.pop(key, None), last=st.backwards_left[ins.model] == 0)
        if grad is not None:
            st.in_grads[key] = grad

    def _send_grad(self, rt, ins):
        self.state.pending += post_send(self.state.in_grads.pop((ins.model, ins.mb)), ins.peer,
                                        self._tag(ins))

    def _wait_sends(self, rt, ins):
        wait_all(self.state.pending)
        self.state.pending.clear()

    def _reduce(self, rt, ins):
        self.compute.reduce_grads(rt)

    def _step(self, rt, ins):
        self.compute.step(rt)


def _label(ins: C.Instr) -> str:
    if ins.kind in C.COMPUTE:
        return f"{ins.model} {ins.kind[0]}{ins.mb}"
    return str(ins)


@dataclass
class StepResult:
    """``losses``: {model: mean micro-batch loss} on last-stage ranks (tensors);
    ``timeline``: this rank's; ``per_rank``: all ranks' events when gathered."""

    losses: dict
    timeline: Timeline
    per_rank: list | None = None


def run_step(schedule: Schedule, runtimes: dict, compute=None, trace_path=None,
             gather_timeline: bool = False, group=None, tags: str = "per_message") -> StepResult:
    """One mini-batch step of every model in ``schedule`` on this rank.

    Refuses (ScheduleError) a schedule that is cyclic or does not match the
    runtimes' placements and micro-batch counts before any communication.
    Collective over ``group`` (default: world), which must hold the fused
    pipeline's ranks; ``trace_path``/``gather_timeline``/``tags`` (see
    :class:`Executor`) must agree on all ranks.
    Gradients must be zero (or None) on entry; the optimizer step clears them.
    """
    rank = dist.get_rank()
    placements = {name: rt.mesh for name, rt in runtimes.items()}
    counts = {name: len(rt.microbatches) for name, rt in runtimes.items()}
    program = C.compile_rank(schedule, placements, rank, counts)
    executor = Executor(runtimes, compute, tags)
    dist.barrier(group=group)
    timeline = Timeline(rank)
    losses = executor.run(program, timeline)
    per_rank = None
    if trace_path is not None or gather_timeline:
        per_rank = gather(timeline, group)
        if trace_path is not None and dist.get_rank(group) == 0:
            write_chrome_trace(trace_path, per_rank)
    return StepResult(losses, timeline, per_rank)
