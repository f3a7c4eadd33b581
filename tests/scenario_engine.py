"""2-rank scenario for the generation engine (one launch, several checks).

Rank 0: greedy tokens vs HF generate and vs a full-recompute loop on the
training model, log-probs vs the training model (raw, and tempered at T=0.7:
log_softmax(logits / T) of the plain model), preemption with a tiny pool, and
the source side of migration. Rank 1: prefix-sharing block accounting for
n=8, seeded sampling independent of batching, two stop ids, capacity errors,
the destination side of migration, and a bf16 engine's log-probs vs the bf16 model. Both: TP2 engine (weights resharded
from a DP2 training layout) vs a TP1 engine, and its tempered log-probs vs the
plain TP1 model; multi-turn episodes (scripted environments) on TP2 and TP1 engines; a Qwen3-shaped
model (QK-norm, head_dim 24 != 64 / 4) and two tiny MoE models (4 experts, top-2, with and without
norm_topk_prob, one with a shared expert) against the training model at TP1 (rank 0: Qwen3 and the normed
MoE; rank 1: the other MoE and bf16) and at TP2, with the engine's routing record against megatron's router.
Every check returns small values; the test module asserts.
"""

import threading
from dataclasses import replace

import torch
import torch.distributed as dist

from rlhf.engine import (Engine, EngineConfig, EngineConfigError, NeverFitsError, OutOfBlocksError, Request,
                         SamplingParams)
from rlhf.envs.environment import Environment, EnvironmentStep
from rlhf.envs.episodes import EnvironmentDriver, EpisodeRunner
from rlhf.fusion.transport import recv_sequence, send_sequence
from rlhf.models import ModelConfig
from rlhf.models.gpt import build_model, stage_forward
from rlhf.models.logprobs import vocab_parallel_log_probs
from rlhf.parallel import Placement
from rlhf.parallel.groups import build_task_groups, local_groups
from rlhf.parallel.reshard import reshard

CFG = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_kv_heads=2,
                  vocab_size=256, max_seq_len=96, qkv_bias=True)
HF_CFG = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_kv_heads=2,
                     vocab_size=256, max_seq_len=96, rope_theta=10000.0, norm_eps=1e-6)
PLAN = {"actor_train": {"ranks": "0-1", "dp": 2}, "actor_gen": {"ranks": "0-1", "tp": 2}}
SEED = 21
GREEDY = SamplingParams(max_new_tokens=14)
SAMPLED = SamplingParams(max_new_tokens=14, temperature=0.9, top_k=40, top_p=0.9, seed=5)
TEMPERED = replace(SAMPLED, temperature=0.7)  # logprobs_of="tempered", the default


def _prompts(count, lo=3, hi=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (count,), generator=g).tolist()
    return [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in lens]


def _requests(prompts, params, tag="r"):
    return [Request(f"{tag}{i}", p, params) for i, p in enumerate(prompts)]


def _tokens(results):
    return [list(r.tokens) for r in results]


# ---- rank 0 -----------------------------------------------------------------------


def tiny_hf_llama(cfg: ModelConfig, seed: int, out_dir: str):
    """A tiny random HF LlamaForCausalLM, saved to ``out_dir`` for conversion."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps, tie_word_embeddings=False, attn_implementation="eager")).eval()
    hf.save_pretrained(out_dir, safe_serialization=True)
    return hf


def check_vs_hf(local) -> dict:
    import tempfile

    from rlhf.checkpoint.hf import load_hf_weights, read_hf_config

    with tempfile.TemporaryDirectory() as d:
        hf = tiny_hf_llama(HF_CFG, seed=3, out_dir=d)
        cfg = read_hf_config(d).config
        model = build_model(cfg, "lm", local.pg_collection, local.stage, seed=1)
        load_hf_weights(model, local, d)
    prompts = _prompts(4, seed=1)
    ours = _tokens(Engine(model, local, cfg, EngineConfig(num_blocks=64, block_size=8)).generate(
        _requests(prompts, GREEDY)))
    theirs = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              do_sample=False, max_new_tokens=GREEDY.max_new_tokens,
                              min_new_tokens=GREEDY.max_new_tokens, pad_token_id=0)
            theirs.append(out[0, len(p):].tolist())
    return {"hf_equal": ours == theirs, "hf_len": [len(t) for t in ours]}


def naive_greedy(model, prompt, steps):
    """Full recompute every step with the training model's forward."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(stage_forward(model, torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def training_logprobs(model, prompt, tokens, tp_group, temperature=1.0):
    """The training model's log p(token) for each generated token, from its logits divided by ``temperature``."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        lp = vocab_parallel_log_probs(stage_forward(model, ids)[:, :-1] / temperature, ids[:, 1:], tp_group)[0]
    return lp[len(prompt) - 1:]


def logprob_errors(model, results, tp_group, temperature=1.0) -> torch.Tensor:
    """|engine - training model| of every log-prob of ``results``, the model's logits divided by ``temperature``."""
    return torch.cat([(training_logprobs(model, r.prompt, r.tokens, tp_group, temperature) - torch.tensor(r.logprobs))
                      .abs() for r in results])


