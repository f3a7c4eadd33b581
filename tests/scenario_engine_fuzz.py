"""One-rank scenario for the engine fuzz test (tests/test_engine_fuzz.py asserts on what `run` returns).

Per seed: a random workload, run once on an engine with an ample KV pool (the reference: every request at
once, nothing preempted) and once under pressure: two engines whose pools only just hold the longest sample,
with their own random token budgets, batch limits and prefix sharing on or off, one of them running its decode
steps at static shapes (``cuda_graphs``: padded to a power of two, eagerly here), with the torch attention
path for half the seeds and the C++ kernel for the others; requests arrive at random
steps on either engine, and random unfinished samples move (export, then import with or without K/V) to
either engine, their own included, at random steps. Migration is plain data
(`Engine.export_sequence` -> `Engine.import_sequence`), so both engines live in this process; carrying it
between ranks is tested in scenario_engine.py.

The MoE seeds run the same on a tiny MoE model (scenario_engine's "moe_norm") with the pressured engines
recording routing (``EngineConfig.record_routing``): each finished sample's routing is checked against
megatron's router on a full forward, and the samples that were preempted or moved with and without K/V are
counted.
"""

import random
from collections import Counter, defaultdict
from dataclasses import replace

from scenario_engine import CFG, SEED, VARIANTS, sample_routing_errors, variant_model

from rlhf.engine import Engine, EngineConfig, OutOfBlocksError, Request, SamplingParams
from rlhf.engine.kv_manager import blocks_for
from rlhf.models.gpt import build_model
from rlhf.parallel import Placement
from rlhf.parallel.groups import build_task_groups, local_groups

BLOCK_SIZE = 4
MAX_MODEL_LEN = 28  # prompts up to 20 and limits up to 16: some samples end at the context ("context")
MIGRATE_P = 0.3  # chance per step that one random unfinished sample moves
MOVES = 2  # per sample: a move without K/V starts its prefill again, so unbounded moves might never end
MAX_STEPS = 2000  # far above what a workload takes: a run this long has stopped making progress


def _prompt(rng: random.Random, earlier: list[tuple[int, ...]]) -> list[int]:
    """1-20 tokens; about a third start with the start of an earlier prompt (prefix-map hits), and about a
    third are drawn from two ids only, so that equal blocks follow different prefixes (no false hits)."""
    head = list(rng.choice(earlier)[:rng.randint(1, 20)]) if earlier and rng.random() < 0.3 else []
    ids = rng.choice([range(CFG.vocab_size), range(CFG.vocab_size), (7, 8), (7,)])
    return head + [rng.choice(ids) for _ in range(rng.randint(0 if head else 1, 20 - len(head)))]


def _workload(rng: random.Random, count: int) -> list[Request]:
    """``count`` requests, n in 1-3, each sample its own length limit (1-16); half greedy, half seeded
    sampling (its tokens do not depend on batching, preemption or migration either: one draw per token)."""
    requests = []
    for i in range(count):
        prompt = _prompt(rng, [r.prompt for r in requests])
        n, limit = rng.randint(1, 3), rng.randint(1, 16)
        params = SamplingParams(max_new_tokens=limit, n=n, temperature=rng.choice([0.0, 1.0]), seed=i,
                                sample_max_new_tokens=[rng.randint(1, limit) for _ in range(n)])
        requests.append(Request(f"q{i}", prompt, params))
    return requests


def _with_stops(rng: random.Random, requests: list[Request], reference: dict) -> list[Request]:
    """About half the requests get a stop id: a token their sample 0 generated in the reference."""
    return [replace(r, params=replace(r.params, stop_token_ids=(rng.choice(reference[(r.request_id, 0)]["tokens"]),)))
            if rng.random() < 0.5 else r for r in requests]


def _result(res) -> dict:
    return {"tokens": list(res.tokens), "logprobs": list(res.logprobs), "reason": res.finish_reason}


def _end_state(engine: Engine) -> dict:
    """What must be empty once every sample finished: blocks, tables, prefix map, scheduler queues."""
    pool = engine.kv.pool
    return {"num_free": pool.num_free, "num_blocks": pool.num_blocks, "refs": sum(pool.ref_counts),
            "tables": len(engine.kv.tables), "registered": sum(map(pool.is_registered, range(pool.num_blocks))),
            "running": len(engine.scheduler.running), "waiting": len(engine.scheduler.waiting),
            "unfinished": engine.has_unfinished()}


