"""Megatron-LM checkpoints in and out (rlhf/checkpoint/megatron.py, docs/megatron_checkpoints.md).

megatron-core is the oracle for the format, transformers for the logits. Checkpoints written by
megatron-core's ``dist_checkpointing`` the way Megatron-LM's ``save_checkpoint`` writes them (global
parallel state, TP2 or EP2, args in the common state) load into our actor at TP1 and at PP2 (a MoE at
EP2 too) with the saving model's logits (1e-5), and megatron-to-hf makes HF models whose transformers logits are the same (1e-4);
ours-to-megatron output loads with ``dist_checkpointing.load`` into a GPTModel megatron-core builds from
the args it wrote, with identical weights. One 2-rank launch (tests/scenario_megatron.py) serves them all.

``llama``: GQA, untied, the layers stacked on one key per tensor (Megatron-LM's default).
``qwen_tied``: QKV bias, tied embeddings, no GQA, one key per layer (non-homogeneous layers) and the
local layer spec's own norm names instead of the fused ones megatron-core writes by default.
``qwen3_moe``: QK layer norms, kv_channels apart from hidden / heads, 4 SequentialMLP experts (top-2,
softmax after top-k: HF's norm_topk_prob), saved at EP2 (each rank its two experts) with one key per
layer (``decoder.layers.{i}.mlp.experts.experts.*``); loads into transformers' Qwen3MoeForCausalLM too.
``moe_shared``: a shared expert, softmax before top-k, z-loss, one-element list args, saved at TP2 (the
experts and the shared expert split over TP: expert TP = TP, Megatron-LM's default) with the layers
stacked.

The ours-to-megatron exports that megatron-core loads: a Qwen2 (from transformers), a Qwen3 (QK-norm,
head_dim 20 of hidden 64 / 4 heads), a Qwen3-MoE, and a MoE with a shared expert (random weights): the
MoE ones into a GPTModel at EP2.
"""

import argparse
import os
import pathlib
import pickle
import re
import shutil

import pytest
import torch

from rlhf.ppo.arguments import parse_args
from rlhf.checkpoint.megatron import MegatronCheckpointError, model_shapes, open_megatron, read_megatron_state
from rlhf.checkpoint.rlhf_state import save_model
from rlhf.checkpoint.sources import ModelSourceError, open_source, read_full_state, read_weights
from rlhf.cli import UsageError
from rlhf.models.config import ModelConfig
from rlhf.testing.distributed import launch
from rlhf.testing.tools import load_tool

convert_checkpoint = load_tool("convert_checkpoint")

