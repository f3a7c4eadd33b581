"""4-rank scenario for tests/test_precision.py: bf16 and fp16 mixed precision against fp32.

The trainer of tests/scenario_trainer.py (actor_train TP2xPP2, critic_train
PP2xDP2 reversed, frozen models TP1) learns once from the same fixed samples
and starting weights in fp32, bf16 and fp16; the scenario returns how far each
low-precision batch field and metric is from fp32's. Then fp16 at
Megatron-LM's initial loss scale (2**32, whose gradients overflow) must skip
its steps, and the synthetic task runs 4 iterations in bf16 straight and as
2 + save + load + 2, with the plain and the distributed optimizer: the
metrics and the saved fp32 main weights of the two must agree.
"""

import torch
import torch.distributed as dist

from rlhf.checkpoint.sources import read_full_state
from rlhf.models.precision import PrecisionConfig
from rlhf.parallel import Placement
from rlhf.parallel.groups import build_task_groups
from scenario_trainer import PLAN, learn_fixed_samples, synthetic_trainer, synthetic_weights, trained_weights

FIELDS = ("ref_logprobs", "scores", "values", "advantages", "returns")
METRICS = ("policy_loss", "value_loss", "kl_mean", "approx_kl", "entropy_mean", "advantage_mean", "return_mean")
PRECISIONS = {"fp32": PrecisionConfig(), "bf16": PrecisionConfig(bf16=True),
              "fp16": PrecisionConfig(fp16=True, initial_loss_scale=2.0 ** 12)}


def run(root: str) -> dict:
    placement = Placement.from_plan(PLAN, dist.get_world_size())
    build_task_groups(placement)
    out = {"rank": dist.get_rank(), **_fixed_samples(placement), "overflow": _overflow(placement)}
    for name, options in (("plain", {}), ("distributed", {"use_distributed_optimizer": True})):
        out[f"resume_{name}"] = _resume(placement, f"{root}/{name}", **options)
    out["training_bytes"] = {name: _training_bytes(placement, precision)
                             for name, precision in PRECISIONS.items() if name != "fp16"}
    return out


def _fixed_samples(placement) -> dict:
    """Each precision's learn() on the fixed samples against fp32's: the largest difference of each batch
    field and the difference of each metric."""
    runs = {name: learn_fixed_samples(placement, precision=p)[2] for name, p in PRECISIONS.items()}
    reference = runs.pop("fp32")
    out = {"fp32_metrics": {k: float(reference.metrics[k]) for k in METRICS}}
    for name, result in runs.items():
        out[name] = {
            "fields": {f: (getattr(result.batch, f) - getattr(reference.batch, f)).abs().max().item() for f in FIELDS},
            "metrics": {k: float(result.metrics[k]) - float(reference.metrics[k]) for k in METRICS},
            "field_dtypes": sorted({str(getattr(result.batch, f).dtype) for f in FIELDS}),
            "loss_scale": result.metrics.get("actor_loss_scale"), "skipped": result.metrics.get("actor_skipped_steps")}
    return out


def _overflow(placement) -> dict:
    """fp16 starting at Megatron-LM's loss scale 2**32: every step overflows and is skipped, so the weights
    stay the fp16 rounding of the start."""
    full, _, result, learned = learn_fixed_samples(placement, precision=PrecisionConfig(fp16=True))
    return {"moved": max((learned[m][k] - full[m][k].half()).abs().max().item() for m in learned for k in learned[m]),
            "metrics": {k: float(v) for k, v in result.metrics.items() if "loss_scale" in k or "skipped" in k}}


def _resume(placement, root: str, **optimizer) -> dict:
    """bf16: 4 iterations straight vs 2, save, load into a fresh trainer, 2 more; both saved after the 4th."""
    full, bf16 = synthetic_weights(11), PrecisionConfig(bf16=True)
    straight = synthetic_trainer(placement, full, mini_batch=4, precision=bf16, **optimizer)
    metrics = [straight.step().metrics for _ in range(4)]
    straight.save(f"{root}/straight")
    first = synthetic_trainer(placement, full, mini_batch=4, precision=bf16, **optimizer)
    for _ in range(2):
        first.step()
    first.save(f"{root}/half")
    resumed = synthetic_trainer(placement, full, mini_batch=4, precision=bf16, **optimizer)
    resumed.load(f"{root}/half")
    resumed_metrics = [resumed.step().metrics for _ in range(2)]
    resumed.save(f"{root}/resumed")
    model_weights = trained_weights(resumed)
    out = {"straight": metrics[2:], "resumed": resumed_metrics}
    if dist.get_rank() == 0:
        saved = {run: {m: read_full_state(f"{root}/{run}", m)[2] for m in ("actor", "critic")}
                 for run in ("straight", "resumed")}
        a, b = saved["straight"], saved["resumed"]
        out["saved_dtypes"] = sorted({str(t.dtype) for m in a for t in a[m].values()})
        out["main_weights_equal"] = all(torch.equal(a[m][k], b[m][k]) for m in a for k in a[m])
        out["model_is_main_rounded"] = all(torch.equal(model_weights[m][k], b[m][k].bfloat16())
                                           for m in b for k in b[m])
        out["main_moved"] = max((a[m][k] - full[m][k]).abs().max().item() for m in a for k in a[m])
    return out


def _training_bytes(placement, precision: PrecisionConfig) -> float:
    """memory_training_bytes_max (weights and KV cache held in training, heaviest rank) of one iteration."""
    trainer = synthetic_trainer(placement, synthetic_weights(11), mini_batch=4, precision=precision)
    return trainer.step().metrics["memory_training_bytes_max"]
