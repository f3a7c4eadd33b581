"""Reward functions that tests/test_job_sources.py passes to ``pretrain_rlhf.py --reward-fn``.

They have rlhf.data.synthetic.gold_reward's signature. ``record`` appends each
call's samples and scores to the JSON Lines file ``$RLHF_TEST_RECORD``, so the
test sees exactly what the job scored; its scores carry fresh system-random
noise, so ranks that each called it would disagree.
"""

import json
import os
import random


def record(prompts: list, responses: list, non_finite: dict | None = None) -> list:
    """The fraction of even ids in each response, plus noise below 1e-3, with ``non_finite``'s scores at its
    positions instead; the call is recorded."""
    noise = random.SystemRandom()
    scores = [sum(t % 2 == 0 for t in r) / max(len(r), 1) + noise.random() * 1e-3 for r in responses]
    for i, score in (non_finite or {}).items():
        scores[i] = score
    with open(os.environ["RLHF_TEST_RECORD"], "a", encoding="utf-8") as f:
        f.write(json.dumps({"prompts": prompts, "responses": responses, "scores": scores}) + "\n")
    return scores


def record_some_non_finite(prompts: list, responses: list) -> list:
    """``record``, but NaN for the batch's sample 1 and infinity for its sample 4 (what --skip-nonfinite-samples
    drops)."""
    return record(prompts, responses, {1: float("nan"), 4: float("inf")})


def one_score(prompts: list, responses: list) -> list:
    """One score for the whole batch: the mistake the job must refuse, naming --reward-fn."""
    return [0.0]
