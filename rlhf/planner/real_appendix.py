"""ReaL's appendix tables (arXiv 2406.14088, appendix A) as planner inputs, and what the planner makes of them.

The tables are one JSON file (``TABLES``: the shared seed facts beside the
checkout): Table 1's four LLaMA-3-style shapes, the four execution plans of
Tables 2-5 (per call a mesh of nodes, tp, pp, dp, micro-batches and the
measured seconds) and Table 6's end-to-end seconds, in ReaL's base setting
(512 samples of a 1024-token prompt generated to a 2048-token context, 8 PPO
mini-batches, 8 GPUs per node; the 128-GPU plans at 4096 samples, see
:func:`workload`). :func:`load_appendix` turns them into
:class:`~rlhf.planner.plan.Plan` objects that run as ReaL's runtime runs
them: every call on its own mesh with its own micro-batch count, and a
trained model's weights moved into a call's layout before it and back after
it (``Plan.weights_return``).

* :func:`simulate_table6`: each plan's iteration from its measured call
  seconds, with the weight moves and data transfers the cost model computes
  from the layouts; nothing is fitted to the end-to-end seconds.
* :func:`held_out`: the hardware file calibrated (rlhf.planner.calibrate) on
  one plan's call seconds and iteration, predicting the other plans' call
  seconds and iterations.
* :func:`search_beside_real`: the planner's own search on each setting,
  beside ReaL's plans predicted by the same hardware file.

``REAL_HARDWARE`` is the assumption about ReaL's cluster: H100 SXM compute
and HBM (the ``h100`` preset) with the links ReaL's own reallocation
estimator assumes (realhf/search_engine/param_realloc.py: 200 Gb/s per GPU
between nodes, 1800 Gb/s inside one); the appendix does not state them.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from rlhf.models.config import ModelConfig
from rlhf.parallel.mesh import ParallelStrategy, TaskMesh
from rlhf.planner.calibrate import calibrate
from rlhf.planner.cost import ROLE, Cluster, Workload
from rlhf.planner.errors import PlannerError
from rlhf.planner.hardware import HARDWARE_PRESETS, Hardware
from rlhf.planner.placement_search import PlacementSearchConfig, search_placements
from rlhf.planner.plan import Evaluation, Plan, evaluate

TABLES = Path(__file__).resolve().parents[3] / "shared" / "seed-facts" / "real_appendix_tables.json"
"""Where the shared seed facts keep the tables (../shared beside the checkout)."""

REAL_HARDWARE = replace(HARDWARE_PRESETS["h100"], name="h100, ReaL's links", inter_node_bandwidth=25e9,
                        intra_node_bandwidth=225e9)
"""H100 compute and HBM with the links ReaL's reallocation estimator assumes (see the module docstring)."""

CALLS = {"ActorGen": "actor_gen", "RefInf": "ref_inf", "RewInf": "reward_inf", "CriticInf": "critic_inf",
         "ActorTrain": "actor_train", "CriticTrain": "critic_train"}
"""ReaL's call names -> our tasks."""


@dataclass(frozen=True)
class RealPlan:
    """One of Tables 2-5: the plan, its models and cluster, each call's measured seconds, Table 6's
    end-to-end seconds (with CUDA graphs)."""

    name: str
    plan: Plan
    models: dict
    cluster: Cluster
    workload: Workload
    measured: dict
    end_to_end_s: float

    @property
    def setting(self) -> str:
        """The models, e.g. ``7B+7B``."""
        return self.name.split()[0]


@dataclass(frozen=True)
class RealAppendix:
    """Table 1's shapes by column (``7B`` ...) and its parameter counts (total, without the output
    embedding), and the plans in Table 6's order."""

    shapes: dict
    counts: dict
    plans: tuple


