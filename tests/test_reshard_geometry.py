"""Shard geometry of resharding, against slicing the full tensor directly."""

import itertools

import pytest
import torch

from rlhf.models.naming import owning_stage
from rlhf.models.sharding import ShardSpec, full_to_shard, shard_overlaps, shards_to_full


@pytest.mark.parametrize("stride, dim", [(1, 0), (2, 0), (1, 1)])
def test_full_to_shard_and_back(stride, dim):
    full = torch.arange(8 * 16 * 3).reshape(8 * 2, 8 * 3)[: 16, : 24].clone()
    for tp in (1, 2, 4):
        spec = ShardSpec(tp=tp, dim=dim, stride=stride)
        shards = [full_to_shard(full, spec, r) for r in range(tp)]
        assert torch.equal(shards_to_full(shards, spec), full)
    # stride 2 on dim 0 at TP2: [gate_0; up_0] on rank 0
    spec = ShardSpec(tp=2, dim=0, stride=2)
    gate, up = full.chunk(2)
    assert torch.equal(full_to_shard(full, spec, 0), torch.cat([gate.chunk(2)[0], up.chunk(2)[0]]))


@pytest.mark.parametrize("stride", [1, 2])
def test_overlaps_rebuild_every_destination_shard(stride):
    full = torch.randn(16, 5)
    for src_tp, dst_tp in itertools.product((1, 2, 4), repeat=2):
        src, dst = ShardSpec(tp=src_tp, stride=stride), ShardSpec(tp=dst_tp, stride=stride)
        for d in range(dst_tp):
            rebuilt = torch.full_like(full_to_shard(full, dst, d), float("nan"))
            for s in range(src_tp):
                local = full_to_shard(full, src, s)
                for s_loc, d_loc, n in shard_overlaps(src, s, dst, d, 16):
                    rebuilt[d_loc:d_loc + n] = local[s_loc:s_loc + n]
            assert torch.equal(rebuilt, full_to_shard(full, dst, d)), (src_tp, dst_tp, d)


def test_replicated_parameters_are_copied_whole():
    spec = ShardSpec(tp=4, parallel=False)
    full = torch.randn(6)
    assert torch.equal(full_to_shard(full, spec, 3), full)
    assert shard_overlaps(spec, 0, ShardSpec(tp=2, parallel=False), 1, 6) == [(0, 0, 6)]


def test_owning_stage():
    assert owning_stage("decoder.layers.5.mlp.linear_fc1.weight", 8, 4) == 2
    assert owning_stage("embedding.word_embeddings.weight", 8, 4) == 0
    assert owning_stage("decoder.final_layernorm.weight", 8, 4) == 3
    assert owning_stage("output_layer.weight", 8, 4) == 3


def test_global_names_use_global_layers_and_local_spec_norms():
    from types import SimpleNamespace

    from rlhf.models.naming import global_name

    stage = SimpleNamespace(decoder=SimpleNamespace(layers=[SimpleNamespace(layer_number=5),
                                                            SimpleNamespace(layer_number=6)]))
    assert global_name(stage, "decoder.layers.1.mlp.linear_fc2.weight") == "decoder.layers.5.mlp.linear_fc2.weight"
    # TransformerEngine fuses the norms into the next linear layer; names map to the local spec's
    assert (global_name(stage, "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight")
            == "decoder.layers.4.input_layernorm.weight")
    assert (global_name(stage, "decoder.layers.0.mlp.linear_fc1.layer_norm_weight")
            == "decoder.layers.4.pre_mlp_layernorm.weight")
    assert global_name(stage, "output_layer.weight") == "output_layer.weight"