def logprob_err(model, results, tp_group, temperature=1.0) -> float:
    """Largest |engine - training model| log-prob over ``results``."""
    return logprob_errors(model, results, tp_group, temperature).max().item()


def bf16_distances(prefix: str, model, fp32, results, tp_group) -> dict:
    """A bf16 engine's log-probs against its bf16 training ``model`` (largest and mean |difference|) and the mean
    against the ``fp32`` model of the same weights."""
    errors = logprob_errors(model, results, tp_group)
    return {f"{prefix}_logprob_err": errors.max().item(), f"{prefix}_logprob_mean_err": errors.mean().item(),
            f"{prefix}_vs_fp32_logprob_mean": logprob_errors(fp32, results, tp_group).mean().item()}


def check_vs_training_model(model, local) -> dict:
    prompts = _prompts(5, seed=2)
    # small blocks and a small budget: prompts are prefilled in chunks next to decodes
    cfg = EngineConfig(num_blocks=128, block_size=4, max_tokens_per_step=16)
    results = Engine(model, local, CFG, cfg).generate(_requests(prompts, GREEDY))
    naive = [naive_greedy(model, p, GREEDY.max_new_tokens) for p in prompts]
    raw = Engine(model, local, CFG, cfg).generate(_requests(prompts, replace(TEMPERED, logprobs_of="raw")))
    tempered = Engine(model, local, CFG, cfg).generate(_requests(prompts, TEMPERED))
    big = Engine(model, local, CFG, EngineConfig(num_blocks=256, block_size=4))
    unconstrained = _tokens(big.generate(_requests(prompts * 2, GREEDY)))
    tiny = Engine(model, local, CFG, EngineConfig(num_blocks=12, block_size=4, max_tokens_per_step=32))
    constrained = _tokens(tiny.generate(_requests(prompts * 2, GREEDY)))
    return {"naive_equal": _tokens(results) == naive, "logprob_err": logprob_err(model, results + raw, local.tp),
            "tempered_logprob_err": logprob_err(model, tempered, local.tp, TEMPERED.temperature),
            "tempered_vs_raw": logprob_err(model, tempered, local.tp),
            "raw_tokens_equal": _tokens(raw) == _tokens(tempered),
            "finish_reasons": sorted({r.finish_reason for r in results}),
            "preempt_equal": constrained == unconstrained, "preemptions": tiny.stats.preemptions,
            "tiny_blocks_free_after": tiny.kv.pool.num_free}


# ---- rank 1 -----------------------------------------------------------------------


def check_prefix_sharing(model, local) -> dict:
    prompt = _prompts(1, lo=10, hi=11, seed=3)[0]  # 10 tokens, block size 4: 2 full + 1 partial block
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=9, n=8)
    out = {}
    for share in (True, False):
        eng = Engine(model, local, CFG, EngineConfig(num_blocks=64, block_size=4, prefix_sharing=share))
        eng.add_request(Request("p", prompt, params))
        eng.step()  # prefill (+ first token of every sample)
        after_prefill = eng.kv.pool.num_used
        refs = sorted(eng.kv.pool.ref_counts, reverse=True)[:3]
        eng.step()  # first decode: writes position 10 (the partial block)
        out[share] = {"prefill": after_prefill, "decode": eng.kv.pool.num_used, "refs": refs}
        finished = []
        while eng.has_unfinished():
            finished += eng.step()
        out[share]["tokens"] = _tokens(sorted(finished, key=lambda r: r.sample_index))
        out[share]["free_after"] = eng.kv.pool.num_free
    tiny = Engine(model, local, CFG, EngineConfig(num_blocks=9, block_size=4))
    tiny_tokens = _tokens(tiny.generate([Request("p", prompt, params)]))
    return {"tiny_pool_equal": tiny_tokens == out[True]["tokens"], "tiny_pool_preemptions": tiny.stats.preemptions,
            "blocks_shared": {k: v for k, v in out[True].items() if k != "tokens"},
            "blocks_unshared": {k: v for k, v in out[False].items() if k != "tokens"},
            "shared_equal_unshared": out[True]["tokens"] == out[False]["tokens"],
            "n8_distinct": len({tuple(t) for t in out[True]["tokens"]})}


