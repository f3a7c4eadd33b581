"""Six task meshes in one 4-rank gloo process set, each checked against one unsharded model.

actor_train TP2xPP2, critic_train PP2xDP2 in reverse rank order, actor_gen
TP2xDP2 and reward_inf TP1 on ranks {0, 1}; each runs forward/backward and
matches an unsharded model with the same weights; resharding actor_train to
actor_gen (TP2xDP2) and to ref_inf (TP1 on ranks {2, 3}) reproduces the
unsharded logits.
"""

import pytest

from rlhf.testing.distributed import launch

TOL = 1e-5


@pytest.fixture(scope="module")
def results():
    return launch(4, "scenario_task_meshes:run")


def _values(results, key):
    vals = [r[key] for r in results if key in r]
    assert vals, f"no rank reported {key}"
    return vals


def test_actor_train_tp2_pp2_matches_unsharded(results):
    assert len(_values(results, "actor_train_loss")) == 2  # the two last-stage (TP) ranks
    assert max(_values(results, "actor_train_loss")) < TOL
    assert max(_values(results, "actor_train_grad")) < TOL


def test_critic_train_reversed_pp2_dp2_matches_unsharded(results):
    # logical stage 0 of the reversed pipeline sits on the last ranks
    assert results[0]["critic_first_stage_ranks"] == [2, 0]
    assert len(_values(results, "critic_train_loss")) == 2
    assert max(_values(results, "critic_train_loss")) < TOL
    assert max(_values(results, "critic_train_grad")) < TOL


def test_reward_inf_tp1_on_two_ranks(results):
    assert len(_values(results, "reward_inf_values")) == 2
    assert max(_values(results, "reward_inf_values")) < TOL


@pytest.mark.parametrize("task", ["actor_gen", "ref_inf"])
def test_reshard_from_actor_train_gives_unsharded_logits(results, task):
    expected_ranks = 4 if task == "actor_gen" else 2
    assert len(_values(results, f"{task}_logits")) == expected_ranks
    assert max(_values(results, f"{task}_logits")) < TOL
    assert max(_values(results, f"{task}_loss")) < TOL
