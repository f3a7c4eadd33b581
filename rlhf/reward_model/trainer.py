"""Reward-model training from preference pairs: one optimizer step per iteration, top to bottom.

    pairs (rlhf.data.PreferenceDataset; epoch-shuffled global batches, resumable)
      -> this DP replica's contiguous share -> micro-batches of pairs, 2 rows each
      -> serial 1F1B over the reward model's pipeline (rlhf.pipeline.executor.run_step):
         score r = the value at each sequence's last token (position P + R - 1, where
         PPO's reward_inf reads it); per pair -log sigmoid(r_c - r_r - m) + c (r_c + r_r)^2,
         averaged over the global batch
      -> megatron DDP gradient reduction, AdamW, clipping, LR schedule (rlhf.optim.ModelOptimizer)
      -> metrics (rlhf.metrics), held-out pairs every eval_interval, checkpoint

The model trains on the mesh of the task table's reward_inf (rlhf/reward_model/config.py);
every rank builds the trainer and takes part where that mesh holds it.
A micro-batch keeps both answers of each pair (rlhf/batch.py's layout: prompt
left-aligned, the answer right after it, padding to the right)::

    row 2k     prompt_k  chosen_k    . .     prompt_ids = k (the pair's index in the step)
    row 2k+1   prompt_k  rejected_k  .       sample_indices = 0 (chosen) / 1 (rejected)
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from rlhf import platform
from rlhf.algorithms import preference_loss
from rlhf.batch import Batch
from rlhf.checkpoint.rlhf_state import ModelSlot, load_rlhf_state, save_rlhf_state
from rlhf.config import ConfigError, check_recompute_stage
from rlhf.data import PromptBatchIterator
from rlhf.data.preferences import PreferenceDataset, PreferencePair
from rlhf.metrics import MetricsWriter, StageTimer, reduce_metrics, with_rates, write_trace
from rlhf.models.gpt import build_model, eval_mode
from rlhf.models.naming import named_global_parameters
from rlhf.models.vocab import drop_vocab_padding
from rlhf.optim import ModelOptimizer
from rlhf.parallel.dealing import shares
from rlhf.parallel.exchange import gather_to_all
from rlhf.parallel.groups import build_task_groups
from rlhf.parallel.reshard import gather_tp_full_weights, load_full_weights
from rlhf.pipeline.compiler import serial_schedule
from rlhf.pipeline.executor import ModelRuntime, run_step
from rlhf.pipeline.microbatch import pipeline_forward
from rlhf.parallel import Placement
from rlhf.reward_model.config import MODEL, TASK, RewardJobConfig

POSTFIX = (("loss", "loss"), ("acc", "accuracy"), ("eval_acc", "eval_accuracy"), ("pairs/s", "pairs_per_s"))
"""(label, metric key) of the progress bar's postfix."""

SUMS = ("loss", "accuracy", "margin_mean", "reward_mean")
"""Per-pair statistics, summed on the reporting ranks as ``<name>_sum`` and divided by the pairs after
the reduction: the batch's loss, the fraction of pairs whose chosen answer scores higher, the mean
score difference r_c - r_r and the mean score."""


def pair_batch(pairs: Sequence[PreferencePair], first: int, pad_id: int, device=None) -> Batch:
    """Pairs as one Batch of 2 x len(pairs) rows (module docstring); ``first`` is the first pair's index."""
    rows, prompt_lengths, answer_lengths = [], [], []
    for pair in pairs:
        for answer in (pair.chosen, pair.rejected):
            rows.append(pair.prompt + answer)
            prompt_lengths.append(len(pair.prompt))
            answer_lengths.append(len(answer))
    width, n = max(len(row) for row in rows), len(pairs)
    tokens = torch.tensor([row + (pad_id,) * (width - len(row)) for row in rows], dtype=torch.int64)
    return Batch(tokens=tokens.to(device or platform.device()), pad_id=pad_id,
                 prompt_lengths=torch.tensor(prompt_lengths), response_lengths=torch.tensor(answer_lengths),
                 prompt_ids=torch.arange(first, first + n).repeat_interleave(2),
                 sample_indices=torch.tensor([0, 1]).repeat(n), finish_reasons=("stop",) * (2 * n))


def pair_scores(values: torch.Tensor, mb: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen [P], rejected [P]) float32 scores of a pair batch from the model's values [2P, T]."""
    scores = mb.last_token_values(values).float()
    return scores[0::2], scores[1::2]


def pair_statistics(loss: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor) -> dict:
    """``<name>_sum`` of SUMS over these pairs and ``pairs_count`` (0-dim tensors; detached)."""
    chosen, rejected = chosen.detach(), rejected.detach()
    return {"loss_sum": loss.detach().sum(), "accuracy_sum": (chosen > rejected).float().sum(),
            "margin_mean_sum": (chosen - rejected).sum(), "reward_mean_sum": ((chosen + rejected) / 2).sum(),
            "pairs_count": torch.tensor(float(len(chosen)))}


