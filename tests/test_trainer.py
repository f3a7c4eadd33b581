"""The PPO trainer against textbook PPO: one iteration on given samples, 4 gloo ranks.

actor_train TP2xPP2, critic_train PP2xDP2 reversed, ref and reward TP1 on rank
subsets; two PPO epochs of one mini-batch each. See tests/scenario_trainer.py.
"""

import pytest

from rlhf.testing.distributed import launch

TOL = 1e-5


@pytest.fixture(scope="module")
def results():
    return launch(4, "scenario_trainer:run")


@pytest.mark.parametrize("field", ["ref_logprobs", "scores", "values", "advantages", "returns"])
def test_batch_fields_match_textbook(results, field):
    assert results[0][f"{field}_max_diff"] < TOL


@pytest.mark.parametrize("model", ["actor", "critic"])
def test_parameters_match_textbook_ppo(results, model):
    assert results[0]["smallest_grad_norm"] > 0.05  # every step clipped (PPO.clip_grad)
    assert results[0][f"{model}_moved"] > 1e-4  # the iteration changed the weights
    assert results[0][f"{model}_max_diff"] < TOL