def check_sampling_and_errors(model, local) -> dict:
    prompts = _prompts(4, seed=4)
    alone = _tokens(Engine(model, local, CFG).generate(_requests(prompts[:1], SAMPLED)))
    crowd = _tokens(Engine(model, local, CFG, EngineConfig(max_tokens_per_step=8)).generate(
        _requests(prompts, SAMPLED)))
    stop_ids = (min(set(range(CFG.vocab_size)) - set(alone[0])), alone[0][3])  # the second id is the one drawn
    stop = Engine(model, local, CFG).generate([Request("r0", prompts[0], replace(SAMPLED, stop_token_ids=stop_ids))])[0]
    eng = Engine(model, local, CFG, EngineConfig(num_blocks=4, block_size=4))
    errors = []
    for req in (Request("long", [1] * CFG.max_seq_len), Request("big", [1] * 8, SamplingParams(max_new_tokens=20))):
        try:
            eng.add_request(req)
        except NeverFitsError as e:
            errors.append(str(e))
    return {"seeded_equal": alone[0] == crowd[0], "never_fits": len(errors),
            "stop_reason": stop.finish_reason, "stop_tokens": list(stop.tokens), "stop_logprobs": len(stop.logprobs),
            "until_stop": alone[0][:alone[0].index(stop_ids[1]) + 1]}  # up to and including the stop token


# ---- both ranks -------------------------------------------------------------------


def check_tp2(groups, placement, local) -> dict:
    """TP2 engine on weights resharded from DP2 training replicas vs TP1; then a second reshard."""
    g, train_g = groups["actor_gen"], groups["actor_train"]
    gen = build_model(CFG, "lm", g.pg_collection, g.stage, seed=999)
    reqs = _requests(_prompts(4, seed=5), GREEDY) + _requests(_prompts(2, seed=6), TEMPERED, tag="s")
    cfg = EngineConfig(num_blocks=64, block_size=4, max_tokens_per_step=24)
    engine, out, rounds = None, {}, []
    for round_, seed in enumerate((SEED, SEED + 1)):  # the engine sees each reshard without reloading
        train = build_model(CFG, "lm", train_g.pg_collection, train_g.stage, seed=seed)
        reshard(placement["actor_train"], (train_g, train), placement["actor_gen"], (g, gen), CFG.num_layers)
        engine = engine or Engine(gen, g, CFG, cfg)
        tp2 = engine.generate(reqs)
        plain = build_model(CFG, "lm", local.pg_collection, local.stage, seed=seed)  # unsharded, the same weights
        tp1 = Engine(plain, local, CFG, cfg).generate(reqs)
        rounds.append(_tokens(tp2))
        out[f"tp2_equal_{round_}"] = _tokens(tp2) == _tokens(tp1)
        out[f"tp2_logprob_err_{round_}"] = max(abs(a - b) for x, y in zip(tp1, tp2)
                                               for a, b in zip(x.logprobs, y.logprobs))
        out[f"tp2_tempered_err_{round_}"] = logprob_err(plain, tp2[4:], local.tp, TEMPERED.temperature)
    out["rounds_differ"] = rounds[0] != rounds[1]
    return out


def _run_to_end(eng, finished=()) -> dict:
    """Step until done; tokens by request id of everything that finished."""
    return {r.request_id: list(r.tokens) for r in [*finished, *_finish(eng)]}


def _finish(eng) -> list:
    """Step until done; the samples that finished meanwhile."""
    finished = []
    while eng.has_unfinished():
        finished += eng.step()
    return finished


def check_migration(model, local) -> dict:
    """Rank 0 runs 3 steps, exports two samples (with / without KV) to rank 1, which finishes them."""
    reqs = _requests(_prompts(3, seed=7), GREEDY) + _requests(_prompts(1, seed=8), SAMPLED, tag="s")
    cfg = EngineConfig(num_blocks=64, block_size=4)
    eng = Engine(model, local, CFG, cfg)
    moved = [("r1", True), ("s0", True), ("r2", False)]
    if dist.get_rank() == 0:
        unmoved = {r.request_id: list(r.tokens) for r in Engine(model, local, CFG, cfg).generate(reqs)}
        for r in reqs:
            eng.add_request(r)
        stayed = [r for _ in range(3) for r in eng.step()]
        for rid, with_kv in moved:
            send_sequence(eng.export_sequence(rid, 0, with_kv=with_kv), dst=1)
        return {"unmoved": unmoved, "stayed": _run_to_end(eng, stayed)}
    states = [recv_sequence(src=0) for _ in moved]
    full = Engine(model, local, CFG, EngineConfig(num_blocks=10, block_size=4))
    full.add_request(Request("fill", [1] * 36, SamplingParams(max_new_tokens=4)))
    full.step()  # 9 of the 10 blocks now hold the filler's prompt
    try:  # K/V of >= 5 positions (prompt >= 3, 3 steps) need >= 2 blocks: retry later
        full.import_sequence(states[0])
        out_of_blocks = "no error"
    except OutOfBlocksError:
        out_of_blocks = "OutOfBlocksError"
    for state in states:
        eng.import_sequence(state)
    running_at_import = len(eng.scheduler.running)
    return {"migrated": _run_to_end(eng),
            "kv_shipped": [s.kv is not None for s in states], "running_at_import": running_at_import,
            "import_when_full": out_of_blocks}