SHAPE = dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, max_position_embeddings=64)
CASES = [
    {"name": "llama", "iteration": 7,
     "args": dict(SHAPE, num_query_groups=2, padded_vocab_size=128, rotary_base=5000, norm_epsilon=1e-5)},
    {"name": "qwen_tied", "iteration": 3, "metadata": {"non_homogeneous_layers": True}, "local_norm_names": True,
     "args": dict(SHAPE, num_query_groups=4, group_query_attention=False, padded_vocab_size=96, rotary_base=1000000,
                  norm_epsilon=1e-6, add_qkv_bias=True, untie_embeddings_and_output_weights=False)},
    {"name": "qwen3_moe", "iteration": 5, "tp": 1, "ep": 2, "metadata": {"non_homogeneous_layers": True},
     "args": dict(SHAPE, num_query_groups=2, padded_vocab_size=128, rotary_base=1000000, norm_epsilon=1e-6,
                  kv_channels=20, qk_layernorm=True, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                  moe_aux_loss_coeff=0.01, moe_router_load_balancing_type="aux_loss", moe_layer_freq=1)},
    {"name": "moe_shared", "iteration": 6, "tp": 2, "ep": 1,
     "args": dict(SHAPE, num_query_groups=2, padded_vocab_size=128, rotary_base=10000, norm_epsilon=1e-5,
                  qk_layernorm=True, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
                  moe_shared_expert_intermediate_size=40, moe_router_pre_softmax=True, moe_z_loss_coeff=1e-3,
                  moe_router_load_balancing_type=["aux_loss"], moe_aux_loss_coeff=[0.02])},
]
MOE_CASES = ("qwen3_moe", "moe_shared")
EXPECTED_CONFIGS = {
    "llama": ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_kv_heads=2,
                         vocab_size=128, max_seq_len=64, rope_theta=5000.0, norm_eps=1e-5),
    "qwen_tied": ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                             num_kv_heads=4, vocab_size=96, max_seq_len=64, rope_theta=1e6, norm_eps=1e-6,
                             qkv_bias=True, tie_embeddings=True),
    "qwen3_moe": ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_kv_heads=2,
                             vocab_size=128, max_seq_len=64, rope_theta=1e6, norm_eps=1e-6, qk_norm=True,
                             kv_channels=20, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                             moe_aux_loss_coeff=0.01),
    "moe_shared": ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                              num_kv_heads=2, vocab_size=128, max_seq_len=64, rope_theta=10000.0, norm_eps=1e-5,
                              qk_norm=True, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
                              moe_shared_expert_intermediate_size=40, moe_norm_topk_prob=False,
                              moe_aux_loss_coeff=0.02, moe_z_loss_coeff=1e-3),
}
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen_tied": "Qwen2ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
SHARED_MOE = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_kv_heads=2,
                         vocab_size=96, max_seq_len=64, qk_norm=True, kv_channels=24, num_experts=4,
                         moe_router_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=48,
                         moe_norm_topk_prob=False, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3)
"""Ours, exported: QK-norm, head_dim 24, a shared expert, softmax before top-k (no HF family has it)."""


def _hf_model(path: str, cls, **fields):
    """A random HF model with weights larger than the default init, saved at ``path``."""
    torch.manual_seed(5)
    model = cls(cls.config_class(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **fields))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path)
    return path


def _random_ours(root: str, cfg: ModelConfig) -> str:
    """Our checkpoint (iteration 2) of a random ``cfg`` language model."""
    gen = torch.Generator().manual_seed(11)
    full = {n: torch.randn(shape, generator=gen) * 0.3 for n, shape in model_shapes(cfg, "lm").items()}
    save_model(root, 2, "actor", cfg, "lm", full)
    return root


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM

    root = tmp_path_factory.mktemp("megatron")
    sources = {"qwen2": _hf_model(str(root / "qwen2"), Qwen2ForCausalLM),
               "qwen3": _hf_model(str(root / "qwen3"), Qwen3ForCausalLM, head_dim=20),
               "qwen3_moe": _hf_model(str(root / "qwen3_moe"), Qwen3MoeForCausalLM, num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)}
    ours, exported = {}, {}
    for name, hf in sources.items():
        ours[name] = str(root / "ours" / name)
        assert convert_checkpoint.main(["hf-to-ours", "--hf", hf, "--out", ours[name], "--iteration", "4"]) == 0
    ours["moe_shared"] = _random_ours(str(root / "ours" / "moe_shared"), SHARED_MOE)
    for name, path in ours.items():
        exported[name] = str(root / "exported" / name)
        assert convert_checkpoint.main(["ours-to-megatron", "--load", path, "--out", exported[name]]) == 0
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    results = launch(2, "scenario_megatron:run", root=str(root / "saved"), cases=CASES, ids=ids,
                     ours_to_megatron={name: open_megatron(path).path for name, path in exported.items()})
    dirs = {case["name"]: str(root / "saved" / case["name"]) for case in CASES}
    return {"root": root, "dirs": dirs, "ours": ours, "exported": exported, "ids": ids, "results": results}


@pytest.mark.parametrize("name, layout", [(c["name"], layout) for c in CASES for layout in ("tp1", "pp2", "ep2")
                                          if layout != "ep2" or c["name"] in MOE_CASES])
