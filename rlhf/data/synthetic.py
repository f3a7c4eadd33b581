"""The built-in synthetic task: seeded prompts and the rule-based gold reward.

This module owns the task that ``pretrain_rlhf.py`` trains with no files: a
prompt dataset made from a seed (usable wherever :class:`PromptDataset` is)
and :func:`gold_reward`, the rule the run is judged by.

Prompts
    BOS, then random upper-case words of ByteTokenizer bytes separated by
    single spaces, e.g. ``<s>QWF ZX MPLOR`` (lengths in tokens, BOS included,
    uniform in ``[min_length, max_length]``). Upper case keeps every prompt
    byte outside the gold rule's target set, so the score is a property of the
    response alone and a reward model need not tell prompt letters from
    response letters.

Gold reward
    The fraction of the response's tokens that are lower-case ASCII letters
    (ids 97..122), the response's EOS counted as a token::

        response          ids                 score
        []                                    0
        [EOS]             258                 0
        "ab" EOS          97 98 258           2/3
        "aB"              97 66               1/2
        "abcd"            97 98 99 100        1

    Why this rule: a near-uniform policy over the byte tokenizer's 259 ids (the
    tiny default's vocabulary) scores 26/259 ~= 0.10;
    the way up is to move probability mass onto 26 tokens, the easiest thing a
    policy can learn; every position of the response counts equally, so the
    policy is rewarded for letters over the whole response; and stopping early
    does not pay (an empty or EOS-only response scores 0, the EOS itself is a
    non-letter, so L letters then EOS score L/(L+1)).

Preference pairs (the reward model's training data)
    Two responses to one prompt, ordered by the gold rule (ties dropped). A
    response is ``R ~ U{1..max_length}`` tokens, each one from the rule's
    target set with a per-response probability ``q ~ U(0, 1)``, else from the
    other pool; each response draws from a random subset of each pool (1..all
    of its ids), so a policy that later piles its mass onto a few ids is still
    inside the training distribution, and the scores cover all of [0, 1], not
    only the 0.10 of an untrained policy. :func:`preference_pairs` gives token
    ids (the tiny default: the other pool is the model's whole vocabulary, the
    tokenizer's ids, and the last token is EOS with ``eos_probability``); :func:`preference_records`
    gives text records for files (the other pool is printable ASCII).
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from .prompts import Prompt
from .tokenizer import ByteTokenizer

__all__ = [
    "GOLD_TARGET_IDS",
    "TEXT_IDS",
    "SyntheticPromptConfig",
    "SyntheticPromptDataset",
    "gold_reward",
    "preference_pairs",
    "preference_records",
    "sample_responses",
]

GOLD_TARGET_IDS = tuple(range(ord("a"), ord("z") + 1))
_TARGETS = frozenset(GOLD_TARGET_IDS)
TEXT_IDS = tuple(range(32, 127))
"""Printable ASCII: the other pool of :func:`preference_records` (text answers)."""
_WORD_BYTES = np.arange(ord("A"), ord("Z") + 1)
_SPACE = ord(" ")


def gold_reward(prompts: list[list[int]], responses: list[list[int]]) -> list[float]:
    """One score in [0, 1] per sample: the fraction of lower-case letter ids in the response.

    ``prompts`` [N] and ``responses`` [N] are token id lists (a response may
    end with the EOS id, which counts as a non-letter token); the prompt does
    not enter the score. An empty response scores 0.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"gold_reward: {len(prompts)} prompts but {len(responses)} responses; "
                         "pass one prompt per response")
    return [sum(t in _TARGETS for t in r) / len(r) if r else 0.0 for r in responses]


def _config_error(name: str, value, constraint: str, fix: str) -> ValueError:
    return ValueError(f"SyntheticPromptConfig.{name}={value!r}: {constraint}; {fix}")


@dataclass(frozen=True)
class SyntheticPromptConfig:
    """How many prompts, from which seed, how long (tokens, BOS included)."""

    num_prompts: int = 1024
    seed: int = 0
    min_length: int = 4
    max_length: int = 16

    def __post_init__(self):
        for name in ("num_prompts", "seed", "min_length", "max_length"):
            if not isinstance(getattr(self, name), int):
                raise _config_error(name, getattr(self, name), "must be an int", "pass an integer")
        if self.num_prompts < 1:
            raise _config_error("num_prompts", self.num_prompts, "must be >= 1", "e.g. 1024")
        if self.seed < 0:
            raise _config_error("seed", self.seed, "must be >= 0", "e.g. 0")
        if self.min_length < 2:
            raise _config_error("min_length", self.min_length, "must be >= 2 (BOS + one byte)",
                                "e.g. 4")
        if self.max_length < self.min_length:
            raise _config_error("max_length", self.max_length,
                                f"must be >= min_length={self.min_length}",
                                "raise max_length or lower min_length")


def _prompt_bytes(rng: np.random.Generator, n: int) -> list[int]:
    """``n`` bytes of upper-case words (1..6 letters) separated by single spaces."""
    out: list[int] = []
    while len(out) < n:
        word = rng.choice(_WORD_BYTES, size=int(rng.integers(1, 7))).tolist()
        out += ([_SPACE] if out else []) + word
    out = out[:n]
    if out[-1] == _SPACE:  # the cut fell on a separator: end on a letter instead
        out[-1] = int(rng.choice(_WORD_BYTES))
    return out


