"""Vocabulary padding: Megatron-LM's padded sizes, the -inf mask, row fitting, the flag and the job's sizes.

The distributed checks (a 67-id HF Llama at TP2: greedy tokens, log-probs,
resharding and export) are in tests/test_interop_hf.py, in its 2-rank launch.
"""

import json

import pytest
import torch

from rlhf.cli import UsageError
from rlhf.models.config import ModelConfig, padded_vocab_size
from rlhf.models.vocab import drop_vocab_padding, fit_vocab_rows, mask_vocab_padding
from rlhf.parallel import Placement
from rlhf.ppo import layout
from rlhf.ppo.arguments import build_parser, parse_args
from rlhf.ppo.config import JobConfig, ModelsConfig

EMBED, HEAD = "embedding.word_embeddings.weight", "output_layer.weight"


@pytest.mark.parametrize("vocab, divisible_by, tps, padded", [
    (50257, 128, [1], 50304),  # GPT-2 in Megatron-LM (its default --make-vocab-size-divisible-by 128)
    (50257, 128, [8], 51200),  # ... at tp=8: a multiple of 128 x 8
    (128256, 1, [8], 128256),  # Llama-3: tp 8 divides it, nothing to pad
    (67, 1, [2], 68),
    (67, 1, [2, 4, 1], 68),  # every layout of the model shares one size
    (67, 1, [2, 3], 72),  # lcm(2, 3) = 6, not the largest tp
    (67, 8, [2], 80),
    (67, 1, [], 67),  # no layout given: no padding
])
def test_padded_vocab_size_as_megatron(vocab, divisible_by, tps, padded):
    assert padded_vocab_size(vocab, divisible_by, tps) == padded
    assert all(padded % tp == 0 for tp in tps)


def test_padded_vocab_size_refuses_a_divisor_below_one():
    with pytest.raises(ValueError, match="make_vocab_size_divisible_by must be >= 1, got 0"):
        padded_vocab_size(67, 0, [2])


def test_mask_sets_the_padded_ids_of_a_slice_to_minus_inf():
    logits = torch.arange(2 * 34, dtype=torch.float32).view(2, 34)
    assert mask_vocab_padding(logits, 67, start=0) is logits  # rank 0 of 68 rows at tp=2: all real
    masked = mask_vocab_padding(logits, 67, start=34)  # rank 1: ids 34..67, 67 is padding
    assert torch.equal(masked[:, :33], logits[:, :33]) and (masked[:, 33] == float("-inf")).all()
    assert (mask_vocab_padding(logits, 67, start=68) == float("-inf")).all()  # a slice of padding only
    assert torch.log_softmax(masked, -1)[:, 33].eq(float("-inf")).all()


def test_rows_are_padded_with_zeros_and_dropped_again():
    embed = torch.randn(67, 4)
    padded = fit_vocab_rows(EMBED, embed, 72)
    assert padded.shape == (72, 4) and torch.equal(padded[:67], embed) and not padded[67:].any()
    assert torch.equal(drop_vocab_padding(EMBED, padded, 67), embed)
    value_head, norm = torch.randn(1, 4), torch.randn(72)
    assert fit_vocab_rows(HEAD, value_head, 1) is value_head and drop_vocab_padding(HEAD, value_head, 67) is value_head
    assert fit_vocab_rows("decoder.final_layernorm.weight", norm, 80) is norm
    assert drop_vocab_padding("decoder.final_layernorm.weight", norm, 67) is norm


@pytest.fixture
def odd_vocab_job(tmp_path):
    """A job whose four models have 67 ids, on a placement where the actor runs at tp 2 and 4."""
    shape = tmp_path / "odd.json"
    shape.write_text(json.dumps({"vocab_size": 67, "num_kv_heads": 4}))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"actor_train": {"tp": 2, "pp": 2}, "actor_gen": {"tp": 4}, "ref_inf": {},
                                "critic_train": {"tp": 1}, "critic_inf": {"tp": 1}, "reward_inf": {"tp": 2}}))
    return ["--actor-model", str(shape), "--critic-model", str(shape), "--placement", str(plan)]


def test_flag_sets_the_padding_per_model(odd_vocab_job):
    default = parse_args(odd_vocab_job)
    assert default.models.make_vocab_size_divisible_by == 1
    placement = layout.build_placement(default, 8)  # tp 2 and 4 on a 67-id model: no longer refused
    # the reference shares the actor's size: it starts as a reshard of actor_train
    sizes = {m: layout.padded_vocab_size(default, m, placement) for m in ("actor", "reference", "critic", "reward")}
    assert sizes == {"actor": 68, "reference": 68, "critic": 67, "reward": 68}
    wide = parse_args(odd_vocab_job + ["--make-vocab-size-divisible-by", "32"])
    assert wide.models.make_vocab_size_divisible_by == 32
    assert {m: layout.padded_vocab_size(wide, m, placement) for m in sizes} == {
        "actor": 128, "reference": 128, "critic": 96, "reward": 128}


def test_tiny_default_pads_the_byte_vocabulary_where_tp_needs_it():
    """The tiny presets have the byte tokenizer's 259 ids; on the built-in 4-rank plan the actor's layouts
    (generation and training tp 2) and the critic's (critic_inf tp 2) pad one row, the reward model's (tp 1)
    none."""
    job = JobConfig()
    placement = layout.build_placement(job, 4)
    assert {m: layout.padded_vocab_size(job, m, placement) for m in ("actor", "reference", "critic", "reward")} \
        == {"actor": 260, "reference": 260, "critic": 260, "reward": 259}


@pytest.mark.parametrize("value", ["0", "-3"])
def test_bad_divisor_names_the_flag(value):
    with pytest.raises(UsageError, match=f"^--make-vocab-size-divisible-by: make_vocab_size_divisible_by must "
                                         f"be an integer >= 1, got {value}"):
        parse_args(["--make-vocab-size-divisible-by", value])
    assert "--make-vocab-size-divisible-by N" in build_parser().format_help()


def test_models_config_checks_the_divisor_itself():
    with pytest.raises(ValueError, match="make_vocab_size_divisible_by"):
        ModelsConfig(actor=ModelConfig(vocab_size=67), make_vocab_size_divisible_by=0)
    assert Placement.from_plan({"actor_train": {"tp": 2}}, 2).validate_models({"actor": ModelConfig(vocab_size=67)}) \
        is None
