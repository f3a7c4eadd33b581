"""Fusion scenarios; each returns plain values, the test modules assert.

`run` (2 ranks, transport): rank 0 sends five samples to rank 1, three of them in messages rank 1 must
refuse (cut short; another version; invalid sampling params). `runtime_run` (4 ranks, generation-side
runtime): the same long-tailed requests unfused and fused (R = 0, 0.3, 1; K/V and tokens only) with 4
instances and with 2 TP2 instances.
"""

import dataclasses
import struct

import torch
import torch.distributed as dist

from rlhf.engine import MigratedSequence, SamplingParams
from rlhf.fusion.transport import (VERSION, MigrationFormatError, MigrationRefused, encode_sequence, recv_sequence,
                                   send_encoded, send_sequence)
from rlhf.parallel.exchange import gather_to_all


def sample(index: int, with_kv: bool) -> MigratedSequence:
    """A sample with distinct tokens, log-probs and (optionally) K/V with their routing record
    (5 positions, 2 layers, top-3 of 60 experts)."""
    g = torch.Generator().manual_seed(index)
    tokens = torch.randint(0, 1000, (7 + index,), generator=g).tolist()
    kv = torch.randn(2, 2, 5, 2, 4, generator=g, dtype=torch.float32) if with_kv else None
    routing = torch.randint(0, 60, (5, 2, 3), generator=g).to(torch.int16) if with_kv else None
    params = SamplingParams(max_new_tokens=20, temperature=0.7, top_p=0.9, seed=index, stop_token_ids=(2, 5))
    return MigratedSequence(f"req-{index}", index, 4, tokens, torch.randn(len(tokens) - 4, generator=g).tolist(),
                            params, 5 if with_kv else 0, kv, routing=routing)


def other_version(state) -> bytes:
    """``state`` encoded, its version field set to the previous version's."""
    data = bytearray(encode_sequence(state))
    struct.pack_into("<q", data, 8, VERSION - 1)  # the version field follows the 8-byte magic
    return bytes(data)


SENT = [("ok", sample(0, True)), ("cut", sample(1, True)), ("version", sample(2, False)), ("ok", sample(3, False))]


def run():
    if dist.get_rank() == 0:
        kept = []
        for kind, state in SENT:
            if kind == "ok":
                send_sequence(state, dst=1)
                continue
            data = encode_sequence(state)[:-3] if kind == "cut" else other_version(state)
            if not send_encoded(data, state.kv, dst=1, routing=state.routing):
                kept.append(state.request_id)  # refused: the sender still holds the sample
        bad = sample(4, False)
        object.__setattr__(bad.params, "temperature", -1.0)  # encodes, but no valid SamplingParams on receipt
        try:
            send_sequence(bad, dst=1)
            kept.append("not refused")
        except MigrationRefused as e:
            kept.append(str(e))
        return {"kept": kept}
    received, errors = [], []
    for _ in range(len(SENT) + 1):
        try:
            received.append(recv_sequence(src=0))
        except MigrationFormatError as e:
            errors.append((e.request_id, e.sample_index, str(e)))
    return {"received": [plain(s) for s in received], "errors": errors}


def plain(state: MigratedSequence) -> dict:
    """The fields of ``state`` with tensors as numpy arrays (results cross a process boundary)."""
    return {f.name: (v.numpy() if isinstance(v, torch.Tensor) else v)
            for f in dataclasses.fields(state) for v in [getattr(state, f.name)]}


# --- the generation-side runtime on 4 ranks ---------------------------------------------------------------------

PLANS = {"4 instances": {"ranks": "0-3", "dp": 4}, "2 instances (tp2)": {"ranks": "0-3", "dp": 2, "tp": 2}}
RUNS = [("R=0", 0.0, True), ("R=0.3 kv", 0.3, True), ("R=0.3 tokens", 0.3, False), ("R=1 kv", 1.0, True),
        ("R=1 tokens", 1.0, False)]
CHECK_EVERY = 3


LENGTHS = (4, 6, 30, 3, 5, 24, 2, 7)
"""max_new_tokens per request (no stop token): two long ones, on different instances with 4 and with 2."""


def _requests():
    """8 prompts x 2 samples of LENGTHS tokens; odd requests sampled (their draws must continue exactly)."""
    from rlhf.engine import Request

    g = torch.Generator().manual_seed(3)
    return [Request(str(i), torch.randint(0, 256, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g)
                    .tolist(), SamplingParams(max_new_tokens=n, temperature=0.9 if i % 2 else 0.0, top_k=50, seed=i,
                                              n=2))
            for i, n in enumerate(LENGTHS)]


def _all_samples(results, groups) -> list:
    """Every instance's finished samples (from its TP rank 0), on every rank."""
    mine = [(s.request_id, s.sample_index, s.tokens, s.logprobs) for s in results] if groups.tp_rank == 0 else []
    return gather_to_all(mine)


def runtime_run():
    from rlhf.engine import Engine, EngineConfig
    from rlhf.fusion.runtime import MigrationConfig, fused_generate
    from rlhf.models import ModelConfig
    from rlhf.models.gpt import build_model
    from rlhf.parallel import Placement
    from rlhf.parallel.groups import build_task_groups
    from rlhf.tasks import TASKS

    cfg = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_kv_heads=2,
                      vocab_size=256, max_seq_len=96)
    requests, out = _requests(), {}
    for label, entry in PLANS.items():
        plan = {task: None for task in TASKS} | {"actor_gen": entry}
        g = build_task_groups(Placement.from_plan(plan, dist.get_world_size()))["actor_gen"]
        model = build_model(cfg, "lm", g.pg_collection, g.stage, seed=11)
        mine = [r for i, r in enumerate(requests) if i % g.mesh.strategy.dp == g.coord.dp]

        def engine():
            return Engine(model, g, cfg, EngineConfig(num_blocks=512, block_size=4))
        runs = {"unfused": (_all_samples(engine().generate(mine), g), None)}
        for name, threshold, kv in RUNS:
            fused = fused_generate(engine(), mine, g, MigrationConfig(threshold, kv, CHECK_EVERY, b_sat=16))
            stats = dataclasses.replace(fused, samples=[])
            runs[name] = (_all_samples(fused.samples, g), gather_to_all([stats]))
        out[label] = runs
    return out
