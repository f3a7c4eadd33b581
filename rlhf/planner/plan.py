"""An execution plan (every task's ranks and degrees), what it costs, and the placement file it becomes.

:func:`evaluate` builds one PPO iteration as calls (rlhf.planner.iteration_sim)::

    reshard actor -> actor_gen -> ref_inf, reward_inf, critic_inf -> advantage -> actor_train
                                                                              -> critic_train -> reshard critic

as the trainer runs it (rlhf/ppo/trainer.py: the actor's weights move into the
generation layout before generation, the critic's into the inference layout
after training). ``advantage`` is host time on every rank (the hardware
file's ``host_s``: advantages, metrics), and a point where all ranks meet:
the trainer gathers the whole batch after inference.
A reshard occupies both layouts' ranks for its worst rank's received bytes
(rlhf.planner.reshard_bytes) over the link between them; it is left out when
nothing moves. With ``weights_return`` (how ReaL's runtime moves weights,
for its plans) each move into a call's layout has a move back after it::

    reshard actor -> actor_gen -> return actor -> ref_inf, reward_inf
                                               -> reshard critic -> critic_inf -> return critic -> advantage ...

The samples move along the data edges (tokens, log-probs and
the scores as 4-byte values per token). With ``fuse_training`` the two
training calls are one call on their shared ranks whose time is the serial
time scaled by the greedy fused schedule's makespan over serial 1F1B
(rlhf.schedule; the annealed schedule of tools/search_schedule.py is at
least as short). With ``fuse_generation`` generation and the three
inference calls are one call on actor_gen's ranks, timed by the fusion
policy's simulation (rlhf.planner.fused_generation). With ``asynchronous``
(``--max-staleness K``, rlhf/ppo/asynchronous.py) actor_gen has ranks of its
own and generates a later iteration's batch while the rest infer and train
on one generated before; the two sides meet at the actor's move, the steady
state of one iteration::

    actor_gen ------------------------------------------\
    ref_inf, reward_inf, critic_inf -> advantage -> training -> reshard critic -> reshard actor

(``advantage`` then on the learners' ranks only). With ``partial_rollouts`` too
(``--partial-rollouts``, rlhf/ppo/partial_rollouts.py) the engine keeps the next
batches' samples running beside a batch's long tail, so its running batch stays
full: a batch's decode steps are its mean response length instead of its
longest (the prefill and the call's overhead unchanged). But a batch starts K
iterations before the meeting that needs it finished (``max_staleness`` K), so
an iteration lasts at least 1/K of the batch's own generation, its longest
sample's latency. Memory per rank: the static
bytes of every task on it plus the largest transient bytes of one call (both
training calls when fused).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

from rlhf.models.config import ModelConfig
from rlhf.parallel.mesh import PlacementError, TaskMesh, sharing_ranks
from rlhf.parallel.placement import Placement
from rlhf.planner import fused_generation
from rlhf.planner.cost import (BF16, MEMORY_PARTS, STATIC_PARTS, Cluster, Precision, TaskCost, Workload,
                               microbatches_per_replica, task_cost)
from rlhf.planner.errors import PlannerError
from rlhf.planner.hardware import Hardware
from rlhf.planner.shapes import schedule_shape
from rlhf.planner.reshard_bytes import received_bytes
from rlhf.planner.iteration_sim import Call, IterationTimeline, Sharing, schedule_calls
from rlhf.schedule.cost_model import CostConfig, build_problem
from rlhf.schedule.generators import greedy_fused, serial_1f1b_makespan
from rlhf.schedule.problem import ProblemError
from rlhf.schedule.simulate import simulate as simulate_schedule
from rlhf.tasks import INFERENCE_TASKS, MODEL_KIND, TASK_MODEL, TASKS

FUSED_GENERATION = "actor_gen+inference"
"""The one call of generation and inference under inter-stage fusion."""
RESHARDS = {"reshard actor": ("actor_train", "actor_gen"), "reshard critic": ("critic_train", "critic_inf")}
"""Weight moves (source task, destination task) into the calls that hold a copy of a trained model."""
RETURNS = {"return actor": ("actor_gen", "actor_train"), "return critic": ("critic_inf", "critic_train")}
"""The moves back into training after those calls, where weights return (ReaL's runtime)."""
BATCH_BYTES_PER_TOKEN = 16
"""Bytes per token of the batch moving between tasks: token id, log-probs, reference log-probs, values."""


@dataclass(frozen=True)
class Plan:
    """Every task's mesh; ``fuse_training`` runs actor and critic training as one fused schedule,
    ``fuse_generation`` generation and inference as one fused call (rlhf.planner.fused_generation)."""

    name: str
    meshes: dict
    fuse_training: bool = False
    fuse_generation: bool = False
    migration_threshold: float | None = None
    """R of the fused generation; None: the fusion policy's choice."""
    microbatches: dict = field(default_factory=dict)
    """Micro-batches per DP replica of named tasks (per mini-batch in training; in generation pipelined
    over its stages or run in turn), as ReaL's plans give them; a task not named splits by the workload's
    micro-batch size (generation: one continuous batch, what our engine runs)."""
    weights_return: bool = False
    """ReaL's runtime: a trained model's weights move into a call's layout before the call and back into
    the training layout after it. False: the trainer's, where the call's layout keeps its copy."""
    asynchronous: bool = False
    """Generation on ranks of its own runs ahead of training (``--max-staleness`` > 0): the steady state."""
    partial_rollouts: bool = False
    """Asynchronous generation running free between meetings (``--partial-rollouts``): full decode batches."""
    max_staleness: int = 1
    """K of an asynchronous plan; with ``partial_rollouts`` a batch has K iterations to finish."""

    def __post_init__(self):
        if self.weights_return and self.fuse_generation:
            raise PlannerError(f"plan {self.name!r}: fused generation keeps the actor's copy on its ranks; it "
                               "cannot return the weights after generation (weights_return)")
        if self.partial_rollouts and not self.asynchronous:
            raise PlannerError(f"plan {self.name!r}: partial rollouts run asynchronous generation free; the plan "
                               "is not asynchronous")
        if self.max_staleness < 1:
            raise PlannerError(f"plan {self.name!r}: max_staleness {self.max_staleness} must be >= 1")
        if self.asynchronous:
            if self.weights_return or self.fuse_generation:
                raise PlannerError(f"plan {self.name!r}: asynchronous generation keeps its ranks to itself; it "
                                   "neither fuses with inference nor returns the weights")
            shared = sharing_ranks(self.meshes, "actor_gen")
            if shared:
                raise PlannerError(f"plan {self.name!r}: asynchronous generation needs ranks of its own, but "
                                   f"{', '.join(shared)} share(s) actor_gen's")

    def placement(self) -> dict:
        """The plan as ``pretrain_rlhf.py --placement`` reads it (rlhf.parallel.placement)."""
        out = {}
        for task in TASKS:
            mesh, s = self.meshes[task], self.meshes[task].strategy
            out[task] = {"ranks": rank_spec(mesh.ranks), "dp": s.dp, "pp": s.pp, "tp": s.tp}
            if s.ep > 1:
                out[task]["ep"] = s.ep
            if mesh.reverse_pp:
                out[task]["reverse_pp"] = True
        return out

    def describe(self) -> str:
        """One line: each task's layout, tasks on the same ranks grouped."""
        parts = [f"{t.split('_')[0]}.{t.split('_')[1]}={rank_spec(m.ranks)}:{m.strategy}"
                 for t, m in self.meshes.items()]
        return " ".join(parts) + (" +fused" if self.fuse_training else "") + (
            " +inter-stage" if self.fuse_generation else "") + (" +async" if self.asynchronous else "") + (
            " +partial" if self.partial_rollouts else "")


def plan_from_placement_file(path: str | Path, cluster: Cluster, fuse_training: bool = False,
                             fuse_generation: bool = False, migration_threshold: float | None = None) -> Plan:
    """A placement file's meshes (every task placed) as a Plan named after the file; ``fuse_training``,
    ``fuse_generation``, ``migration_threshold``: the job runs with --intra-stage-fusion,
    --inter-stage-fusion, --migration-threshold. PlannerError says what is wrong with the file."""
    try:
        placement = Placement.from_file(path, cluster.gpus)
    except PlacementError as exc:
        raise PlannerError(str(exc)) from None
    missing = [t for t in TASKS if t not in placement.meshes]
    if missing:
        raise PlannerError(f"task(s) {missing} are not placed; the planner needs all six")
    return Plan(Path(path).name, dict(placement.meshes), fuse_training, fuse_generation, migration_threshold)


def rank_spec(ranks) -> str | list:
    """``"a-b"`` for an ascending run of ranks, else the list (placement files accept both)."""
    ranks = list(ranks)
    return f"{ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[0] + len(ranks))) else ranks


@dataclass(frozen=True)
class Evaluation:
    """A plan's predicted iteration: seconds, each call's timing and cost, bytes per rank."""

    plan: Plan
    timeline: IterationTimeline
    costs: dict
    memory: dict
    reshard_bytes: dict = field(default_factory=dict)
    migration_threshold: float | None = None

    @property
    def seconds(self) -> float:
        return self.timeline.seconds

    @property
    def peak_memory(self) -> float:
        return max(self.memory.values())


def evaluate(plan: Plan, models: dict, wl: Workload, hw: Hardware, cluster: Cluster,
             durations: dict | None = None, precision: Precision = BF16) -> Evaluation:
    """Predict ``plan``'s iteration (``models``: ModelConfig per model name; bytes at ``precision``).
    ``durations`` overrides the cost model's seconds of named tasks (e.g. measured per-call times)."""
    costs = {task: cached_cost(task, models[TASK_MODEL[task]], MODEL_KIND[TASK_MODEL[task]], mesh, wl, hw, cluster,
                               plan.microbatches.get(task), precision) for task, mesh in plan.meshes.items()}
    seconds = {task: c.seconds for task, c in costs.items()} | (durations or {})
    if plan.partial_rollouts and "actor_gen" not in (durations or {}):
        seconds["actor_gen"] = free_running_generation_s(costs["actor_gen"], wl, hw, plan.max_staleness)
    moved = {name: most_received(models[TASK_MODEL[src]], MODEL_KIND[TASK_MODEL[src]], plan.meshes[src],
                                 plan.meshes[dst]) for name, (src, dst) in weight_moves(plan).items()}
    moves = {name: _move_call(name, plan, nbytes, hw, cluster) for name, nbytes in moved.items() if nbytes}
    everyone = set().union(*(m.ranks for m in plan.meshes.values()))
    if plan.asynchronous:
        calls = _ahead_calls(plan, seconds)
        scored, threshold = calls[1:], None
        everyone -= set(plan.meshes["actor_gen"].ranks)  # the learners
    else:
        calls, scored, threshold = _rollout_calls(plan, models, wl, hw, cluster, seconds, moves)
    # each inference task sends one value per token, a quarter of the batch's bytes, from its own ranks
    calls.append(Call("advantage", everyone, hw.host_s,
                      [_batch_edge(c.name, c.ranks, everyone, wl, hw, cluster, 0.25) for c in scored]
                      + _after(moves, "return critic")))
    calls += _training_calls(plan, models, wl, hw, seconds, moves)
    if plan.asynchronous:  # the meeting: the next batch arrives, the updated actor moves into actor_gen
        gen = plan.meshes["actor_gen"].ranks
        calls += _placed(moves, "reshard actor", [_batch_edge("actor_gen", gen, everyone, wl, hw, cluster),
                                                  (calls[-1].name, 0.0)])
    return Evaluation(plan, schedule_calls(calls, sharing(hw, cluster)), costs, memory_per_rank(plan, costs), moved,
                      threshold)


def free_running_generation_s(cost: TaskCost, wl: Workload, hw: Hardware, max_staleness: int) -> float:
    """Seconds of generation per iteration when the engine's running batch stays full (partial rollouts): a
    batch's decode steps (and their communication, latency and per-step overhead) scaled from the longest
    response to the mean one of the workload's lengths, the prefill and the call's overhead as they are;
    but at least 1/K of the batch's own seconds, as it has K iterations for its longest sample."""
    lengths = fused_generation.workload_lengths(wl).lengths
    ratio = sum(lengths) / len(lengths) / wl.response_len
    fixed = cost.parts.get("prefill", 0.0) + hw.call_overhead_s
    return max(fixed + (cost.seconds - fixed) * ratio, cost.seconds / max_staleness)


def weight_moves(plan: Plan) -> dict:
    """The weight moves of ``plan``'s iteration, name -> (source task, destination task): into generation
    and critic inference, and with ``weights_return`` back into training after them."""
    return RESHARDS | (RETURNS if plan.weights_return else {})


def _move_call(name: str, plan: Plan, nbytes: int, hw: Hardware, cluster: Cluster) -> Call:
    """Weight move ``name`` as a call (inputs added by the graph): both layouts' ranks, for the busiest
    rank's ``nbytes`` over the link between them."""
    src, dst = weight_moves(plan)[name]
    ranks = set(plan.meshes[src].ranks) | set(plan.meshes[dst].ranks)
    return Call(name, ranks, nbytes / cluster.bandwidth(ranks, hw))


def _after(moves: dict, name: str, inputs: list | None = None) -> list:
    """The edge waiting for move ``name`` when it moves anything, else ``inputs`` (default none)."""
    return [(name, 0.0)] if name in moves else list(inputs or [])


def _placed(moves: dict, name: str, inputs: list) -> list[Call]:
    """Move ``name`` after ``inputs``, when it moves anything."""
    return [replace(moves[name], inputs=tuple(inputs))] if name in moves else []


def _rollout_calls(plan: Plan, models: dict, wl: Workload, hw: Hardware, cluster: Cluster, seconds: dict,
                   moves: dict) -> tuple[list[Call], list[Call], float | None]:
    """The calls up to advantage: the actor's move, generation, the inference calls it feeds and (with
    ``weights_return``) the moves around them as ReaL's runtime makes them (back into training right
    after a call, before its consumers; the critic's after generation, as its inference's own inputs);
    the calls whose scores advantage waits for; the fused generation's R."""
    calls = _placed(moves, "reshard actor", [])
    if plan.fuse_generation:
        fused, threshold = _fused_generation_call(plan, models, wl, hw, cluster, seconds,
                                                  _after(moves, "reshard actor"))
        return calls + [fused], [fused], threshold
    mesh, gen = plan.meshes, plan.meshes["actor_gen"]
    calls.append(Call("actor_gen", gen.ranks, seconds["actor_gen"], _after(moves, "reshard actor")))
    calls += _placed(moves, "return actor", [("actor_gen", 0.0)])
    generated = _after(moves, "return actor")
    if plan.weights_return:
        calls += _placed(moves, "reshard critic", generated or [("actor_gen", 0.0)])
    ready = {t: _after(moves, "reshard critic", generated) if t == "critic_inf" and plan.weights_return
             else generated for t in INFERENCE_TASKS}
    inferring = [Call(t, mesh[t].ranks, seconds[t], [_batch_edge("actor_gen", gen.ranks, mesh[t].ranks, wl, hw,
                                                                 cluster)] + ready[t]) for t in INFERENCE_TASKS]
    return calls + inferring + _placed(moves, "return critic", [("critic_inf", 0.0)]), inferring, None


def _ahead_calls(plan: Plan, seconds: dict) -> list[Call]:
    """Asynchronous generation of a later batch beside the inference calls of one generated before
    (no edge between them: the batch the inference reads arrived at the last meeting)."""
    mesh = plan.meshes
    return [Call("actor_gen", mesh["actor_gen"].ranks, seconds["actor_gen"])] + [
        Call(t, mesh[t].ranks, seconds[t]) for t in INFERENCE_TASKS]


def _training_calls(plan: Plan, models: dict, wl: Workload, hw: Hardware, seconds: dict, moves: dict) -> list[Call]:
    """The training calls after advantage (one fused call with ``fuse_training``), and the critic's move
    into its inference layout after them (the trainer's order; ReaL's moves it before its inference)."""
    mesh = plan.meshes
    if plan.fuse_training:
        fused = fused_training_seconds(plan, models, wl, hw, seconds["actor_train"] + seconds["critic_train"])
        calls = [Call("actor_train+critic_train", mesh["actor_train"].ranks, fused, [("advantage", 0.0)])]
    else:
        calls = [Call(t, mesh[t].ranks, seconds[t], [("advantage", 0.0)]) for t in ("actor_train", "critic_train")]
    return calls + ([] if plan.weights_return else _placed(moves, "reshard critic", [(calls[-1].name, 0.0)]))


def _batch_edge(src: str, src_ranks, dst_ranks, wl: Workload, hw: Hardware, cluster: Cluster,
                tokens_share: float = 1.0) -> tuple:
    """The input edge of data from call ``src``: ``tokens_share`` of the batch's bytes over the link."""
    nbytes = wl.samples * wl.seq * BATCH_BYTES_PER_TOKEN * tokens_share
    return src, nbytes / cluster.bandwidth(set(src_ranks) | set(dst_ranks), hw)


def _fused_generation_call(plan: Plan, models: dict, wl: Workload, hw: Hardware, cluster: Cluster, seconds: dict,
                           inputs: list) -> tuple[Call, float]:
    """Generation and inference as one call on actor_gen's ranks (and its R), lasting their unfused span
    times the fusion policy's fused over unfused time."""
    mesh, gen = plan.meshes, plan.meshes["actor_gen"]
    why = fused_generation.refusal(mesh, hw)
    if why:
        raise PlannerError(why)
    unfused = [Call("actor_gen", gen.ranks, seconds["actor_gen"])] + [
        Call(t, mesh[t].ranks, seconds[t], [_batch_edge("actor_gen", gen.ranks, mesh[t].ranks, wl, hw, cluster)])
        for t in INFERENCE_TASKS]
    span = schedule_calls(unfused, sharing(hw, cluster)).seconds
    cost = fused_generation.generation_cost(models["actor"], gen, wl, hw, cluster, seconds["actor_gen"],
                                            span - seconds["actor_gen"])
    fused, threshold = fused_generation.fused_seconds(cost, wl, span, plan.migration_threshold)
    return Call(FUSED_GENERATION, gen.ranks, fused, inputs), threshold


def sharing(hw: Hardware, cluster: Cluster) -> Sharing | None:
    """How the ranks of a node share its cores (None when each rank has its own device)."""
    return Sharing(cluster.gpus_per_node, hw.shared_cores) if hw.shared_cores else None


STAGES = {"reshard": tuple(RESHARDS) + tuple(RETURNS), "generation": ("actor_gen", FUSED_GENERATION),
          "inference": INFERENCE_TASKS, "advantage": ("advantage",),
          "training": ("actor_train", "critic_train", "actor_train+critic_train")}
"""The trainer's timed stages (``time_<stage>_s``) and the calls of each."""


def stage_seconds(ev: Evaluation) -> dict:
    """Predicted seconds of each stage: from its first call's start to its last call's end (the stages
    meet at all-rank gathers), the two reshards added; 0 for a stage without calls."""
    t, out = ev.timeline, {}
    for stage, names in STAGES.items():
        names = [n for n in names if n in t.start]
        if stage == "reshard":
            out[stage] = sum(t.end[n] - t.start[n] for n in names)
        else:
            out[stage] = max((t.end[n] for n in names), default=0.0) - min((t.start[n] for n in names), default=0.0)
    return out


@lru_cache(maxsize=None)
def cached_cost(task: str, cfg: ModelConfig, kind: str, mesh: TaskMesh, wl: Workload, hw: Hardware,
                cluster: Cluster, count: int | None = None, precision: Precision = BF16) -> TaskCost:
    """rlhf.planner.cost.task_cost, remembered (the search asks for the same layouts again and again)."""
    return task_cost(task, cfg, kind, mesh, wl, hw, cluster, count, precision)


@lru_cache(maxsize=None)
def most_received(cfg: ModelConfig, kind: str, src: TaskMesh, dst: TaskMesh) -> int:
    """The bytes the busiest rank receives resharding ``src`` -> ``dst`` (remembered)."""
    return max(received_bytes(cfg, kind, src, dst).values())


def memory_per_rank(plan: Plan, costs: dict) -> dict:
    """Bytes each rank holds at its peak: every task's static part plus the largest transient part."""
    static, transient = {}, {}
    for task, mesh in plan.meshes.items():
        c: TaskCost = costs[task]
        extra = c.transient_bytes
        if plan.fuse_training and task in ("actor_train", "critic_train"):
            extra = costs["actor_train"].transient_bytes + costs["critic_train"].transient_bytes
        for r in mesh.ranks:
            static[r] = static.get(r, 0.0) + c.static_bytes
            transient[r] = max(transient.get(r, 0.0), extra)
    return {r: static[r] + transient[r] for r in static}


def memory_parts_per_rank(plan: Plan, memory: dict, resident_kv: bool = False) -> dict:
    """{rank: {part: bytes}} (rlhf.planner.cost.MEMORY_PARTS) of :func:`memory_per_rank`'s peak, from each
    task's parts (``memory[task]``: ``TaskCost.memory``, rlhf.planner.cost.task_memory): every task's static
    parts summed, the transient parts of the call with the largest transient bytes (both training calls
    when fused); the parts of a rank add up to its memory_per_rank. ``resident_kv``: the KV cache stays
    allocated between generations (our trainer without --release-generation-memory), so it is static."""
    out = {}
    static_parts = (*STATIC_PARTS, "kv") if resident_kv else STATIC_PARTS
    for task, mesh in plan.meshes.items():
        calls = [memory[task]]
        if plan.fuse_training and task in ("actor_train", "critic_train"):
            calls = [memory["actor_train"], memory["critic_train"]]
        transient = {p: sum(x[p] for x in calls) for p in MEMORY_PARTS if p not in static_parts}
        for r in mesh.ranks:
            parts = out.setdefault(r, {"static": dict.fromkeys(static_parts, 0.0), "transient": None})
            for p in static_parts:
                parts["static"][p] += memory[task][p]
            if parts["transient"] is None or sum(transient.values()) > sum(parts["transient"].values()):
                parts["transient"] = transient
    return {r: parts["static"] | parts["transient"] for r, parts in out.items()}


def fused_training_seconds(plan: Plan, models: dict, wl: Workload, hw: Hardware, serial_s: float) -> float:
    """Serial training seconds scaled by the greedy fused schedule's makespan over serial 1F1B."""
    a, c = plan.meshes["actor_train"], plan.meshes["critic_train"]
    if set(a.ranks) != set(c.ranks):
        raise PlannerError("intra-stage fusion needs actor_train and critic_train on the same ranks")
    minibatch = wl.samples // wl.minibatches
    shapes = [schedule_shape(models[TASK_MODEL[t]], TASK_MODEL[t], mesh.strategy.tp, mesh.strategy.pp,
                             microbatches_per_replica(minibatch, mesh.strategy.dp, wl.micro_batch_size), d)
              for t, mesh, d in (("actor_train", a, "down"), ("critic_train", c, "up"))]
    try:
        pb = build_problem(shapes, CostConfig(tokens_per_microbatch=wl.micro_batch_size * wl.seq,
                                              seq_len=wl.seq, gpu_flops=hw.gpu_flops, mfu=hw.mfu))
    except ProblemError as exc:
        raise PlannerError(f"intra-stage fusion: {exc}") from None
    return serial_s * simulate_schedule(pb, greedy_fused(pb)).makespan / serial_1f1b_makespan(pb)
