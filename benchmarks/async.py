"""Asynchronous iterations (--max-staleness K) against synchronous ones on 4 gloo ranks: measured and predicted.

The trainer of the tiny default's shape (the synthetic task, gold rule as the reward) on 4 ranks with
actor_gen dp2 on ranks 0-1 and every other task on ranks 2-3 (docs/async.md's layout), the same
placement for every K: K = 0 is the synchronous iteration, K >= 1 asynchronous. Compute is made to look
like a cluster's by calibrated sleeps: each engine call sleeps ``--generation-s`` on the generation
ranks and each PPO update ``--training-s`` on the learners, beside which the tiny models' own compute is
small (on 2 shared cores it is not free: the residue is what the two sides' real work costs).

Prediction, from the synchronous run's own stage seconds: generation g = time_generation_s, learning
l = inference + advantage + training (+ the critic's reshard), meeting m = the iteration's remainder
(the batch gather and the actor's reshard). Synchronous: g + l + m. Asynchronous, lockstep steady
state: max(g, l) + m (rlhf/ppo/asynchronous.py: the two sides meet once per iteration). Steady-state
means skip the first K + 1 iterations (the start-up batches).

``prompts_once``: the reward function records every prompt it scores; yes when each prompt of the
iterations trained was scored exactly its n samples' times.

Usage: ``python benchmarks/async.py [--iterations 8] [--generation-s 2] [--training-s 2] [--k 1 2]``
Last line: ``async: sync_s=<x> async_s=<y> speedup=<x/y> predicted=<p> staleness_max=<k> prompts_once=<yes|no>``
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

LEARNING = ("inference", "advantage", "training")
SAMPLES_PER_PROMPT = 4


def run_rank(k: int, iterations: int, generation_s: float, training_s: float) -> dict:
    """One run on this rank (a worker of rlhf.testing.distributed.launch): per-iteration metrics and the
    prompts this rank's reward function scored."""
    import torch.distributed as dist

    from rlhf.data import ByteTokenizer, PromptBatchIterator
    from rlhf.data.synthetic import SyntheticPromptConfig, SyntheticPromptDataset, gold_reward
    from rlhf.config import RunConfig
    from rlhf.parallel import Placement
    from rlhf.ppo.config import JobConfig, PPOConfig, RewardConfig
    from rlhf.ppo.trainer import Trainer

    scored: list = []

    def reward(prompts, responses):
        scored.extend(tuple(p) for p in prompts)
        return gold_reward(prompts, responses)

    plan = {"actor_gen": {"ranks": [0, 1], "dp": 2}, "actor_train": {"ranks": [2, 3], "pp": 2},
            "critic_train": {"ranks": [2, 3], "pp": 2, "reverse_pp": True}, "ref_inf": {"ranks": [2, 3]},
            "reward_inf": {"ranks": [2, 3]}, "critic_inf": {"ranks": [2, 3]}}
    config = JobConfig(run=RunConfig(iterations=iterations, seed=3),
                       ppo=PPOConfig(n_samples_per_prompt=SAMPLES_PER_PROMPT, max_staleness=k),
                       reward=RewardConfig(reward_fn="rlhf.data.synthetic:gold_reward"))
    prompts = PromptBatchIterator(SyntheticPromptDataset(SyntheticPromptConfig(seed=3)),
                                  config.ppo.rollout_batch_size, seed=3)
    trainer = Trainer(config, Placement.from_plan(plan, 4), prompts, ByteTokenizer(), reward_fn=reward)
    _calibrate(trainer, generation_s, training_s)
    metrics = [trainer.step().metrics for _ in range(iterations)]
    dist.barrier()
    return {"metrics": metrics, "scored": scored}


