"""Search over model placements, GPU allocations and per-task (dp, pp, tp): the ranked plans.

The space, pruned as it is built:

* **placements** (HybridFlow section 6): the partitions of the four models
  into colocated sets; all tasks of a model run on its set's ranks (an
  inference task possibly on half of them, below). APP's
  presets are named among them: ``flatten`` (one set: every model on every
  GPU), ``interleave`` ({actor, reference} and {critic, reward} on two
  halves, so the concurrent inference calls and the two training calls run
  side by side), ``separate`` (each model alone).
* **allocations**: each set gets a contiguous block of ranks, whole nodes, or
  a power-of-two part of one node that does not straddle nodes.
* **strategies**: per task every (dp, pp, tp) filling its block, pruned when
  tp does not divide the heads, KV heads or ffn, a TP group leaves its node,
  pp does not divide the layers, generation is pipelined (the engine decodes
  a whole model: pp = 1), a mixture of experts trains at tp > 1 (megatron
  needs sequence parallelism for it), or the task alone cannot fit one GPU;
  a mixture of experts' tasks but generation (whose engine holds every
  expert) each with every ep dividing both dp and the experts; the
  ``options`` fastest survivors (cost model) are kept, and the leanest.
* **sub-meshes** (ReaL's per-call meshes): an inference task may also run
  on either half of its set's block (the fastest strategy there), so that
  two inference calls of one set run side by side.

Each (placement, allocation) is first scored with every task's fastest
option; the ``keep`` best go on to a full search of their option products
(the ``keep`` best synchronous and the ``keep`` best asynchronous ones).
That search is brute force when the products hold at most
``brute_force_limit`` plans, otherwise simulated annealing (one task's option
changed per proposal, ``proposals`` proposals per candidate, seeded: the same
input gives the same plans). Infeasible plans (a rank over its memory) are
kept out of the ranking and reported with their reason. Where actor and
critic share a set, fused training (intra-stage fusion) is tried too when
``fuse_training`` is set; where all four models share one set, fused
generation and inference (inter-stage fusion, rlhf.planner.fused_generation)
when ``fuse_generation`` is set and actor_gen has dp >= 2. With
``asynchronous`` every placement is also tried with actor_gen on a block of
its own before the models' blocks (``gen | ...``), both synchronous and
asynchronous (``--max-staleness``: the steady state of rlhf.planner.plan;
with ``partial_rollouts`` asynchronous means free-running generation,
``--partial-rollouts``).
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from rlhf.parallel.mesh import ParallelStrategy, TaskMesh
from rlhf.planner import fused_generation
from rlhf.planner.cost import ROLE, Cluster, Workload
from rlhf.planner.errors import PlannerError
from rlhf.planner.hardware import Hardware
from rlhf.planner.plan import Evaluation, Plan, cached_cost, evaluate, most_received
from rlhf.planner.reshard_bytes import hybridflow_ranks
from rlhf.tasks import INFERENCE_TASKS, MODEL_KIND, MODELS, TASK_MODEL, TASKS

GENERATION = "generation"
"""The set of an asynchronous candidate that holds actor_gen alone (rlhf/ppo/asynchronous.py)."""

APP_PLACEMENTS = {
    "flatten": (("actor", "reference", "reward", "critic"),),
    "interleave": (("actor", "reference"), ("reward", "critic")),
    "separate": (("actor",), ("reference",), ("reward",), ("critic",)),
}
"""APP's named placements: the sets of models that share ranks."""


@dataclass(frozen=True)
class PlacementSearchConfig:
    """Knobs of the search (see the module docstring)."""

    options: int = 3
    keep: int = 8
    brute_force_limit: int = 2000
    proposals: int = 600
    seed: int = 0
    fuse_training: bool = False
    fuse_generation: bool = False
    asynchronous: bool = False
    partial_rollouts: bool = False
    max_staleness: int = 1


class AsyncMode(NamedTuple):
    """How an asynchronous candidate's generation runs (a non-empty tuple: true where a mode is a bool)."""

    partial_rollouts: bool
    max_staleness: int


