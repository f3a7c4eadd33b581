"""rlhf/models/attention.py: the local spec's core attention (PyTorch's scaled_dot_product_attention) equals
megatron's unfused DotProductAttention in whole models (tests/scenario_attention.py, 2 ranks): padded and
packed micro-batches, grouped-query heads, TP1 and TP2, fp32 and bf16, logits and gradients."""

import math

import pytest
import torch

from rlhf.models.attention import packed_causal_mask
from rlhf.testing.distributed import launch

BF16_EPS = 2.0 ** -7  # bf16's machine epsilon: 7 significant bits after the leading one


def _ulp_bf16(scale: float) -> float:
    """One bf16 unit in the last place at ``scale``'s binade."""
    return BF16_EPS * 2.0 ** math.floor(math.log2(scale))


@pytest.fixture(scope="module")
def results():
    return launch(2, "scenario_attention:run")


@pytest.mark.parametrize("tp", ["tp1", "tp2"])
def test_fp32_equals_megatrons_attention_padded_and_packed(results, tp):
    for rank in results:
        r = rank[f"{tp}/float32"]
        assert r["classes"] == ["SdpaAttention"]  # the model as built runs the new attention
        assert r["padded"] < 1e-5 and r["packed"] < 1e-5, r
        assert r["padded_grad"] < 1e-5 * r["grad_scale"] and r["packed_grad"] < 1e-5 * r["grad_scale"], r


@pytest.mark.parametrize("tp", ["tp1", "tp2"])
def test_bf16_is_within_two_units_in_the_last_place(results, tp):
    """The fused kernels keep the scores in fp32 where megatron's unfused path rounds them to bf16 first, so
    bf16 results may differ by rounding: the documented tolerance is two bf16 units in the last place of the
    largest logit (and gradient)."""
    for rank in results:
        r = rank[f"{tp}/bfloat16"]
        assert max(r["padded"], r["packed"]) <= 2 * _ulp_bf16(r["scale"]), r
        assert max(r["padded_grad"], r["packed_grad"]) <= 2 * _ulp_bf16(r["grad_scale"]), r


def test_attention_makes_no_host_sync_padded_or_packed(results):
    """Forward and backward of one core attention, padded and packed (the mask from cu_seqlens on the device)."""
    for rank in results:
        for r in rank.values():
            assert r["syncs"] == []


def test_packed_mask_is_causal_within_each_sample():
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    mask = packed_causal_mask(cu, 5).int().tolist()
    assert mask == [[1, 0, 0, 0, 0],
                    [1, 1, 0, 0, 0],
                    [0, 0, 1, 0, 0],
                    [0, 0, 1, 1, 0],
                    [0, 0, 1, 1, 1]]