def test_megatron_lm_checkpoint_loads_into_our_actor(setup, name, layout):
    errs = [r[f"{name}/{layout}"]["err"] for r in setup["results"] if r[f"{name}/{layout}"]]
    scale = max(r[f"{name}/{layout}"]["scale"] for r in setup["results"] if r[f"{name}/{layout}"])
    assert len(errs) == (1 if layout == "pp2" else 2)  # both DP (EP) replicas / the last stage report
    # TP2 (the saving model) and TP1/PP2 (ours) sum in different orders: float32 rounding, which grows with
    # the logits (up to 8.3 here; 1.1e-5 measured on an AMD EPYC host, under 1e-5 on others). A conversion
    # error (a swapped head, a missed norm or bias, a misplaced expert) is of the logits' own size.
    assert max(errs) < 4e-6 * scale, (max(errs), scale)


@pytest.mark.parametrize("name", sorted(HF_ARCHITECTURES))
def test_megatron_to_hf_gives_the_saving_models_logits(setup, name, tmp_path):
    from transformers import AutoModelForCausalLM

    out = str(tmp_path / "hf")
    assert convert_checkpoint.main(["megatron-to-hf", "--megatron", setup["dirs"][name], "--out", out]) == 0
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == HF_ARCHITECTURES[name]
    assert model.config.tie_word_embeddings == (name == "qwen_tied")
    with torch.no_grad():
        logits = model(setup["ids"]).logits
    assert (logits - setup["results"][0]["expected"][name]).abs().max() < 1e-4


def test_a_shared_expert_has_no_hf_family(setup, tmp_path, capsys):
    out = str(tmp_path / "hf")
    assert convert_checkpoint.main(["megatron-to-hf", "--megatron", setup["dirs"]["moe_shared"], "--out", out]) == 2
    assert "Qwen3-MoE has no shared expert: moe_shared_expert_intermediate_size=40" in capsys.readouterr().err


@pytest.mark.parametrize("name", [c["name"] for c in CASES])
def test_args_become_our_model_config(setup, name):
    ckpt = open_megatron(setup["dirs"][name])
    assert ckpt.config == EXPECTED_CONFIGS[name]
    assert (ckpt.role, ckpt.iteration) == ("lm", next(c["iteration"] for c in CASES if c["name"] == name))
    assert os.path.basename(ckpt.path) == f"iter_{ckpt.iteration:07d}"


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "qwen3_moe", "moe_shared"])
def test_ours_to_megatron_loads_into_megatron_cores_own_gpt_model(setup, name):
    """Every weight bit for bit; a MoE model's experts split over two EP ranks, each loading its own."""
    _, _, ours = read_full_state(setup["ours"][name], "actor")
    experts = set()
    for rank in setup["results"]:
        loaded = rank["ours_to_megatron"][name]
        assert all(torch.equal(loaded[n], ours[n]) for n in loaded)
        experts |= {n for n in loaded if ".local_experts." in n}
        assert sorted(n for n in loaded if ".local_experts." not in n) == sorted(n for n in ours if ".local_experts."
                                                                                 not in n)
    assert experts == {n for n in ours if ".local_experts." in n}
    assert len(experts) == (16 if "moe" in name else 0)


