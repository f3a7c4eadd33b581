"""4-rank scenario for the executor: actor and critic fused on ranks 0-3.

For each placement given (e.g. actor pp4 down + critic pp4 up with
reverse_pp), one PPO mini-batch step (4 micro-batches of 2 samples, SGD
through megatron's DDP and optimizer, ``rlhf.optim.ModelOptimizer``) through
the executor with each schedule and tag mode given, compared with unsharded
single-process training (``torch.optim.SGD``) of the same weights on the same
micro-batches and with the config's first (serial) run.
Also: mismatched and cyclic schedules are refused with no p2p or collective
call made.
"""

import torch
import torch.distributed as dist

from rlhf.algorithms import policy_loss, value_loss
from rlhf.batch import Batch
from rlhf.models import ModelConfig
from rlhf.models.gpt import build_model, stage_forward
from rlhf.models.logprobs import vocab_parallel_log_probs
from rlhf.optim import ModelOptimizer, OptimizerConfig
from rlhf.parallel import Placement
from rlhf.parallel.groups import build_task_groups, local_groups
from rlhf.parallel.reshard import gather_tp_full_weights, load_full_weights
from rlhf.pipeline.executor import ModelRuntime, run_step
from rlhf.schedule.io import schedule_from_dict
from rlhf.schedule.schedule import ScheduleError

CFG = ModelConfig(num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                  num_kv_heads=2, vocab_size=64, max_seq_len=16)
MODELS = {"actor": ("actor_train", "lm", 11), "critic": ("critic_train", "value", 12)}
MICROBATCHES, MB_SIZE, SEQ, LR = 4, 2, 8, 0.5
SGD = OptimizerConfig(optimizer="sgd", lr=LR, clip_grad=0.0)


def actor_loss(logits, mb: Batch, groups, packed=None):
    logprobs = mb.response_from_positions(vocab_parallel_log_probs(logits[:, :-1], mb.tokens[:, 1:], groups.tp))
    return policy_loss(logprobs, mb.old_logprobs, mb.advantages, mb.response_mask)[0]


def critic_loss(values, mb: Batch, groups, packed=None):
    return value_loss(mb.response_from_positions(values), mb.values, mb.returns, mb.response_mask)[0]


LOSSES = {"actor": actor_loss, "critic": critic_loss}


def make_microbatches(seed: int = 0) -> list:
    """Fixed synthetic PPO micro-batches: one-token prompts with SEQ-1 response tokens
    (the first sample of each micro-batch stops 2 tokens early), old log-probs,
    old values, advantages, returns; the batch split into MICROBATCHES parts."""
    g = torch.Generator().manual_seed(seed)
    n, shape = MICROBATCHES * MB_SIZE, (MICROBATCHES * MB_SIZE, SEQ - 1)
    response_lengths = torch.full((n,), SEQ - 1)
    response_lengths[::MB_SIZE] = SEQ - 3
    tokens = torch.randint(0, CFG.vocab_size, (n, SEQ), generator=g)
    fields = {"old_logprobs": -4.2 + 0.1 * torch.randn(shape, generator=g), "advantages": torch.randn(shape, generator=g),
              "values": 0.05 * torch.randn(shape, generator=g), "returns": torch.randn(shape, generator=g)}
    mask = (torch.arange(SEQ - 1) < response_lengths.unsqueeze(1)).float()
    batch = Batch(tokens=tokens, pad_id=0, prompt_lengths=torch.ones(n, dtype=torch.int64),
                  response_lengths=response_lengths, prompt_ids=torch.arange(n), sample_indices=torch.zeros(n, dtype=torch.int64),
                  finish_reasons=("length",) * n, **{k: v * mask for k, v in fields.items()})
    return batch.split(MICROBATCHES)


def reference_step(name: str, mbs: list) -> tuple:
    """Unsharded single-process training: (weights before, weights after) by global name."""
    task, kind, seed = MODELS[name]
    local = local_groups()
    model = build_model(CFG, kind, local.pg_collection, local.stage, seed=seed)
    before = gather_tp_full_weights(model, local)
    total = 0.0
    for mb in mbs:
        loss = LOSSES[name](stage_forward(model, mb.tokens), mb, local) / len(mbs)
        loss.backward()
        total += loss.item()  # a scalar for the report, once per micro-batch
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return before, gather_tp_full_weights(model, local), total