def load_appendix(path: str | Path = TABLES) -> RealAppendix:
    """The tables of ``path`` as planner inputs; PlannerError naming the file when it is missing or off."""
    try:
        raw = json.loads(Path(path).read_text())
        base, table1 = raw["base_setting"], raw["table1_llama3_configs"]
        shapes = {col: _shape(table1, i) for i, col in enumerate(table1["columns"])}
        counts = {col: (table1["TotalParamCount"][i], table1["ParamCountWithoutOutputEmbedding"][i])
                  for i, col in enumerate(table1["columns"])}
        e2e = raw["table6_wall_time_breakdown_seconds"]
        tables = [int(n) for n in re.findall(r"\(Table (\d+)\)", e2e["_columns"])]
        plans = tuple(_plan(key, raw["plans"][key], shapes, base, seconds)
                      for n, seconds in zip(tables, e2e["End2End_with_cuda_graph"])
                      for key in raw["plans"] if key.startswith(f"table{n}_"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise PlannerError(f"ReaL's tables {path}: {type(exc).__name__}: {exc}; give the file of "
                           "../shared/seed-facts (real_appendix_tables.json)") from None
    if len(plans) != len(tables):
        raise PlannerError(f"ReaL's tables {path}: Table 6 names tables {tables}, the file has plans "
                           f"{sorted(k for k in raw['plans'] if not k.startswith('_'))}")
    return RealAppendix(shapes, counts, plans)


def _shape(table1: dict, i: int) -> ModelConfig:
    """Column ``i`` of Table 1 as a model shape."""
    return ModelConfig(num_layers=table1["NumLayers"][i], hidden_size=table1["HiddenSize"][i],
                       ffn_hidden_size=table1["IntermediateSize"][i],
                       num_attention_heads=table1["NumAttentionHeads"][i], num_kv_heads=table1["NumKVHeads"][i],
                       vocab_size=table1["VocabSize"][i], max_seq_len=table1["MaxPositionEmbeddings"][i])


def _plan(key: str, calls: dict, shapes: dict, base: dict, end_to_end_s: float) -> RealPlan:
    """Plan ``key`` (``table4_7b_actor_7b_critic_searched``): its meshes, micro-batches and seconds, at the
    batch of the weak-scaling experiment with its GPU count (see :func:`workload`)."""
    table, actor, critic, kind = re.fullmatch(r"table(\d+)_(\d+)b_actor_(\d+)b_critic_(\w+)", key).groups()
    gpus_per_node = base["gpus_per_node"]
    meshes, microbatches, measured = {}, {}, {}
    for call, entry in calls.items():
        task = CALLS[call]
        ranks = tuple(r for node in _nodes(entry["mesh"]) for r in range(node * gpus_per_node,
                                                                         (node + 1) * gpus_per_node))
        meshes[task] = TaskMesh(task, ranks, ParallelStrategy(dp=entry["dp"], pp=entry["pp"], tp=entry["tp"]))
        microbatches[task] = _pipelined(task, entry["micro_batches"], entry["pp"])
        measured[task] = entry["seconds"]
    a, c = shapes[f"{actor}B"], shapes[f"{critic}B"]
    nodes = 1 + max(r for m in meshes.values() for r in m.ranks) // gpus_per_node
    name = f"{actor}B+{critic}B {kind} (Table {table})"
    plan = Plan(name, meshes, microbatches=microbatches, weights_return=True)
    cluster = Cluster(nodes, gpus_per_node)
    return RealPlan(name, plan, {"actor": a, "reference": a, "critic": c, "reward": c}, cluster,
                    workload(base, cluster.gpus), measured, end_to_end_s)


def workload(base: dict, gpus: int) -> Workload:
    """ReaL's base setting on ``gpus`` GPUs: prompts of ``max_prompt_length`` generated to
    ``context_length``, ``ppo_mini_batches`` mini-batches, the global batch of the weak-scaling experiment
    with that many GPUs (512 on 16, 4096 on 128).

    The appendix gives one base batch (512); the 70B+7B plans run on 128 GPUs, the weak-scaling point of
    batch 4096. Read at 512 their calls (generation aside) take 10-18x what the uncalibrated cost model
    predicts, at 4096 1.1-2.7x, as the 7B+7B plans' calls do at 512 (docs/planner.md), so they are read at
    4096: an inference from the numbers, not something the paper says."""
    scaling = dict(zip(base["weak_scaling"]["gpus"], base["weak_scaling"]["batch_size"]))
    prompt = base["max_prompt_length"]
    return Workload(scaling.get(gpus, base["global_batch_size"]), prompt, base["context_length"] - prompt,
                    base["ppo_mini_batches"])


def _pipelined(task: str, count: int, pp: int) -> int:
    """Micro-batches per DP replica of a ReaL call of ``count`` micro-batches: with pp > 1 ReaL's pipeline
    runner splits each into pp (inference, generation) or 2 pp (training) to fill the pipeline
    (realhf/impl/model/backend/pipe_runner.py: default_inf_mbs, default_train_mbs)."""
    return count if pp == 1 else count * pp * (2 if ROLE[task] == "training" else 1)


def _nodes(mesh: str) -> range:
    """0-based node indices of ``trainer01`` or ``trainer[01-16]``."""
    m = re.fullmatch(r"trainer(?:(\d+)|\[(\d+)-(\d+)\])", mesh)
    if m is None:
        raise ValueError(f"mesh {mesh!r} is not trainerNN or trainer[NN-MM]")
    first, last = (m.group(1), m.group(1)) if m.group(1) else (m.group(2), m.group(3))
    return range(int(first) - 1, int(last))


def simulate_table6(app: RealAppendix, hw: Hardware = REAL_HARDWARE) -> dict:
    """Plan name -> its iteration simulated from the measured call seconds (Table 6's check), the weight
    moves and data transfers timed by the cost model."""
    return {p.name: evaluate(p.plan, p.models, p.workload, hw, p.cluster, p.measured) for p in app.plans}


@dataclass(frozen=True)
class HeldOut:
    """The hardware file calibrated on plan ``calibrated_on``, and what it predicts of every plan: per
    (plan name, task) the (predicted, measured) seconds, per plan name its iteration's."""

    calibrated_on: str
    hardware: Hardware
    calls: dict
    iterations: dict

    def errors(self) -> list[float]:
        """Relative errors of the calls of the plans the file was not fitted to."""
        return [p / m - 1 for (plan, _), (p, m) in self.calls.items() if plan != self.calibrated_on]

    @property
    def median_error(self) -> float:
        return statistics.median(abs(e) for e in self.errors())

    @property
    def largest_error(self) -> float:
        return max(abs(e) for e in self.errors())


HELD_OUT_TERMS = ("mfu", "hbm_efficiency", "collective_latency_s", "layer_overhead_s")
"""The constants fitted to one plan's six calls (compute, decode reads, per-collective and per-layer-pass
latency: what the GPU calls of these layouts spend their time on)."""


def held_out(app: RealAppendix, hw: Hardware = REAL_HARDWARE, terms: tuple = HELD_OUT_TERMS) -> list[HeldOut]:
    """For each plan: ``hw`` calibrated on its call seconds and iteration alone, predicting every plan."""
    out = []
    for fit in app.plans:
        fitted = calibrate(hw, fit.plan, fit.models, fit.workload, fit.cluster,
                           fit.measured | {"iteration": fit.end_to_end_s}, terms)
        calls, iterations = {}, {}
        for p in app.plans:
            ev = evaluate(p.plan, p.models, p.workload, fitted, p.cluster)
            calls |= {(p.name, t): (ev.costs[t].seconds, s) for t, s in p.measured.items()}
            iterations[p.name] = (ev.seconds, p.end_to_end_s)
        out.append(HeldOut(fit.name, fitted, calls, iterations))
    return out


@dataclass(frozen=True)
class SearchBeside:
    """The planner's own best plan for one of ReaL's settings (at its best micro-batch size) and ReaL's
    plans of that setting, all predicted with the hardware file calibrated on ``calibrated_on``."""

    setting: str
    calibrated_on: str
    best: Evaluation
    micro_batch_size: int
    real: dict
    """ReaL plan name -> predicted seconds."""


def search_beside_real(app: RealAppendix, fits: list[HeldOut], micro_batch_sizes: tuple = (1, 2, 4),
                       config: PlacementSearchConfig = PlacementSearchConfig(fuse_training=True),
                       settings: tuple | None = None) -> list[SearchBeside]:
    """Per setting (all, or ``settings``: ``7B+7B`` ...), :func:`~rlhf.planner.placement_search.search_placements`
    on its models, GPUs and batch with the hardware file of ``fits`` calibrated on its heuristic plan (so
    that ReaL's searched plan is predicted by a file not fitted to it either), trying each micro-batch size
    (the job's knob), beside ReaL's plans predicted by the same file."""
    out = []
    for setting in settings or dict.fromkeys(p.setting for p in app.plans):
        plans = [p for p in app.plans if p.setting == setting]
        fit = next(h for h in fits if h.calibrated_on in {p.name for p in plans if "heuristic" in p.name})
        p = plans[0]
        found = {}
        for size in micro_batch_sizes:
            try:
                found[size] = search_placements(p.models, replace(p.workload, micro_batch_size=size), fit.hardware,
                                                p.cluster, config).best
            except PlannerError:  # nothing fits at this micro-batch size
                continue
        if not found:
            raise PlannerError(f"{setting}: no plan fits at micro-batch sizes {micro_batch_sizes}")
        size = min(found, key=lambda k: found[k].seconds)
        real = {q.name: evaluate(q.plan, q.models, q.workload, fit.hardware, q.cluster).seconds for q in plans}
        out.append(SearchBeside(setting, fit.calibrated_on, found[size], size, real))
    return out