def _calibrate(trainer, generation_s: float, training_s: float) -> None:
    """Make each engine call take ``generation_s`` longer and each PPO update ``training_s`` longer."""
    if trainer.engine is not None:
        generate = trainer.engine.generate
        trainer.engine.generate = lambda requests: _after_sleep(generation_s, generate, requests)
    update = trainer.update
    trainer.update = lambda batch: _after_sleep(training_s, update, batch)


def _after_sleep(seconds: float, fn, *args):
    time.sleep(seconds)
    return fn(*args)


def steady(metrics: list, k: int, key: str) -> float:
    """Mean of ``key`` over the iterations after the first k + 1."""
    return statistics.mean(m.get(key, 0.0) for m in metrics[k + 1:])


def predicted(sync: list) -> dict:
    """Seconds per iteration, synchronous and asynchronous, from the synchronous run's stage seconds."""
    g = steady(sync, 0, "time_generation_s")
    learn = sum(steady(sync, 0, f"time_{s}_s") for s in LEARNING)
    meet = steady(sync, 0, "time_iteration_s") - g - learn
    return {"generation": g, "learning": learn, "meeting": meet, "sync": g + learn + meet,
            "async": max(g, learn) + meet}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=8, help="iterations per run (default %(default)s)")
    ap.add_argument("--generation-s", type=float, default=2.0, help="sleep added to each engine call on the "
                                                                    "generation ranks (default %(default)s)")
    ap.add_argument("--training-s", type=float, default=2.0, help="sleep added to each PPO update on the "
                                                                  "learners (default %(default)s)")
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2], help="staleness bounds to run besides 0 "
                                                                     "(default %(default)s)")
    args = ap.parse_args(argv)
    if args.iterations < max(args.k) + 3 or min(args.k) < 1:
        ap.error(f"--k {args.k} must be >= 1 and --iterations {args.iterations} >= max K + 3 (steady state)")
    from rlhf.testing.distributed import launch

    runs = {}
    for k in [0, *args.k]:
        ranks = launch(4, "async:run_rank", timeout_s=900, k=k, iterations=args.iterations,
                       generation_s=args.generation_s, training_s=args.training_s)
        scored = Counter(p for r in ranks for p in r["scored"])
        runs[k] = {"metrics": ranks[0]["metrics"], "once": set(scored.values()) == {SAMPLES_PER_PROMPT}}
    p = predicted(runs[0]["metrics"])
    print(f"4 ranks (generation 0-1, the rest 2-3) on 2 shared cores; sleeps: generation {args.generation_s} s, "
          f"training {args.training_s} s; synchronous stages: generation {p['generation']:.2f} s, learning "
          f"{p['learning']:.2f} s, meeting {p['meeting']:.2f} s")
    print("| K | s/iteration | speedup | predicted | staleness_max | gen idle | train idle | prompts once |")
    print("|---|---|---|---|---|---|---|---|")
    sync_s = steady(runs[0]["metrics"], 0, "time_iteration_s")
    for k, run in runs.items():
        m = run["metrics"]
        s = steady(m, k, "time_iteration_s")
        pred = p["sync"] / (p["async"] if k else p["sync"])
        print(f"| {k} | {s:.2f} | {sync_s / s:.2f} | {pred:.2f} | {max(x.get('staleness_max', 0) for x in m):.0f} | "
              f"{steady(m, k, 'generation_idle_fraction'):.2f} | {steady(m, k, 'training_idle_fraction'):.2f} | "
              f"{'yes' if run['once'] else 'no'} |")
    k = args.k[0]
    async_s = steady(runs[k]["metrics"], k, "time_iteration_s")
    print(f"async: sync_s={sync_s:.3f} async_s={async_s:.3f} speedup={sync_s / async_s:.3f} "
          f"predicted={p['sync'] / p['async']:.3f} "
          f"staleness_max={max(x.get('staleness_max', 0) for x in runs[k]['metrics']):.0f} "
          f"prompts_once={'yes' if all(r['once'] for r in runs.values()) else 'no'}")


if __name__ == "__main__":
    main()
