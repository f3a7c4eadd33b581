"""Asynchronous iterations (--max-staleness K, --partial-rollouts) against synchronous ones on 4 gloo ranks.

The trainer of the tiny default's shape (the synthetic task, gold rule as the reward) on 4 ranks with
actor_gen dp2 on ranks 0-1 and every other task on ranks 2-3 (docs/async.md's layout), the same
placement for every run: K = 0 is the synchronous iteration, K >= 1 asynchronous in lockstep, and with
``--partial K`` free-running (partial rollouts). Compute is made to look like a cluster's by calibrated
sleeps: each engine step sleeps ``--step-s`` on the generation ranks (a memory-bound decode step, as
long whatever the running batch) and each PPO update ``--training-s`` on the learners, beside which the
tiny models' own compute is small (on 2 shared cores it is not free: the residue is what the two sides'
real work costs). ``--long-tail-median M`` draws the responses' lengths from the trainer's long-tailed
lognormal (median M, EOS ignored); 0: responses end at EOS or --max-response-len.

Prediction (:func:`simulated`), from the synchronous run's own seconds: each batch's generation g_j
(time_generation_s of its iteration: the same seeds draw the same lengths in every mode), learning
l = inference + advantage + training (+ the critic's reshard), meeting m = the iteration's remainder
(the batch gather and the actor's reshard). Synchronous: g + l + m. Asynchronous, lockstep: max(g, l) + m
per iteration (the two sides meet once per iteration). Partial rollouts: a batch starts K iterations
before the meeting that needs it, so with equal batches max(g / K, l) + m; the planner's
max(g r, g / K, l) + m adds the full-engine bound g r (r = mean over longest response), which at these
sizes never binds (rlhf.planner.plan.free_running_generation_s). Steady-state means skip the first K + 1
iterations (the start-up batches) and the last K (nothing left to generate), measured and predicted.

``prompts_once``: the reward function records every prompt it scores; yes when each prompt of the
iterations trained was scored exactly its n samples' times, in every run.

Usage: ``python benchmarks/async.py [--iterations 10] [--step-s 0.06] [--training-s 4] [--k 1 2] [--partial 2]
[--long-tail-median 8] [--max-response-len 64] [--kv recompute|keep]``
Last line (the fastest asynchronous run): ``async: sync_s=<x> async_s=<y> speedup=<x/y> predicted=<p>
staleness_max=<k> prompts_once=<yes|no>``
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

LEARNING = ("inference", "advantage", "training")
SAMPLES_PER_PROMPT = 4


def run_rank(k: int, partial: bool, iterations: int, step_s: float, training_s: float, long_tail_median: int,
             max_response_len: int, kv: str) -> dict:
    """One run on this rank (a worker of rlhf.testing.distributed.launch): per-iteration metrics and the
    prompts this rank's reward function scored."""
    import torch.distributed as dist

    from rlhf.config import RunConfig
    from rlhf.data import ByteTokenizer, PromptBatchIterator
    from rlhf.data.synthetic import SyntheticPromptConfig, SyntheticPromptDataset, gold_reward
    from rlhf.parallel import Placement
    from rlhf.ppo.config import GenerationConfig, JobConfig, PPOConfig, RewardConfig
    from rlhf.ppo.trainer import Trainer

    scored: list = []

    def reward(prompts, responses):
        scored.extend(tuple(p) for p in prompts)
        return gold_reward(prompts, responses)

    plan = {"actor_gen": {"ranks": [0, 1], "dp": 2}, "actor_train": {"ranks": [2, 3], "pp": 2},
            "critic_train": {"ranks": [2, 3], "pp": 2, "reverse_pp": True}, "ref_inf": {"ranks": [2, 3]},
            "reward_inf": {"ranks": [2, 3]}, "critic_inf": {"ranks": [2, 3]}}
    config = JobConfig(run=RunConfig(iterations=iterations, seed=3),
                       generation=GenerationConfig(max_response_len=max_response_len,
                                                   long_tail_median=long_tail_median),
                       ppo=PPOConfig(n_samples_per_prompt=SAMPLES_PER_PROMPT, max_staleness=k,
                                     partial_rollouts=partial, partial_rollout_kv=kv),
                       reward=RewardConfig(reward_fn="rlhf.data.synthetic:gold_reward"))
    prompts = PromptBatchIterator(SyntheticPromptDataset(SyntheticPromptConfig(seed=3)),
                                  config.ppo.rollout_batch_size, seed=3)
    trainer = Trainer(config, Placement.from_plan(plan, 4), prompts, ByteTokenizer(), reward_fn=reward)
    _calibrate(trainer, step_s, training_s)
    metrics = [trainer.step().metrics for _ in range(iterations)]
    dist.barrier()
    return {"metrics": metrics, "scored": scored}


