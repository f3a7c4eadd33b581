"""Model runner: a TP-sharded decoder forward over the paged KV cache (tensors only).

It reads the parameters of the actor_gen model (a megatron GPTModel built by
`build_model` and filled by resharding from the training layout) by
reference, so a later reshard into that model is seen without reloading. Per
TP rank it computes, on flat tokens ``[T]``:

    embedding (vocab slice; out-of-slice ids masked; all-reduce over TP)
    per layer: RMSNorm -> fused QKV (local heads) -> [QK-norm] -> RoPE -> write K/V to cache
               -> paged attention -> proj (row parallel; all-reduce) -> +residual
               RMSNorm -> MLP -> +residual
    final RMSNorm and output layer on the rows that need logits -> all-gather over TP
    -> padded vocabulary ids -inf (rlhf.models.vocab, as the training forward masks them)

where the MLP is dense, fc1 [gate; up] -> silu(gate) * up -> fc2 (all-reduce), or a mixture of experts
(``cfg.is_moe``, megatron's MoE layer with SequentialMLP experts, all of them on every TP rank):

    router logits in fp32 (fp32 input and weight) -> top-k: with ``moe_norm_topk_prob`` the top k logits,
    then a softmax over those k; without it, a softmax over all experts, then its top k (unnormalised)
    -> per expert, on its tokens: fc1 -> silu(gate) * up -> * prob (fp32, cast back) -> fc2
    -> summed per token (index_add in the model's dtype, experts in ascending order, as megatron's
       unpermute) -> + the shared expert (TP-sharded like the dense MLP, all-reduced), if any

The routed part needs no collective: every TP rank holds every expert (expert TP 1) and computes the
same full sum, which is added after the shared expert's all-reduce, as megatron adds it.

QK-norm (Qwen3, ``cfg.qk_norm``) is megatron's q_layernorm / k_layernorm: an RMSNorm over head_dim of each
query head and each key head (one weight for the queries, one for the keys), before RoPE, so the cache
holds normed, rotated keys. The head dimension is ``cfg.head_dim`` (kv_channels may differ from
hidden / heads: the QKV rows and the projection's input are heads x head_dim).

This is the math of megatron's local layer spec, so the logits match `rlhf.models.gpt.stage_forward` on
the same tokens. PP is not supported (the generation mesh is TP x DP).

Routing record (MoE, for routing replay): with ``record_routing`` set (constructor argument or the
attribute), every `logits` call (so every `forward`) leaves in ``last_routing`` the experts each MoE layer
chose for each token it computed: an int tensor [T, num_moe_layers, k] (int16, int32 past 32767 experts;
on the model's device) in the step's flat token order (``StepInputs.input_ids``: prefill and decode rows
alike), the k experts of a token in megatron's top-k order (highest score first). ``last_routing[:, l]``
is the ``top_indices`` megatron's RouterReplay records for MoE layer l. Off (the default), or for a dense
model, it stays None and costs nothing.

A decoder made with ``record_routing`` on a MoE model also keeps a *routing cache* beside the KV cache,
``routing_cache`` [blocks, block_size, num_layers, k] (the dtype of ``last_routing``): each step writes its
``last_routing`` rows at the step's KV slots, `copy_blocks` copies routing with K/V (copy on write), and
`read_routing` / `write_routing` read and write a sequence's routing by its blocks, as `read_blocks` /
`write_blocks` do its K/V. So a shared prefix block holds the routing of the sample that computed it, and a
position's record is that of the computation whose K/V the cache holds. Setting the attribute later gives
``last_routing`` only.

A MoE model never takes the static decode path (``static_decode`` is ignored): the tokens per expert
change every step, which a CUDA graph cannot replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlhf.engine.attention import AttentionMeta
from rlhf.engine.attention_backend import make_attention
from rlhf.engine.native import cpu_kernels
from rlhf.engine.sampler import SampleInputs, sample
from rlhf.engine.static_decode import StaticDecode
from rlhf.models.config import ModelConfig
from rlhf.models.naming import named_global_parameters
from rlhf.models.vocab import mask_vocab_padding


@dataclass
class StepInputs:
    """One step's flat batch (all tensors on the model's device).

    input_ids / positions / slots: [T]; logits_rows: [S] flat indices of the
    tokens whose next-token logits are needed (one per sampling sequence: the
    samples forked off a prompt repeat its last token's); copies: (src, dst) KV
    blocks to copy before the step (copy on write).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    logits_rows: torch.Tensor
    attn: AttentionMeta
    copies: list[tuple[int, int]]


class _Layer:
    """References to one layer's local weight shards.

    Dense: ``fc1``, ``fc2``. MoE (``router`` not None): ``router`` [E, hidden] (and its bias, if any),
    ``experts`` [(fc1, fc2)] of every expert, whole on every TP rank, ``shared`` (fc1, fc2) of the shared
    expert (TP-sharded) or None. QK-norm: ``q_norm`` / ``k_norm`` [head_dim], else None.
    """

    def __init__(self, p: dict[str, torch.Tensor], i: int, num_experts: int = 0):
        pre = f"decoder.layers.{i}."
        self.norm1 = p[pre + "input_layernorm.weight"]
        self.qkv = p[pre + "self_attention.linear_qkv.weight"]
        self.qkv_bias = p.get(pre + "self_attention.linear_qkv.bias")
        self.q_norm = p.get(pre + "self_attention.q_layernorm.weight")
        self.k_norm = p.get(pre + "self_attention.k_layernorm.weight")
        self.proj = p[pre + "self_attention.linear_proj.weight"]
        self.norm2 = p[pre + "pre_mlp_layernorm.weight"]
        self.router = p.get(pre + "mlp.router.weight") if num_experts else None
        if self.router is None:
            self.fc1 = p[pre + "mlp.linear_fc1.weight"]
            self.fc2 = p[pre + "mlp.linear_fc2.weight"]
            return
        self.router_bias = p.get(pre + "mlp.router.bias")
        experts = pre + "mlp.experts.local_experts."
        self.experts = [(p[f"{experts}{e}.linear_fc1.weight"], p[f"{experts}{e}.linear_fc2.weight"])
                        for e in range(num_experts)]
        shared = pre + "mlp.shared_experts."
        self.shared = ((p[shared + "linear_fc1.weight"], p[shared + "linear_fc2.weight"])
                       if shared + "linear_fc1.weight" in p else None)


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
                 block_size: int, max_len: int, attention_backend: str = "auto", static_decode: bool = False,
                 record_routing: bool = False):
        if not (model.pre_process and model.post_process):
            raise ValueError("the generation decoder needs a whole model (pp=1); got a pipeline stage")
        static_decode = static_decode and not cfg.is_moe  # MoE steps run eagerly (module doc)
        self.cfg, self.group = cfg, tp_group
        self.record_routing = record_routing
        self.routing_dtype = torch.int16 if cfg.num_experts <= torch.iinfo(torch.int16).max else torch.int32
        self.last_routing: torch.Tensor | None = None  # [T, num_moe_layers, k] of the last step, when recording
        self.tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        p = {n: t.data for n, t in named_global_parameters(model).items()}
        self.embed, self.out = p["embedding.word_embeddings.weight"], p["output_layer.weight"]
        self.final_norm = p["decoder.final_layernorm.weight"]
        self.layers = [_Layer(p, i, cfg.num_experts) for i in range(cfg.num_layers)]
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
        # [blocks, block_size, layers, k]: the experts of each cached position (module doc), MoE and asked for only
        self.routing_cache = (torch.zeros(self.kv_cache.shape[3], block_size, cfg.num_layers, cfg.moe_router_topk,
                                          device=dev, dtype=self.routing_dtype)
                              if record_routing and cfg.is_moe else None)
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
        if layer.q_norm is not None:
            self._qk_norm(layer, qkv.view(T, self.kv_heads, self.q_per_kv + 2, hd))
        k_cache, v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]
        q = self.ops.rope_and_cache(qkv, *rope, k_cache.view(self.kv_heads, -1, hd),
                                    v_cache.view(self.kv_heads, -1, hd), inp.slots, self.q_per_kv)
        o = self.attention(q, k_cache, v_cache, plan, self.scale)
        return self._all_reduce(F.linear(o.reshape(T, -1), layer.proj))

    def _qk_norm(self, layer: _Layer, x: torch.Tensor) -> None:
        """RMSNorm in place of each query head and each key head of ``x`` [T, kv_heads, q_per_kv + 2, D]
        (per KV group: its query heads, key, value), as megatron's q_layernorm / k_layernorm (torch's
        RMSNorm) on the split projection."""
        eps, q = self.cfg.norm_eps, self.q_per_kv
        x[:, :, :q] = TorchOps.rms_norm(x[:, :, :q], layer.q_norm, eps)
        x[:, :, q] = TorchOps.rms_norm(x[:, :, q], layer.k_norm, eps)

    def _swiglu(self, h: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor) -> torch.Tensor:
        """fc2(silu(gate) * up) of fc1(h) = [gate | up], without the all-reduce."""
        return F.linear(self.ops.silu_and_mul(F.linear(h, fc1)), fc2)

    def _mlp(self, layer: _Layer, h: torch.Tensor, routing: list | None = None) -> torch.Tensor:
        """The layer's MLP of ``h`` [T, hidden], complete on every TP rank; a MoE layer appends its top-k
        expert indices [T, k] to ``routing`` when that is a list."""
        if layer.router is not None:
            return self._moe(layer, h, routing)
        return self._all_reduce(self._swiglu(h, layer.fc1, layer.fc2))

    def route(self, layer: _Layer, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(probs [T, k] float32, expert indices [T, k] int64) of megatron's top-k router (softmax score,
        router in fp32) on ``h`` [T, hidden]."""
        logits = F.linear(h.float(), layer.router.float(),
                          None if layer.router_bias is None else layer.router_bias.float())
        k = self.cfg.moe_router_topk
        if self.cfg.moe_norm_topk_prob:  # megatron's moe_router_pre_softmax=False
            top, idx = torch.topk(logits, k, dim=1)
            return torch.softmax(top, dim=-1, dtype=torch.float32), idx
        return torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), k, dim=1)

    def _moe(self, layer: _Layer, h: torch.Tensor, routing: list | None) -> torch.Tensor:
        """megatron's MoE layer on ``h`` [T, hidden]: the routed experts (all local, no collective) plus
        the shared expert (all-reduced), in megatron's arithmetic and dtypes (module doc)."""
        probs, idx = self.route(layer, h)
        if routing is not None:
            routing.append(idx)
        k = idx.shape[1]
        flat = idx.flatten()
        order = torch.argsort(flat, stable=True)  # by expert, then by token: megatron's permutation
        counts = torch.bincount(flat, minlength=len(layer.experts)).tolist()  # one host sync a layer
        tokens, weights = order // k, probs.flatten()[order]
        out = torch.zeros_like(h)
        start = 0
        for (fc1, fc2), n in zip(layer.experts, counts):
            if n:
                rows = tokens[start:start + n]
                act = self.ops.silu_and_mul(F.linear(h.index_select(0, rows), fc1))
                act = (act * weights[start:start + n, None]).to(h.dtype)  # megatron's per_token_scale
                out.index_add_(0, rows, F.linear(act, fc2))
                start += n
        if layer.shared is not None:
            out = out + self._all_reduce(self._swiglu(h, *layer.shared))
        return out

    @torch.no_grad()
    def forward(self, inp: StepInputs) -> torch.Tensor:
        """Full-vocabulary logits [S, V] (float32; V padded, padded ids -inf) for ``inp.logits_rows``;
        fills the KV cache (copy-on-write copies first). With ``record_routing``, ``last_routing`` holds the
        step's expert choices (module doc)."""
        self.copy_blocks(inp.copies)
        return self.logits(inp)

    @torch.no_grad()
    def forward_and_sample(self, inp: StepInputs, sampling: SampleInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [S], log-probs [S]) drawn from the logits rows of `forward` by `rlhf.engine.sampler.sample`
        (``sampling``: one row per logits row). A decode step runs at its bucket's static shapes, forward and
        sampling in one function that a GPU records as one graph, when the decoder was made with
        ``static_decode`` (rlhf/engine/static_decode.py; never for MoE)."""
        if self.static is None or not StaticDecode.applies(inp):
            return sample(self.forward(inp), sampling)
        self.copy_blocks(inp.copies)
        return self.static.run(inp, sampling)

    @torch.no_grad()
    def logits(self, inp: StepInputs) -> torch.Tensor:
        """`forward` without its block copies: the model on ``inp``'s tokens (and, with ``record_routing``
        on a MoE model, ``last_routing`` of them)."""
        eps = self.cfg.norm_eps
        x = self._embed(inp.input_ids)
        rope = (self.cos[inp.positions], self.sin[inp.positions])
        plan = self.attention.prepare(inp.attn)
        routing = [] if self.record_routing and self.cfg.is_moe else None
        for i, layer in enumerate(self.layers):
            x = x + self._attention(layer, i, self.ops.rms_norm(x, layer.norm1, eps), inp, rope, plan)
            x = x + self._mlp(layer, self.ops.rms_norm(x, layer.norm2, eps), routing)
        self.last_routing = None
        if routing is not None:
            self.last_routing = torch.stack(routing, dim=1).to(self.routing_dtype)
            if self.routing_cache is not None:
                self.routing_cache.view(-1, *self.routing_cache.shape[2:]).index_copy_(0, inp.slots, self.last_routing)
        x = self.ops.rms_norm(x[inp.logits_rows], self.final_norm, eps)
        logits = F.linear(x, self.out).float()
        if self.tp > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp)]
            dist.all_gather(parts, logits.contiguous(), group=self.group)
            logits = torch.cat(parts, dim=-1)
        return mask_vocab_padding(logits, self.cfg.vocab_size)

    @torch.no_grad()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks src -> dst in every layer, and their routing if cached (copy on write)."""
        for src, dst in copies:
            self.kv_cache[:, :, :, dst].copy_(self.kv_cache[:, :, :, src])
            if self.routing_cache is not None:
                self.routing_cache[dst].copy_(self.routing_cache[src])

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

    def _block_slots(self, blocks: list[int], num_tokens: int) -> torch.Tensor:
        """Slots of the first ``num_tokens`` positions held in ``blocks`` (in order)."""
        bs = self.kv_cache.shape[4]
        idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
        return (idx[:, None] * bs + torch.arange(bs, device=self.device)).flatten()[:num_tokens]

    def read_routing(self, blocks: list[int], num_tokens: int) -> torch.Tensor:
        """Routing of the first ``num_tokens`` positions held in ``blocks``: [n, num_layers, k] (needs the
        routing cache: ``record_routing`` at construction, MoE)."""
        flat = self.routing_cache.view(-1, *self.routing_cache.shape[2:])
        return flat.index_select(0, self._block_slots(blocks, num_tokens))

    def write_routing(self, blocks: list[int], routing: torch.Tensor) -> None:
        """Inverse of `read_routing`."""
        flat = self.routing_cache.view(-1, *self.routing_cache.shape[2:])
        flat.index_copy_(0, self._block_slots(blocks, routing.shape[0]), routing.to(flat.device, flat.dtype))