def check_placement(config: RewardJobConfig, placement: Placement) -> None:
    """Refuse batch sizes the reward model's DP size cannot split, and a recompute chunk that does not divide
    a pipeline stage's layers (ConfigError naming the field)."""
    dp, t = placement[TASK].strategy.dp, config.training
    check_recompute_stage("training", TASK, t.recompute_granularity, t.recompute_num_layers,
                          config.model.num_layers // placement[TASK].strategy.pp)
    if t.global_batch_size % (dp * t.micro_batch_size):
        raise ConfigError(f"global_batch_size {t.global_batch_size} must be a multiple of the reward model's "
                          f"dp {dp} x micro_batch_size {t.micro_batch_size} (each DP replica runs whole "
                          "micro-batches)", "training.global_batch_size")


def microbatches(config: RewardJobConfig, placement: Placement) -> int:
    """Micro-batches one DP replica runs per optimizer step."""
    t = config.training
    return t.global_batch_size // (placement[TASK].strategy.dp * t.micro_batch_size)


class RewardTrainer:
    """A value-kind model trained on preference pairs over the placement's reward_inf mesh
    (collective: every rank builds one and calls its methods together; ranks off the mesh take
    part in the reductions only).

    ``initial_weights``: None (seeded random weights, ``config.run.seed``), a full state dict
    (global names), or a function ``names -> full tensors`` that a rank asks for its own stage's
    names. ``eval_data``: held-out pairs scored every ``eval_interval`` iterations and after the last.
    """

    def __init__(self, config: RewardJobConfig, placement, train_data: PreferenceDataset, pad_id: int,
                 eval_data: PreferenceDataset | None = None, initial_weights=None):
        check_placement(config, placement)
        self.config, self.pad_id = config, pad_id
        self.eval_data = eval_data
        size = config.training.global_batch_size
        if size > len(train_data):
            raise ConfigError(f"global_batch_size {size} is more than the {len(train_data)} usable pairs of the "
                              "training data; lower it or give more pairs", "training.global_batch_size")
        self.batches = PromptBatchIterator(train_data, size, seed=config.run.seed)
        self.groups = build_task_groups(placement)[TASK]
        self.model = self.optimizer = None
        if self.groups is not None:
            g = self.groups
            t = config.training
            self.model = build_model(config.model, "value", g.pg_collection, g.stage, seed=config.run.seed,
                                     dtype=config.precision.dtype, recompute_granularity=t.recompute_granularity,
                                     recompute_num_layers=t.recompute_num_layers)
            if initial_weights is not None:
                full = initial_weights
                if callable(full):  # asked for this rank's stage only
                    full = full(list(named_global_parameters(self.model)))
                load_full_weights(self.model, g, full)
            self.optimizer = ModelOptimizer(self.model, g, config.optimizer, config.precision)
        self.schedule = serial_schedule(MODEL, placement[TASK], microbatches(config, placement))
        self.timer = StageTimer(trace_iteration=config.logging.trace_iteration)
        self.iteration = 0

    # ---- the loop --------------------------------------------------------------------

    def train(self) -> None:
        """Iterations until ``config.run.iterations``, each logged (rank 0 writes), saved when configured."""
        cfg, ckpt = self.config, self.config.checkpoint
        with MetricsWriter(cfg.logging, cfg.run.iterations, dist.get_rank(), self.iteration, desc="reward",
                           postfix=POSTFIX, checkpoint=ckpt) as writer:
            while self.iteration < cfg.run.iterations:
                writer.log(self.iteration + 1, self.step())
                last = self.iteration == cfg.run.iterations
                if ckpt.save and (last or (ckpt.save_interval and self.iteration % ckpt.save_interval == 0)):
                    self.save(ckpt.save)

    def step(self) -> dict:
        """One optimizer step on the next global batch (and the held-out pairs when due); returns the
        iteration's metrics, reduced over all ranks (collective)."""
        iteration = self.iteration + 1
        self.timer.start_iteration(iteration)
        pairs = next(self.batches).prompts
        with self.timer.stage("training"):
            local = self._update(pairs)
        if self.eval_data is not None and (iteration % self.config.training.eval_interval == 0
                                           or iteration == self.config.run.iterations):
            with self.timer.stage("eval"):
                local.update({f"eval_{k}": v for k, v in self._evaluate(self.eval_data).items()})
        self.iteration = iteration
        local.update(self.timer.metrics())
        metrics = _per_pair(with_rates(reduce_metrics(local)))
        if self.timer.timeline is not None:
            write_trace(self.config.logging.trace_file, self.timer.timeline)
        return metrics

    def _update(self, pairs: Sequence[PreferencePair]) -> dict:
        """This rank's part of one optimizer step on the global batch ``pairs``: its statistics (last
        stage, TP rank 0), the grad norm and LR (every rank of the mesh); {} off the mesh."""
        g = self.groups
        if g is None:
            return {}
        dp, size = g.mesh.strategy.dp, self.config.training.micro_batch_size
        share = shares(len(pairs), dp)[g.coord.dp]
        micro = [pair_batch([pairs[i] for i in share[k:k + size]], share[k], self.pad_id)
                 for k in range(0, len(share), size)]
        margins = torch.tensor([p.margin for p in pairs], device=platform.device())
        # Each micro-batch's summed loss is scaled so that, after the executor's 1/micro-batches and the
        # DP average, the gradient is that of the mean loss over the global batch.
        scale = len(micro) * dp / len(pairs)
        records: list = []

        def loss_fn(values, mb, groups, packed=None):  # pairs always run padded
            chosen, rejected = pair_scores(values, mb)
            margin = margins[mb.prompt_ids[0::2].to(margins.device)]
            loss = preference_loss(chosen, rejected, margin, self.config.training.center_rewards_coef)
            if groups.tp_rank == 0:  # TP ranks hold the same values: report one copy
                records.append(pair_statistics(loss, chosen, rejected) | {
                    "samples_count": torch.tensor(float(len(mb))), "tokens_count": mb.sequence_lengths.sum().float()})
            return loss.sum() * scale

        runtime = ModelRuntime(MODEL, g.mesh, micro, self.model, g, self.optimizer, loss_fn,
                               self.config.model.hidden_size)
        self.timer.include(run_step(self.schedule, {MODEL: runtime}, group=g.mesh_group).timeline)
        return _add(records) | self.optimizer.last_step

    def _evaluate(self, data: Sequence[PreferencePair]) -> dict:
        """This rank's share of scoring ``data`` (forward only, micro-batched through the pipeline):
        the SUMS statistics on the last stage's TP rank 0, {} elsewhere. Collective over the mesh."""
        g = self.groups
        if g is None:
            return {}
        share, size = shares(len(data), g.mesh.strategy.dp)[g.coord.dp], self.config.training.micro_batch_size
        records = []
        with eval_mode(self.model):
            for k in range(0, len(share), size):
                pairs = [data[i] for i in share[k:k + size]]
                mb = pair_batch(pairs, 0, self.pad_id)
                values = pipeline_forward(self.model, g, mb.tokens)
                if values is not None and g.tp_rank == 0:
                    chosen, rejected = pair_scores(values, mb)
                    margin = torch.tensor([p.margin for p in pairs], device=chosen.device)
                    loss = preference_loss(chosen, rejected, margin, self.config.training.center_rewards_coef)
                    records.append(pair_statistics(loss, chosen, rejected))
        return _add(records)

    # ---- weights and checkpoints -----------------------------------------------------

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The model's full weights (global names, no padded vocabulary rows) on every rank (collective; an
        object all-gather: for small models, such as the tiny default's)."""
        g, mine = self.groups, {}
        if g is not None and g.coord.dp < g.mesh.strategy.ep:  # replica 0's EP group holds every weight; its
            full = gather_tp_full_weights(self.model, g)  # TP (and EP) ranks gather together
            vocab = self.config.model.vocab_size
            first = g.tp_rank == 0 and g.coord.dp == 0
            mine = {n: drop_vocab_padding(n, t, vocab) for n, t in full.items()} if first else {}
        merged = {}
        for part in gather_to_all([mine]):
            merged.update(part)
        return merged

    def save(self, root: str) -> str:
        """Save the model with its optimizer and LR schedule, the data position and each rank's RNG as
        checkpoint ``iteration`` under ``root`` (collective, atomic)."""
        return save_rlhf_state(root, self.iteration, self._slots(), data_position=self.batches.state_dict(),
                               group=dist.group.WORLD, keep_last=self.config.checkpoint.keep_last)

    def load(self, root: str) -> None:
        """Resume from the latest complete checkpoint under ``root`` (any layout; collective)."""
        state = load_rlhf_state(root, self._slots(), group=dist.group.WORLD)
        self.iteration = state.iteration
        self.batches.load_state_dict(state.data_position)

    def _slots(self) -> dict:
        opt = self.optimizer
        return {MODEL: ModelSlot(self.config.model, "value", self.model, self.groups, opt,
                                 opt.scheduler if opt is not None else None)}


def _add(records: list) -> dict:
    """Key-wise sums of a list of metric dicts."""
    out: dict = {}
    for record in records:
        for key, value in record.items():
            out[key] = out[key] + value if key in out else value
    return out


def _per_pair(metrics: dict) -> dict:
    """Reduced metrics with each ``[eval_]<name>_sum`` divided by its pairs (``[eval_]pairs_count``, which
    is dropped), and ``pairs_per_s`` from ``samples_per_s`` (a pair is two sequences)."""
    out = dict(metrics)
    for prefix in ("", "eval_"):
        pairs = out.pop(f"{prefix}pairs_count", None)
        for name in SUMS:
            total = out.pop(f"{prefix}{name}_sum", None)
            if total is not None and pairs:
                out[prefix + name] = total / pairs
    if "samples_per_s" in out:
        out["pairs_per_s"] = out["samples_per_s"] / 2
    return dict(sorted(out.items()))
