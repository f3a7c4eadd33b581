"""Inter-stage fusion: generation + inference time against the migration threshold R.

(a) The simulation of RLHFuse Figure 9 (pure, `rlhf.fusion.policy`): 8
    generation instances, a batch of 512 samples from the long-tailed
    workload (lognormal response lengths, median 128, p99.9 ~ 12x the
    median), generation + inference time (mean over ``--batches`` fresh
    batches) for R = 5..95%, next to unfused. The policy picks R from an
    earlier sample of lengths (four iterations' worth); the sweep's best is
    measured on the fresh batches. The paper finds about 20%.
(b) 4 gloo ranks, one generation instance each, with compute replaced by
    calibrated sleeps (`SleepEngine`: a decode step sleeps the cost model's
    step time; inference sleeps ``infer_s`` per sample) while the real
    fusion runtime runs: the counts, the migration (token-only messages
    through the real transport), the inference on the freed ranks of the
    samples finished by then and of those the destinations stream, and the
    final gather (`rlhf.fusion.inter_stage`). Unfused and fused wall times
    (median of ``--repeats``) next to the simulator's prediction for the
    same batch.
(c) The same on real tiny models: the trainer's generate + infer on 4 CPU
    ranks (actor_gen dp4 TP1, inference tasks over the same ranks) on the
    long-tailed workload, unfused and fused at (b)'s R and at 0.2. Four ranks
    share 2 cores here, so a freed rank's inference competes for CPU with
    the destinations' generation: the overlap that fusion buys on GPUs is
    partly serialized, and (c) understates the speedup (b) shows.

Usage: ``python benchmarks/inter_stage.py [--batches 32] [--seed 0] [--repeats 3]``
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from types import SimpleNamespace

from rlhf.fusion.inter_stage import FIRST_THRESHOLD
from rlhf.fusion.policy import (SWEEP, GenerationCost, LengthDistribution, choose_threshold, long_tailed_lengths,
                                simulate, split_batch)

BATCH = 512
COST = GenerationCost(instances=8, step_s=0.03, b_sat=32, infer_s=0.2, migrate_s=0.1)
"""Assumed costs: a 30 ms decode step flat up to 32 running samples; 0.2 s of ref+reward+critic inference
per sample on one instance's ranks (unfused inference ~ 13 s after ~ 45 s of generation); 0.1 s per
migrated sample (KV transfer or re-prefill)."""


def figure9(batches: int, seed: int) -> dict:
    """Sweep table, unfused time, the policy's R and the sweep's best on ``batches`` fresh batches."""
    rng = random.Random(seed)
    fresh = [long_tailed_lengths(BATCH, rng) for _ in range(batches)]
    rows = []
    for r in SWEEP:
        runs = [simulate(b, COST, r) for b in fresh]
        rows.append((r, statistics.mean(x.total_s for x in runs), statistics.mean(x.generation_s for x in runs),
                     statistics.mean(x.m for x in runs), statistics.mean(x.migrated for x in runs)))
    unfused = [simulate(b, COST, 0.0) for b in fresh]
    history = LengthDistribution(long_tailed_lengths(4 * BATCH, random.Random(seed + 1)))
    choice = choose_threshold(history, COST, BATCH, seed=seed + 2)
    best = min(rows, key=lambda row: (row[1], row[0]))
    unfused_s = statistics.mean(x.total_s for x in unfused)
    return {"rows": rows, "unfused_s": unfused_s, "unfused_gen_s": statistics.mean(x.generation_s for x in unfused),
            "chosen": choice.threshold, "best": best[0],
            "chosen_s": dict((row[0], row[1]) for row in rows)[choice.threshold], "best_s": best[1]}


def print_figure9(res: dict, batches: int) -> None:
    print(f"(a) simulation, RLHFuse Figure 9: {COST.instances} instances, batch {BATCH}, long-tailed lengths "
          f"(lognormal median 128, sigma 0.8, cap 2048), mean of {batches} batches")
    print(f"    cost model: step {COST.step_s * 1e3:g} ms flat up to B_sat={COST.b_sat}, inference "
          f"{COST.infer_s:g} s/sample/instance, migration {COST.migrate_s:g} s/sample")
    print(f"    {'R':>5} {'gen+inf s':>10} {'gen s':>8} {'m':>5} {'migrated':>9} {'vs unfused':>10}")
    for r, total, gen, m, moved in res["rows"]:
        mark = "  <- best" if r == res["best"] else ""
        mark += "  <- policy" if r == res["chosen"] else ""
        print(f"    {r:5.0%} {total:10.2f} {gen:8.2f} {m:5.1f} {moved:9.1f} {res['unfused_s'] / total:10.3f}{mark}")
    print(f"    unfused {res['unfused_s']:.2f} s (generation {res['unfused_gen_s']:.2f} s); "
          f"policy R={res['chosen']:.0%} ({res['chosen_s']:.2f} s), sweep best R={res['best']:.0%} ({res['best_s']:.2f} s); the paper: ~20%")


# --- (b) calibrated sleeps on 4 ranks ----------------------------------------------------------------------------

SLEEP_COST = GenerationCost(instances=4, step_s=0.02, b_sat=64, infer_s=0.12, migrate_s=0.004)
"""(b)'s cost model: a 20 ms decode step (flat: b_sat above any instance's batch), 120 ms of inference per
sample on one rank, 4 ms per migrated sample at the destination (token-only: its re-prefill)."""
SLEEP_BATCH, SLEEP_MEDIAN, SLEEP_CAP, CHECK_EVERY = 64, 16, 160, 2


class SleepEngine:
    """The engine interface `fused_generate` drives, with each decode step a sleep of the cost model's step
    time and samples of given lengths (``params.sample_max_new_tokens``); samples migrate as tokens."""

    def __init__(self, cost: GenerationCost):
        from rlhf.engine.engine import EngineStats
        from rlhf.engine.types import EngineConfig

        self.cost, self.config, self.stats = cost, EngineConfig(block_size=16), EngineStats()
        self.kv = SimpleNamespace(pool=SimpleNamespace(num_free=1 << 20))  # KV never runs out
        self.running = {}  # (request id, sample index) -> [request, tokens so far]

    def add_request(self, request) -> None:
        for i in range(request.params.n):
            self.running[(request.request_id, i)] = [request, []]

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def step(self) -> list:
        from rlhf.engine.types import SampleResult

        time.sleep(self.cost.step_time(len(self.running)))
        self.stats.steps += 1
        done = []
        for key, (request, tokens) in list(self.running.items()):
            tokens.append(len(tokens) % 200)
            if len(tokens) >= request.params.max_new_tokens_of(key[1]):
                del self.running[key]
                done.append(SampleResult(key[0], key[1], request.prompt, tuple(tokens), (0.0,) * len(tokens),
                                         "length", 0.0))
        return done

    def exportable(self) -> list:
        return sorted((rid, i, len(request.prompt) + len(tokens))
                      for (rid, i), (request, tokens) in self.running.items())

    def export_sequence(self, request_id: str, index: int, with_kv: bool):
        from rlhf.engine.migration import MigratedSequence

        request, tokens = self.running.pop((request_id, index))
        return MigratedSequence(request_id, index, len(request.prompt), list(request.prompt) + tokens,
                                [0.0] * len(tokens), request.params, 0)

    def import_sequence(self, state) -> None:
        from rlhf.engine.types import Request

        time.sleep(self.cost.migrate_s)  # the re-prefill
        request = Request(state.request_id, tuple(state.tokens[:state.prompt_len]), state.params)
        self.running[(state.request_id, state.sample_index)] = [request, list(state.tokens[state.prompt_len:])]


class _Samples(list):
    """A list of samples with the one Batch method `InterStageFusion.infer_early` uses."""

    def select(self, index):
        return _Samples(self[i] for i in index)


def sleep_batch(seed: int) -> list:
    """(b)'s response lengths: one long-tailed batch."""
    return long_tailed_lengths(SLEEP_BATCH, random.Random(seed), median=SLEEP_MEDIAN, cap=SLEEP_CAP)


