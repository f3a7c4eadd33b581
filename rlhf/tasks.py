"""The six tasks of a PPO iteration and the four models they run: the one task table.

    task          model      kind    what it does
    actor_gen     actor      lm      generates the responses (the engine)
    ref_inf       reference  lm      log-probs of the frozen reference policy
    reward_inf    reward     value   the sequence score
    critic_inf    critic     value   per-token values
    actor_train   actor      lm      PPO policy update
    critic_train  critic     value   value regression

A model's *kind* is its head: ``lm`` (vocab-parallel logits) or ``value`` (one
scalar per token). Tasks of one model share its shape and, through
resharding, its weights. Everything the programs need to know about a task
or a model (which task trains it, where its weights live, its seed, what an
inference pass adds to the batch) is a table here.
"""

from __future__ import annotations

TASKS = ("actor_gen", "ref_inf", "reward_inf", "critic_inf", "actor_train", "critic_train")
"""In iteration order; every rank creates the tasks' process groups in this order."""

INFERENCE_TASKS = ("ref_inf", "reward_inf", "critic_inf")
"""The tasks that only score the generated batch (forward passes, no update)."""

MODELS = ("actor", "reference", "reward", "critic")

KINDS = ("lm", "value")

TASK_MODEL = {
    "actor_gen": "actor",
    "ref_inf": "reference",
    "reward_inf": "reward",
    "critic_inf": "critic",
    "actor_train": "actor",
    "critic_train": "critic",
}

MODEL_KIND = {"actor": "lm", "reference": "lm", "reward": "value", "critic": "value"}

TRAIN_TASK = {"actor": "actor_train", "critic": "critic_train"}
"""The task that updates each trained model (reference and reward stay frozen)."""

WEIGHTS_TASK = {**TRAIN_TASK, "reference": "ref_inf", "reward": "reward_inf"}
"""The task whose copy of each model's weights is the original: loaded and saved there, resharded from there."""


def task_kind(task: str) -> str:
    """``lm`` or ``value``: the head of the model that ``task`` runs."""
    return MODEL_KIND[TASK_MODEL[task]]

FROZEN_TASKS = tuple(task for model, task in WEIGHTS_TASK.items() if model not in TRAIN_TASK)
"""The frozen models' tasks (reference and reward inference): they only ever run forward passes."""

MODEL_SEEDS = {"actor": 11, "critic": 23, "reward": 37, "reference": 11}
"""Offsets from the run seed of each model's random initial weights (reference = actor: they start equal;
a value head drawn for a model that has none uses its model's too)."""

INFERENCE_FIELDS = {"ref_inf": "ref_logprobs", "reward_inf": "scores", "critic_inf": "values",
                    "actor_train": "old_logprobs"}
"""The batch field each inference pass adds (rlhf/batch.py), in the order the trainer runs them: per
response token for the log-probs and values, one per sample for ``scores`` (the reward model's value at
the last token); actor_train infers only to recompute the old log-probs."""
