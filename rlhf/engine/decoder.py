"""Model runner: a TP-sharded decoder forward over the paged KV cache (tensors only).

It reads the parameters of the actor_gen model (a megatron GPTModel built by
`build_model` and filled by resharding from the training layout) by
reference, so a later reshard into that model is seen without reloading. Per
TP rank it computes, on flat tokens ``[T]``:

    embedding (vocab slice; out-of-slice ids masked; all-reduce over TP)
    per layer: RMSNorm -> fused QKV (local heads) -> RoPE -> write K/V to cache
               -> paged attention -> proj (row parallel; all-reduce) -> +residual
               RMSNorm -> fc1 [gate; up] -> silu(gate) * up -> fc2 (all-reduce) -> +residual
    final RMSNorm and output layer on the rows that need logits -> all-gather over TP
    -> padded vocabulary ids -inf (rlhf.models.vocab, as the training forward masks them)

which is the math of megatron's local layer spec, so the logits match
`rlhf.models.gpt.stage_forward` on the same tokens. PP is not supported (the
generation mesh is TP x DP).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlhf.engine.attention import AttentionMeta, make_attention
from rlhf.engine.native import cpu_kernels
from rlhf.engine.static_decode import StaticDecode
from rlhf.models.config import ModelConfig
from rlhf.models.naming import named_global_parameters
from rlhf.models.vocab import mask_vocab_padding


@dataclass
class StepInputs:
    """One step's flat batch (all tensors on the model's device).

    input_ids / positions / slots: [T]; logits_rows: [S] flat indices of the
    tokens whose next-token logits are needed; copies: (src, dst) KV blocks to
    copy before the step (copy on write).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    logits_rows: torch.Tensor
    attn: AttentionMeta
    copies: list[tuple[int, int]]


class _Layer:
    """References to one layer's local weight shards."""

    def __init__(self, p: dict[str, torch.Tensor], i: int):
        pre = f"decoder.layers.{i}."
        self.norm1 = p[pre + "input_layernorm.weight"]
        self.qkv = p[pre + "self_attention.linear_qkv.weight"]
        self.qkv_bias = p.get(pre + "self_attention.linear_qkv.bias")
        self.proj = p[pre + "self_attention.linear_proj.weight"]
        self.norm2 = p[pre + "pre_mlp_layernorm.weight"]
        self.fc1 = p[pre + "mlp.linear_fc1.weight"]
        self.fc2 = p[pre + "mlp.linear_fc2.weight"]


class TorchOps:
    """The decoder's elementwise steps in torch, for any device and dtype. The C++ CPU kernels
    (rlhf/engine/native.py) have the same functions, each one pass where torch runs several ops."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, x.shape[-1:], weight, eps)

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU's silu(gate) * up of fc1's output [rows, 2F] = [gate | up]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def rope_and_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slots: torch.Tensor, q_per_kv: int) -> torch.Tensor:
        """Rotated queries [T, kv_heads * q_per_kv, D] of the fused projection ``qkv`` [T, kv_heads *
        (q_per_kv + 2) * D] (per KV group: its query heads, key, value); the rotated keys and the values go
        into ``k_cache`` / ``v_cache`` [kv_heads, slots, D] at ``slots``. Non-interleaved (rotate-half) RoPE
        with ``cos`` / ``sin`` [T, D] of the tokens' positions."""
        kv_heads, _, hd = k_cache.shape
        x = qkv.view(-1, kv_heads, q_per_kv + 2, hd)
        t = x[:, :, :q_per_kv + 1]  # queries and keys rotate together
        t1, t2 = t.chunk(2, dim=-1)
        qk = t * cos[:, None, None] + torch.cat((-t2, t1), dim=-1) * sin[:, None, None]
        k_cache.index_copy_(1, slots, qk[:, :, q_per_kv].transpose(0, 1))
        v_cache.index_copy_(1, slots, x[:, :, q_per_kv + 1].transpose(0, 1))
        return qk[:, :, :q_per_kv].reshape(x.shape[0], -1, hd)


def decoder_ops(dtype: torch.dtype, device: torch.device):
    """The C++ kernels for a float32 model on the CPU when they build, else `TorchOps`."""
    kernels = cpu_kernels() if dtype == torch.float32 and device.type == "cpu" else None
    return kernels if kernels is not None else TorchOps