def sleep_rank(lengths: list, threshold: float, repeats: int) -> dict:
    """One rank of (b): unfused and fused generation + inference wall times (runs alternate)."""
    import torch.distributed as dist

    from rlhf.ppo.config import FusionConfig, JobConfig, PPOConfig
    from rlhf.engine.types import Request, SamplingParams
    from rlhf.fusion.inter_stage import InterStageFusion
    from rlhf.parallel import Placement
    from rlhf.parallel.dealing import shares
    from rlhf.parallel.exchange import gather_to_all
    from rlhf.parallel.groups import build_task_groups

    placement = Placement.from_plan({"actor_gen": {"ranks": "0-3", "dp": 4}, "ref_inf": {"ranks": "0-3", "dp": 4}}, 4)
    g = build_task_groups(placement)["actor_gen"]
    config = JobConfig(ppo=PPOConfig(rollout_batch_size=SLEEP_BATCH, n_samples_per_prompt=1,
                                     ppo_mini_batch_size=SLEEP_BATCH, micro_batch_size=1),
                       fusion=FusionConfig(inter_stage_fusion=True, migration_threshold=threshold,
                                           migrate_kv="no", migration_check_every=CHECK_EVERY))
    part = split_batch(list(range(SLEEP_BATCH)), 4)[g.coord.dp]  # contiguous, as the simulator deals
    requests = [Request(str(i), (1, 2), SamplingParams(max_new_tokens=SLEEP_CAP, n=1,
                                                        sample_max_new_tokens=(lengths[i],))) for i in part]

    def infer(count: int) -> None:
        time.sleep(count * SLEEP_COST.infer_s)

    class SleepInference:
        """The runner `InterStageFusion.infer_early` drives: each task's part sleeps its samples' inference."""

        def infer(self, task: str, part) -> None:
            infer(len(part))

    def unfused() -> None:
        engine = SleepEngine(SLEEP_COST)
        for request in requests:
            engine.add_request(request)
        while engine.has_unfinished():
            engine.step()
        gather_to_all([])  # the samples' all-gather
        infer(len(shares(SLEEP_BATCH, 4)[g.coord.dp]))

    def fused() -> dict:
        fusion = InterStageFusion(config, placement, ["ref_inf"], SLEEP_COST.b_sat)
        fusion.start_iteration()
        out = fusion.generate(SleepEngine(SLEEP_COST), requests, g)
        early = fusion.infer_early(out, _Samples, SleepInference())
        _, early = fusion.gather(out.samples, early, out)
        done = early.done.get("ref_inf", set())
        infer(len(shares(SLEEP_BATCH - len(done), 4)[g.coord.dp]))
        return {"migrated": out.moved_out, "destinations": out.destinations, "early": len(done)}

    times, info = {"unfused": [], "fused": []}, None
    for _ in range(repeats + 1):  # the first round warms up
        for name, body in (("unfused", unfused), ("fused", fused)):
            dist.barrier()
            start = time.perf_counter()
            result = body()
            dist.barrier()
            times[name].append(time.perf_counter() - start)
            info = result or info
    return {name: statistics.median(t[1:]) for name, t in times.items()} | {"info": info}


