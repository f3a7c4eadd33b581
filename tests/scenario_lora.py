"""4-rank scenario of the LoRA tests: a PEFT-adapted HF Llama loaded into ours, trained 3 Adam steps.

Two layouts of the same 4 ranks: TP2xPP2 (megatron's DDP and optimizer over
the adapters only) and TP2xDP2 with the distributed optimizer (each replica
takes half of every batch). Each loads the HF base with ``load_hf_weights``,
adds adapters (rlhf.models.lora.apply_lora) and fills them from PEFT's files
(rlhf.checkpoint.peft.load_peft), then per batch runs forward and backward
through its pipeline (token-mean cross-entropy), reduces the gradients and
steps. Returns, per layout, the full logits and adapter gradients of the first
batch and the full adapters after the last step (rank 0 of each stage reports),
plus what the optimizer holds. Then the trainer with LoRA (`_trainer_runs`,
`_reference_from_base`), the tiny default learning with LoRA, and LoRA dropout
(`_dropout`): off in inference passes, on in training forwards, the same masks
when megatron recomputes a layer in backward.
"""

import os

import torch
import torch.distributed as dist

from rlhf.checkpoint.hf import load_hf_weights, read_hf_config
from rlhf.checkpoint.peft import load_peft
from rlhf.models import ModelConfig
from rlhf.models.config import LoRAConfig
from rlhf.models.gpt import build_model, eval_mode, stage_forward
from rlhf.models.logprobs import vocab_parallel_log_probs
from rlhf.models.lora import apply_lora, is_adapter
from rlhf.models.naming import named_global_parameters
from rlhf.models.sharding import ShardSpec
from rlhf.optim import ModelOptimizer, OptimizerConfig
from rlhf.parallel import Placement
from rlhf.parallel.groups import build_task_groups, local_groups
from rlhf.ppo.config import AdaptersConfig
from rlhf.parallel.reshard import gather_tp_full, load_full_weights
from rlhf.pipeline.microbatch import pipeline_forward
from rlhf.pipeline.p2p import recv_backward, send_backward
from rlhf.platform import seed_model_parallel_rng
from rlhf.testing.pipeline import stage_pass

PLAN = {"actor_train": {"ranks": "0-3", "tp": 2, "pp": 2}, "critic_train": {"ranks": "0-3", "tp": 2, "dp": 2}}
LAYOUTS = {"tp2pp2": ("actor_train", False), "tp2dp2": ("critic_train", True)}


def _full(model, groups, grads: bool = False) -> dict:
    """Full adapter tensors (or their gradients) of this stage, gathered over TP."""
    tp = groups.mesh.strategy.tp
    return {name: gather_tp_full(p.main_grad if grads else p.data, ShardSpec.of(p, tp), groups.tp).numpy()
            for name, p in named_global_parameters(model).items() if is_adapter(name)}


def _gathered_logits(logits: torch.Tensor, groups) -> torch.Tensor:
    parts = [torch.empty_like(logits) for _ in range(groups.mesh.strategy.tp)]
    dist.all_gather(parts, logits.detach().contiguous(), group=groups.tp)
    return torch.cat(parts, dim=-1).numpy()  # numpy: a tensor's shared memory dies with its worker


def _forward_backward(model, groups, ids: torch.Tensor, hidden: int):
    """One batch through this replica's pipeline: token-mean cross-entropy, backward. The last stage
    returns the full logits, the others None."""
    x, out = stage_pass(model, groups, ids, hidden)
    if not groups.is_last_stage:
        out.backward(recv_backward(out, groups.peer(+1)))
        return None
    loss = -vocab_parallel_log_probs(out[:, :-1], ids[:, 1:], groups.tp).mean()
    loss.backward()
    if x is not None:
        send_backward(x.grad, groups.peer(-1))
    return _gathered_logits(out, groups)


def _train(groups, base_dir: str, adapter_dir: str, batches: list, lr: float, distributed: bool) -> dict:
    cfg = read_hf_config(base_dir).config
    lora, adapters = load_peft(adapter_dir)
    model = build_model(cfg, "lm", groups.pg_collection, groups.stage, seed=5)
    load_hf_weights(model, groups, base_dir)
    apply_lora(model, lora, cfg, seed=5)
    load_full_weights(model, groups, adapters, names=adapters)
    opt = ModelOptimizer(model, groups, OptimizerConfig(lr=lr, clip_grad=0.0, use_distributed_optimizer=distributed))
    trained = [n for n, p in named_global_parameters(model).items() if p.requires_grad]
    out = {"trained": sorted(trained), "optimized": sum(len(g["params"]) for g in opt.param_groups),
           "adapters_here": sum(map(is_adapter, named_global_parameters(model)))}
    dp, dp_rank = groups.mesh.strategy.dp, groups.coord.dp
    for step, ids in enumerate(batches):
        logits = _forward_backward(model, groups, ids.chunk(dp)[dp_rank], cfg.hidden_size)
        opt.reduce_grads()
        if step == 0:
            out["logits"] = logits
            out["grads"] = _full(model, groups, grads=True)
        opt.step()
    out["adapters"] = _full(model, groups)
    out["report"], out["dp_rank"] = groups.tp_rank == 0 and dp_rank == 0, dp_rank
    return out


