"""One-rank scenario for the synthetic task: the reward-model fit (see test_synthetic_task.py).

Fits a tiny-critic value model to the gold rule on a reduced budget, checks
the report against an independent recomputation, the score position against
unpadded single-sequence forwards, and that a fit is a function of its seeds.
"""

import dataclasses

import numpy as np
import torch

from rlhf.data.synthetic import GOLD_TARGET_IDS, SyntheticPromptConfig, SyntheticPromptDataset, gold_reward
from rlhf.data.tokenizer import ByteTokenizer
from rlhf.models import preset
from rlhf.models.gpt import build_model, stage_forward
from rlhf.parallel import Placement
from rlhf.parallel.groups import build_task_groups, local_groups
from rlhf.reward_fit import RewardFitConfig, fit_reward_model, pack_sequences, sample_sequences, score_sequences

# A reduced budget (~2.5 s on one core) that still clears correlation 0.9 with a margin.
FIT = RewardFitConfig(steps=120, lr=5e-3, batch_size=32, eval_samples=256)
TINY_FIT = RewardFitConfig(steps=3, batch_size=4, eval_samples=8)
MODEL_SEED = 5


def _fit(local, prompts, config, model_seed=MODEL_SEED):
    model = build_model(preset("tiny-critic"), "value", local.pg_collection, local.stage, seed=model_seed)
    report = fit_reward_model(model, gold_reward, prompts, config, target_ids=GOLD_TARGET_IDS,
                              eos_id=ByteTokenizer.EOS, pad_id=ByteTokenizer.PAD)
    return model, report


def _independent_check(model, prompts) -> dict:
    """Pearson r / MAE on fresh sequences, computed with numpy, and per-sequence forwards."""
    p, r = sample_sequences(prompts, 256, GOLD_TARGET_IDS, 512, ByteTokenizer.EOS, FIT,
                            torch.Generator().manual_seed(1234))
    tokens, positions = pack_sequences(p, r, ByteTokenizer.PAD)
    with torch.no_grad():
        scores = score_sequences(model, tokens, positions).numpy()
        singles = [stage_forward(model, torch.tensor([pi + ri]))[0, -1].item() for pi, ri in zip(p[:8], r[:8])]
    gold = np.array(gold_reward(p, r))
    return {"corr": float(np.corrcoef(scores, gold)[0, 1]), "mae": float(np.abs(scores - gold).mean()),
            "single_err": float(np.abs(scores[:8] - np.array(singles)).max())}


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return max((sa[k] - sb[k]).abs().max().item() for k in sa if torch.is_tensor(sa[k]))


def run() -> dict:
    build_task_groups(Placement.from_plan({}, 1))
    local = local_groups()
    prompts = [p.token_ids for p in SyntheticPromptDataset(SyntheticPromptConfig(num_prompts=64))]
    model, report = _fit(local, prompts, FIT)
    first, _ = _fit(local, prompts, TINY_FIT)
    again, _ = _fit(local, prompts, TINY_FIT)
    other, _ = _fit(local, prompts, dataclasses.replace(TINY_FIT, seed=1))
    return {"report": dataclasses.asdict(report), "check": _independent_check(model, prompts),
            "rerun_diff": _max_diff(first, again), "other_seed_diff": _max_diff(first, other)}