def _migrate(rng: random.Random, engines: list[Engine], counts: Counter, moves: Counter, moved: dict) -> None:
    """Move one random unfinished sample to a random engine (maybe its own): with its K/V, or to prefill again
    when the K/V are not asked for, not computed yet, or find no room there now (`OutOfBlocksError`).
    ``counts`` counts the moves of each kind, ``moved`` collects the samples moved by kind."""
    movable = [(e, rid, i) for e in engines for rid, i, _ in e.exportable() if moves[(rid, i)] < MOVES]
    if not movable:
        return
    src, rid, index = rng.choice(movable)
    moves[(rid, index)] += 1
    state = src.export_sequence(rid, index, with_kv=rng.random() < 0.7)
    dst = rng.choice(engines)
    try:
        dst.import_sequence(state)
        kind = "with_kv" if state.kv is not None else "without_kv"
    except OutOfBlocksError:
        dst.import_sequence(replace(state, kv=None, num_computed=0))
        kind = "refused_kv"
    counts[kind] += 1
    moved[kind].add((rid, index))


def _note_preemptions(engine: Engine, keys: set) -> None:
    """Collect in ``keys`` the samples ``engine``'s scheduler preempts."""
    preempt = engine.scheduler.preempt

    def noted(seq):
        keys.add(seq.key)
        return preempt(seq)
    engine.scheduler.preempt = noted


def _pressured(model, cfg, local, rng: random.Random, requests: list[Request], configs: list[EngineConfig]) -> dict:
    """One tiny-pool engine per config; requests arrive at random steps, samples move at random steps. With
    routing recorded, each finished sample's routing is checked (`sample_routing_errors`)."""
    engines = [Engine(model, local, cfg, c) for c in configs]
    preempted, moved, samples = set(), defaultdict(set), []
    for e in engines:
        _note_preemptions(e, preempted)
    arrivals = sorted((rng.randrange(len(requests)), k) for k in range(len(requests)))
    counts, moves, step = Counter(with_kv=0, without_kv=0, refused_kv=0), Counter(), 0
    while arrivals or any(e.has_unfinished() for e in engines):
        if step == MAX_STEPS:
            raise RuntimeError(f"no end after {step} steps: {[e.snapshot() for e in engines]}")
        while arrivals and arrivals[0][0] <= step:
            rng.choice(engines).add_request(requests[arrivals.pop(0)[1]])
        if rng.random() < MIGRATE_P:
            _migrate(rng, engines, counts, moves, moved)
        for e in engines:
            samples += e.step()
        step += 1
    finished = [((r.request_id, r.sample_index), _result(r)) for r in samples]
    static = [e.decoder.static for e in engines if e.decoder.static is not None]
    keys = {key for key, _ in finished}
    routing = None
    if configs[0].record_routing:
        routing = {**sample_routing_errors(model, samples), "preempted_samples": len(keys & preempted),
                   **{f"{kind}_samples": len(keys & moved[kind]) for kind in counts}}
    return {"finished": finished, "migrations": dict(counts), "steps": step, "routing": routing,
            "preemptions": sum(e.stats.preemptions for e in engines), "end": [_end_state(e) for e in engines],
            "static_steps": sum(d.steps for d in static),
            "static_buckets": sorted({size for d in static for size in d.buckets})}


def fuzz(model, local, seed: int, count: int, cfg=CFG) -> dict:
    """The reference run, then the pressured run of the same workload with stop ids added (recording routing
    for a MoE ``cfg``)."""
    rng = random.Random(seed)
    requests = _workload(rng, count)
    ample = Engine(model, local, cfg, EngineConfig(num_blocks=512, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN))
    reference = {(r.request_id, r.sample_index): _result(r) for r in ample.generate(requests)}
    requests = _with_stops(rng, requests, reference)
    # room for the longest sample alone (the least Engine.check_fits accepts): others are preempted for it
    need = max(blocks_for(min(len(r.prompt) + r.params.max_new_tokens, MAX_MODEL_LEN), BLOCK_SIZE) for r in requests)
    configs = [EngineConfig(num_blocks=need, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                            max_tokens_per_step=rng.choice([4, 8, 16, 64]), max_num_seqs=rng.choice([4, 64]),
                            prefix_sharing=rng.random() < 0.7, cuda_graphs=(seed + k) % 2 == 1,
                            attention_backend="torch" if seed % 4 < 2 else "auto", record_routing=cfg.is_moe)
               for k in range(2)]
    out = _pressured(model, cfg, local, rng, requests, configs)
    out.update(reference=reference, reference_preemptions=ample.stats.preemptions, num_blocks=need,
               stops={r.request_id: r.params.stop_token_ids for r in requests},
               samples={r.request_id: r.params.n for r in requests})
    return out


def run(seeds: list[int], count: int, moe_seeds: tuple[int, ...] = ()) -> dict:
    """`fuzz` for each seed on one random tiny model, and for each of ``moe_seeds`` on a tiny MoE model
    (routing recorded); results by seed."""
    build_task_groups(Placement.from_plan({}, 1))
    local = local_groups()
    model = build_model(CFG, "lm", local.pg_collection, local.stage, seed=SEED)
    out = {seed: fuzz(model, local, seed, count) for seed in seeds}
    moe = variant_model("moe_norm", local)
    return out | {seed: fuzz(moe, local, seed, count, VARIANTS["moe_norm"]) for seed in moe_seeds}
