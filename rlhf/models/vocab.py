"""Vocabulary padding: embedding and output-layer rows past the vocabulary, so any tp can split them.

megatron gives every TP rank an equal, contiguous slice of the vocabulary, so
the number of rows must be a multiple of tp. A model whose ``vocab_size`` is
not is built with ``padded`` rows (Megatron-LM's ``--make-vocab-size-divisible-by``; the size is
``rlhf.models.config.padded_vocab_size``, torch-free so the planner counts the same rows)::

    ids:   0 ............. vocab_size-1 | vocab_size .. padded-1
           real tokens                  | padding: zero rows, logits -inf
    tp=2:  [ rank 0 slice       ][ rank 1 slice        ]

Padded rows never leave the model: full tensors (checkpoints, HF export,
``load_full_weights`` input) have ``vocab_size`` rows, padded with zeros when
a model is filled and cut when it is saved. Padded logits are -inf, the same
in training (``rlhf.models.gpt.stage_forward``) and in the engine's sampling,
so no padded id is ever drawn and both sides normalise over the same ids.
"""

from __future__ import annotations

import torch

VOCAB_PARAMETERS = ("embedding.word_embeddings.weight", "output_layer.weight")
"""Global names of the parameters with one row per vocabulary id (an LM's; a value head has one row)."""


def mask_vocab_padding(logits: torch.Tensor, vocab_size: int, start: int = 0) -> torch.Tensor:
    """``logits`` [..., n] of ids ``start .. start+n-1`` with the ids >= ``vocab_size`` set to -inf.

    Returns ``logits`` itself when the slice holds no padding (no copy).
    """
    real = vocab_size - start
    if real >= logits.shape[-1]:
        return logits
    padding = torch.arange(logits.shape[-1], device=logits.device) >= real
    return logits.masked_fill(padding, float("-inf"))


def fit_vocab_rows(name: str, full: torch.Tensor, rows: int) -> torch.Tensor:
    """Full tensor ``full`` of global parameter ``name`` with ``rows`` rows: zero rows appended to a
    vocabulary parameter that has fewer (padding); any other tensor is returned as is."""
    if name not in VOCAB_PARAMETERS or full.shape[0] >= rows:
        return full
    return torch.cat([full, full.new_zeros(rows - full.shape[0], *full.shape[1:])])


def drop_vocab_padding(name: str, full: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Full tensor ``full`` of global parameter ``name`` without its padded rows (ids >= ``vocab_size``)."""
    if name not in VOCAB_PARAMETERS or full.shape[0] <= vocab_size:
        return full
    return full[:vocab_size]