def _calibrate(trainer, step_s: float, training_s: float) -> None:
    """Make each engine step take ``step_s`` longer and each PPO update ``training_s`` longer."""
    if trainer.engine is not None:
        step = trainer.engine.step
        trainer.engine.step = lambda: _after_sleep(step_s, step)
    update = trainer.update
    trainer.update = lambda batch: _after_sleep(training_s, update, batch)


def _after_sleep(seconds: float, fn, *args):
    time.sleep(seconds)
    return fn(*args)


def steady(metrics: list, k: int, key: str) -> float:
    """Mean of ``key`` over the iterations after the first k + 1 and before the last k (no generation)."""
    return statistics.mean(m.get(key, 0.0) for m in metrics[k + 1:len(metrics) - k])


def stages(sync: list) -> dict:
    """The synchronous run's steady seconds: generation, learning (inference, advantage, training, the
    critic's reshard) and the meeting (the rest: the batch gather and the actor's reshard)."""
    g = steady(sync, 0, "time_generation_s")
    learn = sum(steady(sync, 0, f"time_{s}_s") for s in LEARNING)
    return {"generation": g, "learning": learn, "meeting": steady(sync, 0, "time_iteration_s") - g - learn,
            "full": steady(sync, 0, "response_length_mean") / steady(sync, 0, "response_length_max")}


