"""How a batch of samples reaches the update: the one seam between the trainer and its rollout modes.

The trainer (rlhf/ppo/trainer.py) drives every iteration the same way::

    rollout = source.next_rollout()          # the batch to learn from (None: this rank generates meanwhile)
    batch, local = trainer.update_from(...)  # inference, advantages, PPO epochs (ranks with a rollout)
    batch = source.after_update(batch, local)
    trainer.finish_iteration(batch, local)

and three sources implement it:

    Lockstep          this module                       generate the iteration's prompts now, with the
                                                        current weights (synchronous PPO)
    GenerationAhead   rlhf/ppo/asynchronous.py          actor_gen, on ranks of its own, K iterations ahead
    PartialRollouts   rlhf/ppo/partial_rollouts.py      the same, generation running free between meetings

A source asks its host (the trainer) only for what :class:`RolloutHost` lists; none imports the trainer.
Generation itself (the requests of each replica, the engine or the episodes, gathering the samples into
one Batch: ``collect_rollout``) is the trainer's, as the host, since inter-stage fusion's early inference
needs its models; a source decides *when* it runs and *which* prompts and weights it uses. The data
position a checkpoint keeps is the source's too: the prompts not trained yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Protocol

from rlhf.batch import Batch

if TYPE_CHECKING:
    from rlhf.fusion.inter_stage import FusionOutcome


@dataclass
class Rollout:
    """What generation hands to inference: the samples as one Batch (on every rank) and, with
    inter-stage fusion or streamed partial rollouts, what this rank inferred of them meanwhile."""

    batch: Batch
    fusion: Optional[FusionOutcome] = None


class RolloutHost(Protocol):
    """What a rollout source may ask of the trainer that drives it (rlhf.ppo.trainer.Trainer)."""

    config: object  # rlhf.ppo.config.JobConfig
    groups: dict  # task -> this rank's TaskGroups, None where the task has no rank here
    learners: object  # the process group of the ranks besides actor_gen's (asynchronous runs)
    prompts: object  # the prompt batches, with state_dict() / load_state_dict()
    iteration: int  # iterations done
    timer: object  # rlhf.metrics.StageTimer
    memory: object  # rlhf.memory.StageMemory
    engine: object  # this actor_gen replica's rlhf.engine.Engine, None off actor_gen
    tokenizer: object
    kl: object  # the KL controller (its value travels with a learned batch)

    def sync_generation_weights(self) -> None: ...

    def generate(self, prompt_batch) -> Rollout: ...

    def requests_here(self, prompt_batch, iteration: int) -> list: ...

    def generate_here(self, prompt_batch, iteration: int) -> tuple: ...

    def collect_rollout(self, prompt_batch, mine: list, fused=None) -> Rollout: ...

    def infer_here(self, batch: Batch, done: dict) -> list: ...

    def inference_tasks(self) -> list: ...


class RolloutSource:
    """The interface the trainer drives (module docstring); :class:`Lockstep` is the plain one."""

    def __init__(self, host: RolloutHost):
        self.host = host

    def next_rollout(self) -> Optional[Rollout]:
        """The batch this iteration learns from, on the ranks that learn (collective); None on ranks that
        generate meanwhile instead."""
        raise NotImplementedError

    def after_update(self, batch: Optional[Batch], local: dict) -> Batch:
        """What follows the update (``batch`` None on ranks that did not learn): the learned batch, complete
        on every rank, ``local`` given this source's metrics (collective)."""
        raise NotImplementedError

    def data_position(self) -> dict:
        """Where a resumed run continues drawing prompts: before the first batch not trained yet."""
        return self.host.prompts.state_dict()

    def forget(self) -> None:
        """A checkpoint was loaded (its data position is before anything generated ahead): drop that."""


class Lockstep(RolloutSource):
    """The synchronous iteration: the next prompts, generated now with the weights the last update left."""

    def next_rollout(self) -> Rollout:
        host = self.host
        prompts = next(host.prompts)
        with host.timer.stage("reshard"):
            host.sync_generation_weights()
        with host.timer.stage("generation"):
            return host.generate(prompts)

    def after_update(self, batch: Batch, local: dict) -> Batch:
        return batch