def check_bf16(local) -> dict:
    """A bf16 engine (weights and KV cache in bf16) against the same bf16 training model: the log-probs of the
    tokens it sampled (raw: log_softmax of the logits), and its dtypes."""
    model = build_model(CFG, "lm", local.pg_collection, local.stage, seed=SEED, dtype=torch.bfloat16)
    engine = Engine(model, local, CFG, EngineConfig(num_blocks=128, block_size=4, max_tokens_per_step=16))
    results = engine.generate(_requests(_prompts(5, seed=3), replace(SAMPLED, logprobs_of="raw")))
    fp32 = build_model(CFG, "lm", local.pg_collection, local.stage, seed=SEED)
    return {**bf16_distances("bf16", model, fp32, results, local.tp), "bf16_kv_dtype": str(engine.decoder.kv_cache.dtype)}


def check_weight_refresh(local) -> dict:
    """New weights reach samples in flight (partial rollouts): 4 steps under weights A (version 0), then B's
    copied in and ``refresh_weights(1)``; each token's log-prob against the model of the version it records,
    with the K/V computed again and kept; ``abort_all`` frees every block."""
    models = [build_model(CFG, "lm", local.pg_collection, local.stage, seed=s) for s in (SEED, SEED + 7)]
    gen = build_model(CFG, "lm", local.pg_collection, local.stage, seed=SEED)
    reqs = _requests(_prompts(3, seed=9), replace(TEMPERED, n=2))
    out = {}
    for keep in (False, True):
        with torch.no_grad():
            for p, q in zip(gen.parameters(), models[0].parameters()):
                p.copy_(q)
        eng = Engine(gen, local, CFG, EngineConfig(num_blocks=64, block_size=4))
        eng.refresh_weights(0)
        for r in reqs:
            eng.add_request(r)
        finished = [r for _ in range(4) for r in eng.step()]
        with torch.no_grad():
            for p, q in zip(gen.parameters(), models[1].parameters()):
                p.copy_(q)
        eng.refresh_weights(1, keep_kv=keep)
        blocks_after_refresh = eng.kv.pool.num_used
        results = finished + _finish(eng)
        errors = {0: 0.0, 1: 0.0}
        for r in results:
            versions = torch.tensor(r.policy_versions)
            for v in (0, 1):
                lp = training_logprobs(models[v], r.prompt, r.tokens, local.tp, TEMPERED.temperature)
                err = (lp - torch.tensor(r.logprobs)).abs()[versions == v]
                errors[v] = max(errors[v], err.max().item() if len(err) else 0.0)
        name = "keep" if keep else "recompute"
        out[f"refresh_{name}_errors"] = errors
        out[f"refresh_{name}_blocks"] = blocks_after_refresh
        out[f"refresh_{name}_versions"] = sorted({tuple(r.policy_versions) for r in results})
    eng.add_request(Request("x", [1] * 8, GREEDY))
    eng.step()
    eng.abort_all()
    out["refresh_free_after_abort"] = eng.kv.pool.num_free
    return out


# ---- multi-turn episodes ------------------------------------------------------------------


class ScriptedEnvironment(Environment):
    """Fixed observations that depend only on the turn (so every rank could compute them): turn k gets
    [200 + k, 3 + sum(turn ids) % 50, 7], reward k + 1; done after the third turn."""

    def step(self, turn):
        if turn.index == 2:
            return EnvironmentStep(reward=10.0, done=True)
        return EnvironmentStep(observation=[200 + turn.index, 3 + sum(turn.token_ids) % 50, 7],
                               reward=turn.index + 1.0)


class WaitingEnvironment(ScriptedEnvironment):
    """Sample 0 of request "e0" answers its first turn only once request "e1" has ended its episode: a
    runner that waited on it before stepping the engine again would never get there (20 s timeout)."""

    other_done = threading.Event()
    blocked = []

    def step(self, turn):
        if self.first and turn.index == 0:
            self.blocked.append(not self.other_done.wait(timeout=20))
        step = super().step(turn)
        if self.second and step.done:
            self.other_done.set()
        return step

    def reset(self, prompt):
        self.first, self.second = prompt == "e0", prompt == "e1"


