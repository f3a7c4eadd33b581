"""Cost model of one task call: seconds and bytes per GPU under a (mesh, dp, pp, tp) layout.

Three kinds of call (``ROLE``), every time in seconds::

    training   (actor_train, critic_train)   compute-bound, 1F1B per mini-batch:
        f = fwd FLOPs of one micro-batch / (pp * tp * gpu_flops * mfu) + TP all-reduces + PP send
        b = 2 f;  per mini-batch (m + pp - 1) * (f + b) + DP gradient all-reduce
    inference  (ref_inf, reward_inf, critic_inf)   compute-bound, one pipelined pass: (m + pp - 1) * f
    generation (actor_gen)   per DP replica of b samples: prefill (compute-bound; it samples the first
        token), then R - 1 decode steps of
        max(weights + KV bytes read / (tp * hbm_bandwidth * hbm_efficiency),  FLOPs / (tp * gpu_flops * mfu))
        + TP all-reduces + PP sends; the KV read at the mean context P + R/2

with m micro-batches per DP replica: the workload's micro-batch size, or a
count given per call (ReaL's plans give one per call). Generation may be
split into m micro-batches too and pipelined over pp stages: each token then
takes max(m, pp) passes of one micro-batch through one stage (m = 1, pp = 1:
one continuous batch, what our engine runs), so the step above is scaled by
max(m, pp) / pp at a micro-batch of b / m samples. The batch that saturates a decode step
(:func:`saturating_batch`) is where its two terms meet. An all-reduce of n
bytes over g ranks takes 2 (g-1)/g n / bandwidth, the bandwidth of NVLink when
the group sits in one node, of the network otherwise. Each call adds
``call_overhead_s`` once (a training call ``update_overhead_s`` per update
too), ``layer_overhead_s`` per layer (and one more for the
embedding and head) of each sequential step on its critical path
(``TaskCost.steps``: decode steps and the prefill through the whole model;
forward-pass equivalents of the pipelined micro-batches through one stage, a
backward counting two) and
``collective_latency_s`` per collective or pipeline message on that path
(``TaskCost.collectives``: :func:`pass_collectives` per micro-batch pass, per
update the executor's barrier, the DP gradient all-reduce and the gradient
norm; per engine step 2 per layer, the embedding's and the logits'), which is
what TP costs when the messages are small.

Memory per GPU (bytes, :func:`task_memory`, in the parts of ``MEMORY_PARTS``): a
task's *static* part stays resident for the whole iteration (its parameters;
a trained model's gradients and optimizer state too), its *transient* part
only while it runs (training: activations of the micro-batches 1F1B keeps in
flight, 34 bytes per token and hidden unit per layer at 16-bit, and fp32
logits; generation: the KV cache and one step's logits; inference: one layer's
activations and the logits). Element sizes come from a :class:`Precision`:
``BF16`` (the default, Megatron-LM's bf16 training: bf16 weights, fp32
gradients, fp32 main parameters and Adam moments, 18 bytes per trained
parameter; bf16 activations and KV) or ``FP32`` (16 bytes per trained
parameter, 4-byte activations and KV). A GPU must hold the static parts of
all its tasks plus the largest transient part.

A mixture of experts (rlhf.planner.shapes): FLOPs are a token's active
parameters' (k of E experts, the router, the shared expert); a rank holds its
largest stage's dense parameters / tp and its experts / ep
(:func:`rlhf.planner.shapes.rank_parameters`; gradients and optimizer state
alike), and its activations count the active MLP width (k x f_e + f_s) where
a dense model's count ffn. With ep > 1 every MoE layer adds two all-to-alls
per pass (dispatch and combine; a backward two more), each sending
tokens x h x 2 bytes x k x (ep-1)/ep per rank over the EP group's link
(:func:`expert_alltoall_bytes`; ``ep_comm`` in a call's parts, inside
``decode_comm`` for decode steps), and one ``collective_latency_s`` each;
training all-reduces the experts' gradients over their dp / ep expert-DP
replicas, the rest over dp. A decode step reads the dense weights and, per
layer, the experts its batch reaches: E (1 - (1 - k/E)^b) of them in
expectation (:func:`decode_read_parameters`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from rlhf.models.config import ModelConfig
from rlhf.parallel.mesh import TaskMesh
from rlhf.planner.errors import PlannerError
from rlhf.planner.hardware import Hardware
from rlhf.planner.shapes import (BYTES, active_ffn, expert_parameters, forward_flops_per_token, head_outputs,
                                 kv_bytes_per_token, kv_width, parameter_count, rank_expert_parameters,
                                 rank_parameters)

ROLE = {"actor_gen": "generation", "ref_inf": "inference", "reward_inf": "inference", "critic_inf": "inference",
        "actor_train": "training", "critic_train": "training"}
ACT_BYTES_PER_TOKEN_HIDDEN = 34  # per layer at 16-bit (Korthikanti et al.), as rlhf.schedule.cost_model


@dataclass(frozen=True)
class Precision:
    """Bytes per element of what the memory model counts: every model's ``weight``s (activations and the
    KV cache are computed in the same type), a trained model's ``grad`` buffer, the optimizer's ``main``
    parameters (an fp32 copy of low-precision weights; 0 when the weights are fp32 already) and its
    ``optimizer`` state per parameter (Adam's two fp32 moments: 8)."""

    name: str
    weight: int
    grad: int
    main: int
    optimizer: int

    def __post_init__(self):
        for part in ("weight", "grad", "main", "optimizer"):
            value = getattr(self, part)
            if not (isinstance(value, int) and value >= 0):
                raise PlannerError(f"precision {self.name}: {part}={value!r} must be bytes per element >= 0")

    @property
    def trained_bytes_per_param(self) -> int:
        """Resident bytes per parameter of a trained model: weight, gradient, main copy, optimizer state."""
        return self.weight + self.grad + self.main + self.optimizer


BF16 = Precision("bf16", weight=2, grad=4, main=4, optimizer=8)
"""Megatron-LM's bf16 training (gradients accumulated in fp32, fp32 main parameters and Adam moments)."""
FP32 = Precision("fp32", weight=4, grad=4, main=0, optimizer=8)
"""Everything fp32 (a job without --bf16/--fp16): the optimizer updates the weights themselves."""
PRECISIONS = {p.name: p for p in (BF16, FP32)}
TRAIN_BYTES_PER_PARAM = BF16.trained_bytes_per_param  # 18: the default cluster's assumption
MEMORY_PARTS = ("parameters", "gradients", "optimizer", "activations", "kv")
"""The parts of a task's bytes per GPU; the first three are static, the last two transient."""
STATIC_PARTS = MEMORY_PARTS[:3]


@dataclass(frozen=True)
class Cluster:
    """``nodes`` nodes of ``gpus_per_node`` GPUs; global rank r sits on node r // gpus_per_node."""

    nodes: int
    gpus_per_node: int

    def __post_init__(self):
        for name in ("nodes", "gpus_per_node"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise PlannerError(f"{name}={value!r} must be a positive integer")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def bandwidth(self, ranks, hw: Hardware) -> float:
        """Bytes/s between ``ranks``: NVLink when they share a node, the network otherwise."""
        return hw.intra_node_bandwidth if len({self.node(r) for r in ranks}) <= 1 else hw.inter_node_bandwidth


@dataclass(frozen=True)
class Workload:
    """PPO batch settings of one iteration: ``samples`` responses of up to ``response_len`` tokens after
    ``prompt_len`` prompt tokens; training in ``minibatches`` mini-batches of micro-batches of
    ``micro_batch_size`` samples, ``ppo_epochs`` times. ``long_tail_median`` > 0 declares the trainer's
    long-tailed workload (response lengths lognormal around it, capped at ``response_len``); 0: every
    response runs to ``response_len``."""

    samples: int
    prompt_len: int
    response_len: int
    minibatches: int = 1
    micro_batch_size: int = 1
    ppo_epochs: int = 1
    long_tail_median: int = 0

    def __post_init__(self):
        for name in ("samples", "prompt_len", "response_len", "minibatches", "micro_batch_size", "ppo_epochs"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise PlannerError(f"{name}={value!r} must be a positive integer")
        if self.samples % self.minibatches:
            raise PlannerError(f"minibatches={self.minibatches} must divide the {self.samples} samples of an "
                               "iteration")
        if not 0 <= self.long_tail_median <= self.response_len:
            raise PlannerError(f"long_tail_median={self.long_tail_median!r} must be in [0, response_len="
                               f"{self.response_len}] (0: off)")

    @property
    def seq(self) -> int:
        return self.prompt_len + self.response_len


@dataclass(frozen=True)
class TaskCost:
    """Predicted seconds of one call (``parts`` says where they go), its sequential steps and collectives
    (on its critical path) and bytes per GPU."""

    seconds: float
    static_bytes: float
    transient_bytes: float
    parts: dict = field(default_factory=dict)
    steps: int = 0
    collectives: int = 0
    memory: dict = field(default_factory=dict)
    """Bytes per GPU by part (``MEMORY_PARTS``): static_bytes + transient_bytes split up."""


def allreduce_s(nbytes: float, ranks, cluster: Cluster, hw: Hardware) -> float:
    """Ring all-reduce of ``nbytes`` over ``ranks``: its bandwidth term (the latency is counted per
    collective, ``TaskCost.collectives``)."""
    g = len(ranks)
    return 0.0 if g <= 1 else 2 * (g - 1) / g * nbytes / cluster.bandwidth(ranks, hw)


def microbatches_per_replica(samples: int, dp: int, micro_batch_size: int) -> int:
    """Micro-batches one DP replica runs for ``samples`` samples."""
    return max(1, math.ceil(samples / (dp * micro_batch_size)))


def split(samples: int, dp: int, wl: Workload, count: int | None) -> tuple[int, float]:
    """(micro-batches per DP replica, samples per micro-batch) of ``samples`` over ``dp`` replicas: ``count``
    micro-batches when given, else micro-batches of the workload's micro-batch size."""
    if count is None:
        return microbatches_per_replica(samples, dp, wl.micro_batch_size), wl.micro_batch_size
    return count, samples / (dp * count)


def _role(task: str, count: int | None) -> str:
    role = ROLE.get(task)
    if role is None:
        raise PlannerError(f"unknown task {task!r}; tasks: {', '.join(ROLE)}")
    if count is not None and count < 1:
        raise PlannerError(f"{task}: micro-batches={count!r} must be a positive integer")
    return role


def task_cost(task: str, cfg: ModelConfig, kind: str, mesh: TaskMesh, wl: Workload, hw: Hardware,
              cluster: Cluster, count: int | None = None, precision: Precision = BF16) -> TaskCost:
    """Seconds and bytes per GPU of ``task`` running model ``cfg`` (``kind`` lm or value) on ``mesh``, in
    ``count`` micro-batches per DP replica (per mini-batch in training) when given, its bytes at
    ``precision`` (see the module docstring)."""
    cost = {"training": _training, "inference": _inference, "generation": _generation}[_role(task, count)]
    memory = task_memory(task, cfg, kind, mesh, wl, count, precision)
    return replace(cost(cfg, kind, mesh, wl, hw, cluster, count), static_bytes=sum(memory[p] for p in STATIC_PARTS),
                   transient_bytes=memory["activations"] + memory["kv"], memory=memory)


def task_memory(task: str, cfg: ModelConfig, kind: str, mesh: TaskMesh, wl: Workload, count: int | None = None,
                precision: Precision = BF16, recompute: tuple = (None, None),
                activation_model: str = "korthikanti") -> dict:
    """{part: bytes} per GPU of ``task`` (``MEMORY_PARTS``; see the module docstring): its largest pipeline
    stage's share of the parameters at ``precision``, and what the call adds while it runs. ``recompute``:
    a training call's (granularity, layers per chunk) as Megatron-LM's flags, its activations counted by
    ``activation_model`` (:func:`training_activations`)."""
    role, s = _role(task, count), mesh.strategy
    stage = rank_parameters(cfg, kind, s)  # the largest stage's dense parameters / tp, its experts / ep
    out = dict.fromkeys(MEMORY_PARTS, 0.0)
    out["parameters"] = stage * precision.weight
    scale = precision.weight / BYTES  # activations and KV in the weights' type; the constants are 16-bit
    if role == "training":
        out["gradients"] = stage * precision.grad
        out["optimizer"] = stage * (precision.main + precision.optimizer)
        m, samples = split(wl.samples // wl.minibatches, s.dp, wl, count)
        tokens = samples * wl.seq
        # fp32 logits: one copy (Korthikanti); ours (rlhf/models/logprobs.py, chunked) keeps the logits in the
        # weights' type and, in the backward, their gradient beside them
        element = 2 * precision.weight if activation_model == "local" else 4
        head = tokens * head_outputs(cfg, kind) * element / s.tp
        out["activations"] = training_activations(cfg, s.pp, s.tp, min(m, s.pp), tokens, precision, head,
                                                  *recompute, wl.seq, activation_model)
    elif role == "inference":
        m, samples = split(wl.samples, s.dp, wl, count)
        tokens = samples * wl.seq
        act = tokens * (4 * cfg.hidden_size + 2 * active_ffn(cfg)) * BYTES / s.tp
        out["activations"] = act * scale + tokens * head_outputs(cfg, kind) * 4 / s.tp
    else:
        m = count or 1
        batch = math.ceil(wl.samples / s.dp)
        part = batch / m if m > 1 else batch
        out["kv"] = batch * wl.seq * kv_bytes_per_token(cfg) / (s.tp * s.pp) * scale
        out["activations"] = part * cfg.vocab_size * 4 / s.tp  # one step's fp32 logits
    return out


ACTIVATION_MODELS = ("korthikanti", "local")
"""How training activations per layer are counted: Korthikanti et al.'s 34 bytes per token and hidden unit at
16-bit (the default: what the ReaL reproductions assume), or the element count measured on megatron's local
layer spec (:func:`local_layer_elements`; docs/planner.md, "Memory: predicted against measured")."""


def local_layer_elements(cfg: ModelConfig, tp: int, seq: int, scores: bool) -> float:
    """Elements one token of a micro-batch leaves saved for backward in one layer of megatron's local layer spec
    (RMSNorm, RoPE, SwiGLU, unfused attention; no sequence parallelism), measured with
    rlhf.memory.SavedActivations and fitted on CPU: 4h + 18 replicated over the TP ranks (the norms' inputs
    and outputs, their statistics) and 5h + 5 ffn + 3 h_kv split over them (queries, attention output, the
    MLP's intermediates, keys and values); ``scores``: the softmax output, heads x ``seq`` more (gone with
    selective recompute)."""
    h, ffn, h_kv = cfg.hidden_size, active_ffn(cfg), kv_width(cfg)
    split = 5 * h + 5 * ffn + 3 * h_kv + (cfg.num_attention_heads * seq if scores else 0)
    return 4 * h + 18 + split / tp


def training_activations(cfg: ModelConfig, pp: int, tp: int, in_flight: int, tokens: int, precision: Precision,
                         head: float, granularity: str | None = None, chunk: int | None = None, seq: int = 0,
                         model: str = "korthikanti") -> float:
    """Bytes one pipeline stage keeps for backward for ``in_flight`` micro-batches of ``tokens`` tokens
    (sequences of ``seq``): its layers' activations, per layer as ``model`` (``ACTIVATION_MODELS``) counts
    them in the weights' type, and the ``head`` bytes of one micro-batch's loss. Korthikanti et al.'s 34
    bytes is their selective-recompute figure (no attention scores), so granularity None and "selective"
    predict the same with it. "full" keeps each chunk's input only (one hidden state per ``chunk`` layers,
    default 1) and, once the head's backward has run, one chunk's layers again while their backward runs."""
    if model not in ACTIVATION_MODELS:
        raise PlannerError(f"activation model {model!r} is not one of {', '.join(ACTIVATION_MODELS)}")
    layers, scale = cfg.num_layers / pp, precision.weight / BYTES
    if model == "korthikanti":
        per_layer = tokens * cfg.hidden_size * ACT_BYTES_PER_TOKEN_HIDDEN / tp * scale
        if granularity != "full":
            return in_flight * layers * tokens * cfg.hidden_size * ACT_BYTES_PER_TOKEN_HIDDEN / tp * scale + head
    else:
        per_layer = tokens * local_layer_elements(cfg, tp, seq, scores=True) * precision.weight
        if granularity != "full":
            kept = local_layer_elements(cfg, tp, seq, scores=granularity is None)
            return in_flight * layers * tokens * kept * precision.weight + head
    chunk = chunk or 1
    return in_flight * layers / chunk * tokens * cfg.hidden_size * precision.weight + max(head, chunk * per_layer)


def expert_alltoall_bytes(cfg: ModelConfig, tokens: float, ep: int, element: int = BYTES) -> float:
    """Bytes one rank sends in one all-to-all (the dispatch, or the combine) of one MoE layer for its
    ``tokens``: each token's hidden state (``element`` bytes a value) to each of its k experts, (ep-1)/ep of
    which other ranks hold (tokens x h x bytes x k x (ep-1)/ep; 0 for a dense model or ep = 1)."""
    if not cfg.is_moe or ep <= 1:
        return 0.0
    return tokens * cfg.hidden_size * element * cfg.moe_router_topk * (ep - 1) / ep


def expert_alltoall_s(cfg: ModelConfig, mesh: TaskMesh, tokens: float, layers: float, cluster: Cluster,
                      hw: Hardware) -> float:
    """Seconds of the expert all-to-alls of ``tokens`` tokens through ``layers`` MoE layers in one direction
    (a forward, or a backward): per layer the dispatch and the combine, each :func:`expert_alltoall_bytes`
    over the EP group's link (NVLink inside a node, the network across nodes; its latency is counted per
    collective, ``TaskCost.collectives``)."""
    nbytes = expert_alltoall_bytes(cfg, tokens, mesh.strategy.ep)
    return 2 * layers * nbytes / cluster.bandwidth(mesh.ep_ranks(0, 0, 0), hw) if nbytes else 0.0


def _moe_collectives(cfg: ModelConfig, s) -> int:
    """All-to-alls of one pass (forward or backward) through one stage: 2 per MoE layer with ep > 1."""
    return 2 * (cfg.num_layers // s.pp) if cfg.is_moe and s.ep > 1 else 0


def expert_alltoall_bytes_per_iteration(task: str, cfg: ModelConfig, mesh: TaskMesh, wl: Workload,
                                        count: int | None = None, element: int = BYTES) -> float:
    """Bytes one rank of ``task`` sends in expert all-to-alls in one iteration (0 unless MoE with ep > 1),
    activations of ``element`` bytes: per MoE layer of its stage a dispatch and a combine of every
    micro-batch it runs, forward, and in training backward too (the gradients retrace both); generation:
    its prefill and each decode step's tokens."""
    s = mesh.strategy
    role, layers = _role(task, count), cfg.num_layers / s.pp
    if role == "training":
        m, samples = split(wl.samples // wl.minibatches, s.dp, wl, count)
        passes, tokens = 2 * m * wl.minibatches * wl.ppo_epochs, samples * wl.seq  # forward + backward
    elif role == "inference":
        m, samples = split(wl.samples, s.dp, wl, count)
        passes, tokens = m, samples * wl.seq
    else:
        passes, tokens = 1, math.ceil(wl.samples / s.dp) * (wl.prompt_len + wl.response_len - 1)
    return passes * 2 * layers * expert_alltoall_bytes(cfg, tokens, s.ep, element)


def _forward_s(cfg, kind, mesh, tokens, wl, hw, cluster) -> tuple[float, float, float]:
    """(compute, bandwidth, expert all-to-all) seconds of one micro-batch of ``tokens`` tokens through one
    stage."""
    s = mesh.strategy
    compute = forward_flops_per_token(cfg, kind, wl.seq) * tokens / (s.pp * s.tp * hw.gpu_flops * hw.mfu)
    act = tokens * cfg.hidden_size * BYTES
    tp = allreduce_s(act, mesh.tp_ranks(0, 0), cluster, hw) * 2 * cfg.num_layers / s.pp
    pp = act / cluster.bandwidth(mesh.pp_ranks(0, 0), hw) if s.pp > 1 else 0.0
    return compute, tp + pp, expert_alltoall_s(cfg, mesh, tokens, cfg.num_layers / s.pp, cluster, hw)


def _stage_units(cfg: ModelConfig, pp: int) -> int:
    """Overhead units of one pass through a stage: its layers, and one for the embedding or head."""
    return cfg.num_layers // pp + 1


def pass_collectives(cfg: ModelConfig, kind: str, mesh: TaskMesh, role: str, backward: bool = False) -> int:
    """Collectives and pipeline messages of one micro-batch's forward (or backward) through the busiest stage.

    Forward, with tp > 1: 2 all-reduces per layer (attention and MLP outputs), 1 on the first stage (the
    vocab-parallel embedding), on an LM's last stage the log-probs' and entropy's 2 (the maxima, then their
    three sums together: rlhf/models/logprobs.py). Backward: 2 per layer (the column-parallel inputs' gradients)
    and 1 for an LM head's input. With pp > 1, one message to the next (previous) stage. A mixture of
    experts with ep > 1: 2 all-to-alls (dispatch, combine) per layer each way.
    """
    s = mesh.strategy
    layers = 2 * (cfg.num_layers // s.pp)
    if kind == "lm":
        head = 1 if backward else 2
    else:
        head = 0
    ends = 0 if backward else 1  # the embedding
    edge = max(ends, head) if s.pp > 1 else ends + head
    return (layers + edge if s.tp > 1 else 0) + (s.pp > 1) + _moe_collectives(cfg, s)


def _training(cfg, kind, mesh, wl, hw, cluster, count) -> TaskCost:
    s = mesh.strategy
    m, samples = split(wl.samples // wl.minibatches, s.dp, wl, count)
    tokens = samples * wl.seq
    f, comm, a2a = _forward_s(cfg, kind, mesh, tokens, wl, hw, cluster)
    updates = wl.minibatches * wl.ppo_epochs
    # dense gradients all-reduced over the DP replicas, a MoE's experts over their expert-DP replicas
    experts = rank_expert_parameters(cfg, kind, s)
    expert_dp = mesh.expert_dp_ranks(0, 0, 0)
    grads = (allreduce_s((rank_parameters(cfg, kind, s) - experts) * BYTES, mesh.dp_ranks(0, 0), cluster, hw)
             + allreduce_s(experts * BYTES, expert_dp, cluster, hw))
    passes = updates * (m + s.pp - 1) * 3
    # per update: the executor's barrier, the DP gradient all-reduce (and the experts' over expert-DP), the
    # model-parallel gradient norm
    per_update = (s.size > 1) + (s.dp > 1) + (s.pp * s.tp > 1) + (cfg.is_moe and len(expert_dp) > 1)
    collectives = updates * ((m + s.pp - 1) * (pass_collectives(cfg, kind, mesh, "training")
                                                + pass_collectives(cfg, kind, mesh, "training", True))
                             + per_update)
    parts = {"compute": updates * m * 3 * f, "bubble": updates * (s.pp - 1) * 3 * f,
             "tp_pp_comm": updates * (m + s.pp - 1) * 2 * comm, "dp_comm": updates * grads,
             "ep_comm": updates * (m + s.pp - 1) * 2 * a2a,
             "latency": collectives * hw.collective_latency_s,
             "overhead": hw.call_overhead_s + updates * hw.update_overhead_s
                         + passes * _stage_units(cfg, s.pp) * hw.layer_overhead_s}
    return TaskCost(sum(parts.values()), 0.0, 0.0, parts, passes, collectives)  # bytes: task_memory


def _inference(cfg, kind, mesh, wl, hw, cluster, count) -> TaskCost:
    s = mesh.strategy
    m, samples = split(wl.samples, s.dp, wl, count)
    tokens = samples * wl.seq
    f, comm, a2a = _forward_s(cfg, kind, mesh, tokens, wl, hw, cluster)
    passes = m + s.pp - 1
    collectives = passes * pass_collectives(cfg, kind, mesh, "inference")
    parts = {"compute": m * f, "bubble": (s.pp - 1) * f, "tp_pp_comm": passes * comm, "ep_comm": passes * a2a,
             "latency": collectives * hw.collective_latency_s,
             "overhead": hw.call_overhead_s + passes * _stage_units(cfg, s.pp) * hw.layer_overhead_s}
    return TaskCost(sum(parts.values()), 0.0, 0.0, parts, passes, collectives)  # bytes: task_memory


def decode_terms(cfg: ModelConfig, mesh: TaskMesh, batch: int, context: float, hw: Hardware,
                 cluster: Cluster) -> tuple[float, float, float]:
    """(weight + KV read, FLOPs, communication) seconds of one decode step of ``batch`` samples at
    ``context`` tokens on one DP replica of ``mesh`` (communication: TP all-reduces, PP sends and, for a
    mixture of experts with ep > 1, the expert all-to-alls)."""
    s = mesh.strategy
    weights = decode_read_parameters(cfg, s, batch) * BYTES
    read = (weights + batch * context * kv_bytes_per_token(cfg)) / (s.tp * hw.hbm_bandwidth * hw.hbm_efficiency)
    compute = forward_flops_per_token(cfg, "lm", int(context)) * batch / (s.tp * hw.gpu_flops * hw.mfu)
    act = batch * cfg.hidden_size * BYTES
    tp = allreduce_s(act, mesh.tp_ranks(0, 0), cluster, hw) * 2 * cfg.num_layers
    pp = (s.pp - 1) * act / cluster.bandwidth(mesh.pp_ranks(0, 0), hw)
    return read, compute, tp + pp + expert_alltoall_s(cfg, mesh, batch, cfg.num_layers, cluster, hw)


def decode_read_parameters(cfg: ModelConfig, s, batch: float) -> float:
    """Parameters a decode step of ``batch`` samples reads on one rank, times tp: every parameter of a dense
    model; of a mixture of experts the dense ones and, per layer, the experts its tokens reach: of the E / ep
    experts a rank holds, E / ep x (1 - (1 - k/E)^(batch x ep)) in expectation (the ep replicas' tokens
    routed uniformly), whole on every TP rank."""
    total = parameter_count(cfg, "lm")
    if not cfg.is_moe:
        return total
    experts = cfg.num_layers * cfg.num_experts * expert_parameters(cfg)
    reached = 1 - (1 - cfg.moe_router_topk / cfg.num_experts) ** (batch * s.ep)
    return total - experts + s.tp * experts / s.ep * reached


def decode_step_s(cfg: ModelConfig, mesh: TaskMesh, batch: int, context: float, hw: Hardware,
                  cluster: Cluster) -> float:
    """Seconds of one decode step: the slower of reading and computing, then the communication."""
    read, compute, comm = decode_terms(cfg, mesh, batch, context, hw, cluster)
    return max(read, compute) + comm


def saturating_batch(cfg: ModelConfig, mesh: TaskMesh, context: float, hw: Hardware) -> int:
    """The running batch at which a decode step's FLOPs take as long as its weight reads (B_sat); for a
    mixture of experts the smallest batch whose FLOPs take as long as the weights it reads
    (:func:`decode_read_parameters`: more experts the larger the batch)."""
    bandwidth = hw.hbm_bandwidth * hw.hbm_efficiency
    flops_s = forward_flops_per_token(cfg, "lm", int(context)) / (hw.gpu_flops * hw.mfu)
    if not cfg.is_moe:
        weights_s = parameter_count(cfg, "lm") * BYTES / bandwidth
        return max(1, math.ceil(weights_s / flops_s))
    s = mesh.strategy

    def short(b: int) -> bool:  # FLOPs still shorter than the reads
        return b * flops_s < decode_read_parameters(cfg, s, b) * BYTES / bandwidth

    lo, hi = 1, 1
    while short(hi):  # reads - FLOPs is concave in b: once the FLOPs catch up they stay ahead
        lo, hi = hi + 1, 2 * hi
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if short(mid) else (lo, mid)
    return hi


def _generation(cfg, kind, mesh, wl, hw, cluster, count) -> TaskCost:
    s, m = mesh.strategy, count or 1
    batch = math.ceil(wl.samples / s.dp)  # per DP replica, in m micro-batches of `part` samples
    part = batch / m if m > 1 else batch
    passes = max(m, s.pp)  # passes of one micro-batch through one stage per token
    prefill = forward_flops_per_token(cfg, "lm", wl.prompt_len) * batch * wl.prompt_len / (
        s.tp * hw.gpu_flops * hw.mfu) * ((m + s.pp - 1) / (m * s.pp))  # pipelined over the micro-batches
    prefill_a2a = expert_alltoall_s(cfg, mesh, batch * wl.prompt_len, cfg.num_layers, cluster, hw) * (
        (m + s.pp - 1) / (m * s.pp))
    read, compute, comm = decode_terms(cfg, mesh, part, wl.prompt_len + wl.response_len / 2, hw, cluster)
    bound = "decode" if read >= compute else "decode_compute"  # memory-bound (the usual case) or not
    steps = wl.response_len  # the prefill step samples the first token, each decode step one more
    # per stage pass with tp > 1: 2 all-reduces per layer, the embedding's and the logits'; with pp > 1 a send;
    # a mixture of experts with ep > 1: 2 all-to-alls per layer
    per_pass = (2 * (cfg.num_layers // s.pp) + 2 if s.tp > 1 else 0) + (s.pp > 1) + _moe_collectives(cfg, s)
    collectives = steps * passes * per_pass
    parts = {"prefill": prefill, bound: (steps - 1) * (passes / s.pp) * max(read, compute),
             "decode_comm": steps * (passes / s.pp) * comm, "ep_comm": prefill_a2a,
             "latency": collectives * hw.collective_latency_s,
             "overhead": hw.call_overhead_s + steps * passes * _stage_units(cfg, s.pp) * hw.layer_overhead_s}
    return TaskCost(sum(parts.values()), 0.0, 0.0, parts, steps * passes, collectives)  # bytes: task_memory