def measure_sleep(seed: int, repeats: int) -> dict:
    """(b): the policy's R for this workload, the 4-rank measurement and the simulator's prediction."""
    from rlhf.testing.distributed import launch

    lengths = sleep_batch(seed)
    history = LengthDistribution(long_tailed_lengths(8 * SLEEP_BATCH, random.Random(seed + 1), median=SLEEP_MEDIAN,
                                                     cap=SLEEP_CAP))
    threshold = choose_threshold(history, SLEEP_COST, SLEEP_BATCH, seed=seed + 2).threshold
    ranks = launch(4, "inter_stage:sleep_rank", lengths=lengths, threshold=threshold, repeats=repeats)
    measured = dict(ranks[0], migrated=sum(r["info"]["migrated"] for r in ranks))
    predicted = {"unfused": simulate(lengths, SLEEP_COST, 0.0).total_s,
                 "fused": simulate(lengths, SLEEP_COST, threshold).total_s}
    return {"threshold": threshold, "measured": measured, "predicted": predicted}


def print_sleep(res: dict) -> None:
    c, m, p = SLEEP_COST, res["measured"], res["predicted"]
    print(f"(b) 4 ranks, calibrated sleeps: batch {SLEEP_BATCH} (lognormal median {SLEEP_MEDIAN}, cap {SLEEP_CAP}), "
          f"step {c.step_s * 1e3:g} ms, inference {c.infer_s * 1e3:g} ms/sample, re-prefill {c.migrate_s * 1e3:g} "
          f"ms/sample, counts every {CHECK_EVERY} steps, R={res['threshold']:.0%} (policy)")
    info = m["info"]
    print(f"    fused run: {m['migrated']} samples migrated to instance(s) {list(info['destinations'])}, "
          f"{info['early']} inferred on the freed ranks while generation ran")
    print(f"    {'':8} {'measured s':>10} {'predicted s':>11} {'measured/predicted':>18}")
    for name in ("unfused", "fused"):
        print(f"    {name:8} {m[name]:10.3f} {p[name]:11.3f} {m[name] / p[name]:18.3f}")
    print(f"    speedup: measured {m['unfused'] / m['fused']:.3f}, predicted {p['unfused'] / p['fused']:.3f}")