def _fingerprint(prompts: Sequence[Prompt]) -> str:
    """sha256 over every prompt's token ids (the identity a resumed data position checks)."""
    digest = hashlib.sha256()
    for p in prompts:
        digest.update(array("q", p.token_ids).tobytes())
        digest.update(b"\xff")
    return digest.hexdigest()


class SyntheticPromptDataset(Sequence[Prompt]):
    """``config.num_prompts`` prompts drawn from ``config.seed``; same seed, same prompts.

    Has what :class:`PromptBatchIterator` reads: ``len()``, indexing to a
    :class:`Prompt` and ``fingerprint``. Prompt ``i`` has ``index=i`` and
    ``source="synthetic:<seed>:<i>"``.
    """

    Config = SyntheticPromptConfig

    def __init__(self, config: SyntheticPromptConfig = SyntheticPromptConfig()):
        self.config = config
        self.tokenizer = ByteTokenizer()  # the ids are bytes: no other tokenizer reads them
        rng = np.random.Generator(np.random.PCG64(config.seed))
        self._prompts = [self._make_prompt(rng, i) for i in range(config.num_prompts)]
        self.fingerprint = _fingerprint(self._prompts)

    def _make_prompt(self, rng: np.random.Generator, index: int) -> Prompt:
        length = int(rng.integers(self.config.min_length, self.config.max_length + 1))
        ids = [self.tokenizer.bos_id] + _prompt_bytes(rng, length - 1)
        return Prompt(index=index, token_ids=tuple(ids), text=self.tokenizer.decode(ids),
                      source=f"synthetic:{self.config.seed}:{index}")

    def __len__(self) -> int:
        return len(self._prompts)

    def __getitem__(self, i):
        return self._prompts[i]

    def __repr__(self) -> str:
        c = self.config
        return (f"SyntheticPromptDataset({len(self)} prompts, seed={c.seed}, "
                f"lengths {c.min_length}..{c.max_length})")


def _from_subsets(pool: torch.Tensor, n: int, width: int, gen: torch.Generator) -> torch.Tensor:
    """[n, width] ids of ``pool``, row i uniform over a random subset of 1..len(pool) of its ids."""
    perm = torch.rand(n, len(pool), generator=gen).argsort(dim=1)
    size = torch.randint(1, len(pool) + 1, (n, 1), generator=gen)
    pick = (torch.rand(n, width, generator=gen) * size).long()
    return pool[perm.gather(1, pick)]


def sample_responses(n: int, other_ids: Sequence[int], max_length: int, gen: torch.Generator,
                     eos_id: int | None = None, eos_probability: float = 0.0) -> list[list[int]]:
    """``n`` responses as the module docstring describes (id lists of 1..``max_length`` tokens, the
    last one ``eos_id`` with ``eos_probability``); deterministic in ``gen`` (a CPU generator)."""
    q = torch.rand(n, 1, generator=gen)
    target = torch.rand(n, max_length, generator=gen) < q
    ids = torch.where(target, _from_subsets(torch.tensor(GOLD_TARGET_IDS), n, max_length, gen),
                      _from_subsets(torch.tensor(list(other_ids)), n, max_length, gen))
    lengths = torch.randint(1, max_length + 1, (n,), generator=gen)
    if eos_id is not None:
        rows, ends = torch.arange(n), torch.rand(n, generator=gen) < eos_probability
        ids[rows, lengths - 1] = torch.where(ends, eos_id, ids[rows, lengths - 1])
    return [row[:r] for row, r in zip(ids.tolist(), lengths.tolist())]


def preference_pairs(prompts: Sequence[Sequence[int]], n: int, other_ids: Sequence[int], max_length: int,
                     gen: torch.Generator, eos_id: int | None = None,
                     eos_probability: float = 0.0) -> list[tuple[list[int], list[int], list[int]]]:
    """Up to ``n`` (prompt, chosen, rejected) id lists: two :func:`sample_responses` per pair, the
    one :func:`gold_reward` scores higher chosen; pairs it scores equal are dropped."""
    which = torch.randint(len(prompts), (n,), generator=gen).tolist()
    responses = sample_responses(2 * n, other_ids, max_length, gen, eos_id, eos_probability)
    scores = gold_reward([[]] * len(responses), responses)  # the rule ignores the prompt
    out = []
    for i, p in enumerate(which):
        a, b = scores[2 * i], scores[2 * i + 1]
        if a != b:
            chosen, rejected = (2 * i, 2 * i + 1) if a > b else (2 * i + 1, 2 * i)
            out.append((list(prompts[p]), responses[chosen], responses[rejected]))
    return out


def preference_records(n: int, seed: int, max_length: int = 32) -> list[dict]:
    """Up to ``n`` text records ``{"prompt", "chosen", "rejected"}`` for a preference file: the
    synthetic task's prompts (seed ``seed``, without the BOS the tokenizer adds back) and printable
    ASCII answers, ordered by the gold rule (which rlhf.data.PreferenceDataset does not see)."""
    tokenizer = ByteTokenizer()
    prompts = [p.token_ids for p in SyntheticPromptDataset(SyntheticPromptConfig(seed=seed))]
    pairs = preference_pairs(prompts, n, TEXT_IDS, max_length, torch.Generator().manual_seed(seed))
    return [{"prompt": tokenizer.decode(p), "chosen": tokenizer.decode(c), "rejected": tokenizer.decode(r)}
            for p, c, r in pairs]
