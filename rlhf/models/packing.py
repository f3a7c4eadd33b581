"""Sequence packing: several samples in one row, attention confined to each (``--max-tokens-per-microbatch``).

A padded micro-batch is ``tokens [b, T]`` with each sample left-aligned and
pad ids up to T (rlhf/batch.py): a long-tailed micro-batch spends most of
its FLOPs on padding. Packed, the same samples are one row ``[1, t]`` of
their tokens back to back (t = the sum of their lengths), described by
megatron's ``PackedSeqParams`` in the THD layout: ``cu_seqlens``, the
offsets where each sample starts. megatron then restarts the rotary
positions at each offset, and the core attention keeps each token's
attention inside its own sample (causal within it):

    padded   p p p r r . .        packed   p p p r r p r r r r p p p p r r r
             p r r r r . .                 |  sample 0 | sample 1  | sample 2    |
             p p p p r r r        cu_seqlens = [0, 5, 10, 17]

TransformerEngine's attention takes the THD layout itself; megatron's local
one does not, so the local spec's core attention is rlhf.models.attention's,
which does. :class:`PackedLayout` packs a
micro-batch's tokens and puts per-token outputs back in the padded layout,
where the losses and the batch fields read them.
"""

from __future__ import annotations

import torch


class PackedLayout:
    """Where the samples of a padded ``tokens [b, T]`` sit in their packed row, from their ``lengths``
    ([b] host ints, each sample's tokens from column 0)."""

    def __init__(self, lengths: torch.Tensor, width: int, device: torch.device):
        lengths = torch.as_tensor(lengths, dtype=torch.int64)
        if lengths.dim() != 1 or not len(lengths) or int(lengths.min()) < 1 or int(lengths.max()) > width:
            raise ValueError(f"PackedLayout: lengths {lengths.tolist()} must be 1..{width} (the padded width), "
                             "one per sample")
        from megatron.core.packed_seq_params import PackedSeqParams

        self.lengths, self.width = lengths, width
        self.total = int(lengths.sum())
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        rows = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        positions = torch.arange(self.total) - offsets[:-1][rows]  # each packed token's position in its sample
        # host -> device without waiting for the queued kernels (a blocking copy would)
        self.positions = positions.unsqueeze(0).to(device, non_blocking=True)  # [1, t] position ids
        self.index = (rows * width + positions).to(device, non_blocking=True)  # [t]: place in the padded [b * T]
        cu_seqlens = offsets.to(dtype=torch.int32).to(device, non_blocking=True)
        longest = int(lengths.max())
        self.seq_params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                          max_seqlen_q=longest, max_seqlen_kv=longest)

    @classmethod
    def of(cls, batch) -> "PackedLayout":
        """The layout of a ``rlhf.batch.Batch`` micro-batch: its samples' prompt + response tokens."""
        return cls(batch.sequence_lengths, batch.tokens.shape[1], batch.tokens.device)

    def pack(self, tokens: torch.Tensor) -> torch.Tensor:
        """[b, T] padded ids -> [1, t] packed."""
        return tokens.reshape(-1)[self.index].unsqueeze(0)

    def next_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """[1, t]: the token each packed position predicts (its sample's next one; at a sample's last
        position, whatever follows it in the padded row: an output no response field reads)."""
        return self.pack(torch.roll(tokens, -1, dims=1))

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """[1, t, ...] per-token outputs -> [b, T, ...] in the padded layout, zeros at the padding
        (differentiable)."""
        rest = packed.shape[2:]
        flat = packed.new_zeros((len(self.lengths) * self.width, *rest)).index_copy(0, self.index, packed[0])
        return flat.reshape(len(self.lengths), self.width, *rest)


def unpacked(per_token: torch.Tensor, packed: PackedLayout | None) -> torch.Tensor:
    """A model output (or something computed per token from it) in the padded layout: as it is when the
    micro-batch ran padded, else put back from its packed row."""
    return per_token if packed is None else packed.unpack(per_token)


def sequence_shape(input_ids: torch.Tensor, packed: PackedLayout | None) -> tuple[int, int]:
    """(s, b) of the hidden states [s, b, h] that a micro-batch's ``input_ids`` [b, T] make between
    pipeline stages: (T, b) padded, (t, 1) packed."""
    return (input_ids.shape[1], input_ids.shape[0]) if packed is None else (packed.total, 1)
