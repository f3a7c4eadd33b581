"""Decode steps at fixed shapes, so that a GPU can replay each, sampling included, as one CUDA graph
(``EngineConfig.cuda_graphs``).

A step whose every sequence decodes one token and samples runs padded to a bucket, the next power of two
at or above its rows. Its inputs are copied into buffers made once per bucket: token ids, positions, KV
slots, block tables at the model's full width (``max_model_len`` / ``block_size`` blocks), context
lengths, and the rows' sampling inputs (`rlhf.engine.sampler.SampleInputs`: keys, counters, temperatures,
top-k, top-p, which rows are greedy). Padded rows decode token 0 at position 0 into a scratch block that
no sequence owns (the cache has one block more than the pool) and sample at temperature 1 without a
filter; their tokens are dropped. Every tensor the step reads is then one of these buffers and every shape
is the bucket's, so `rlhf.platform.capture_graph` records forward and sampling as one function returning
(tokens, log-probs), once per bucket and `SamplePlan` (the passes the rows' settings need: mixed settings
are one plan, recorded like any other), and replays it for every later step of that size and plan,
without launching its kernels one by one. Without a GPU the same padded step runs eagerly: the CPU tests
compare it with the unpadded step. Prefill steps, and steps whose sequences do not all sample, run
unpadded. A MoE model never comes here (`TPDecoder` drops the flag): its tokens per expert change every
step.
"""

from __future__ import annotations

import torch

from rlhf import platform
from rlhf.engine.attention import AttentionMeta
from rlhf.engine.sampler import SampleInputs, SamplePlan, sample


class StaticDecode:
    """The decode steps of one `TPDecoder`, by bucket: its buffers and its (captured) forward and sampling."""

    def __init__(self, decoder, scratch_block: int, block_size: int, max_blocks: int):
        self.decoder, self.scratch = decoder, scratch_block
        self.block_size, self.max_blocks = block_size, max_blocks
        self.buckets: dict[int, tuple] = {}  # rows -> (its StepInputs of buffers, its sampling buffers)
        self.graphs: dict[tuple[int, SamplePlan], object] = {}  # (rows, plan) -> the function of the step
        self.steps = 0  # decode steps run here

    @staticmethod
    def applies(inp) -> bool:
        """Whether ``inp`` (StepInputs) is a step the static path runs: every row decodes and samples."""
        return not inp.attn.prefill_rows and len(inp.logits_rows) == len(inp.attn.decode_rows)

    @staticmethod
    def bucket(rows: int) -> int:
        """The padded batch size of a step of ``rows`` rows: the next power of two."""
        return 1 << (rows - 1).bit_length()

    def run(self, inp, sampling: SampleInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [rows], log-probs [rows]) of a decode step (`applies`) sampled per ``sampling``, computed at
        its bucket's shapes."""
        rows = len(inp.attn.decode_rows)
        size = self.bucket(rows)
        if size not in self.buckets:
            step = type(inp)(*self._buffers(size), copies=[])  # a StepInputs (rlhf/engine/decoder.py)
            self.buckets[size] = step, self._sampling_buffers(size, sampling)
        step, (ints, floats) = self.buckets[size]
        self._fill(step, inp, rows)
        for buffer, value, pad in ((ints, sampling.ints, 0), (floats, sampling.floats, 1.0)):  # SampleInputs' padding
            buffer[:, :rows].copy_(value)
            buffer[:, rows:].fill_(pad)
        key = (size, sampling.plan)
        if key not in self.graphs:  # recorded on this step's inputs: its warm-up runs write the same K/V
            buffers = SampleInputs(ints, floats, sampling.plan)
            self.graphs[key] = platform.capture_graph(lambda: sample(self.decoder.logits(step), buffers))
        tokens, logprobs = self.graphs[key]()
        self.steps += 1
        return tokens[:rows], logprobs[:rows]

    def forget(self) -> None:
        """Drop every bucket's buffers and graphs. A graph replays the addresses it recorded: call this when
        the weights' or the KV cache's storage is freed or moved (the next steps record new graphs)."""
        self.buckets.clear()
        self.graphs.clear()

    def _buffers(self, size: int):
        """(input_ids, positions, slots, logits_rows, AttentionMeta) of a bucket, every row a padded one."""
        dev, width = self.decoder.device, self.max_blocks
        rows = torch.arange(size, device=dev)
        meta = AttentionMeta(list(range(size)), [1] * size, [width * self.block_size] * size,
                             block_tables=torch.full((size, width), self.scratch, dtype=torch.int32, device=dev),
                             decode_rows=list(range(size)), prefill_rows=[],
                             decode_ctx=torch.ones(size, dtype=torch.int32, device=dev), decode_tokens=rows)
        slots = torch.full((size,), self.scratch * self.block_size, dtype=torch.long, device=dev)
        return torch.zeros_like(rows), torch.zeros_like(rows), slots, rows, meta

    def _sampling_buffers(self, size: int, like: SampleInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(ints, floats) of a bucket's `SampleInputs`, as many inputs per row as ``like``'s."""
        return (like.ints.new_zeros(like.ints.shape[0], size), like.floats.new_ones(like.floats.shape[0], size))

    def _fill(self, step, inp, rows: int) -> None:
        """Copy ``inp``'s ``rows`` rows into the bucket's buffers; the other rows become padded ones."""
        meta, width = inp.attn, inp.attn.block_tables.shape[1]
        for buffer, value, pad in ((step.input_ids, inp.input_ids, 0), (step.positions, inp.positions, 0),
                                   (step.slots, inp.slots, self.scratch * self.block_size),
                                   (step.attn.decode_ctx, meta.decode_ctx, 1)):
            buffer[:rows].copy_(value)
            buffer[rows:].fill_(pad)
        tables = step.attn.block_tables
        tables[:rows, :width].copy_(meta.block_tables)
        tables[:rows, width:].fill_(self.scratch)
        tables[rows:].fill_(self.scratch)