class FailingEnvironment(ScriptedEnvironment):
    def step(self, turn):
        if turn.index == 1:
            raise RuntimeError("the scripted tool broke")
        return super().step(turn)


EPISODE_PARAMS = SamplingParams(max_new_tokens=40, n=2)


def _episodes(engine, env, tp_group=None) -> list:
    driver = EnvironmentDriver(env, None, prompt_records=lambda rid: rid)
    runner = EpisodeRunner(engine, driver, None, 3, 40, max_turn_tokens=6, tp_group=tp_group)
    return runner.run(_requests(_prompts(3, seed=11), EPISODE_PARAMS, tag="e"))


def _turn_spans(episode) -> list:
    """(start, end) of each model turn in the episode's response (runs of loss_mask 1)."""
    spans, start = [], None
    for k, m in enumerate([*episode.loss_mask, 0]):
        if m and start is None:
            start = k
        elif not m and start is not None:
            spans.append((start, k))
            start = None
    return spans


def check_episodes(groups, placement, local) -> dict:
    """Multi-turn episodes on a TP2 engine (environments on TP rank 0, answers broadcast) against a TP1 engine,
    each turn against a fresh engine's generation from the same prefix, K/V kept across turns, a tiny pool."""
    g, train_g = groups["actor_gen"], groups["actor_train"]
    train = build_model(CFG, "lm", train_g.pg_collection, train_g.stage, seed=SEED)
    gen = build_model(CFG, "lm", g.pg_collection, g.stage, seed=999)
    reshard(placement["actor_train"], (train_g, train), placement["actor_gen"], (g, gen), CFG.num_layers)
    plain = build_model(CFG, "lm", local.pg_collection, local.stage, seed=SEED)
    cfg = EngineConfig(num_blocks=96, block_size=4, max_tokens_per_step=24)
    tp2 = _episodes(Engine(gen, g, CFG, cfg), ScriptedEnvironment, g.tp)
    engine = Engine(plain, local, CFG, cfg)
    tp1 = _episodes(engine, ScriptedEnvironment)
    prompts = _prompts(3, seed=11)
    out = {"episodes_tp2_equal": [(e.tokens, e.loss_mask, e.rewards) for e in tp2]
           == [(e.tokens, e.loss_mask, e.rewards) for e in tp1],
           "episodes_tp2_logprob_err": max(abs(a - b) for x, y in zip(tp1, tp2)
                                           for a, b in zip(x.logprobs, y.logprobs)),
           "episodes_computed_tokens": engine.stats.computed_tokens,
           "episodes_computed_once": sum(map(len, prompts)) + sum(len(e.tokens) - 1 for e in tp1),
           "episodes_free_after": engine.kv.pool.num_free, "episodes": [
               dict(tokens=list(e.tokens), mask=list(e.loss_mask), rewards=list(e.rewards), turns=e.turns,
                    reward_positions=list(e.reward_positions),
                    reason=e.finish_reason, prompt=list(e.prompt)) for e in tp1]}
    fresh, turn_err, turns_equal = Engine(plain, local, CFG, cfg), 0.0, True
    for k, e in enumerate(tp1):
        for start, end in _turn_spans(e):
            params = SamplingParams(max_new_tokens=end - start)
            want = fresh.generate([Request(f"t{k}-{start}", list(e.prompt) + list(e.tokens[:start]), params)])[0]
            turns_equal &= list(want.tokens) == list(e.tokens[start:end])
            turn_err = max(turn_err, max(abs(a - b) for a, b in zip(want.logprobs, e.logprobs[start:end])))
    out.update(episodes_turns_equal=turns_equal, episodes_turn_logprob_err=turn_err)
    tiny = Engine(plain, local, CFG, EngineConfig(num_blocks=14, block_size=4, max_tokens_per_step=24))
    out["episodes_tiny_pool_equal"] = [e.tokens for e in _episodes(tiny, ScriptedEnvironment)] == [
        e.tokens for e in tp1]
    out.update(episodes_tiny_pool_free_after=tiny.kv.pool.num_free, episodes_held_evictions=tiny.stats.held_evictions)
    if dist.get_rank() == 0:
        waited = _episodes(Engine(plain, local, CFG, cfg), WaitingEnvironment)
        out["episodes_waiting_blocked"] = WaitingEnvironment.blocked
        out["episodes_waiting_equal"] = [e.tokens for e in waited] == [e.tokens for e in tp1]
    try:
        _episodes(Engine(gen, g, CFG, cfg), FailingEnvironment, g.tp)
        out["episodes_failure"] = None
    except RuntimeError as exc:
        out["episodes_failure"] = str(exc)
    return out


# ---- Qwen3 (QK-norm, an explicit head dimension) and MoE ---------------------------------------------------