def test_qwen3_and_moe_args_round_trip(setup):
    """ours -> Megatron-LM -> ours: the same config (QK-norm, kv_channels, every MoE field) and tensors,
    and the args Megatron-LM reads for them."""
    for name in ("qwen3", "qwen3_moe", "moe_shared"):
        cfg, _, ours = read_full_state(setup["ours"][name], "actor")
        ckpt = open_megatron(setup["exported"][name])
        assert ckpt.config == cfg and cfg.qk_norm and cfg.kv_channels == {"qwen3": 20, "moe_shared": 24}.get(name)
        got = read_megatron_state(ckpt)
        assert sorted(got) == sorted(ours) and all(torch.equal(got[n], ours[n]) for n in ours)
    args = torch.load(os.path.join(open_megatron(setup["exported"]["moe_shared"]).path, "common.pt"),
                      weights_only=False)["args"]
    assert (args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size, args.moe_shared_expert_intermediate_size,
            args.moe_router_pre_softmax, args.moe_router_load_balancing_type, args.moe_aux_loss_coeff,
            args.moe_z_loss_coeff, args.qk_layernorm, args.kv_channels, args.expert_model_parallel_size) == \
        (4, 2, 32, 48, True, "aux_loss", 0.01, 1e-3, True, 24, 1)
    dense = torch.load(os.path.join(open_megatron(setup["exported"]["qwen3"]).path, "common.pt"),
                       weights_only=False)["args"]
    assert (dense.num_experts, dense.qk_layernorm, dense.kv_channels) == (None, True, 20)


