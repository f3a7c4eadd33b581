"""One-rank scenario for tests/test_gpu.py, run once on the GPU and once on the CPU.

Every task sits on the one rank. The CPU run is the reference: the same
computations on 4 gloo ranks equal textbook PPO and unsharded models
(tests/test_trainer.py). Tensors come back as numpy arrays (the queue would share torch tensors by file descriptor).
"""

from rlhf import platform
from rlhf.ppo.config import MemoryConfig
from rlhf.memory import module_tensors, storage_bytes
from rlhf.parallel import Placement
from rlhf.parallel.groups import build_task_groups
from rlhf.tasks import FROZEN_TASKS, TASKS
from scenario_engine import CFG, SEED
from scenario_trainer import learn_fixed_samples, synthetic_trainer, synthetic_weights, trained_weights

FIELDS = ("ref_logprobs", "scores", "values", "advantages", "returns", "old_logprobs")


def run() -> dict:
    """The fixed-sample PPO iteration (padded and packed), then two greedy-generation iterations (engine, reshard,
    inference, update), whose decode steps a GPU replays as CUDA graphs (recorded once, on the weights that
    each reshard overwrites in place)."""
    placement = Placement.from_plan({task: {"ranks": [0]} for task in TASKS}, 1)
    build_task_groups(placement)
    _, _, result, learned = learn_fixed_samples(placement)
    _, _, packed, packed_learned = learn_fixed_samples(placement, max_tokens=16)  # TE's THD attention on a GPU
    trainer = synthetic_trainer(placement, synthetic_weights(31), mini_batch=4, temperature=0.0, cuda_graphs=True)
    steps = [trainer.step() for _ in range(2)]
    lean = synthetic_trainer(placement, synthetic_weights(31), mini_batch=4, temperature=0.0, cuda_graphs=True,
                             memory=MemoryConfig(offload_ref_reward=True, release_generation_memory=True))
    lean_steps = [lean.step() for _ in range(2)]
    offloaded = [t for task in FROZEN_TASKS for t in module_tensors(lean.models[task])]
    return {"device": platform.device().type,
            "fields": {f: getattr(result.batch, f).cpu().numpy() for f in FIELDS},
            "learned": _arrays(learned),
            "packed_fields": {f: getattr(packed.batch, f).cpu().numpy() for f in FIELDS},
            "packed_learned": _arrays(packed_learned),
            "tokens": [s.batch.tokens.tolist() for s in steps],
            "metrics": [s.metrics for s in steps],
            "stepped": _arrays(trained_weights(trainer)),
            "lean_tokens": [s.batch.tokens.tolist() for s in lean_steps],
            "lean_metrics": [s.metrics for s in lean_steps],
            "offloaded_bytes": {d.type: n for d, n in storage_bytes(offloaded).items()},  # between their uses
            "offloaded_pinned": all(t.is_pinned() for t in offloaded),
            "peak_memory_bytes": platform.peak_memory_bytes()}


def cuda_graphs() -> dict:
    """One tiny model's engine with and without static decode steps (``cuda_graphs``: captured on the GPU):
    greedy and seeded samples of 12 prompts of 3-14 tokens, n = 3, the decode batch shrinking as they end."""
    from rlhf.engine import Engine, EngineConfig, Request, SamplingParams
    from rlhf.models.gpt import build_model
    from rlhf.parallel.groups import local_groups

    build_task_groups(Placement.from_plan({}, 1))
    local = local_groups()
    model = build_model(CFG, "lm", local.pg_collection, local.stage, seed=SEED)
    requests = [Request(f"q{i}", [(7 * i + j) % CFG.vocab_size for j in range(3 + i)],
                        SamplingParams(max_new_tokens=4 + 2 * i, temperature=float(i % 2), n=3, seed=i))
                for i in range(12)]
    out = {}
    for graphs in (False, True):
        engine = Engine(model, local, CFG, EngineConfig(num_blocks=128, block_size=16, cuda_graphs=graphs))
        results = engine.generate(requests)
        out[graphs] = {"tokens": [list(r.tokens) for r in results], "logprobs": [list(r.logprobs) for r in results],
                       "static_steps": engine.decoder.static.steps if graphs else 0,
                       "buckets": sorted(engine.decoder.static.buckets) if graphs else []}
    return {"device": platform.device().type, "eager": out[False], "graphs": out[True]}


def _arrays(weights: dict) -> dict:
    return {model: {k: v.cpu().numpy() for k, v in params.items()} for model, params in weights.items()}