QWEN3 = replace(CFG, qkv_bias=False, qk_norm=True, kv_channels=24)  # head_dim 24, not 64 / 4 = 16
VARIANTS = {
    "qwen3": QWEN3,
    # Qwen3-MoE-like: the top-2 of the logits, softmax over the two; a shared expert beside them
    "moe_norm": replace(QWEN3, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                        moe_shared_expert_intermediate_size=48),
    # softmax over the 4 experts, its top-2 unnormalised; no shared expert, no QK-norm
    "moe_plain": replace(CFG, qkv_bias=False, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                         moe_norm_topk_prob=False),
}


def variant_model(name, local, dtype=torch.float32):
    """The TP1 model of ``VARIANTS[name]`` (seed SEED); its RMSNorm weights drawn in [0.5, 1.5] (they start at
    1, where the query and key norms could be swapped unnoticed)."""
    model = build_model(VARIANTS[name], "lm", local.pg_collection, local.stage, seed=SEED, dtype=dtype)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "layernorm" in n:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
    return model


@torch.no_grad()
def copy_into_tp_shards(dst, src, tp_rank, tp):
    """Fill ``dst`` (a TP model) with this rank's slices of ``src`` (the same model at TP1), by megatron's
    partition_dim and partition_stride (fc1 [gate; up] slices each half); parameters of the same shape (norms,
    the router, the experts: expert TP is 1) are copied whole."""
    full = dict(src.named_parameters())
    for name, p in dst.named_parameters():
        w = full[name]
        if p.shape != w.shape:
            dim = p.partition_dim
            w = torch.cat([c.chunk(tp, dim)[tp_rank] for c in w.chunk(getattr(p, "partition_stride", 1), dim)], dim)
        p.copy_(w)


ROUTING_TIE_TOL = 1e-5
"""Positions where two of a layer's top k + 1 router scores are this close are left out of routing checks: the
engine and a full forward differ by ~1e-7 in fp32, which may reorder such a near tie."""


