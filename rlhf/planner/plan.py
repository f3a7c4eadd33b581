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
nothing moves. The samples move along the data edges (tokens, log-probs and
the scores as 4-byte values per token). With ``fuse_training`` the two
training calls are one call on their shared ranks whose time is the serial
time scaled by the greedy fused schedule's makespan over serial 1F1B
(rlhf.schedule; the annealed schedule of tools/search_schedule.py is at
least as short). With ``fuse_generation`` generation and the three
inference calls are one call on actor_gen's ranks, timed by the fusion
policy's simulation (rlhf.planner.fused_generation). Memory per rank: the static
bytes of every task on it plus the largest transient bytes of one call (both
training calls when fused).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from rlhf.models.config import ModelConfig
from rlhf.parallel.mesh import PlacementError, TaskMesh
from rlhf.parallel.placement import Placement
from rlhf.planner import fused_generation
from rlhf.planner.cost import Cluster, TaskCost, Workload, microbatches, task_cost
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

    def placement(self) -> dict:
        """The plan as ``pretrain_rlhf.py --placement`` reads it (rlhf.parallel.placement)."""
        out = {}
        for task in TASKS:
            mesh, s = self.meshes[task], self.meshes[task].strategy
            out[task] = {"ranks": rank_spec(mesh.ranks), "dp": s.dp, "pp": s.pp, "tp": s.tp}
            if mesh.reverse_pp:
                out[task]["reverse_pp"] = True
        return out

    def describe(self) -> str:
        """One line: each task's layout, tasks on the same ranks grouped."""
        parts = [f"{t.split('_')[0]}.{t.split('_')[1]}={rank_spec(m.ranks)}:{m.strategy}"
                 for t, m in self.meshes.items()]
        return " ".join(parts) + (" +fused" if self.fuse_training else "") + (
            " +inter-stage" if self.fuse_generation else "")


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
             durations: dict | None = None) -> Evaluation:
    """Predict ``plan``'s iteration (``models``: ModelConfig per model name). ``durations`` overrides
    the cost model's seconds of named tasks (e.g. measured per-call times)."""
    costs = {task: cached_cost(task, models[TASK_MODEL[task]], MODEL_KIND[TASK_MODEL[task]], mesh, wl, hw, cluster)
             for task, mesh in plan.meshes.items()}
    seconds = {task: c.seconds for task, c in costs.items()} | (durations or {})
    calls, moved, reshards = [], {}, {}
    for name, (src, dst) in RESHARDS.items():
        model = TASK_MODEL[src]
        moved[name] = most_received(models[model], MODEL_KIND[model], plan.meshes[src], plan.meshes[dst])
        if moved[name]:
            ranks = set(plan.meshes[src].ranks) | set(plan.meshes[dst].ranks)
            reshards[name] = (ranks, moved[name] / cluster.bandwidth(ranks, hw))
    mesh = plan.meshes
    everyone = set().union(*(m.ranks for m in mesh.values()))
    if "reshard actor" in reshards:
        calls.append(Call("reshard actor", *reshards["reshard actor"]))
    generated, threshold = _generation_calls(plan, models, wl, hw, cluster, seconds,
                                             [("reshard actor", 0.0)] if "reshard actor" in reshards else [])
    calls += generated
    # each inference task sends one value per token, a quarter of the batch's bytes, from its own ranks
    scored = generated[1:] or generated
    calls.append(Call("advantage", everyone, hw.host_s,
                      [_batch_edge(c.name, c.ranks, everyone, wl, hw, cluster, 0.25) for c in scored]))
    if plan.fuse_training:
        fused = fused_training_seconds(plan, models, wl, hw, seconds["actor_train"] + seconds["critic_train"])
        calls.append(Call("actor_train+critic_train", mesh["actor_train"].ranks, fused, [("advantage", 0.0)]))
        trained = "actor_train+critic_train"
    else:
        calls += [Call(t, mesh[t].ranks, seconds[t], [("advantage", 0.0)]) for t in ("actor_train", "critic_train")]
        trained = "critic_train"
    if "reshard critic" in reshards:
        calls.append(Call("reshard critic", *reshards["reshard critic"], [(trained, 0.0)]))
    return Evaluation(plan, schedule_calls(calls, sharing(hw, cluster)), costs, memory_per_rank(plan, costs), moved,
                      threshold)


