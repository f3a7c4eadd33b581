"""Training one model's stage with megatron-core: gradient reduction, optimizer, LR schedule.

A :class:`ModelOptimizer` per trained model on this rank owns three megatron pieces:

* ``DistributedDataParallel`` around the stage module. Its backward hooks sit on
  the parameters' gradient accumulators and add every gradient into one
  contiguous buffer (``param.main_grad``), so forward and backward run on the
  raw stage module (``rlhf.models.gpt.stage_forward``), never on the wrapper.
  :meth:`ModelOptimizer.reduce_grads` averages the buffer over the task's DP
  group (``finalize_model_grads``: an all-reduce, or a reduce-scatter with the
  distributed optimizer).
* The optimizer: torch AdamW (or plain SGD) inside megatron's ``FP32Optimizer``
  (fp32 models), ``Float16OptimizerWithFloat16Params`` (bf16/fp16 models,
  ``PrecisionConfig``: fp32 main copies of the weights, a loss scaler for fp16)
  or, with ``use_distributed_optimizer``, its ``DistributedOptimizer`` (each DP
  rank updates 1/dp of the flat parameter buffer, then all-gathers it), wrapped
  in ``ChainedOptimizer``. The gradient norm is over the whole model: summed over
  the TP and PP ranks of one replica (and the DP shards with the distributed
  optimizer), TP-replicated parameters (norms, the value head) counted once.
  Clipping scales by ``clip_grad / (norm + 1e-6)`` when that is below 1, like
  ``torch.nn.utils.clip_grad_norm_``. One-dimensional parameters (norm weights,
  biases) get no weight decay.
* ``OptimizerParamScheduler``. The update after ``n`` earlier updates uses, with
  ``W = lr_warmup_iters`` and ``D = lr_decay_iters``::

      lr(n) = lr_warmup_init + (lr - lr_warmup_init) * n / W     if W > 0 and n <= W
            = lr                                                 constant style
            = min_lr                                             if n > D
            = min_lr + (lr - min_lr) * c((n - W) / (D - W))      c(x) = 1 - x (linear),
                                                                 (1 + cos(pi x)) / 2 (cosine)

The parameter groups are built here rather than by ``get_megatron_optimizer``,
which all-gathers group keys over the *world* and so would need every rank to
build the same number of optimizers; ours are collective over the task's
groups only. megatron's optimizer allocates scalars on a hard-coded CUDA
device and checks ``tensor.type()`` against CUDA type names; on CPU its
construction and step run under ``rlhf.platform.megatron_scope()``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from rlhf import platform
from rlhf.config import ConfigError
from rlhf.models.precision import PrecisionConfig

OPTIMIZERS = ("adam", "sgd")
DECAY_STYLES = ("constant", "linear", "cosine")


def _require(ok: bool, name: str, value, rule: str) -> None:
    if not ok:
        raise ConfigError(f"OptimizerConfig.{name}={value!r}: {rule}", name)


@dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer and LR schedule of one trained model (see the module docstring for lr(n)).

    ``optimizer``: "adam" (AdamW, decoupled weight decay) or "sgd" (plain SGD, no
    momentum); ``clip_grad``: max global gradient norm, 0 turns clipping off;
    ``lr_decay_iters``: None keeps ``lr`` after the warm-up (``lr_decay_style``
    "constant"); ``use_distributed_optimizer``: shard optimizer state and the
    update over the DP group (ZeRO-1); ``overlap_grad_reduce``: start each
    gradient bucket's DP reduction during the last micro-batch's backward
    (None: where an accelerator computes, see rlhf/platform.py; on the CPU the
    reduction waits for the step).
    """

    optimizer: str = "adam"
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_warmup_init: float = 0.0
    lr_warmup_iters: int = 0
    lr_decay_iters: int | None = None
    lr_decay_style: str = "constant"
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool | None = None

    def __post_init__(self):
        _require(self.optimizer in OPTIMIZERS, "optimizer", self.optimizer, f"choose one of {OPTIMIZERS}")
        _require(self.lr > 0, "lr", self.lr, "must be > 0")
        _require(0 <= self.min_lr <= self.lr, "min_lr", self.min_lr, f"must be in [0, lr={self.lr}]")
        _require(0 <= self.lr_warmup_init <= self.lr, "lr_warmup_init", self.lr_warmup_init,
                 f"must be in [0, lr={self.lr}]")
        _require(isinstance(self.lr_warmup_iters, int) and self.lr_warmup_iters >= 0, "lr_warmup_iters",
                 self.lr_warmup_iters, "must be an integer >= 0")
        self._check_decay()
        _require(self.weight_decay >= 0, "weight_decay", self.weight_decay, "must be >= 0")
        for name in ("adam_beta1", "adam_beta2"):
            _require(0 <= getattr(self, name) < 1, name, getattr(self, name), "must be in [0, 1)")
        _require(self.adam_eps > 0, "adam_eps", self.adam_eps, "must be > 0")
        _require(self.clip_grad >= 0, "clip_grad", self.clip_grad, "must be >= 0 (0 turns clipping off)")
        _require(isinstance(self.use_distributed_optimizer, bool), "use_distributed_optimizer",
                 self.use_distributed_optimizer, "must be True or False")
        _require(self.overlap_grad_reduce in (None, True, False), "overlap_grad_reduce", self.overlap_grad_reduce,
                 "must be True, False or None (None: on where an accelerator computes)")

    def _check_decay(self) -> None:
        style, iters = self.lr_decay_style, self.lr_decay_iters
        _require(style in DECAY_STYLES, "lr_decay_style", style, f"choose one of {DECAY_STYLES}")
        if iters is None:
            _require(style == "constant", "lr_decay_style", style,
                     "needs lr_decay_iters (the step where lr reaches min_lr); set it, or use 'constant'")
            return
        _require(style != "constant", "lr_decay_iters", iters,
                 "has no effect with lr_decay_style='constant'; leave it None or pick 'linear'/'cosine'")
        _require(isinstance(iters, int) and iters > self.lr_warmup_iters, "lr_decay_iters", iters,
                 f"must be an integer > lr_warmup_iters={self.lr_warmup_iters}")