def simulated(sync: list, mode: str, k: int) -> float:
    """Steady seconds per iteration of ``mode`` (sync, lockstep, partial) with bound ``k``, batch by batch:
    batch j's generation takes the synchronous run's generation seconds of iteration j (the same seeds
    draw the same lengths in every mode), learning and the meeting their steady seconds. The iteration
    ends at the meeting, when the learners are done and the batch needed next is generated: in lockstep
    the batch K ahead, generated from the last meeting on; with partial rollouts the next batch, started
    at the meeting that brought the weights K versions before its update (max(g r, g / K, l) + m when
    every batch takes g: rlhf.planner.plan.free_running_generation_s)."""
    st, gen, n = stages(sync), [m["time_generation_s"] for m in sync], len(sync)
    learn, meet = st["learning"], st["meeting"]
    end = {-1: gen[0] + meet if mode == "partial" else sum(gen[:k]) + k * meet}  # the start-up batches
    for i in range(n):
        if mode == "sync":
            end[i] = end[i - 1] + gen[i] + learn + meet
            continue
        ahead = i + 1 if mode == "partial" else i + k
        start = (end[ahead - k - 1] if ahead - k - 1 >= 0 else 0.0) if mode == "partial" else end[i - 1]
        done = start + gen[ahead] if ahead < n else 0.0
        end[i] = max(end[i - 1] + learn, done) + meet
    window = range(k + 1, n - k)
    return statistics.mean(end[i] - end[i - 1] for i in window)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=10, help="iterations per run (default %(default)s)")
    ap.add_argument("--step-s", type=float, default=0.06, help="sleep added to each engine step on the "
                                                               "generation ranks (default %(default)s)")
    ap.add_argument("--training-s", type=float, default=4.0, help="sleep added to each PPO update on the "
                                                                  "learners (default %(default)s)")
    ap.add_argument("--k", type=int, nargs="*", default=[1, 2], help="staleness bounds to run in lockstep "
                                                                     "besides 0 (default %(default)s)")
    ap.add_argument("--partial", type=int, nargs="*", default=[2], help="staleness bounds to run with partial "
                                                                        "rollouts (default %(default)s)")
    ap.add_argument("--long-tail-median", type=int, default=0, help="draw response lengths from the long-tailed "
                                                                    "lognormal of this median (0: all full length)")
    ap.add_argument("--max-response-len", type=int, default=64, help="response length cap (default %(default)s)")
    ap.add_argument("--kv", choices=("recompute", "keep"), default="recompute",
                    help="--partial-rollout-kv of the partial runs: prefill samples in flight again after each "
                         "update (a few engine steps per meeting) or keep their K/V (default %(default)s)")
    args = ap.parse_args(argv)
    bounds = [*args.k, *args.partial]
    if not bounds or args.iterations < 2 * max(bounds) + 3 or min(bounds) < 1 or min(args.partial, default=2) < 2:
        ap.error(f"--k {args.k} must be >= 1, --partial {args.partial} >= 2, at least one given, and --iterations "
                 f"{args.iterations} >= twice the largest + 3 (a steady state between start and end)")
    from rlhf.testing.distributed import launch

    runs = {}
    for k, partial in [(0, False), *((k, False) for k in args.k), *((k, True) for k in args.partial)]:
        ranks = launch(4, "async:run_rank", timeout_s=900, k=k, partial=partial, iterations=args.iterations,
                       step_s=args.step_s, training_s=args.training_s, long_tail_median=args.long_tail_median,
                       max_response_len=args.max_response_len, kv=args.kv)
        scored = Counter(p for r in ranks for p in r["scored"])
        runs[(k, partial)] = {"metrics": ranks[0]["metrics"], "once": set(scored.values()) == {SAMPLES_PER_PROMPT}}
    sync = runs[(0, False)]["metrics"]
    p = stages(sync)
    lengths = f"long-tailed, median {args.long_tail_median}" if args.long_tail_median else "ending at EOS or the cap"
    print(f"4 ranks (generation 0-1, the rest 2-3) on 2 shared cores; responses <= {args.max_response_len} tokens, "
          f"{lengths}; sleeps: {args.step_s} s per engine step, {args.training_s} s per update; synchronous "
          f"stages: generation {p['generation']:.2f} s, learning {p['learning']:.2f} s, meeting {p['meeting']:.2f} "
          f"s; mean / longest response {p['full']:.2f}")
    print("| mode | K | s/iteration | speedup | predicted | staleness_max | partial samples | gen idle | train idle "
          "| prompts once |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    sync_s = steady(runs[(0, False)]["metrics"], 0, "time_iteration_s")
    seconds = {}
    for (k, partial), run in runs.items():
        m, mode = run["metrics"], "partial" if partial else "lockstep" if k else "sync"
        seconds[(k, partial)] = s = steady(m, k, "time_iteration_s")
        pred = simulated(sync, "sync", k) / simulated(sync, mode, k)
        print(f"| {mode} | {k} | {s:.2f} | {sync_s / s:.2f} | {pred:.2f} | "
              f"{max(x.get('staleness_max', 0) for x in m):.0f} | {steady(m, k, 'partial_samples_fraction'):.2f} | "
              f"{steady(m, k, 'generation_idle_fraction'):.2f} | {steady(m, k, 'training_idle_fraction'):.2f} | "
              f"{'yes' if run['once'] else 'no'} |")
    k, partial = fastest = min((key for key in runs if key[0]), key=seconds.get)
    print(f"async: sync_s={sync_s:.3f} async_s={seconds[fastest]:.3f} speedup={sync_s / seconds[fastest]:.3f} "
          f"predicted={simulated(sync, 'sync', k) / simulated(sync, 'partial' if partial else 'lockstep', k):.3f} "
          f"staleness_max={max(x.get('staleness_max', 0) for x in runs[fastest]['metrics']):.0f} "
          f"prompts_once={'yes' if all(r['once'] for r in runs.values()) else 'no'}")


if __name__ == "__main__":
    main()