# --- (c) real tiny models -----------------------------------------------------------------------------------------

REAL_PLAN = {"actor_train": {"ranks": "0-3", "dp": 4}, "critic_train": {"ranks": "0-3", "dp": 4},
             "actor_gen": {"ranks": "0-3", "dp": 4}, "ref_inf": {"ranks": "0-3", "dp": 4},
             "reward_inf": {"ranks": "0-3", "dp": 4}, "critic_inf": {"ranks": "0-3", "dp": 4}}


def real_rank(thresholds: list, repeats: int) -> dict:
    """One rank of (c): the trainer's generate + infer, unfused and fused at each R of ``thresholds``
    (median seconds)."""
    import torch.distributed as dist

    from rlhf.config import RunConfig
    from rlhf.ppo.config import FusionConfig, GenerationConfig, JobConfig, ModelsConfig, PPOConfig
    from rlhf.data import ByteTokenizer, PromptBatchIterator
    from rlhf.data.synthetic import SyntheticPromptConfig, SyntheticPromptDataset, gold_reward
    from rlhf.parallel import Placement
    from rlhf.ppo.trainer import Trainer

    config = JobConfig(models=ModelsConfig(), run=RunConfig(seed=3),  # the tiny presets at the byte tokenizer's ids
                       generation=GenerationConfig(max_prompt_len=16, max_response_len=96, long_tail_median=12),
                       ppo=PPOConfig(rollout_batch_size=16, n_samples_per_prompt=4, ppo_mini_batch_size=64,
                                     micro_batch_size=8),
                       fusion=FusionConfig(inter_stage_fusion=True, migrate_kv="yes"))
    prompts = PromptBatchIterator(SyntheticPromptDataset(SyntheticPromptConfig(seed=3, max_length=16)), 16, seed=3)
    trainer = Trainer(config, Placement.from_plan(REAL_PLAN, 4), prompts, ByteTokenizer(), reward_fn=gold_reward)
    batch_prompts, fusion = next(prompts), trainer.inter_stage
    times = {"unfused": [], **{r: [] for r in thresholds}}
    for _ in range(repeats + 1):
        for name in times:
            trainer.inter_stage = None if name == "unfused" else fusion
            if name != "unfused":
                fusion.threshold = name
            dist.barrier()
            start = time.perf_counter()
            rollout = trainer.generate(batch_prompts)
            trainer.infer(rollout.batch, rollout.fusion)
            dist.barrier()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t[1:]) for name, t in times.items()}


def print_real(res: dict) -> None:
    print(f"(c) real tiny models (tiny actor, tiny-critic; 4 ranks on {os.cpu_count()} CPU cores), 64 samples, "
          f"lognormal median 12, cap 96: generate + infer; unfused {res['unfused']:.3f} s")
    for r, seconds in res.items():
        if r != "unfused":
            print(f"    fused at R={r:.0%}: {seconds:.3f} s, speedup {res['unfused'] / seconds:.3f}")
    print("    (the ranks share the cores: a freed rank's inference slows the destinations' generation, and a "
          "decode step's time grows with the batch, which (b)'s flat step does not)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=32, help="fresh batches averaged per R (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the simulated workload (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per mode in (b) and (c), after one warm-up "
                                                           "(default %(default)s)")
    ap.add_argument("--skip-real", action="store_true", help="leave out (c), the real tiny models")
    args = ap.parse_args(argv)
    if args.batches < 1 or args.repeats < 1:
        ap.error(f"--batches {args.batches} and --repeats {args.repeats} must be >= 1")
    res = figure9(args.batches, args.seed)
    print_figure9(res, args.batches)
    sleep = measure_sleep(args.seed, args.repeats)
    print_sleep(sleep)
    if not args.skip_real:
        from rlhf.testing.distributed import launch

        thresholds = sorted({sleep["threshold"], FIRST_THRESHOLD})
        print_real(launch(4, "inter_stage:real_rank", timeout_s=900, thresholds=thresholds, repeats=args.repeats)[0])
    m, p = sleep["measured"], sleep["predicted"]
    ratio = (m["unfused"] / m["fused"]) / (p["unfused"] / p["fused"])
    print(f"inter-stage: R={res['chosen']:.2f} best_R={res['best']:.2f} "
          f"sim_speedup={res['unfused_s'] / res['chosen_s']:.3f} measured_speedup={m['unfused'] / m['fused']:.3f} "
          f"measured/predicted={ratio:.3f}")


if __name__ == "__main__":
    main()
