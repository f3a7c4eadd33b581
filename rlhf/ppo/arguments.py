"""All command-line flags of pretrain_rlhf.py, grouped, parsed into a frozen JobConfig.

Each config section's flags are listed once in ``SECTIONS`` (field, type,
help), read by rlhf/cli.py's flag-table mechanism: the flag is the field's
name with dashes (``ppo.clip_eps`` -> ``--clip-eps``), its default is the
dataclass default, and a ConfigError on that field is reported against that
flag. The placement and model flags are built here.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path
from typing import Mapping

from rlhf.checkpoint.sources import ModelSourceError, open_source
from rlhf.cli import (LOGGING_FLAGS, PRECISION_FLAGS, TIMEOUT_FLAG, UsageError, add_section_flags, flag_name,
                      fraction_or_auto, int_or_auto, load_model_config, optional_float, parse_task_spec,
                      section_configs, section_flag, usage_errors)
from rlhf.config import CheckpointConfig, ConfigError, PlacementConfig, RunConfig
from rlhf.data import named_tokenizer
from rlhf.models.config import LORA_MODULES_TO_SAVE, LORA_TARGET_MODULES, MODEL_PRESETS
from rlhf.ppo.config import (AdaptersConfig, DataConfig, FusionConfig, GenerationConfig, JobConfig, MemoryConfig,
                             ModelsConfig, PPOConfig, RewardConfig)
from rlhf.tasks import MODELS, TASKS


def _auto_or_name(text: str):
    """'auto' -> None (the estimator's default), else the name."""
    return None if text.lower() == "auto" else text


def _token_ids(text: str) -> tuple:
    """'2,32000' -> (2, 32000)."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of token ids") from None


def _projections(text: str) -> tuple:
    """'q_proj,v_proj' -> ('q_proj', 'v_proj'); PEFT's 'all-linear' -> every projection (checked by the config)."""
    if text.strip().lower() == "all-linear":
        return LORA_TARGET_MODULES
    return _names(text)


def _names(text: str) -> tuple:
    """'lm_head,norm' -> ('lm_head', 'norm') (checked by the config)."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _lora_flags(model: str, prefix: str) -> list:
    """The flag table rows of one model's LoRA fields (``prefix``: ``lora_`` or ``critic_lora_``)."""
    saved = ",".join(m for m in LORA_MODULES_TO_SAVE if model == "actor" or m != "lm_head")  # a critic's head trains
    return [
        (prefix + "rank", int, f"LoRA rank r of the {model}'s adapters: only they are trained (megatron's DDP and "
                               f"optimizer see nothing else{', bar the value head' if model == 'critic' else ''}); "
                               "0: full fine-tuning (docs/lora.md)"),
        (prefix + "alpha", optional_float, f"LoRA alpha of the {model}: the adapters' output is scaled by alpha / r "
                                           "as PEFT ('none': the rank, scale 1)"),
        (prefix + "dropout", float, f"dropout on the input of the {model}'s adapters in training (PEFT's "
                                    "lora_dropout)"),
        (prefix + "target_modules", _projections, f"the {model}'s projections that get adapters, PEFT's names "
                                                  f"comma-separated: {','.join(LORA_TARGET_MODULES)} (or "
                                                  "all-linear)"),
        (prefix + "modules_to_save", _names, f"modules of the {model} trained in full beside its adapters, PEFT's "
                                             f"modules_to_save names comma-separated: {saved} (lm_head: the output "
                                             "layer; norm: every RMSNorm); default: none"),
    ]


def _auto_switch(text: str):
    """'auto' -> None (the platform decides), 'on' -> True, 'off' -> False."""
    choices = {"auto": None, "on": True, "off": False}
    if text.lower() not in choices:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of auto, on, off")
    return choices[text.lower()]


_LOGGING_CONFIG, _LOGGING_TITLE, _LOGGING_FIELDS = LOGGING_FLAGS  # both programs' logging flags, and ours

SECTIONS = {
    "run": (RunConfig, "run", [
        ("iterations", int, "total PPO iterations; a resumed run continues to this number "
                            "(alias --train-iters, as Megatron-LM)"),
        ("seed", int, "random seed of weights, data order and sampling, in [0, 2**28 - 1]"),
        TIMEOUT_FLAG,
    ]),
    "generation": (GenerationConfig, "generation", [
        ("max_prompt_len", int, "longest prompt in tokens (BOS included)"),
        ("max_response_len", int, "tokens generated at most per sample"),
        ("temperature", float, "sampling temperature (0: greedy)"),
        ("top_p", float, "nucleus sampling mass (1: off)"),
        ("top_k", int, "sample among the k most likely tokens (0: all)"),
        ("long_tail_median", int, "the long-tailed measurement workload (0: off): each sample's response "
                                  "length is drawn from a lognormal with this median in tokens (p99.9 about 12x "
                                  "it), capped at --max-response-len, and EOS is ignored (docs/fusion.md)"),
        ("stop_token_ids", _token_ids, "more ids that end a response, 'ID,ID', besides the tokenizer's EOS and every "
                                       "eos_token_id of the model's generation_config.json (the response keeps its "
                                       "stop token)"),
        ("environment", str, "MODULE:CLASS of an rlhf.envs.environment.Environment: every sample becomes a "
                             "multi-turn episode, the environment answering each model turn (tool results, a "
                             "user) until it says done; its rewards, summed per episode, are the reward, and "
                             "its observations are trained on as context only (docs/agents.md)"),
        ("agent", str, "MODULE:FUNCTION of an agent written against the openai client, fn(client, prompt) -> "
                       "reward: it runs once per sample on a host thread with a client tied to that sample's "
                       "episode, its chat requests are the model's turns (token in, token out) and its return "
                       "value is the reward (docs/agents.md)"),
        ("max_turns", int, "with --environment or --agent: model turns per episode at most (--max-response-len "
                           "bounds the episode's turns and observations together)"),
        ("max_turn_tokens", int, "with --environment or --agent: tokens per model turn at most (0: no limit but "
                                 "--max-response-len)"),
        ("cuda_graphs", bool, "on a GPU, run the engine's decode steps at static shapes (batch padded to a power "
                              "of two) and replay each as a CUDA graph; no effect on the CPU (docs/engine.md)"),
    ]),
    "ppo": (PPOConfig, "PPO", [
        ("rollout_batch_size", int, "prompts per iteration"),
        ("n_samples_per_prompt", int, "samples generated per prompt (they share the prompt's KV cache)"),
        ("ppo_mini_batch_size", int, "samples per optimizer step; must divide rollout_batch_size x "
                                     "n_samples_per_prompt, and be a multiple of DP x micro-batch size"),
        ("ppo_epochs", int, "passes over the iteration's samples"),
        ("micro_batch_size", int, "samples per micro-batch (training and inference)"),
        ("max_tokens_per_microbatch", int_or_auto, "sequence packing: micro-batches of consecutive samples while "
                                                   "their tokens (prompt + response) fit this budget, each packed "
                                                   "into one row without padding, attention kept within each sample "
                                                   "(training and inference); at least --max-prompt-len + "
                                                   "--max-response-len. 0: --micro-batch-size samples padded to the "
                                                   "longest. auto (None): on a GPU the largest budget whose "
                                                   "predicted peak fits the card (--dry-run shows it), padded on the "
                                                   "CPU and with --intra-stage-fusion (rlhf/ppo/memory_plan.py)"),
        ("lr", float, "actor learning rate"),
        ("critic_lr", float, "critic learning rate"),
        ("clip_grad", float, "clip each model's global gradient norm to this (0: off)"),
        ("weight_decay", float, "AdamW weight decay of matrices (1-D parameters get none)"),
        ("lr_warmup_iters", int, "optimizer steps of linear LR warm-up from 0 (steps: ppo_epochs x mini-batches "
                                 "per iteration)"),
        ("lr_decay_style", str, "LR after the warm-up: constant, linear or cosine (to --min-lr at --lr-decay-iters)"),
        ("lr_decay_iters", int, "optimizer step at which the decay reaches --min-lr"),
        ("min_lr", float, "the LR the decay ends at"),
        ("use_distributed_optimizer", bool, "shard the optimizer state and update over each model's DP group "
                                            "(megatron's distributed optimizer, ZeRO-1)"),
        ("overlap_grad_reduce", _auto_switch, "start each gradient bucket's DP reduction during the last "
                                              "micro-batch's backward: auto (on where a GPU computes; None), on, off"),
        ("clip_eps", float, "PPO ratio clip range (the lower one with --clip-eps-high)"),
        ("clip_eps_high", optional_float, "upper ratio clip range, clip-higher as DAPO ('none': --clip-eps)"),
        ("dual_clip", optional_float, "dual-clip constant c > 1: a negative advantage's loss is capped at -c A "
                                       "('none': off)"),
        ("value_clip", optional_float, "value clip range around the old values ('none': off)"),
        ("kl_coef", float, "KL penalty coefficient (the initial one with --kl-target)"),
        ("kl_target", optional_float, "KL per sequence the adaptive controller aims at ('none': fixed "
                                       "coefficient); peers' targets are per token: multiply by the mean response "
                                       "length"),
        ("kl_horizon", int, "the adaptive controller's horizon in samples"),
        ("kl_estimator", _auto_or_name, "per-token KL estimator: k1, k2 or k3 (k3 clamped as verl); auto: k3 "
                                        "with the KL in the loss (k1 there has zero expected gradient and is "
                                        "refused), k1 in the rewards"),
        ("kl_in", _auto_or_name, "where the KL penalty acts: reward (in the token rewards) or loss (a term of the "
                                 "actor loss); auto: loss for grpo and dr-grpo, reward otherwise"),
        ("gamma", float, "discount"),
        ("lam", float, "GAE lambda"),
        ("advantage_estimator", str, "gae (needs a critic), grpo, dr-grpo, rloo, reinforce++ or "
                                     "reinforce++-baseline (no critic tasks run)"),
        ("whiten_advantages", bool, "whiten GAE advantages over the batch's response tokens"),
        ("loss_agg", str, "how per-token losses become the loss: token-mean, seq-mean-token-sum or "
                          "seq-mean-token-mean (verl's names), exact over DP replicas and micro-batches"),
        ("entropy_coef", float, "entropy bonus coefficient of the actor loss (0: off)"),
        ("mask_truncated", bool, "leave samples cut at --max-response-len out of the loss (TRL's "
                                 "mask_truncated_completions); by default they are trained like finished ones"),
        ("overlong_penalty", str, "DAPO's soft overlong punishment 'LEN,COEF': a response longer than "
                                  "max_response_len - LEN loses COEF x the overflow / LEN of its score"),
        ("tis_cap", optional_float, "truncated importance sampling of the rollout policy: weight each token by "
                                     "min(exp(old - rollout log-prob), cap) (needs --recompute-logprobs; 'none': "
                                     "off)"),
        ("tis_mode", str, "token (a weight per token) or sequence (one weight per sample) for --tis-cap"),
        ("critic_warmup", int, "iterations that train the critic alone before the actor starts"),
        ("max_skipped_steps", int, "stop the run, naming the model, once this many of its optimizer steps in a "
                                   "row were skipped for non-finite gradients (checked after each iteration, alike "
                                   "on every rank; 0: never). A skipped step leaves the weights as they were, so a "
                                   "model that skips step after step has stopped learning: 10 lets a few bad "
                                   "batches pass and stops such a run within a few iterations; fp16 overflows "
                                   "that the dynamic loss scale still backs off from (it starts at 2**32, as "
                                   "Megatron-LM's) do not count"),
        ("recompute_logprobs", bool, "recompute the old log-probs on actor_train instead of taking the "
                                     "engine's (also reports mismatch_kl: the engine vs the trainer)"),
        ("max_staleness", int, "asynchronous RL: actor_gen, placed on ranks of its own (without --placement "
                               "the built-in plan does so on 2 or more ranks), generates the next K "
                               "iterations' batches while the other ranks train, so a batch is trained at most "
                               "K policy versions after the weights that generated it; the old log-probs are "
                               "recomputed (decoupled PPO's proximal policy; --tis-cap weights proximal over "
                               "behaviour); 0: synchronous (docs/async.md)"),
        ("partial_rollouts", bool, "with --max-staleness K: generation runs free between iterations, keeps the "
                                   "batches the bound allows in flight and takes each actor update's weights "
                                   "mid-sample (tokens and rollout log-probs kept, each token's policy version "
                                   "recorded); samples span updates from K = 2"),
        ("partial_rollout_kv", str, "the K/V of samples in flight when new weights arrive: recompute (prefill "
                                    "again under the new weights, exact) or keep (cheaper; later tokens attend "
                                    "to the old weights' K/V)"),
        ("routing_replay", bool, "a mixture-of-experts actor's old log-prob passes and training forwards use the "
                                 "experts the engine chose for each token (verl's R3, slime's routing replay), "
                                 "the router still trained at them; without it they route on their own, and "
                                 "routing_agreement reports how often the two agree (docs/moe.md)"),
    ]),
    "logging": (_LOGGING_CONFIG, _LOGGING_TITLE, [*_LOGGING_FIELDS, (
        "log_samples", int, "print one decoded prompt and response with its reward every this many iterations "
                            "(0: never)")]),
    "fusion": (FusionConfig, "fusion", [
        ("intra_stage_fusion", bool, "run actor and critic training as one fused pipeline schedule (they must "
                                     "be placed on the same ranks in opposite directions)"),
        ("schedule", str, "the fused schedule file (tools/search_schedule.py --out), checked against the "
                          "placement and micro-batch counts at start-up; without it the first iteration runs "
                          "serial 1F1B, measures every stage's forward and backward time and a fused schedule "
                          "is searched for them"),
        ("search_budget", float, "nominal seconds of that search's annealing (a fixed proposal count)"),
        ("inter_stage_fusion", bool, "migrate generation's long tail to a few instances once few samples are "
                                     "left, and infer the finished samples (reference, reward, critic) on the "
                                     "freed ranks while those generate (needs actor_gen dp >= 2; docs/fusion.md)"),
        ("migration_threshold", fraction_or_auto, "migrate when the unfinished samples are at most this fraction "
                                                   "of the batch (0: never; 1: at the first count); auto: 0.2 "
                                                   "in the first iteration, then the fusion policy's simulated "
                                                   "best for the lengths and times measured so far"),
        ("migrate_kv", str, "move a migrated sample with its K/V (yes), as tokens that the destination "
                            "prefills again (no), or the cheaper of the two as measured (auto)"),
        ("migration_check_every", int, "engine steps between the instances' counts of unfinished samples "
                                       "(one small all-gather each)"),
    ]),
    "checkpoint": (CheckpointConfig, "checkpointing", [
        ("save", str, "checkpoint root to save into (atomic; <root>/iter_N, <root>/latest)"),
        ("save_interval", int, "save every this many iterations (and after the last; default: only after the "
                               "last)"),
        ("keep_last", int, "keep only the N newest checkpoints under --save: older ones are deleted once a "
                           "newer one is complete (default: keep all)"),
        ("load", str, "checkpoint root to resume from: models, optimizers, LR schedules, KL controller, RNG "
                      "and data position; the run continues to --iterations. The same root as --save makes a "
                      "relaunch with the same command (or a torchrun restart) continue from the newest complete "
                      "checkpoint, or start fresh before the first save"),
        ("save_format", str, "ours, or torch_dist: also write each saved actor as a Megatron-LM torch_dist "
                             "checkpoint in <save>/megatron"),
    ]),
    "data": (DataConfig, "tokenizer and prompts", [
        ("tokenizer", str, "'byte' or an HF tokenizer directory (None: the actor directory's tokenizer with "
                           "--prompt-data, when it has one; else byte); a model given as a preset has its ids"),
        ("prompt_data", str, "JSONL or Parquet file of prompt records (None: the built-in synthetic task)"),
        ("prompt_field", str, "record field holding the prompt text"),
        ("messages_field", str, "record field holding chat messages [{role, content}] to render with the "
                                "tokenizer's chat template (instead of --prompt-field)"),
        ("chat_template", bool, "wrap each text prompt as one user message in the tokenizer's chat template"),
        ("add_generation_prompt", bool, "end chat-template prompts where the assistant's answer starts"),
        ("prompt_overlong", str, "prompts longer than --max-prompt-len: 'reject' (dropped, counted) or "
                                 "'truncate_left' (keep their end)"),
    ]),
    "reward": (RewardConfig, "rewards", [
        ("reward_fn", str, "MODULE:FUNCTION, fn(prompts, responses) -> one number per sample (token-id lists; "
                           "a response may end with EOS). Alone: it is the reward and no reward model runs; with "
                           "--reward-model: logged as gold_reward_mean (None: the synthetic task's gold rule "
                           "without --prompt-data)"),
        ("skip_nonfinite_samples", bool, "a sample whose score (--reward-fn's, or the reward model's) is NaN or "
                                         "infinite is dropped instead of stopping the run: its tokens leave every "
                                         "loss, the KL, the value targets, the whitening and its GRPO/RLOO group, "
                                         "its score the reward metrics; nonfinite_samples_dropped counts them"),
    ]),
    "precision": PRECISION_FLAGS,
    "lora": (AdaptersConfig, "LoRA adapters (docs/lora.md)", _lora_flags("actor", "lora_") +
             _lora_flags("critic", "critic_lora_") +
             [("reference_from_actor_base", bool, "the reference log-probs come from actor_train with the actor's "
                                                  "LoRA adapters disabled: no reference model is built or placed "
                                                  "(ref_inf is dropped from the plan); needs --lora-rank")]),
    "memory": (MemoryConfig, "memory between stages", [
        ("offload_ref_reward", bool, "keep the reference and reward weights in host memory (pinned on a GPU "
                                     "host) between their inference passes: each pass copies them to the device "
                                     "and frees the copy after, so generation and training have that memory; "
                                     "costs one host-to-device copy of both models per iteration"),
        ("release_generation_memory", bool, "free actor_gen's weights and the engine's KV cache after generation "
                                            "and allocate them again, zero-filled, at the next reshard, so "
                                            "inference and training have that memory; costs a free, an "
                                            "allocation and a memset per iteration (and may fragment a GPU "
                                            "allocator's cache), so it is off unless actor_gen shares devices "
                                            "with tasks short of memory"),
        ("recompute_granularity", str, "activation recomputation of the trained models (actor_train, "
                                       "critic_train), as Megatron-LM: full (recompute whole transformer layers in "
                                       "the backward, keeping only each chunk's input) or selective (recompute the "
                                       "core attention); none by default. Same results, less activation memory, "
                                       "more compute"),
        ("recompute_num_layers", int, "with --recompute-granularity full: layers per recomputed chunk (megatron's "
                                      "uniform method; default 1); must divide the layers of each training "
                                      "pipeline stage"),
    ]),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain_rlhf.py",
        description="PPO-based RLHF on Megatron-Core. Launch with torchrun; every task (actor "
        "generation, reference/reward/critic inference, actor/critic training) runs on its own "
        "device mesh with its own (dp, pp, tp).",
    )
    place = parser.add_argument_group("placement (device mesh and parallel strategy per task)")
    place.add_argument("--placement", metavar="FILE",
                       help="JSON/YAML plan mapping each task to {ranks, dp, pp, tp, ep, reverse_pp} (ep: expert "
                            "parallelism of a mixture of experts, docs/moe.md); "
                            "see examples/placement_4ranks.json. Per-task flags below merge into its entries "
                            "field by field (default: that file's plan on 4 ranks, else every task data "
                            "parallel on all ranks; with --max-staleness, a plan with actor_gen on ranks of its "
                            "own, docs/async.md)")
    for task in TASKS:
        place.add_argument(flag_name(task), metavar="SPEC", default=None,
                           help=f"mesh of {task}, e.g. 'tp=2,pp=2,ranks=0-3[,ep=2][,reverse_pp]', or 'none' "
                                "(default: the plan's entry, else all ranks, data parallel only)")

    model = parser.add_argument_group("models (a DIR is an HF model directory or our checkpoint root: shape "
                                      "and weights from it)")
    pairs = {name: model.add_mutually_exclusive_group() for name in MODELS}  # --<model>-model or -load-megatron
    pairs["actor"].add_argument("--actor-model", default="tiny", metavar="PRESET|JSON|DIR",
                       help=f"the actor: a preset ({', '.join(sorted(MODEL_PRESETS))}; its vocabulary is the "
                            "tokenizer's ids) or a JSON file of ModelConfig fields (a shape: seeded random weights), "
                            "or a DIR with a *ForCausalLM or our model 'actor' (default: tiny)")
    pairs["critic"].add_argument("--critic-model", default="tiny-critic", metavar="PRESET|JSON|DIR",
                       help="the critic, same forms; a DIR with a *ForSequenceClassification (value head from "
                            "score.weight), a *ForCausalLM (a new value head) or our model 'critic' (else "
                            "'reward') (default: tiny-critic)")
    pairs["reference"].add_argument("--reference-model", default=None, metavar="DIR",
                       help="the reference: a DIR with a *ForCausalLM or our model 'reference' (else 'actor') "
                            "(default: a copy of the actor's start)")
    pairs["reward"].add_argument("--reward-model", default=None, metavar="DIR",
                       help="the reward model: a DIR with a *ForSequenceClassification or our value model "
                            "'reward' (default: none when --reward-fn is given, whose function is then the reward; "
                            "else, for the synthetic task, one trained at start-up on its gold rule's preference "
                            "pairs; train_reward.py trains one from your preference data)")
    for name in MODELS:
        pairs[name].add_argument(f"--{name}-load-megatron", default=None, metavar="DIR",
                                 help=f"the {name}: a Megatron-LM checkpoint directory (torch_dist, any tp/pp; "
                                      f"its --save: latest_checkpointed_iteration.txt, iter_NNNNNNN/), shape from "
                                      f"its args; instead of --{name}-model (docs/megatron_checkpoints.md)")
    model.add_argument(flag_name("make_vocab_size_divisible_by"), type=int, default=1, metavar="N",
                       help="pad each model's embedding and output layer to a multiple of N x the tp of its "
                            "layouts (the lcm of the tps its weights move between), as Megatron-LM does, so any "
                            "tp can split any vocabulary; the padded ids are never sampled and never saved. "
                            "1 pads only what tp needs: none where tp divides the vocabulary (default: 1)")

    add_section_flags(parser, SECTIONS)
    parser.add_argument("--train-iters", dest="iterations", type=int, help=argparse.SUPPRESS)
    check = parser.add_argument_group("checking a launch")
    check.add_argument("--dry-run", action="store_true",
                       help="check the flags, the placement on --world-size ranks, the model shapes and the fused "
                            "schedule as a launch would, print each task's ranks and layout and each model's size, "
                            "and exit: no process started, no model built, no torchrun needed (default: off)")
    check.add_argument("--world-size", type=int, metavar="N",
                       help="the ranks --dry-run plans for: nodes x GPUs per node (default: none; a real run "
                            "takes the world size from torchrun)")
    return parser


def models_config(args: argparse.Namespace, data: DataConfig) -> ModelsConfig:
    """The four models' shapes and weight directories of the --<model>-model flags: a directory's shape and
    a JSON file's are their own, a preset's has the job tokenizer's ids (:func:`tokenizer_name` of ``data``;
    ConfigError: bad shapes, a tokenizer that cannot be built)."""
    shapes, weights, shape_flags = {}, {}, {}
    for model in MODELS:
        value, flag = getattr(args, f"{model}_model"), f"--{model}-model"
        megatron = getattr(args, f"{model}_load_megatron", None)
        if megatron is not None:
            value, flag = megatron, f"--{model}-load-megatron"
        if value is None:
            continue
        _refuse_quantized(args, model, value, flag)
        if megatron is not None or (Path(value).is_dir() and value not in MODEL_PRESETS):
            try:
                shapes[model], weights[model] = open_source(value, model, megatron=megatron is not None).config, value
            except ModelSourceError as exc:
                raise UsageError(f"{flag} {value}: {exc}") from None
        elif model in ("actor", "critic"):  # the two models with a shape of their own by default
            shape_flags[model] = value, flag
        else:
            raise UsageError(f"{flag} {value}: not a directory; give an HF model directory or our checkpoint root")
    tokenizer_ids = functools.cache(lambda: named_tokenizer(tokenizer_name(data, weights)).vocab_size)
    for model, (value, flag) in shape_flags.items():
        shapes[model] = load_model_config(value, flag, tokenizer_ids)
    return ModelsConfig(**shapes, weights=weights, make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)


def tokenizer_name(data: DataConfig, weights: Mapping[str, str]) -> str:
    """The job's tokenizer: ``data.tokenizer``; else, with prompt data, the one that comes with the actor's
    directory (``weights``: ModelsConfig.weights), when it has one; else "byte" (ConfigError: an actor
    directory that cannot be read)."""
    if data.tokenizer is not None:
        return data.tokenizer
    if data.prompt_data is None or "actor" not in weights:
        return "byte"
    try:
        return open_source(weights["actor"], "actor").tokenizer_dir() or "byte"
    except ModelSourceError as exc:
        raise ConfigError(str(exc), "models.actor") from None


def _refuse_quantized(args: argparse.Namespace, model: str, value: str, flag: str) -> None:
    """UsageError for a GGUF file given as a model (its weights must be dequantized into an HF directory first),
    naming the model's --lora-rank when it is to get adapters: LoRA trains on the base's float weights."""
    lora = {"actor": "lora_rank", "critic": "critic_lora_rank"}.get(model)
    rank = getattr(args, lora, 0) if lora else 0
    gguf = Path(value).is_file() and value.lower().endswith(".gguf")
    quantized = gguf or (Path(value).is_dir() and _hf_quantization(value) is not None)
    if not quantized or (not gguf and not rank):
        return
    fix = (f"dequantize it first: tools/convert_checkpoint.py gguf-to-hf --gguf {value} --out DIR, then {flag} DIR"
           if gguf else "give the float model (tools/convert_checkpoint.py gguf-to-hf dequantizes a GGUF file)")
    what = "a GGUF quantized file" if gguf else f"quantized ({_hf_quantization(value)})"
    if rank:
        raise UsageError(f"{flag_name(lora)}: LoRA adapts the {model}'s float weights, but {flag} {value} is {what}; "
                         f"{fix}")
    raise UsageError(f"{flag} {value}: {what}; {fix}")


def _hf_quantization(path: str) -> str | None:
    """The quantization method an HF directory's config.json declares (None: a float model, or no HF config)."""
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    quant = raw.get("quantization_config") if isinstance(raw, dict) else None
    return None if not quant else str(quant.get("quant_method", "unknown method") if isinstance(quant, dict) else quant)


def flag_of(field_name: str) -> str:
    """The flag that sets a dotted JobConfig field (``ppo.clip_eps`` -> ``--clip-eps``, ``models.critic`` ->
    ``--critic-model``)."""
    section, _, name = field_name.partition(".")
    if section == "models" and name in MODELS:
        return f"--{name}-model"
    if field_name == "models.make_vocab_size_divisible_by":
        return flag_name(name)
    return section_flag(field_name, SECTIONS)


def config_from_args(args: argparse.Namespace) -> JobConfig:
    """The JobConfig of parsed flags; a bad value exits naming its flag."""
    overrides = {t: parse_task_spec(t, getattr(args, t)) for t in TASKS if getattr(args, t)}
    with usage_errors(flag_of):
        sections = section_configs(args, SECTIONS)
        models = models_config(args, sections["data"])
        return JobConfig(placement=PlacementConfig(args.placement, overrides), models=models, **sections)


def parse_args(argv=None) -> JobConfig:
    return config_from_args(build_parser().parse_args(argv))


def dry_run_world_size(args: argparse.Namespace) -> int | None:
    """The world size of a ``--dry-run`` (None: a real run); UsageError for ``--dry-run`` without a
    ``--world-size`` of at least 1, or ``--world-size`` without ``--dry-run``."""
    if not args.dry_run:
        if args.world_size is not None:
            raise UsageError("--world-size: only with --dry-run; a real run takes the world size from torchrun")
        return None
    if args.world_size is None or args.world_size < 1:
        got = "none given" if args.world_size is None else f"got {args.world_size}"
        raise UsageError(f"--world-size: --dry-run needs the number of ranks to plan for ({got}); give nodes x "
                         "GPUs per node, e.g. --world-size 16")
    return args.world_size
