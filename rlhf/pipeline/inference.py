"""One inference task's forward passes over a batch: a (task, Batch) in, a Batch of outputs out.

The reference (``ref_logprobs``), the reward model (``scores``), the critic
(``values``) and, with ``recompute_logprobs``, actor_train (``old_logprobs``)
each add one field to the batch (rlhf.tasks.INFERENCE_FIELDS). A DP replica
runs its samples micro-batched through its pipeline; the last stage's TP rank
0 returns them as a host Batch of those samples holding just that field, so
the outputs travel between ranks as batches and are put back by sample
(``Batch.with_fields_from``). The PPO trainer's inference phase and
inter-stage fusion's early inference (rlhf/fusion/inter_stage.py) both run
tasks here.
"""

from __future__ import annotations

import torch

from rlhf.batch import OPTIONAL_FIELDS, Batch
from rlhf.memory import StageMemory
from rlhf.models import moe
from rlhf.models.gpt import eval_mode
from rlhf.models.logprobs import vocab_parallel_logprobs_entropy
from rlhf.models.packing import PackedLayout, unpacked
from rlhf.pipeline.microbatch import pipeline_forward
from rlhf.tasks import INFERENCE_FIELDS, task_kind


def response_logprobs(logits: torch.Tensor, mb: Batch, g, temperature: float = 1.0,
                      packed: PackedLayout | None = None, entropy: bool = True
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[b, R] log-probs of the response tokens and [b, R] entropies of the distributions they were drawn from
    (None without ``entropy``: inference needs none), from a micro-batch's vocab-parallel logits ([b, T, V/tp] padded, [1, t, V/tp] packed) divided by
    ``temperature``: the distribution the engine sampled from, before top-k / top-p (as the peers). Both in
    one chunked pass over the vocabulary (rlhf.models.logprobs), differentiable; each position predicts the
    next token of its sample (a sample's last position predicts nothing a response field reads)."""
    targets = torch.roll(mb.tokens, -1, dims=1) if packed is None else packed.next_tokens(mb.tokens)
    outputs = vocab_parallel_logprobs_entropy(logits, targets, g.tp, temperature, entropy)
    return tuple(None if x is None else mb.response_from_positions(unpacked(x, packed)) for x in outputs)


def task_output(task: str, out: torch.Tensor, mb: Batch, g, temperature: float = 1.0,
                packed: PackedLayout | None = None) -> torch.Tensor:
    """What ``task``'s last stage makes of a micro-batch's model output (``packed``: it ran packed): [b, R]
    response log-probs at ``temperature`` (a language model), [b] scores (the reward model's value at each
    sample's last token, prompt + response) or [b, R] values (the critic's, per response token)."""
    if task_kind(task) == "lm":
        return response_logprobs(out, mb, g, temperature, packed, entropy=False)[0]
    values = unpacked(out, packed)
    if INFERENCE_FIELDS[task] == "scores":
        return mb.last_token_values(values).float()
    return mb.response_from_positions(values.float())


class InferenceRunner:
    """This rank's inference tasks: ``models``/``groups`` by task, ``memory`` (offloaded models are
    loaded for their pass, and what a pass holds is noted), ``micro_batch_size`` samples per pass (or
    with ``max_tokens`` passes of packed samples: Batch.micro_batches), and the sampling ``temperature``
    the log-probs are taken at (the engine's, 1 when greedy). A mixture-of-experts actor's old log-prob pass
    (actor_train) compares its routing with the samples' ``routing``, or with ``routing_replay`` uses it
    (rlhf/models/moe.py)."""

    def __init__(self, models: dict, groups: dict, memory: StageMemory, micro_batch_size: int,
                 temperature: float = 1.0, max_tokens: int | None = None, routing_replay: bool = False):
        self.models, self.groups, self.memory, self.micro_batch_size = models, groups, memory, micro_batch_size
        self.temperature, self.max_tokens, self.routing_replay = temperature, max_tokens, routing_replay

    def infer(self, task: str, part: Batch, field: str | None = None) -> Batch | None:
        """``task``'s outputs for the samples of ``part``, which this rank's replica runs (collective over
        it): on the last stage's TP rank 0, ``part`` on the host with ``field`` (None:
        ``INFERENCE_FIELDS[task]``) set and no other optional field; None on the replica's other ranks.
        The model runs in eval mode (dropout, e.g. LoRA's, off: the log-probs are the policy's)."""
        g, model = self.groups[task], self.models[task]
        outputs = []
        with self.memory.on_device(task), eval_mode(model):
            for mb in part.micro_batches(self.micro_batch_size, self.max_tokens):
                packed = None if self.max_tokens is None else PackedLayout.of(mb)
                routing = mb.routing if task == "actor_train" else None
                with moe.replayed(model, routing, self.routing_replay, packed):
                    out = pipeline_forward(model, g, mb.tokens, packed)
                if out is not None:  # kept where it was computed: no host wait between micro-batches
                    outputs.append(task_output(task, out, mb, g, self.temperature, packed))
            self.memory.note("inference")
        if not outputs or g.tp_rank != 0:
            return None
        bare = part.with_fields(**dict.fromkeys(OPTIONAL_FIELDS)).to("cpu")  # the samples' identity and tokens
        return bare.with_fields(**{field or INFERENCE_FIELDS[task]: torch.cat(outputs).cpu()})  # one transfer
