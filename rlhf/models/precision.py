"""Numeric precision of a job's models: fp32, or bf16/fp16 mixed precision with Megatron-LM's flags.

With ``bf16`` (or ``fp16``) every model of the job is built in that dtype:
the trained models' parameters and activations, the reference and reward
models, and actor_gen (so the engine's weights and KV cache). What stays
fp32, as in Megatron-LM and the RLHF peers:

* the main (master) parameters and Adam moments inside megatron's
  mixed-precision optimizer (``Float16OptimizerWithFloat16Params``, or the
  distributed optimizer's fp32 shards): each step updates the fp32 main
  copy and casts it into the model;
* the gradient buffer where ``accumulate_allreduce_grads_in_fp32`` (always
  for bf16, as Megatron-LM forces it; a choice for fp16): micro-batch
  gradients accumulate and are all-reduced in fp32;
* log-probabilities, entropies and values: computed in fp32 from the
  low-precision logits and value-head outputs (rlhf.models.logprobs);
* checkpoints: a trained model's saved weights are its fp32 main parameters,
  so a resumed run continues exactly.

``fp16`` scales the loss before backward: by ``loss_scale`` when given, else
dynamically (start ``initial_loss_scale``; a step whose gradients overflow is
skipped and the scale halved after ``hysteresis`` overflows; after
``loss_scale_window`` clean steps it doubles; never below ``min_loss_scale``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf.config import ConfigError, check_field_types

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class PrecisionConfig:
    """The job's precision (see the module docstring); the field names are Megatron-LM's flags."""

    bf16: bool = False
    fp16: bool = False
    loss_scale: float | None = None
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    accumulate_allreduce_grads_in_fp32: bool = False

    def __post_init__(self):
        check_field_types("precision", self)
        if self.bf16 and self.fp16:
            raise ConfigError("bf16 and fp16 exclude each other; choose one (or neither: fp32)", "precision.fp16")
        for name in ("loss_scale", "initial_loss_scale", "min_loss_scale"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name}={value} must be > 0", f"precision.{name}")
        if self.min_loss_scale > self.initial_loss_scale:
            raise ConfigError(f"min_loss_scale={self.min_loss_scale} exceeds initial_loss_scale="
                              f"{self.initial_loss_scale}", "precision.min_loss_scale")
        for name in ("loss_scale_window", "hysteresis"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1", f"precision.{name}")
        if self.loss_scale is not None and not self.fp16:
            raise ConfigError(f"loss_scale={self.loss_scale} scales fp16 losses only; add --fp16 or leave it out",
                              "precision.loss_scale")

    @property
    def name(self) -> str:
        """fp32, bf16 or fp16."""
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"

    @property
    def dtype(self) -> torch.dtype:
        """The dtype every model of the job is built in."""
        return DTYPES[self.name]

    @property
    def grads_in_fp32(self) -> bool:
        """Whether gradients accumulate and reduce in fp32 (fp32 models; bf16 always, as Megatron-LM)."""
        return self.name != "fp16" or self.accumulate_allreduce_grads_in_fp32
