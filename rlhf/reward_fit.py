"""Fit a value-kind model to a reward function: the reward model of a task with a rule score.

This module owns the start-up fit of the built-in synthetic task (single
process, unsharded model): which sequences the reward model trains and is
checked on, how they are laid out, where they are scored, and the report.

Sequences
    A prompt drawn from the task's prompts, then a response whose tokens are
    each, independently, from the reward rule's target set with a per-sample
    probability ``q ~ U(0, 1)``, else uniform over the model's vocabulary;
    ``R ~ U{1..max_response_length}`` tokens, the last one replaced by EOS
    with probability ``eos_probability``. Each sample also draws its tokens
    from a random subset of each pool (1..all of its ids), so a policy that
    later piles its mass onto a few ids is still in the training distribution.
    Scores then cover [0, 1], not only the near-uniform start of training.

Layout (``rlhf/batch.py``'s convention) and where a sequence is scored
    prompt left-aligned, response right after it, pad to the right; the score
    is the value at the last response token (its EOS when it has one)::

        position    0   1   2   3   4   5   6
        tokens     p0  p1  p2  r0  r1  r2  pad      P = 3, R = 3
                                       ^ score = values[:, P + R - 1]
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from rlhf.models.gpt import stage_forward

__all__ = ["FitReport", "RewardFitConfig", "fit_reward_model", "pack_sequences",
           "sample_sequences", "score_sequences"]

RewardFn = Callable[[list[list[int]], list[list[int]]], list[float]]


def _config_error(name: str, value, constraint: str, fix: str) -> ValueError:
    return ValueError(f"RewardFitConfig.{name}={value!r}: {constraint}; {fix}")


@dataclass(frozen=True)
class RewardFitConfig:
    """Budget, optimiser and sequence shape of the fit (defaults: measured in docs/training.md)."""

    steps: int = 300
    lr: float = 3e-3
    batch_size: int = 64
    seed: int = 0
    max_response_length: int = 32
    eos_probability: float = 0.25
    eval_samples: int = 512

    def __post_init__(self):
        for name, low in (("steps", 1), ("batch_size", 2), ("seed", 0),
                          ("max_response_length", 1), ("eval_samples", 2)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise _config_error(name, value, f"must be an int >= {low}", "pass a larger int")
        if not self.lr > 0:
            raise _config_error("lr", self.lr, "must be > 0", "e.g. 3e-3")
        if not 0 <= self.eos_probability <= 1:
            raise _config_error("eos_probability", self.eos_probability, "must be in [0, 1]",
                                "e.g. 0.25")


@dataclass(frozen=True)
class FitReport:
    """What the fit did and how well the model ranks held-out sequences against the rule."""

    steps: int
    seconds: float  # wall clock of the training steps
    cpu_seconds: float  # this process's CPU time of the training steps
    final_loss: float  # MSE of the last step
    correlation: float  # Pearson r, model score vs rule, held-out sequences
    mae: float  # mean |model score - rule|, held-out sequences
    eval_samples: int

    def summary(self) -> str:
        """One line for the log."""
        return (f"reward model fit: {self.steps} steps in {self.seconds:.1f} s "
                f"({self.cpu_seconds:.1f} s CPU), final loss {self.final_loss:.4f}; held-out "
                f"({self.eval_samples} sequences): Pearson {self.correlation:.3f}, "
                f"MAE {self.mae:.3f}")


def _from_subsets(pool: torch.Tensor, n: int, width: int, gen: torch.Generator) -> torch.Tensor:
    """[n, width] ids of ``pool``, row i uniform over a random subset of 1..len(pool) ids."""
    perm = torch.rand(n, len(pool), generator=gen).argsort(dim=1)
    size = torch.randint(1, len(pool) + 1, (n, 1), generator=gen)
    pick = (torch.rand(n, width, generator=gen) * size).long()
    return pool[perm.gather(1, pick)]


def sample_sequences(prompts: Sequence[Sequence[int]], n: int, target_ids: Sequence[int],
                     vocab_size: int, eos_id: int, config: RewardFitConfig,
                     gen: torch.Generator) -> tuple[list[list[int]], list[list[int]]]:
    """``n`` prompts and ``n`` responses (id lists, R_i in 1..max_response_length), as the
    module docstring describes; deterministic in ``gen`` (a CPU generator)."""
    width = config.max_response_length
    q = torch.rand(n, 1, generator=gen)
    target = torch.rand(n, width, generator=gen) < q
    ids = torch.where(target, _from_subsets(torch.tensor(list(target_ids)), n, width, gen),
                      _from_subsets(torch.arange(vocab_size), n, width, gen))
    lengths = torch.randint(1, width + 1, (n,), generator=gen)
    rows, last = torch.arange(n), lengths - 1
    ends_in_eos = torch.rand(n, generator=gen) < config.eos_probability
    ids[rows, last] = torch.where(ends_in_eos, eos_id, ids[rows, last])
    which = torch.randint(len(prompts), (n,), generator=gen)
    responses = [row[:r] for row, r in zip(ids.tolist(), lengths.tolist())]
    return [list(prompts[i]) for i in which.tolist()], responses


def pack_sequences(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                   pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [N, T] int64, score_positions [N] int64)``: prompt + response + pad, and P + R - 1."""
    rows = [list(p) + list(r) for p, r in zip(prompts, responses)]
    width = max(len(row) for row in rows)
    tokens = torch.tensor([row + [pad_id] * (width - len(row)) for row in rows], dtype=torch.int64)
    return tokens, torch.tensor([len(row) - 1 for row in rows], dtype=torch.int64)