LORA = AdaptersConfig(lora_rank=4, lora_alpha=8.0, critic_lora_rank=4, critic_lora_target_modules=("q_proj", "v_proj"))


def _max_diff(a: dict, b: dict, names) -> float:
    return max((a[m][k] - b[m][k]).abs().max().item() for m, k in names)


def _base_sources(root: str, full: dict) -> dict:
    """The actor's and critic's starting weights written as our checkpoint roots beside ``root`` (rank 0), as a
    run launched with --actor-model / --critic-model would have them: the LoRA checkpoint records them."""
    from rlhf.checkpoint.rlhf_state import save_model
    from scenario_trainer import RESUME_MODEL

    sources = {m: os.path.join(os.path.dirname(root), f"base_{m}") for m in ("actor", "critic")}
    if dist.get_rank() == 0:
        for model, path in sources.items():
            save_model(path, 0, model, RESUME_MODEL, "lm" if model == "actor" else "value", full[model])
    dist.barrier()
    return sources


def _checkpoint_contents(root: str) -> dict:
    """model -> (tensor names, bytes of its tensor files) of the latest checkpoint under ``root``."""
    from safetensors import safe_open

    from rlhf.checkpoint.storage import checkpoint_path, latest_iteration

    path, out = checkpoint_path(root, latest_iteration(root)), {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            model = name.split("_stage")[0]
            with safe_open(os.path.join(path, name), "pt") as f:
                names = out.setdefault(model, ([], [0]))
                names[0].extend(f.keys())
            names[1][0] += os.path.getsize(os.path.join(path, name))
    return {m: (sorted(names), size[0]) for m, (names, size) in out.items()}


def _trainer_runs(root: str) -> dict:
    """The PPO trainer with LoRA on the actor (all projections) and the critic (q, v; its value head trains),
    every task in scenario_trainer's layout (actor_train TP2xPP2, critic_train PP2xDP2 reversed, the engine
    TP2xDP2), the old log-probs recomputed so the engine's can be compared: 4 iterations straight, and 2,
    save, load into a fresh trainer, 2 more; what the checkpoint holds, and a load onto another base."""
    from rlhf.checkpoint.rlhf_state import BaseMismatchError
    from scenario_trainer import PLAN as TRAINER_PLAN, synthetic_trainer, synthetic_weights, trained_weights

    placement = Placement.from_plan(TRAINER_PLAN, dist.get_world_size())
    full = synthetic_weights(11)
    options = dict(lora=LORA, recompute_logprobs=True, use_distributed_optimizer=True, lr=1e-2,
                   sources=_base_sources(root, full))
    straight = synthetic_trainer(placement, full, mini_batch=4, **options)
    metrics = [straight.step().metrics for _ in range(4)]
    first = synthetic_trainer(placement, full, mini_batch=4, **options)
    for _ in range(2):
        first.step()
    first.save(root)
    contents = _checkpoint_contents(root) if dist.get_rank() == 0 else None
    other = synthetic_trainer(placement, synthetic_weights(12), mini_batch=4, **options)
    try:
        other.load(root)
        refusal = None
    except BaseMismatchError as e:
        refusal = str(e)
    resumed = synthetic_trainer(placement, full, mini_batch=4, **options)
    resumed.load(root)
    resumed_metrics = [resumed.step().metrics for _ in range(2)]
    a, b = trained_weights(straight), trained_weights(resumed)
    names = [(m, k) for m in a for k in a[m]]
    adapters = [(m, k) for m, k in names if is_adapter(k)]
    frozen = [(m, k) for m, k in names if not is_adapter(k) and (m, k) != ("critic", "output_layer.weight")]
    return {"mismatch": [m["mismatch_logprob_abs_max"] for m in metrics],
            "straight_metrics": metrics[2:], "resumed_metrics": resumed_metrics,
            "resume_param_diff": _max_diff(a, b, names), "adapters": len(adapters),
            "b_moved": max(a[m][k].abs().max().item() for m, k in adapters if k.endswith(".B")),  # B starts at 0
            "frozen_moved": _max_diff(a, full, frozen),
            "head_moved": _max_diff(a, full, [("critic", "output_layer.weight")]),
            "contents": contents, "refusal": refusal,
            "base_bytes": {m: sum(4 * t.numel() for k, t in full[m].items() if (m, k) in frozen) for m in a}}


def _reference_from_base() -> dict:
    """--reference-from-actor-base on the trainer's layout without ref_inf: after 2 iterations (the adapters
    trained), its batch's reference log-probs against those a separately built reference (ref_inf holding a
    copy of the initial actor, in a trainer without the flag) gives the same batch, and what was built."""
    import dataclasses

    from scenario_trainer import PLAN as TRAINER_PLAN, synthetic_trainer, synthetic_weights

    world, full = dist.get_world_size(), synthetic_weights(11)
    placement = Placement.from_plan({t: m for t, m in TRAINER_PLAN.items() if t != "ref_inf"}, world)
    lora = dataclasses.replace(LORA, reference_from_actor_base=True)
    trainer = synthetic_trainer(placement, full, mini_batch=4, lora=lora, lr=1e-2)
    batch = [trainer.step() for _ in range(2)][-1].batch
    separate = synthetic_trainer(Placement.from_plan(TRAINER_PLAN, world), full, mini_batch=4, lr=1e-2)
    ref = separate.infer(batch).ref_logprobs
    mask = batch.response_mask.bool()
    return {"ref_diff": (batch.ref_logprobs - ref)[mask].abs().max().item(),
            "policy_vs_ref": (batch.old_logprobs - batch.ref_logprobs)[mask].abs().max().item(),
            "models": sorted(trainer.models), "separate_models": sorted(separate.models)}


def tiny_default_metrics(flags: list, iterations: int) -> list:
    """The tiny default job (its default placement, the random tiny actor and critic) with ``flags``, rewarded by
    the synthetic task's gold rule (no reward model to train first): each iteration's metrics."""
    from rlhf.ppo.arguments import parse_args
    from rlhf.ppo.job import build_trainer
    from rlhf.ppo.layout import build_placement

    config = parse_args(flags + ["--reward-fn", "rlhf.data.synthetic:gold_reward", "--iterations", str(iterations)])
    trainer = build_trainer(config, build_placement(config, dist.get_world_size()))
    return [trainer.step().metrics for _ in range(iterations)]


DROPOUT_CFG = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                          vocab_size=64, max_seq_len=16)
DROPOUT_LORA = LoRAConfig(rank=4, alpha=8.0, dropout=0.5)