class Pruned(NamedTuple):
    """A plan (or placement) left out of the ranking, and why."""

    what: str
    why: str


class Candidate(NamedTuple):
    """A placement and allocation: its ``name``, the ``sets`` of models sharing ranks, each set's block
    size in rank order."""

    name: str
    sets: tuple
    sizes: tuple


class Scored(NamedTuple):
    """A candidate's first score: its best seconds with every task's fastest or leanest option."""

    seconds: float
    name: str
    options: dict
    fuse: tuple


@dataclass
class PlacementSearchResult:
    """Feasible plans, fastest first; :class:`Pruned` entries; how the search ran."""

    ranked: list
    pruned: list = field(default_factory=list)
    method: str = ""
    evaluations: int = 0
    predicted: dict = field(default_factory=dict, repr=False)
    """Every choice predicted so far, by (placement, choice, fusion): a fused variant's twin is met again."""

    @property
    def best(self) -> Evaluation:
        return self.ranked[0]


def set_partitions(items: tuple) -> list[tuple]:
    """All partitions of ``items`` into non-empty sets, each set in ``items`` order."""
    if not items:
        return [()]
    head, rest = items[0], items[1:]
    out = []
    for part in set_partitions(rest):
        out.append(((head,),) + part)
        for i in range(len(part)):
            out.append(part[:i] + ((head,) + part[i],) + part[i + 1:])
    return sorted(out, key=lambda p: (len(p), p))


def allocations(sets: int, cluster: Cluster) -> list[tuple[int, ...]]:
    """Block sizes (in rank order) giving ``sets`` sets all GPUs: whole nodes, or a power-of-two part of
    one node that does not straddle a node boundary."""
    g = cluster.gpus_per_node
    sizes = sorted({g * k for k in range(1, cluster.nodes + 1)} | {1 << i for i in range(g.bit_length())
                                                                     if g % (1 << i) == 0})
    out = []

    def grow(prefix: tuple, offset: int):
        if len(prefix) == sets:
            if offset == cluster.gpus:
                out.append(prefix)
            return
        for size in sizes:
            inside = size % g == 0 and offset % g == 0 or size < g and offset // g == (offset + size - 1) // g
            if offset + size <= cluster.gpus and inside and (size >= g or offset % size == 0):
                grow(prefix + (size,), offset + size)

    grow((), 0)
    return out