class TPDecoder:
    """This TP rank's share of the decoder plus its slice of the KV cache."""

    def __init__(self, model: torch.nn.Module, tp_group, cfg: ModelConfig, num_blocks: int,
                 block_size: int, max_len: int, attention_backend: str = "auto", static_decode: bool = False):
        if not (model.pre_process and model.post_process):
            raise ValueError("the generation decoder needs a whole model (pp=1); got a pipeline stage")
        self.cfg, self.group = cfg, tp_group
        self.tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        p = {n: t.data for n, t in named_global_parameters(model).items()}
        self.embed, self.out = p["embedding.word_embeddings.weight"], p["output_layer.weight"]
        self.final_norm = p["decoder.final_layernorm.weight"]
        self.layers = [_Layer(p, i) for i in range(cfg.num_layers)]
        self.kv_heads = cfg.num_kv_heads // self.tp
        self.q_per_kv = cfg.num_attention_heads // cfg.num_kv_heads
        dev, dtype = self.embed.device, self.embed.dtype
        # [layers, k/v, local kv heads, blocks, block_size, head_dim] (see attention.py); static decode steps
        # write their padded rows into one more block, which the pool does not hand out
        self.kv_cache = torch.zeros(cfg.num_layers, 2, self.kv_heads, num_blocks + static_decode, block_size,
                                    cfg.head_dim, device=dev, dtype=dtype)
        with torch.no_grad():
            emb = model.rotary_pos_emb.get_emb(max_len).reshape(max_len, -1).to(dev)  # megatron's own freqs
        self.cos, self.sin = emb.cos().to(dtype), emb.sin().to(dtype)
        self.attention = make_attention(attention_backend, block_size, self.kv_heads, self.q_per_kv, dtype, dev)
        self.scale = cfg.head_dim ** -0.5
        self.ops = decoder_ops(dtype, dev)
        self.static = StaticDecode(self, num_blocks, block_size, -(-max_len // block_size)) if static_decode else None

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def kv_bytes_per_block(self) -> int:
        """Bytes of K and V one block holds on this rank, over all layers."""
        return self.kv_cache[:, :, :, 0].numel() * self.kv_cache.element_size()

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        v_local = self.embed.shape[0]
        local = ids - self.tp_rank * v_local
        outside = (local < 0) | (local >= v_local)
        x = F.embedding(local.clamp(0, v_local - 1), self.embed)
        return self._all_reduce(x.masked_fill(outside[:, None], 0.0))

    def _attention(self, layer: _Layer, i: int, h: torch.Tensor, inp: StepInputs, rope, plan) -> torch.Tensor:
        T, hd = h.shape[0], self.cfg.head_dim
        qkv = F.linear(h, layer.qkv, layer.qkv_bias)
        k_cache, v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]
        q = self.ops.rope_and_cache(qkv, *rope, k_cache.view(self.kv_heads, -1, hd),
                                    v_cache.view(self.kv_heads, -1, hd), inp.slots, self.q_per_kv)
        o = self.attention(q, k_cache, v_cache, plan, self.scale)
        return self._all_reduce(F.linear(o.reshape(T, -1), layer.proj))

    def _mlp(self, layer: _Layer, h: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(F.linear(self.ops.silu_and_mul(F.linear(h, layer.fc1)), layer.fc2))

    @torch.no_grad()
    def forward(self, inp: StepInputs) -> torch.Tensor:
        """Full-vocabulary logits [S, V] (float32; V padded, padded ids -inf) for ``inp.logits_rows``;
        fills the KV cache (copy-on-write copies first). A decode step runs at its bucket's static shapes
        when the decoder was made with ``static_decode`` (rlhf/engine/static_decode.py)."""
        self.copy_blocks(inp.copies)
        if self.static is not None and StaticDecode.applies(inp):
            return self.static.run(inp)
        return self.logits(inp)

    @torch.no_grad()
    def logits(self, inp: StepInputs) -> torch.Tensor:
        """`forward` without its block copies: the model on ``inp``'s tokens."""
        eps = self.cfg.norm_eps
        x = self._embed(inp.input_ids)
        rope = (self.cos[inp.positions], self.sin[inp.positions])
        plan = self.attention.prepare(inp.attn)
        for i, layer in enumerate(self.layers):
            x = x + self._attention(layer, i, self.ops.rms_norm(x, layer.norm1, eps), inp, rope, plan)
            x = x + self._mlp(layer, self.ops.rms_norm(x, layer.norm2, eps))
        x = self.ops.rms_norm(x[inp.logits_rows], self.final_norm, eps)
        logits = F.linear(x, self.out).float()
        if self.tp > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp)]
            dist.all_gather(parts, logits.contiguous(), group=self.group)
            logits = torch.cat(parts, dim=-1)
        return mask_vocab_padding(logits, self.cfg.vocab_size)

    @torch.no_grad()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks src -> dst in every layer (copy on write)."""
        for src, dst in copies:
            self.kv_cache[:, :, :, dst].copy_(self.kv_cache[:, :, :, src])

    def read_blocks(self, blocks: list[int], num_tokens: int) -> torch.Tensor:
        """K/V of the first ``num_tokens`` positions held in ``blocks``: [L, 2, n, kv_heads, hd]."""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
        kv = self.kv_cache.index_select(3, idx).flatten(3, 4)[:, :, :, :num_tokens]  # [L, 2, kvh, n, hd]
        return kv.transpose(2, 3).contiguous()

    def write_blocks(self, blocks: list[int], kv: torch.Tensor) -> None:
        """Inverse of `read_blocks`."""
        bs, n = self.kv_cache.shape[4], kv.shape[2]
        for j, block in enumerate(blocks):
            chunk = kv[:, :, j * bs:min(n, (j + 1) * bs)].transpose(2, 3)  # [L, 2, kvh, <=bs, hd]
            self.kv_cache[:, :, :, block, :chunk.shape[3]].copy_(chunk)