def test_moe_keys_are_megatron_cores(setup):
    """The MoE keys and global shapes megatron-core wrote, and those we write: the same, but for the
    TE spec's name of the pre-MLP norm (a MoE layer), written too; per-layer keys where layers are not stacked."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    def tensors(path):
        md = open_megatron(path).metadata.state_dict_metadata
        return {k: tuple(v.size) for k, v in md.items() if isinstance(v, TensorStorageMetadata)}

    saved = tensors(setup["dirs"]["moe_shared"])
    moe_keys = {k: v for k, v in saved.items() if k.startswith("decoder.layers.") and ("mlp." in k or "layernorm" in k)}
    assert moe_keys == {
        "decoder.layers.mlp.router.weight": (2, 4, 64),
        "decoder.layers.mlp.experts.experts.linear_fc1.weight": (2, 4, 96, 64),
        "decoder.layers.mlp.experts.experts.linear_fc2.weight": (2, 4, 64, 48),
        "decoder.layers.mlp.shared_experts.linear_fc1.weight": (2, 80, 64),
        "decoder.layers.mlp.shared_experts.linear_fc2.weight": (2, 64, 40),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": (2, 64),
        "decoder.layers.self_attention.q_layernorm.weight": (2, 16),
        "decoder.layers.self_attention.k_layernorm.weight": (2, 16)}
    ours = tensors(setup["exported"]["moe_shared"])
    assert set(ours) - set(saved) == {"decoder.layers.pre_mlp_layernorm.weight"}
    per_layer = tensors(setup["dirs"]["qwen3_moe"])  # non-homogeneous layers: a key per layer
    assert (per_layer["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"],
            per_layer["decoder.layers.1.self_attention.q_layernorm.weight"]) == ((4, 64, 64), (20,))


def test_megatron_to_ours_and_back_keeps_every_tensor(setup, tmp_path):
    ckpt = open_megatron(setup["dirs"]["qwen_tied"])
    full = read_megatron_state(ckpt)
    assert torch.equal(full["output_layer.weight"], full["embedding.word_embeddings.weight"])  # tied
    ours = str(tmp_path / "ours")
    assert convert_checkpoint.main(["megatron-to-ours", "--megatron", setup["dirs"]["qwen_tied"], "--out", ours]) == 0
    cfg, role, saved = read_full_state(ours, "actor")
    assert (cfg, role) == (ckpt.config, "lm") and os.path.isdir(os.path.join(ours, "iter_0000003"))
    assert sorted(saved) == sorted(full) and all(torch.equal(saved[n], full[n]) for n in full)
    again = ["megatron-to-ours", "--megatron", setup["dirs"]["qwen_tied"], "--out", ours]
    assert convert_checkpoint.main(again) == 2  # iteration 3 exists: refused, not overwritten
    back = str(tmp_path / "back")
    assert convert_checkpoint.main(["ours-to-megatron", "--load", ours, "--out", back]) == 0
    again = open_megatron(back)
    assert again.config == ckpt.config
    assert all(torch.equal(t, full[n]) for n, t in read_megatron_state(again).items())
    assert "output_layer.weight" not in again.metadata.state_dict_metadata  # still tied


def test_a_stage_reads_only_its_own_layers(setup, monkeypatch):
    """Pipeline stage 1 of 2 asks for layer 1 and the head: only chunks of layer 1 (and whole tensors) are read,
    and the tensors equal those of a full read."""
    import torch.distributed.checkpoint as dcp

    ckpt = open_megatron(setup["dirs"]["llama"])
    full = read_megatron_state(ckpt)
    reads, real = [], dcp.FileSystemReader.read_data

    def spy(self, plan, planner):
        reads.extend((r.storage_index.fqn, tuple(r.storage_index.offset)) for r in plan.items)
        return real(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemReader, "read_data", spy)
    stage1 = ["decoder.layers.1.mlp.linear_fc1.weight", "decoder.layers.1.input_layernorm.weight",
              "decoder.final_layernorm.weight", "output_layer.weight"]
    got = read_megatron_state(ckpt, stage1)
    assert sorted(got) == sorted(stage1) and all(torch.equal(got[n], full[n]) for n in stage1)
    layer_reads = [offset for key, offset in reads if key.startswith("decoder.layers.")]
    assert layer_reads and all(offset[0] == 1 for offset in layer_reads)
    assert {key for key, _ in reads} == {"decoder.layers.mlp.linear_fc1.weight", "output_layer.weight",
                                         "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
                                         "decoder.final_layernorm.weight"}
    assert len([k for k, _ in reads if k == "decoder.layers.mlp.linear_fc1.weight"]) == 4  # 2 TP ranks x [gate; up]


def test_critic_starts_from_the_language_model_with_a_new_head(setup):
    lm = setup["dirs"]["llama"]
    critic = open_source(lm, "critic")
    assert critic.new_head and critic.format == "megatron"
    names = ["decoder.final_layernorm.weight", "output_layer.weight"]
    got = read_weights(critic, names, head_seed=3)
    assert got["output_layer.weight"].shape == (1, 64)
    assert torch.equal(got["decoder.final_layernorm.weight"],
                       read_megatron_state(open_megatron(lm), names[:1])[names[0]])
    with pytest.raises(ModelSourceError, match="frozen, so it needs a trained one"):
        open_source(lm, "reward")


def test_value_models_round_trip_as_megatron_checkpoints(setup, tmp_path):
    from transformers import LlamaForCausalLM

    value = str(tmp_path / "value")
    hf = _hf_model(str(tmp_path / "hf"), LlamaForCausalLM)
    assert convert_checkpoint.main(["hf-to-ours", "--hf", hf, "--out", value, "--role", "value",
                                    "--model-name", "reward"]) == 0
    out = str(tmp_path / "megatron")
    assert convert_checkpoint.main(["ours-to-megatron", "--load", value, "--model-name", "reward", "--out", out]) == 0
    reward = open_source(out, "reward")
    assert not reward.new_head and open_megatron(out).role == "value"
    _, _, want = read_full_state(value, "reward")
    got = read_weights(reward, list(want), head_seed=0)
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_load_megatron_flags_fill_the_job(setup, tmp_path, capsys):
    cfg = parse_args(["--actor-load-megatron", setup["dirs"]["llama"], "--critic-load-megatron",
                      setup["dirs"]["llama"], "--reference-model", setup["dirs"]["llama"]])
    assert cfg.models.actor == cfg.models.critic == EXPECTED_CONFIGS["llama"]
    assert dict(cfg.models.weights) == {m: setup["dirs"]["llama"] for m in ("actor", "critic", "reference")}
    with pytest.raises(UsageError, match=r"^--reward-load-megatron \S+: Megatron-LM checkpoint .* is a language "
                                         "model without a value head; the reward model is frozen"):
        parse_args(["--reward-load-megatron", setup["dirs"]["llama"]])
    with pytest.raises(UsageError, match=r"^--actor-load-megatron \S+: \S+/latest_checkpointed_iteration.txt: no "
                                         "such file; give the directory Megatron-LM saved into"):
        parse_args(["--actor-load-megatron", setup["ours"]["qwen2"]])
    with pytest.raises(SystemExit):
        parse_args(["--actor-load-megatron", setup["dirs"]["llama"], "--actor-model", "tiny-critic"])
    assert "not allowed with argument" in capsys.readouterr().err


def _broken(setup, tmp_path, edit) -> str:
    """A copy of the llama checkpoint changed by ``edit(iteration directory)``."""
    path = str(tmp_path / "broken")
    shutil.copytree(setup["dirs"]["llama"], path)
    edit(os.path.join(path, "iter_0000007"))
    return path


def _edit_common(**changes):
    def edit(it_dir):
        path = os.path.join(it_dir, "common.pt")
        common = torch.load(path, weights_only=False)  # our own test file
        args = vars(common["args"])
        for key, value in changes.items():
            if key == "checkpoint_version":
                common[key] = value
            else:
                args[key] = value
        torch.save(common, path)
    return edit


BAD_INPUT = {
    "moe_without_experts": (_edit_common(num_experts=4),
                            r"/.metadata: no tensor for decoder.layers.0.mlp.router.weight \(as "
                            r"decoder.layers.mlp.router.weight\), which the args in \S+common.pt imply \(num_experts, "
                            r"hidden_size\); the args and the shards disagree"),
    "qk_norm_missing": (_edit_common(qk_layernorm=True),
                        r"/.metadata: no tensor for decoder.layers.0.self_attention.q_layernorm.weight .* "
                        r"\(qk_layernorm, kv_channels\)"),
    "qk_l2_norm": (_edit_common(qk_l2_norm=True), r"common.pt: args.qk_l2_norm=True: L2 query/key norms are not "
                                                  r"supported \(qk_layernorm is\)"),
    "moe_dense_layers": (_edit_common(num_experts=4, moe_layer_freq=[0, 1]),
                         r"common.pt: args.moe_layer_freq=\[0, 1\]: only MoE layers throughout \(moe_layer_freq=1\) "
                         "are supported, not dense layers between them"),
    "moe_layer_freq_2": (_edit_common(num_experts=4, moe_layer_freq=2), r"common.pt: args.moe_layer_freq=2: "),
    "moe_sigmoid": (_edit_common(num_experts=4, moe_router_score_function="sigmoid"),
                    "common.pt: args.moe_router_score_function='sigmoid': only softmax router scores are supported"),
    "moe_group_limited": (_edit_common(num_experts=4, moe_router_num_groups=2, moe_router_group_topk=1),
                          "common.pt: args.moe_router_num_groups=2: group-limited routing is not supported"),
    "moe_expert_bias": (_edit_common(num_experts=4, moe_router_enable_expert_bias=True),
                        r"common.pt: args.moe_router_enable_expert_bias=True: a router expert bias \(aux-loss-free "
                        r"load balancing\) is not supported"),
    "moe_topk_scaling": (_edit_common(num_experts=4, moe_router_topk_scaling_factor=2.5),
                         "common.pt: args.moe_router_topk_scaling_factor=2.5: scaled routing weights are not "
                         "supported"),
    "moe_sinkhorn": (_edit_common(num_experts=4, moe_router_load_balancing_type="sinkhorn"),
                     r"common.pt: args.moe_router_load_balancing_type='sinkhorn': only 'aux_loss' \(or 'none'\) "),
    "moe_two_losses": (_edit_common(num_experts=4, moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"]),
                       r"common.pt: args.moe_router_load_balancing_type=\['aux_loss', 'seq_aux_loss'\]: "),
    "moe_shared_gate": (_edit_common(num_experts=4, moe_shared_expert_intermediate_size=64,
                                     moe_shared_expert_gate=True),
                        "common.pt: args.moe_shared_expert_gate=True: a gated shared expert is not supported"),
    "learned_positions": (_edit_common(position_embedding_type="learned_absolute"),
                          r"common.pt: args.position_embedding_type='learned_absolute': only RoPE \('rope'\) is "
                          "supported, not learned absolute positions"),
    "version": (_edit_common(checkpoint_version=2.0), r"common.pt: checkpoint_version=2.0; only 3.0 "),
    "ffn_disagrees": (_edit_common(ffn_hidden_size=128),
                      r"/.metadata: decoder.layers.mlp.linear_fc1.weight has shape \[2, 192, 64\], but the args in "
                      r"\S+common.pt \(ffn_hidden_size, hidden_size\) imply \[2, 256, 64\]; the args and the shards "
                      "disagree"),
    "bias_missing": (_edit_common(add_qkv_bias=True),
                     r"/.metadata: no tensor for decoder.layers.0.self_attention.linear_qkv.bias .* the args and "
                     "the shards disagree"),
    "tied_but_untied_shards": (_edit_common(untie_embeddings_and_output_weights=False),
                               "/.metadata: holds output_layer.weight, which the args in .* do not describe"),
    "no_tracker": (lambda d: os.remove(os.path.join(os.path.dirname(d), "latest_checkpointed_iteration.txt")),
                   "latest_checkpointed_iteration.txt: no such file; give the directory Megatron-LM saved into"),
    "bad_tracker": (lambda d: pathlib.Path(os.path.dirname(d), "latest_checkpointed_iteration.txt").write_text("x7"),
                    r"latest_checkpointed_iteration.txt: holds 'x7'; expected an iteration number or 'release'"),
    "not_torch_dist": (lambda d: pathlib.Path(d, "metadata.json").write_text('{"sharded_backend": "zarr"}'),
                       "metadata.json: sharded_backend 'zarr'; only 'torch_dist' is supported"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_checkpoints_are_refused_in_one_line_naming_the_file_and_arg(setup, tmp_path, capsys, case):
    edit, message = BAD_INPUT[case]
    path = _broken(setup, tmp_path, edit)
    assert convert_checkpoint.main(["megatron-to-hf", "--megatron", path, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"convert_checkpoint.py: {path}/") and err.count("\n") == 1, err
    assert re.search(message, err), err
    with pytest.raises(UsageError, match="^--actor-load-megatron " + re.escape(path) + ": " + re.escape(path)):
        parse_args(["--actor-load-megatron", path])


class _Touch:
    """Unpickling this would create ``path``: the test that no loader runs it."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.path),)