def strategies(task: str, cfg, ranks: tuple, wl: Workload, cluster: Cluster) -> tuple[list[ParallelStrategy],
                                                                                    list[str]]:
    """Every (dp, pp, tp) for ``task`` on ``ranks`` that shards ``cfg`` and the batch, and why the others
    do not (the rules rlhf.parallel.placement and the job's config apply); a mixture of experts' tasks but
    actor_gen with each ep dividing dp and the experts (ep = 1 first)."""
    minibatch = wl.samples // wl.minibatches
    n, ok, why = len(ranks), [], []
    for tp in (d for d in range(1, n + 1) if n % d == 0):
        for pp in (d for d in range(1, n // tp + 1) if (n // tp) % d == 0):
            dp = n // (tp * pp)
            s = ParallelStrategy(dp=dp, pp=pp, tp=tp)
            rule = next((msg for bad, msg in (
                (cfg.num_attention_heads % tp or cfg.num_kv_heads % tp or cfg.ffn_hidden_size % tp,
                 f"tp={tp} does not divide the heads/KV heads/ffn"),
                (tp > cluster.gpus_per_node or cluster.gpus_per_node % tp, f"tp={tp}: a TP group leaves its node"),
                (cfg.num_layers % pp, f"pp={pp} does not divide {cfg.num_layers} layers"),
                (task == "actor_gen" and pp > 1, "generation decodes a whole model (pp=1)"),
                (ROLE[task] == "training" and minibatch % (n // (tp * pp) * wl.micro_batch_size),
                 f"dp={n // (tp * pp)} x micro-batch {wl.micro_batch_size} does not divide the mini-batch of "
                 f"{minibatch} samples"),
                (cfg.is_moe and tp > 1 and ROLE[task] == "training",
                 f"tp={tp}: megatron trains MoE layers at tp > 1 only with sequence parallelism (split the experts "
                 "with ep)"),
            ) if bad), None)
            if rule:
                why.append(f"{task} {s}: {rule}")
            elif cfg.is_moe and task != "actor_gen":
                ok += [replace(s, ep=ep) for ep in range(1, dp + 1) if dp % ep == 0 and cfg.num_experts % ep == 0]
            else:
                ok.append(s)
    return ok, why


def task_options(task: str, models: dict, ranks: tuple, wl: Workload, hw: Hardware, cluster: Cluster,
                 count: int) -> tuple[list[TaskMesh], list[str]]:
    """The ``count`` fastest meshes of ``task`` on ``ranks`` that fit one GPU alone and the leanest one
    (fewest static bytes: it leaves the most room to the other tasks), and why the others fell."""
    cfg, kind = models[TASK_MODEL[task]], MODEL_KIND[TASK_MODEL[task]]
    good, why = strategies(task, cfg, ranks, wl, cluster)
    limit = hw.gpu_memory * hw.memory_headroom
    fits: dict = {}  # mesh -> its cost
    for s in good:
        mesh = TaskMesh(task, ranks, s)
        c = cached_cost(task, cfg, kind, mesh, wl, hw, cluster)
        if c.static_bytes + c.transient_bytes > limit:
            why.append(f"{task} {s}: needs {(c.static_bytes + c.transient_bytes) / 2**30:.1f} GiB per GPU alone "
                       f"> {limit / 2**30:.1f} GiB")
        else:
            fits[mesh] = c
    kept = sorted(fits, key=lambda m: fits[m].seconds)[:count]
    leanest = min(fits, key=lambda m: (fits[m].static_bytes, fits[m].seconds), default=None)
    if leanest is not None and leanest not in kept:
        kept.append(leanest)
    return kept, why


def generation_order(meshes: dict, models: dict) -> dict:
    """actor_gen's ranks in HybridFlow's order when that moves fewer bytes from actor_train."""
    gen, train = meshes["actor_gen"], meshes["actor_train"]
    if set(gen.ranks) != set(train.ranks):
        return meshes
    order = hybridflow_ranks(train, gen.strategy)
    if order is None or order == gen.ranks:
        return meshes
    nested = TaskMesh("actor_gen", order, gen.strategy)
    cfg = models["actor"]
    if most_received(cfg, "lm", train, nested) < most_received(cfg, "lm", train, gen):
        return {**meshes, "actor_gen": nested}
    return meshes


def placement_candidates(cluster: Cluster, asynchronous: bool = False) -> list[Candidate]:
    """Every placement and allocation on ``cluster``; APP's placements named. With ``asynchronous`` also
    each with actor_gen apart: a first set of its own (``GENERATION``) before the models' sets."""
    named = {v: k for k, v in APP_PLACEMENTS.items()}
    out = []
    for sets in set_partitions(MODELS):
        label = named.get(sets, " | ".join("+".join(m[:3] for m in s) for s in sets))
        variants = [((), label)] + ([(((GENERATION,),), f"gen | {label}")] if asynchronous else [])
        for prefix, name in variants:
            for sizes in allocations(len(sets) + len(prefix), cluster):
                out.append(Candidate(f"{name} [{','.join(map(str, sizes))}]", prefix + sets, sizes))
    return out


def search_placements(models: dict, wl: Workload, hw: Hardware, cluster: Cluster,
                      config: PlacementSearchConfig = PlacementSearchConfig()) -> PlacementSearchResult:
    """Rank plans for ``models`` (ModelConfig per model name) on ``cluster``; PlannerError if none fits."""
    result = PlacementSearchResult(ranked=[])
    scored = []
    for name, sets, sizes in placement_candidates(cluster, config.asynchronous):
        options = _options(name, sets, sizes, models, wl, hw, cluster, config, result)
        if options is None:
            continue
        for fuse in _fusions(sets, config):
            firsts = [_evaluate(name, [o[i] for o in options.values()], options, fuse, models, wl, hw, cluster,
                                result) for i in (0, -1)]  # every task's fastest, every task's leanest
            firsts = [ev for ev in firsts if ev is not None]
            if firsts:
                scored.append(Scored(min(ev.seconds for ev in firsts), name, options, fuse))
    scored.sort(key=lambda x: x.seconds)
    # the best of each mode goes on: asynchronous candidates (fuse[2]) are not crowded out by synchronous ones
    kept = [c for mode in (False, True) for c in [c for c in scored if bool(c.fuse[2]) == mode][:config.keep]]
    total = sum(math.prod(len(o) for o in c.options.values()) for c in kept)
    result.method = ("brute force" if total <= config.brute_force_limit else
                     f"simulated annealing ({config.proposals} proposals per candidate)")
    best: dict = {}
    for _, name, options, fuse in kept:
        found = (_brute_force if total <= config.brute_force_limit else _anneal)(
            name, options, fuse, models, wl, hw, cluster, config, result)
        for ev in found:
            key = ev.plan.describe()
            if key not in best or ev.seconds < best[key].seconds:
                best[key] = ev
    result.ranked = sorted(best.values(), key=lambda e: e.seconds)
    result.pruned = list(dict.fromkeys(result.pruned))  # one plan can come from two choices (generation_order)
    if not result.ranked:
        raise PlannerError(_nothing_fits(result.pruned, cluster))
    return result


def _nothing_fits(pruned: list, cluster: Cluster) -> str:
    """Why no plan exists, in one line: memory, or GPUs that no layout divides."""
    memory = [p.why for p in pruned if "GiB" in p.why]
    if memory:
        return (f"no plan fits in memory on {cluster.nodes} x {cluster.gpus_per_node} GPUs (e.g. {memory[0]}); "
                "add GPUs, use GPUs with more memory, or shorten the sequences or micro-batches")
    example = pruned[0].why if pruned else "no candidate"
    return (f"the {cluster.gpus} GPUs ({cluster.nodes} x {cluster.gpus_per_node}) cannot be divided among the "
            f"tasks: no (dp, pp, tp) shards the models and the batch (e.g. {example}); use a GPU count per node "
            "that divides the heads and layers (a power of two) or change the batch sizes")


def _fusions(sets: tuple, config: PlacementSearchConfig) -> list[tuple[bool, bool, "AsyncMode | bool"]]:
    """(fuse_training, fuse_generation, asynchronous) variants worth trying on this placement: a candidate
    with actor_gen apart runs asynchronous (the config's AsyncMode; and synchronous, False, too: generation
    apart can win without it)."""
    training = (False, True) if config.fuse_training and any("actor" in s and "critic" in s for s in sets) \
        else (False,)
    generation = (False, True) if config.fuse_generation and len(sets) == 1 else (False,)
    mode = AsyncMode(config.partial_rollouts, config.max_staleness)
    apart = (False, mode) if (GENERATION,) in sets else (False,)
    return list(itertools.product(training, generation, apart))


def _options(name, sets, sizes, models, wl, hw, cluster, config, result) -> dict | None:
    """Per task, its kept meshes on its set's block; None (and a pruned entry) when a task has none."""
    blocks, offset = {}, 0
    for s, size in zip(sets, sizes):
        for model in s:
            blocks[model] = tuple(range(offset, offset + size))
        offset += size
    options = {}
    for task in TASKS:
        block = blocks[GENERATION if task == "actor_gen" and GENERATION in blocks else TASK_MODEL[task]]
        kept, why = task_options(task, models, block, wl, hw, cluster, config.options)
        if not kept:
            result.pruned.append(Pruned(name, why[-1] if why else f"{task}: no strategy"))
            return None
        if task in INFERENCE_TASKS and len(block) > 1:  # a half of the set: inference calls side by side
            halves = (block[:len(block) // 2], block[len(block) // 2:])
            # after the fastest, before the leanest (the first scoring takes the first and the last)
            fastest = []
            for half in halves:
                meshes, _ = task_options(task, models, half, wl, hw, cluster, 1)
                fastest += meshes[:1]
            kept[1:1] = fastest
        options[task] = kept
    return options


def _evaluate(name, choice, options, fuse, models, wl, hw, cluster, result) -> Evaluation | None:
    """One option per task as a plan, predicted (once); None when it is pruned. A fused-generation variant
    that cannot fuse or gains nothing (no long tail) stands as its unfused twin."""
    key = (name, tuple(choice), fuse)
    if key not in result.predicted:
        result.predicted[key] = _evaluate_new(name, choice, options, fuse, models, wl, hw, cluster, result)
    return result.predicted[key]


def _evaluate_new(name, choice, options, fuse, models, wl, hw, cluster, result) -> Evaluation | None:
    meshes = dict(zip(options, choice))
    fuse_training, fuse_generation, asynchronous = fuse
    if fuse_generation:
        twin = _evaluate(name, choice, options, (fuse_training, False, False), models, wl, hw, cluster, result)
        if twin is None or fused_generation.refusal(twin.plan.meshes, hw):
            return twin
        ev = _predict(replace(twin.plan, fuse_generation=True), models, wl, hw, cluster, result)
        return ev if ev is not None and ev.seconds < twin.seconds else twin
    if fuse_training:
        critic = meshes["critic_train"]
        meshes["critic_train"] = TaskMesh("critic_train", critic.ranks, critic.strategy, reverse_pp=True)
    mode = asynchronous or AsyncMode(False, 1)
    return _predict(Plan(name, generation_order(meshes, models), fuse_training, asynchronous=bool(asynchronous),
                         partial_rollouts=mode.partial_rollouts, max_staleness=mode.max_staleness), models, wl, hw,
                    cluster, result)


def _predict(plan, models, wl, hw, cluster, result) -> Evaluation | None:
    """``plan`` evaluated; None (and a pruned entry) when it is refused or over a GPU's memory."""
    result.evaluations += 1
    try:
        ev = evaluate(plan, models, wl, hw, cluster)
    except PlannerError as exc:
        result.pruned.append(Pruned(plan.name, str(exc)))
        return None
    limit = hw.gpu_memory * hw.memory_headroom
    if ev.peak_memory > limit:
        rank = max(ev.memory, key=ev.memory.get)
        result.pruned.append(Pruned(plan.describe(), f"memory: rank {rank} needs {ev.peak_memory / 2**30:.1f} GiB > "
                                               f"{limit / 2**30:.1f} GiB"))
        return None
    return ev


def _brute_force(name, options, fuse, models, wl, hw, cluster, config, result) -> list:
    found = (_evaluate(name, choice, options, fuse, models, wl, hw, cluster, result)
             for choice in itertools.product(*options.values()))
    return [ev for ev in found if ev is not None]


def _anneal(name, options, fuse, models, wl, hw, cluster, config, result) -> list:
    """Simulated annealing over one option index per task, from the fastest options."""
    rng = random.Random(f"{config.seed}:{name}:{fuse}")
    lists = list(options.values())
    state = [0] * len(lists)
    seen: dict = {}

    def energy(st) -> float:
        key = tuple(st)
        if key not in seen:
            seen[key] = _evaluate(name, [l[i] for l, i in zip(lists, st)], options, fuse, models, wl, hw,
                                  cluster, result)
        return seen[key].seconds if seen[key] is not None else math.inf

    current = energy(state)
    temp0 = 0.05 * current if math.isfinite(current) else 1.0
    for k in range(config.proposals):
        task = rng.randrange(len(lists))
        if len(lists[task]) < 2:
            continue
        proposal = state[:]
        proposal[task] = rng.choice([i for i in range(len(lists[task])) if i != state[task]])
        e = energy(proposal)
        temp = temp0 * (1 - k / config.proposals) + 1e-12
        if e <= current or (math.isfinite(e) and rng.random() < math.exp(-(e - current) / temp)):
            state, current = proposal, e
    return [ev for ev in seen.values() if ev is not None]