def score_sequences(model: torch.nn.Module, tokens: torch.Tensor, score_positions: torch.Tensor) -> torch.Tensor:
    """[N] value of an unsharded value-kind model at each sequence's score position."""
    values = stage_forward(model, tokens)  # [N, T]
    return values.gather(1, score_positions[:, None]).squeeze(1)


@dataclass(frozen=True)
class _Sequences:
    """Fresh scored sequences for one fit: what to sample and how to lay it out."""

    reward_fn: RewardFn
    prompts: Sequence[Sequence[int]]
    target_ids: Sequence[int]
    eos_id: int
    pad_id: int
    vocab_size: int
    config: RewardFitConfig

    def batch(self, n: int, gen: torch.Generator, device: torch.device):
        """tokens [n, T], score positions [n] and rule scores [n] (float32), on ``device``."""
        p, r = sample_sequences(self.prompts, n, self.target_ids, self.vocab_size, self.eos_id,
                                self.config, gen)
        tokens, positions = pack_sequences(p, r, self.pad_id)
        gold = torch.tensor(self.reward_fn(p, r), dtype=torch.float32)
        return tokens.to(device), positions.to(device), gold.to(device)


def _evaluate(model, batch) -> tuple[float, float]:
    """Pearson r and MAE of the model's scores against the rule on one batch."""
    tokens, positions, gold = batch
    with torch.no_grad():
        score = score_sequences(model, tokens, positions).float()
    r = torch.corrcoef(torch.stack([score, gold]))[0, 1]
    # .item(): two numbers for the report, once per fit
    return float(r.item()), float((score - gold).abs().mean().item())


def fit_reward_model(model: torch.nn.Module, reward_fn: RewardFn, prompts: Sequence[Sequence[int]],
                     config: RewardFitConfig = RewardFitConfig(), *, target_ids: Sequence[int],
                     eos_id: int, pad_id: int) -> FitReport:
    """Train ``model`` (an unsharded value-kind GPTModel) so its score regresses ``reward_fn``.

    ``prompts``: the task's prompt id lists; ``target_ids``: the ids the rule
    rewards (for the synthetic task ``rlhf.data.synthetic.GOLD_TARGET_IDS``);
    ``eos_id`` / ``pad_id``: the tokenizer's. Adam, MSE loss on the score
    position, ``config.steps`` fresh batches, learning rate decayed by a
    cosine to 0. Deterministic in ``config.seed`` and the model's initial
    weights: the held-out sequences are the seed's first draws, the training
    batches the ones after them.
    """
    if not prompts:
        raise ValueError("fit_reward_model: no prompts; pass the task's prompt id lists")
    sequences = _Sequences(reward_fn, prompts, target_ids, eos_id, pad_id, model.vocab_size, config)
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(config.seed)
    held_out = sequences.batch(config.eval_samples, gen, device)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / config.steps)))
    model.train()
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(config.steps):
        tokens, positions, gold = sequences.batch(config.batch_size, gen, device)
        loss = torch.nn.functional.mse_loss(score_sequences(model, tokens, positions), gold)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    model.eval()
    correlation, mae = _evaluate(model, held_out)
    return FitReport(steps=config.steps, seconds=seconds, cpu_seconds=cpu_seconds,
                     final_loss=float(loss.item()),  # .item(): once, for the report
                     correlation=correlation, mae=mae, eval_samples=config.eval_samples)