def make_runtimes(groups: dict, full: dict, mbs: list) -> dict:
    """Stage modules loaded with the reference weights; each DP replica gets its
    contiguous share of the micro-batches."""
    out = {}
    for name, (task, kind, seed) in MODELS.items():
        g = groups[task]
        module = build_model(CFG, kind, g.pg_collection, g.stage, seed=seed + 100)
        load_full_weights(module, g, full[name])
        share = len(mbs) // g.mesh.strategy.dp
        mine = mbs[g.coord.dp * share:(g.coord.dp + 1) * share]
        out[name] = ModelRuntime(name, g.mesh, mine, module, g, ModelOptimizer(module, g, SGD),
                                 LOSSES[name], CFG.hidden_size)
    return out


def _max_err(mine: dict, ref: dict) -> float:
    return max((mine[k] - ref[k]).abs().max().item() for k in mine)


class _CommCounter:
    """Counts p2p and collective calls made while active (refusal happens before any)."""

    NAMES = ("isend", "irecv", "send", "recv", "barrier", "all_reduce", "all_gather_object")

    def __enter__(self):
        self.calls, self.saved = 0, {n: getattr(dist, n) for n in self.NAMES}

        def wrap(fn):
            def counted(*a, **k):
                self.calls += 1
                return fn(*a, **k)
            return counted
        for n, fn in self.saved.items():
            setattr(dist, n, wrap(fn))
        return self

    def __exit__(self, *exc):
        for n, fn in self.saved.items():
            setattr(dist, n, fn)


def _refusal(sched_dict: dict, runtimes: dict) -> dict:
    with _CommCounter() as counter:
        try:
            run_step(schedule_from_dict(sched_dict), runtimes)
            message = None
        except ScheduleError as exc:
            message = str(exc)
    return {"message": message, "comm_calls": counter.calls}


def _train(cfg: str, runs: dict, groups: dict, refs: dict, mbs: list, results: dict,
           trace_path: str | None) -> None:
    """One step per run ``{label: (schedule dict, tags)}``; parameter errors vs the
    reference and vs the first run (serial 1F1B); ``trace_path`` from "fused/per_message"."""
    full = {name: ref[0] for name, ref in refs.items()}
    after = {}
    for label, (d, tags) in runs.items():
        runtimes = make_runtimes(groups, full, mbs)
        traced = label == "fused/per_message"
        res = run_step(schedule_from_dict(d), runtimes, trace_path=trace_path if traced else None, tags=tags)
        if traced:
            results["events"][cfg] = len(res.timeline.events)
        after[label] = {n: gather_tp_full_weights(rt.module, rt.groups) for n, rt in runtimes.items()}
        results["losses"][cfg, label] = {n: v.item() for n, v in res.losses.items()}
        for name, (before, ref_after, _) in refs.items():
            mine = after[label][name]
            results["err"][cfg, label, name] = _max_err(mine, ref_after)
            results["moved"][cfg, label, name] = max((mine[k] - before[k]).abs().max().item() for k in mine)
            results["vs_serial"][cfg, label, name] = _max_err(mine, after[next(iter(runs))][name])


def run(configs: dict, refused: dict, trace_path: str) -> dict:
    """``configs``: {name: {"plan": placement plan, "runs": {label: (schedule dict, tags)}}}
    (the first run is serial 1F1B); ``refused``: {label: schedule dict} refused under the
    first config's placement; the first config's "fused/per_message" run writes ``trace_path``."""
    world = dist.get_world_size()
    all_groups = [build_task_groups(Placement.from_plan(spec["plan"], world)) for spec in configs.values()]
    mbs = make_microbatches()
    refs = {name: reference_step(name, mbs) for name in MODELS}
    results = {"rank": dist.get_rank(), "refused": {}, "err": {}, "moved": {}, "losses": {},
               "vs_serial": {}, "events": {}, "ref_losses": {name: ref[2] for name, ref in refs.items()}}
    for i, ((cfg, spec), groups) in enumerate(zip(configs.items(), all_groups)):
        if i == 0:
            full = {name: ref[0] for name, ref in refs.items()}
            for label, d in refused.items():
                results["refused"][label] = _refusal(d, make_runtimes(groups, full, mbs))
        _train(cfg, spec["runs"], groups, refs, mbs, results, trace_path if i == 0 else None)
    return results