def _batch_edge(src: str, src_ranks, dst_ranks, wl: Workload, hw: Hardware, cluster: Cluster,
                tokens_share: float = 1.0) -> tuple:
    """The input edge of data from call ``src``: ``tokens_share`` of the batch's bytes over the link."""
    nbytes = wl.samples * wl.seq * BATCH_BYTES_PER_TOKEN * tokens_share
    return src, nbytes / cluster.bandwidth(set(src_ranks) | set(dst_ranks), hw)


def _generation_calls(plan: Plan, models: dict, wl: Workload, hw: Hardware, cluster: Cluster, seconds: dict,
                      inputs: list) -> tuple[list[Call], float | None]:
    """actor_gen and the inference calls it feeds, or with ``fuse_generation`` one fused call (and its R)
    lasting their span times the fusion policy's fused over unfused time."""
    mesh, gen = plan.meshes, plan.meshes["actor_gen"]
    inferring = [Call(t, mesh[t].ranks, seconds[t], [_batch_edge("actor_gen", gen.ranks, mesh[t].ranks, wl, hw,
                                                                 cluster)]) for t in INFERENCE_TASKS]
    if not plan.fuse_generation:
        return [Call("actor_gen", gen.ranks, seconds["actor_gen"], inputs)] + inferring, None
    why = fused_generation.refusal(mesh, hw)
    if why:
        raise PlannerError(why)
    unfused = [Call("actor_gen", gen.ranks, seconds["actor_gen"])] + inferring
    span = schedule_calls(unfused, sharing(hw, cluster)).seconds
    cost = fused_generation.generation_cost(models["actor"], gen, wl, hw, cluster, seconds["actor_gen"],
                                       span - seconds["actor_gen"])
    fused, threshold = fused_generation.fused_seconds(cost, wl, span, plan.migration_threshold)
    return [Call(FUSED_GENERATION, gen.ranks, fused, inputs)], threshold


def sharing(hw: Hardware, cluster: Cluster) -> Sharing | None:
    """How the ranks of a node share its cores (None when each rank has its own device)."""
    return Sharing(cluster.gpus_per_node, hw.shared_cores) if hw.shared_cores else None


STAGES = {"reshard": ("reshard actor", "reshard critic"), "generation": ("actor_gen", FUSED_GENERATION),
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
                cluster: Cluster) -> TaskCost:
    """rlhf.planner.cost.task_cost, remembered (the search asks for the same layouts again and again)."""
    return task_cost(task, cfg, kind, mesh, wl, hw, cluster)


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


def fused_training_seconds(plan: Plan, models: dict, wl: Workload, hw: Hardware, serial_s: float) -> float:
    """Serial training seconds scaled by the greedy fused schedule's makespan over serial 1F1B."""
    a, c = plan.meshes["actor_train"], plan.meshes["critic_train"]
    if set(a.ranks) != set(c.ranks):
        raise PlannerError("intra-stage fusion needs actor_train and critic_train on the same ranks")
    shapes = [schedule_shape(models[TASK_MODEL[t]], TASK_MODEL[t], mesh.strategy.tp, mesh.strategy.pp,
                             microbatches(wl.samples // wl.minibatches, mesh.strategy.dp, wl.micro_batch_size), d)
              for t, mesh, d in (("actor_train", a, "down"), ("critic_train", c, "up"))]
    try:
        pb = build_problem(shapes, CostConfig(tokens_per_microbatch=wl.micro_batch_size * wl.seq,
                                              seq_len=wl.seq, gpu_flops=hw.gpu_flops, mfu=hw.mfu))
    except ProblemError as exc:
        raise PlannerError(f"intra-stage fusion: {exc}") from None
    return serial_s * simulate_schedule(pb, greedy_fused(pb)).makespan / serial_1f1b_makespan(pb)
