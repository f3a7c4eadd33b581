"""One-rank scenario for tests/test_engine_pipelined.py: decode steps launched before the last step's tokens
are read (`Engine.step`), against the same engine made to read every step's tokens at its end (the engine
before the change)."""

from scenario_engine import CFG, SEED

from rlhf.engine import Engine, EngineConfig, Request, SamplingParams
from rlhf.models.gpt import build_model
from rlhf.parallel import Placement
from rlhf.parallel.groups import build_task_groups, local_groups


class ReadEveryStep(Engine):
    """The reference: every step's tokens are read, and its finished samples returned, by the step itself."""

    def step(self):
        done = super().step()
        self._flush()
        return done + self._take_done()


def _traced(engine: Engine) -> list:
    """Log ("launch", tokens) for each step that samples and ("read", tokens, dropped rows) for each first
    read of a step's tokens on the host (`Engine._read`), in order."""
    log, sample, read = [], engine.decoder.forward_and_sample, engine._read

    def launched(inputs, sampling):
        tokens, logps = sample(inputs, sampling)
        log.append(("launch", tokens))
        return tokens, logps

    def reading(step):
        if not step.read:
            log.append(("read", step.tokens, sum(s.finish_reason is not None or s.status.value != "running"
                                                 for s in step.seqs)))
        read(step)
    engine.decoder.forward_and_sample, engine._read = launched, reading
    return log


def _order(log: list) -> list[str]:
    """The log as "L<k>" / "R<k>", k the index of the step's launch."""
    index = {id(e[1]): k for k, e in enumerate(e for e in log if e[0] == "launch")}
    return [f"{e[0][0].upper()}{index[id(e[1])]}" for e in log]


def _results(results) -> list:
    return [(r.request_id, r.sample_index, r.prompt, r.tokens, r.logprobs, r.finish_reason) for r in results]


def _mixed_requests() -> list[Request]:
    """Greedy and sampled, n up to 3, per-sample limits, stop ids that end some samples early."""
    reqs = []
    for i in range(10):
        prompt = [(7 * i + 3 * k) % CFG.vocab_size for k in range(3 + i % 5)]
        params = SamplingParams(max_new_tokens=6 + 3 * (i % 4), n=1 + i % 3, temperature=0.0 if i % 2 else 1.0,
                                seed=i, stop_token_ids=tuple(range(i % 3 * 20, i % 3 * 20 + 20)))
        reqs.append(Request(f"m{i}", prompt, params))
    return reqs


CONFIGS = {"ample": EngineConfig(num_blocks=256, block_size=4),
           "few seqs": EngineConfig(num_blocks=256, block_size=4, max_num_seqs=3, max_tokens_per_step=16),
           "tiny pool": EngineConfig(num_blocks=12, block_size=4, max_tokens_per_step=8, prefix_sharing=False),
           "static": EngineConfig(num_blocks=64, block_size=4, cuda_graphs=True)}


def run() -> dict:
    build_task_groups(Placement.from_plan({}, 1))
    local = local_groups()
    model = build_model(CFG, "lm", local.pg_collection, local.stage, seed=SEED)
    out = {}
    # 3 prompts x 2 samples, 8 tokens each, no stop: one prefill step, then decode steps only
    plain = [Request(f"p{i}", [5 + i, 9, 11 + i], SamplingParams(max_new_tokens=8, n=2, temperature=float(i % 2),
                                                                 seed=i)) for i in range(3)]
    engine = Engine(model, local, CFG, EngineConfig(num_blocks=64, block_size=4))
    log = _traced(engine)
    results = engine.generate(plain)
    out["plain"] = {"order": _order(log), "equal": _results(results) == _results(
        ReadEveryStep(model, local, CFG, EngineConfig(num_blocks=64, block_size=4)).generate(plain))}
    for name, cfg in CONFIGS.items():
        engine = Engine(model, local, CFG, cfg)
        log = _traced(engine)
        got, want = (_results(e.generate(_mixed_requests()))
                     for e in (engine, ReadEveryStep(model, local, CFG, cfg)))
        order = _order(log)
        out[name] = {"got": got, "want": want, "ahead": sum(a[0] == "L" and b[0] == "R" and int(b[1:]) < int(a[1:])
                                                           for a, b in zip(order, order[1:])),
                     "dropped": sum(e[2] for e in log if e[0] == "read"),
                     "reads": sum(e[0] == "read" for e in log), "launches": sum(e[0] == "launch" for e in log),
                     "preemptions": engine.stats.preemptions, "free": engine.kv.pool.num_free,
                     "blocks": cfg.num_blocks, "unfinished": engine.has_unfinished()}
    return out