def test_pickled_parts_never_run_code(setup, tmp_path):
    marker = tmp_path / "ran"

    def evil_common(it_dir):
        path = os.path.join(it_dir, "common.pt")
        common = torch.load(path, weights_only=False)
        common["args"].hook = _Touch(marker)
        torch.save(common, path)

    path = _broken(setup, tmp_path, evil_common)
    # torch.save's pickle protocol 2 reaches Path.touch through getattr(pathlib.Path, "touch")
    with pytest.raises(MegatronCheckpointError, match=r"common.pt: refused to unpickle builtins.getattr, pathlib.Path: "
                                                      "not on the allow-list"):
        open_megatron(path)
    assert not marker.exists()
    shutil.rmtree(path)

    def evil_metadata(it_dir):
        with open(os.path.join(it_dir, ".metadata"), "wb") as f:
            pickle.dump({"state_dict_metadata": _Touch(marker)}, f, protocol=4)

    path = _broken(setup, tmp_path, evil_metadata)
    with pytest.raises(MegatronCheckpointError, match=r"\.metadata: refused to unpickle pathlib.Path.touch"):
        open_megatron(path)
    assert not marker.exists()
    assert isinstance(torch.load(os.path.join(setup["dirs"]["llama"], "iter_0000007", "common.pt"),
                                 weights_only=False)["args"], argparse.Namespace)