def _dropout_model(recompute: str | None, b_seed: int):
    """A one-rank DROPOUT_CFG actor with DROPOUT_LORA's adapters on every projection, B drawn from ``b_seed``
    (not zero, so the adapters act), megatron recomputing every layer in backward when ``recompute`` is 'full'."""
    local = local_groups()
    model = build_model(DROPOUT_CFG, "lm", local.pg_collection, local.stage, seed=5, recompute_granularity=recompute)
    apply_lora(model, DROPOUT_LORA, DROPOUT_CFG, seed=6)
    gen = torch.Generator().manual_seed(b_seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".B"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model, local


def _adapter_grads(model, local, ids: torch.Tensor, seed: int) -> dict:
    """The adapters' gradients of one training forward and backward (token-mean log-likelihood) whose dropout
    masks are drawn from ``seed``."""
    seed_model_parallel_rng(seed)
    model.zero_grad()
    (-vocab_parallel_log_probs(stage_forward(model, ids)[:, :-1], ids[:, 1:], local.tp).mean()).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if is_adapter(name)}


def _dropout() -> dict:
    """--lora-dropout 0.5: (1) the issue's run of the tiny default (--recompute-logprobs, B trained from zero):
    every iteration's mismatch_kl, the engine's log-probs against actor_train's inference pass; (2) one rank's
    adapted model: two forward passes in eval mode, as inference passes run, against each other and against a
    training forward; the adapters' gradients with every layer recomputed in backward against those
    without recompute from the same seed, and against another seed's masks."""
    metrics = tiny_default_metrics(["--lora-rank", "4", "--lora-dropout", "0.5", "--lora-modules-to-save", "lm_head,norm",
                                    "--recompute-logprobs", "--ppo-mini-batch-size", "64", "--lr", "1e-2"], 3)
    ids = torch.randint(0, DROPOUT_CFG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    model, local = _dropout_model(None, b_seed=4)
    with eval_mode(model):  # as the inference passes run (rlhf.pipeline.inference.InferenceRunner)
        inferred = [pipeline_forward(model, local, ids) for _ in range(2)]
    with torch.no_grad():
        trained = stage_forward(model, ids)
    plain = _adapter_grads(model, local, ids, seed=11)
    other_masks = _adapter_grads(model, local, ids, seed=12)
    recomputed_model, _ = _dropout_model("full", b_seed=4)
    recomputed = _adapter_grads(recomputed_model, local, ids, seed=11)
    return {"mismatch_kl": [m["mismatch_kl"] for m in metrics],
            "inference_repeat_diff": (inferred[0] - inferred[1]).abs().max().item(),
            "train_vs_inference": (trained - inferred[0]).abs().max().item(),
            "still_training": model.training and all(m.training for m in model.modules()),
            "recompute_grad_diff": max((recomputed[k] - plain[k]).abs().max().item() for k in plain),
            "other_masks_grad_diff": max((other_masks[k] - plain[k]).abs().max().item() for k in plain)}


def run(base_dir: str, adapter_dir: str, batches: list, lr: float, root: str, learn_flags: list,
        learn_iterations: int) -> dict:
    groups = build_task_groups(Placement.from_plan(PLAN, dist.get_world_size()))
    out = {name: _train(groups[task], base_dir, adapter_dir, batches, lr, distributed)
           for name, (task, distributed) in LAYOUTS.items()}
    out["trainer"] = _trainer_runs(root)
    out["reference_from_base"] = _reference_from_base()
    out["learns"] = [m["reward_mean"] for m in tiny_default_metrics(learn_flags, learn_iterations)]
    out["dropout"] = _dropout()
    return out