@dataclass(frozen=True)
class StateSlice:
    """Where an optimizer keeps one model parameter's state.

    ``inner`` is a parameter of the torch optimizer ``owner`` (its state is
    ``owner.state[inner]``); it holds elements ``[start, end)`` of the flattened
    model parameter: all of it, or this DP rank's share with the distributed optimizer.
    It is the fp32 main copy where the model is bf16 or fp16 (the model parameter itself in fp32).
    """

    owner: torch.optim.Optimizer
    inner: torch.Tensor
    start: int
    end: int


class ModelOptimizer:
    """megatron DDP + optimizer + LR scheduler of one model's stage on this rank.

    ``module``: the stage (``build_model``, in ``precision``'s dtype) to run forward and backward on;
    ``groups``: its task's ``TaskGroups``. Construction and every method except
    :meth:`zero_grad` are collective over the task's groups (DP, and TP/PP for
    the gradient norm). Gradients accumulate over micro-batches between steps.
    """

    def __init__(self, module: torch.nn.Module, groups, config: OptimizerConfig,
                 precision: PrecisionConfig = PrecisionConfig()):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        if module.config.params_dtype != precision.dtype:
            raise ValueError(f"ModelOptimizer: the module is {module.config.params_dtype}, the precision "
                             f"{precision.name} ({precision.dtype}); build the model in the job's dtype")
        if config.use_distributed_optimizer and groups.mesh.strategy.ep > 1:
            raise ValueError(f"{groups.mesh.task}: the distributed optimizer with ep={groups.mesh.strategy.ep} is "
                             "not supported (its state would be sharded over two groups); drop "
                             "--use-distributed-optimizer or use ep=1")
        self.module, self.groups, self.config, self.precision = module, groups, config, precision
        overlap = config.overlap_grad_reduce
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=precision.grads_in_fp32,
            use_distributed_optimizer=config.use_distributed_optimizer,
            overlap_grad_reduce=platform.has_accelerator() if overlap is None else overlap)
        self.ddp = DistributedDataParallel(module.config, ddp_config, module, pg_collection=groups.pg_collection)
        with platform.megatron_scope():
            self.optimizer = self._build_optimizer()
        self.scheduler = self._build_scheduler()
        self.last_step: dict[str, float] = {}  # the last step's grad_norm, lr and loss scale (step)
        self.skipped_in_a_row = 0  # steps skipped since the last update (step; a resumed run starts at 0)

    def _build_optimizer(self):
        """megatron's ChainedOptimizer of the dense parameters' optimizer and, with expert parallelism, the
        routed experts' (megatron's split: the experts' gradients live in DDP's expert buffers, averaged over
        the expert-data-parallel replicas, and their norm is summed over the ranks holding one copy of every
        expert)."""
        from megatron.core.optimizer import ChainedOptimizer, OptimizerConfig as MegatronConfig
        from megatron.core.optimizer import _get_megatron_optimizer_based_on_param_groups

        c, p, pgc, g = self.config, self.precision, self.groups.pg_collection, self.groups
        mcfg = MegatronConfig(optimizer=c.optimizer, lr=c.lr, min_lr=c.min_lr, weight_decay=c.weight_decay,
                              adam_beta1=c.adam_beta1, adam_beta2=c.adam_beta2, adam_eps=c.adam_eps,
                              sgd_momentum=0.0, clip_grad=c.clip_grad,
                              use_distributed_optimizer=c.use_distributed_optimizer,
                              bf16=p.bf16, fp16=p.fp16, params_dtype=p.dtype, loss_scale=p.loss_scale,
                              initial_loss_scale=p.initial_loss_scale, min_loss_scale=p.min_loss_scale,
                              loss_scale_window=p.loss_scale_window, hysteresis=p.hysteresis)
        inner = [_get_megatron_optimizer_based_on_param_groups(
            mcfg, [self.ddp], self._param_groups(expert=False), per_model_buffers={0: self.ddp.buffers},
            model_parallel_group=pgc.mp, data_parallel_group=pgc.intra_dp_cp, data_parallel_group_gloo=None,
            data_parallel_group_idx=pgc.mp.rank(), intra_dist_opt_group=pgc.intra_dist_opt,
            distributed_optimizer_instance_id=0, pg_collection=pgc)]
        if self.ddp.expert_parallel_buffers:
            inner.append(_get_megatron_optimizer_based_on_param_groups(
                mcfg, [self.ddp], self._param_groups(expert=True),
                per_model_buffers={0: self.ddp.expert_parallel_buffers}, model_parallel_group=g.expert_mp,
                data_parallel_group=pgc.expt_dp, data_parallel_group_gloo=None,
                data_parallel_group_idx=g.expert_mp.rank(), intra_dist_opt_group=pgc.expt_dp,
                distributed_optimizer_instance_id=0, pg_collection=pgc))
        return ChainedOptimizer(inner)

    def _param_groups(self, expert: bool) -> list[dict]:
        """megatron-style groups of the dense (or, ``expert``, the expert-parallel) parameters: weight decay on
        matrices, none on 1-D parameters (both groups always exist)."""
        params = [p for p in self.ddp.module.parameters()
                  if p.requires_grad and (not getattr(p, "allreduce", True)) == expert]
        groups = []
        for wd_mult, members in ((1.0, [p for p in params if p.dim() > 1]),
                                 (0.0, [p for p in params if p.dim() <= 1])):
            groups.append({"params": members, "wd_mult": wd_mult, "lr_mult": 1.0, "is_expert_parallel": expert,
                           "is_decoupled_lr": False, "default_config": True,
                           "max_lr": self.config.lr, "min_lr": self.config.min_lr})
        return groups

    def _build_scheduler(self):
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        c = self.config
        decay_iters = c.lr_decay_iters if c.lr_decay_iters is not None else c.lr_warmup_iters + 1
        return OptimizerParamScheduler(
            self.optimizer, init_lr=c.lr_warmup_init, max_lr=c.lr, min_lr=c.min_lr,
            lr_warmup_steps=c.lr_warmup_iters, lr_decay_steps=decay_iters, lr_decay_style=c.lr_decay_style,
            start_wd=c.weight_decay, end_wd=c.weight_decay, wd_incr_steps=1, wd_incr_style="constant")

    @property
    def param_groups(self) -> list[dict]:
        """The torch optimizer's parameter groups (hyper-parameters; the scheduler sets ``lr``)."""
        return self.optimizer.param_groups

    def backward_scope(self, last_microbatch: bool):
        """The context of one micro-batch's backward: megatron's ``no_sync`` unless it is the step's
        last, so an overlapped reduction starts only once every micro-batch's gradient has accumulated."""
        return contextlib.nullcontext() if last_microbatch else self.ddp.no_sync()

    def reduce_grads(self) -> None:
        """Average the accumulated gradients over the DP group (all-reduce or reduce-scatter), or
        wait for the reductions that overlapped the last backward."""
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.ddp], pg_collection=self.groups.pg_collection)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the fp16 loss scale, for backward (unchanged without loss scaling)."""
        opt = self.optimizer.chained_optimizers[0]  # an expert optimizer's scaler moves with the dense one's
        return loss if getattr(opt, "grad_scaler", None) is None else loss * opt.get_loss_scale()

    def step(self) -> dict[str, float]:
        """Unscale (fp16), clip, update, advance the LR schedule and zero the gradients.

        Returns ``grad_norm`` (global, before clipping), ``lr`` (used by this
        update), ``skipped`` (1: the gradients were not finite, an fp16 overflow
        or a NaN or infinity in any precision, so neither the weights, the
        optimizer's moments nor the LR schedule moved) and, with fp16 loss
        scaling, ``loss_scale`` (the scale of this step's gradients), as Python
        floats: megatron syncs the norm to the host to clip. Every rank of the
        model gets the same global norm, so every rank skips alike. The same dict
        stays in ``last_step`` for whoever logs it (the executor calls step).

        ``skipped_in_a_row`` counts the skips since the last update, but not fp16
        overflows that the dynamic loss scale still backs off from (it is above
        ``min_loss_scale``): those are the scaler finding its scale, as the first
        steps from Megatron-LM's 2**32 are.
        """
        from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging

        lr = get_canonical_lr_for_logging(self.optimizer.param_groups)
        opt = self.optimizer.chained_optimizers[0]
        scaler = getattr(opt, "grad_scaler", None)
        scale = float(scaler.scale) if scaler is not None else None
        with platform.megatron_scope():
            updated, grad_norm = self._finite_step()
        if updated:  # Megatron-LM: the schedule advances only with the weights
            self.scheduler.step(increment=1)
        self.zero_grad()
        p = self.precision
        backing_off = grad_norm is None and p.loss_scale is None and scale > p.min_loss_scale
        if updated or not backing_off:
            self.skipped_in_a_row = 0 if updated else self.skipped_in_a_row + 1
        self.last_step = {"grad_norm": float("nan") if grad_norm is None else float(grad_norm), "lr": float(lr),
                          "skipped": float(not updated)}
        if scale is not None:
            self.last_step["loss_scale"] = scale
        return self.last_step

    def _finite_step(self) -> tuple[bool, float | None]:
        """megatron's ChainedOptimizer.step (prepare the gradients, take their global norm, clip, update), but
        an update whose norm is not finite is not made: (updated, norm; None on an fp16 overflow)."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        config = self.optimizer.chained_optimizers[0].config
        if self.optimizer.prepare_grads():  # an fp16 overflow: the loss scale backs off
            return False, None
        grad_norm = self.optimizer.get_grad_norm()
        if not math.isfinite(grad_norm):
            return False, grad_norm
        if config.clip_grad > 0.0:
            params = [p for opt in self.optimizer.chained_optimizers for p in opt.get_parameters()]
            clip_grad_by_total_norm_fp32(params, max_norm=config.clip_grad, total_norm=grad_norm,
                                         use_decoupled_grad=config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
        return self.optimizer.step_with_ready_grads(), grad_norm

    def zero_grad(self) -> None:
        """Zero the gradient buffer and drop ``param.grad`` (megatron points it into the buffer)."""
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad(set_to_none=True)

    def gradient_buffers(self) -> list[torch.Tensor]:
        """megatron DDP's contiguous gradient buffers of this stage (``param.main_grad`` are views of them)."""
        return [buffer.grad_data for buffer in self.ddp.buffers + self.ddp.expert_parallel_buffers]

    def state_tensors(self) -> list[torch.Tensor]:
        """The tensors the optimizer holds beyond the model's parameters and gradients: its state (Adam's
        moments and step counters; empty before the first step) and main parameters that are copies (fp32
        masters of low-precision weights), not views of the model's weights."""
        model = {p.untyped_storage().data_ptr() for p in self.module.parameters()}
        out = []
        for opt in self.optimizer.chained_optimizers:
            inner = opt.optimizer
            out += [t for state in inner.state.values() for t in state.values() if torch.is_tensor(t)]
            out += [p for group in inner.param_groups for p in group["params"]
                    if p.untyped_storage().data_ptr() not in model]
        return out

    @property
    def shard_group(self):
        """The group the optimizer state is sharded over (the DP group with the distributed optimizer), or None."""
        return self.groups.dp if self.config.use_distributed_optimizer else None

    def state_slices(self) -> dict[torch.nn.Parameter, StateSlice]:
        """Model parameter -> where its optimizer state and fp32 main weights live on this rank (checkpoints
        read and fill them): with mixed precision the slice's ``inner`` is the main copy, else the parameter.

        With the distributed optimizer a parameter wholly in other DP ranks' shares is absent.
        """
        out = {}
        for opt in self.optimizer.chained_optimizers:
            out.update(self._state_slices(opt))
        return out

    def _state_slices(self, opt) -> dict[torch.nn.Parameter, StateSlice]:
        if self.config.use_distributed_optimizer:
            out = {}
            for param, (group, index) in opt.model_param_group_index_map.items():
                share = opt._get_model_param_range_map(param)["param"]
                out[param] = StateSlice(opt.optimizer, opt.optimizer.param_groups[group]["params"][index],
                                        share.start, share.end)
            return out
        if self.precision.name == "fp32":
            return {p: StateSlice(opt.optimizer, p, 0, p.numel()) for p in opt.get_parameters()}
        pairs = [(p, p) for group in opt.fp32_from_fp32_groups for p in group]
        pairs += [pair for model, main in zip(opt.float16_groups, opt.fp32_from_float16_groups)
                  for pair in zip(model, main)]
        return {p: StateSlice(opt.optimizer, main, 0, p.numel()) for p, main in pairs}