def training_routing(model, ids) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megatron's routing on the training model's forward on ``ids``: its routing map [len(ids), moe layers, E]
    (bool), the top-k experts [len(ids), moe layers, k] in score order (the map's experts, highest score first),
    and per position the smallest gap between consecutive scores of each layer's top k + 1 [len(ids)] (scores:
    the router's logits, or their softmax with ``moe_router_pre_softmax``, as megatron ranks them)."""
    maps, tops, gaps = [], [], []

    def hook(router, args, out):
        logits = router.gating(args[0]).flatten(0, -2).float()
        scores = logits.softmax(-1) if router.config.moe_router_pre_softmax else logits
        top = scores.topk(min(router.topk + 1, scores.shape[1]))
        maps.append(out[1])
        tops.append(top.indices[:, :router.topk])
        gaps.append((top.values[:, :-1] - top.values[:, 1:]).min(dim=1).values)

    hooks = [layer.mlp.router.register_forward_hook(hook) for layer in model.decoder.layers]
    with torch.no_grad():
        stage_forward(model, torch.tensor([list(ids)]))
    for h in hooks:
        h.remove()
    return torch.stack(maps, dim=1), torch.stack(tops, dim=1), torch.stack(gaps, dim=1).min(dim=1).values


def sample_routing_errors(model, samples) -> dict:
    """Each sample's ``routing`` (`SampleResult.routing`) against megatron's router on a full forward of its
    prompt + tokens, at every position 0..P+R-2 but near ties (`ROUTING_TIE_TOL`): positions whose experts
    (in order) differ, positions compared, near ties left out, samples whose record has the wrong shape, dtype
    or device, and positions where the hook's top-k is not megatron's own routing map (the reference's check)."""
    out = dict(bad=0, total=0, ties=0, bad_shape=0, bad_reference=0)
    for s in samples:
        ids = list(s.prompt) + list(s.tokens)[:-1]
        want_map, want, gaps = training_routing(model, ids)
        got = s.routing
        if got is None or got.shape != want.shape or got.dtype != torch.int16 or got.device.type != "cpu":
            out["bad_shape"] += 1
            continue
        clear = gaps > ROUTING_TIE_TOL
        out["bad"] += int((got.long() != want).any(dim=(1, 2))[clear].sum())
        out["total"] += int(clear.sum())
        out["ties"] += int((~clear).sum())
        out["bad_reference"] += int((torch.zeros_like(want_map).scatter_(2, want, True) != want_map).any(dim=(1, 2))
                                    .sum())
    return out


def generate_recording_routing(engine, requests):
    """``engine.generate(requests)`` with the decoder's routing record on: the results and, per request id,
    the experts of each position it computed [positions, moe layers, k], from each step's ``last_routing``
    (rows in the step's flat order: the scheduled sequences' token ranges, one after another)."""
    engine.decoder.record_routing = True
    spans, records = [], []
    prepare, forward = engine._prepare, engine.decoder.forward

    def prepare_and_note(out):
        spans.append([(seq.request_id, seq.num_computed, n) for seq, n in out.scheduled])
        return prepare(out)

    def forward_and_record(inp):
        logits = forward(inp)
        records.append(engine.decoder.last_routing)
        return logits

    engine._prepare, engine.decoder.forward = prepare_and_note, forward_and_record
    results = engine.generate(requests)
    per_request = {}
    for step, record in zip(spans, records):
        if record is None:  # a dense model records nothing
            continue
        assert record.shape[0] == sum(n for _, _, n in step)
        row = 0
        for rid, start, n in step:
            for j in range(n):
                per_request.setdefault(rid, {})[start + j] = record[row + j]
            row += n
    return results, {rid: torch.stack([pos[k] for k in sorted(pos)]) for rid, pos in per_request.items()}


def routing_mismatches(model, results, routing) -> tuple[int, int]:
    """(tokens whose recorded experts differ from megatron's router on the training model, tokens compared)
    over every computed position (the prompt and each generated token but the last) of ``results``."""
    bad = total = 0
    for r in results:
        ids = list(r.prompt) + list(r.tokens)[:-1]
        want = training_routing(model, ids)[0]
        rec = routing[r.request_id].long()
        got = torch.zeros_like(want).scatter_(2, rec, True)
        bad += int((got != want).any(dim=(1, 2)).sum())
        total += len(ids)
    return bad, total


def check_variant(name, local) -> dict:
    """``VARIANTS[name]`` at TP1 against its training model: greedy and raw log-probs (chunked prefill beside
    decodes), and for MoE: the routing record against megatron's router on every computed token, a
    norm_topk_prob mismatch seen, static decode (``cuda_graphs``) not applied and the same tokens."""
    cfg, model = VARIANTS[name], variant_model(name, local)
    prompts = _prompts(4, seed=12)
    ecfg = EngineConfig(num_blocks=128, block_size=4, max_tokens_per_step=16)
    greedy = Engine(model, local, cfg, ecfg).generate(_requests(prompts, GREEDY))
    raw = Engine(model, local, cfg, ecfg).generate(_requests(prompts, replace(TEMPERED, logprobs_of="raw")))
    out = {f"{name}_naive_equal": _tokens(greedy[:2]) == [naive_greedy(model, p, GREEDY.max_new_tokens)
                                                         for p in prompts[:2]],
           f"{name}_logprob_err": logprob_err(model, greedy + raw, local.tp)}
    if not cfg.is_moe:
        try:
            Engine(model, local, cfg, replace(ecfg, record_routing=True))
            out[f"{name}_record_routing_refused"] = None
        except EngineConfigError as e:
            out[f"{name}_record_routing_refused"] = (e.field_name, str(e))
        return out
    out.update(check_routing_record(name, model, local, ecfg, greedy))
    recorded, routing = generate_recording_routing(Engine(model, local, cfg, ecfg), _requests(prompts, GREEDY))
    flipped = replace(cfg, moe_norm_topk_prob=not cfg.moe_norm_topk_prob)
    graphs = Engine(model, local, cfg, replace(ecfg, cuda_graphs=True))
    out.update({f"{name}_recorded_tokens_equal": _tokens(recorded) == _tokens(greedy),
                f"{name}_routing_mismatch": routing_mismatches(model, recorded, routing),
                f"{name}_routing_dtype": str(routing[recorded[0].request_id].dtype),
                f"{name}_flipped_norm_err": logprob_err(model, Engine(model, local, flipped, ecfg).generate(
                    _requests(prompts, replace(TEMPERED, logprobs_of="raw"))), local.tp),
                f"{name}_graphs_static": graphs.decoder.static is not None,
                f"{name}_graphs_equal": _tokens(graphs.generate(_requests(prompts, GREEDY))) == _tokens(greedy)})
    return out


def check_routing_record(name, model, local, ecfg, unrecorded) -> dict:
    """``EngineConfig.record_routing`` on ``VARIANTS[name]``: each sample's ``routing`` against megatron's router
    (`sample_routing_errors`) with 3 samples per prompt (the prompt computed once, its blocks shared, the last
    one copied on write) and chunked prefill beside decodes; multi-turn episodes (held samples, observations
    inserted, 2 samples per prompt); a sample whose K/V arrive without routing is prefilled again (and
    recorded). Recording changes no token; off, ``routing`` is None (``unrecorded``: results of an engine
    without it)."""
    cfg, rec = VARIANTS[name], replace(ecfg, record_routing=True)
    reqs = _requests(_prompts(4, seed=16), replace(SAMPLED, n=3))
    engine = Engine(model, local, cfg, rec)
    samples = engine.generate(reqs)
    episodes = _episodes(Engine(model, local, cfg, rec), ScriptedEnvironment)
    # K/V exported without their routing (as from an engine not recording) into one that records
    src, dst = Engine(model, local, cfg, ecfg), Engine(model, local, cfg, rec)
    src.add_request(reqs[0])
    for _ in range(3):
        src.step()
    dst.import_sequence(src.export_sequence("r0", 1))
    requeued = [s.key for s in dst.scheduler.waiting] == [("r0", 1)]
    moved = _finish(dst)
    return {f"{name}_record_samples": sample_routing_errors(model, samples),
            f"{name}_record_shared_prefill": engine.stats.computed_tokens
            < sum(len(r.prompt) + len(r.tokens) - 1 for r in samples),
            f"{name}_record_tokens_equal": _tokens(samples) == _tokens(
                Engine(model, local, cfg, ecfg).generate(reqs)),
            f"{name}_record_off_none": all(r.routing is None for r in unrecorded),
            f"{name}_record_episodes": sample_routing_errors(model, episodes),
            f"{name}_record_episode_turns": sorted({e.turns for e in episodes}),
            f"{name}_record_requeued": requeued and len(moved) == 1,
            f"{name}_record_requeued_sample": sample_routing_errors(model, moved)}


def check_moe_bf16(local) -> dict:
    """The bf16 engine on the bf16 MoE models (router in fp32, probabilities applied before fc2 in fp32 and
    cast back, as megatron) against the bf16 training models, and the fp32 ones' distance."""
    out = {}
    for name in ("moe_norm", "moe_plain"):
        model = variant_model(name, local, torch.bfloat16)
        ecfg = EngineConfig(num_blocks=128, block_size=4, max_tokens_per_step=16)
        engine = Engine(model, local, VARIANTS[name], ecfg)
        results = engine.generate(_requests(_prompts(4, seed=13), replace(SAMPLED, logprobs_of="raw")))
        out.update(bf16_distances(f"{name}_bf16", model, variant_model(name, local), results, local.tp))
    return out


def check_variants_tp2(groups, local) -> dict:
    """Each variant's TP2 engine (its TP2 model filled with slices of the TP1 model: every rank holds every
    expert) against the TP1 engine and the training model; the MoE routing records of the two equal."""
    g, out = groups["actor_gen"], {}
    reqs = _requests(_prompts(3, seed=14), GREEDY) + _requests(_prompts(2, seed=15), TEMPERED, tag="s")
    ecfg = EngineConfig(num_blocks=64, block_size=4, max_tokens_per_step=24)
    for name, cfg in VARIANTS.items():
        plain = variant_model(name, local)
        gen = build_model(cfg, "lm", g.pg_collection, g.stage, seed=999)
        copy_into_tp_shards(gen, plain, g.tp.rank(), g.tp.size())
        tp2, routing2 = generate_recording_routing(Engine(gen, g, cfg, ecfg), reqs)
        tp1, routing1 = generate_recording_routing(Engine(plain, local, cfg, ecfg), reqs)
        out[f"{name}_tp2_equal"] = _tokens(tp2) == _tokens(tp1)
        out[f"{name}_tp2_logprob_err"] = max(abs(a - b) for x, y in zip(tp1, tp2)
                                             for a, b in zip(x.logprobs, y.logprobs))
        out[f"{name}_tp2_vs_training"] = max(logprob_err(plain, tp2[:3], local.tp),
                                             logprob_err(plain, tp2[3:], local.tp, TEMPERED.temperature))
        if cfg.is_moe:
            out[f"{name}_tp2_routing_equal"] = (routing1.keys() == routing2.keys() and all(
                torch.equal(routing1[k], routing2[k]) for k in routing1))
    return out


def run():
    rank = dist.get_rank()
    placement = Placement.from_plan(PLAN, dist.get_world_size())
    groups = build_task_groups(placement)
    local = local_groups()
    model = build_model(CFG, "lm", local.pg_collection, local.stage, seed=SEED)
    out = {"rank": rank}
    out.update(check_tp2(groups, placement, local))
    out.update(check_migration(model, local))
    out.update(check_episodes(groups, placement, local))
    out.update(check_variants_tp2(groups, local))
    if rank == 0:
        out.update(check_vs_training_model(model, local))
        out.update(check_vs_hf(local))
        out.update(check_variant("qwen3", local))
        out.update(check_variant("moe_norm", local))
    else:
        out.update(check_prefix_sharing(model, local))
        out.update(check_sampling_and_errors(model, local))
        out.update(check_bf16(local))
        out.update(check_weight_refresh(local))
        out.update(check_variant("moe_plain", local))
        out.update(check_moe_bf16(local))
    return out
