"""Six task meshes in one 4-rank gloo process set, each checked against one unsharded model.

actor_train TP2xPP2, critic_train PP2xDP2 in reverse rank order, actor_gen
TP2xDP2 and reward_inf TP1 on ranks {0, 1}; each runs forward/backward and
matches an unsharded model with the same weights; resharding actor_train to
actor_gen (TP2xDP2) and to ref_inf (TP1 on ranks {2, 3}) reproduces the
unsharded logits. A mixture of experts is the same model and gives the
unsharded logits at EP2 x DP4, TP2 x EP2, PP2 x DP2 and TP2 x PP2, the
unsharded gradient at EP2 x DP4, and reshards from EP2 to TP2 x EP2.
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


@pytest.mark.parametrize("layout", ["actor_train", "ref_inf", "critic_train", "reward_inf"])
def test_moe_layouts_build_one_model_and_give_the_unsharded_logits(results, layout):
    """EP2 x DP4, TP2 x EP2, PP2 x DP2, TP2 x PP2 from one seed: every expert, router and QK-norm weight
    equals the unsharded build's (a function of the seed and the name, whatever the layout), and the logits
    of the last stage match the unsharded model's."""
    weights = [r[f"moe_{layout}"][0] for r in results]
    logits = [r[f"moe_{layout}"][1] for r in results if r[f"moe_{layout}"][1] is not None]
    assert len(weights) == 4 and max(weights) == 0.0
    assert len(logits) == (2 if layout in ("critic_train", "reward_inf") else 4)
    assert max(logits) < TOL


def test_moe_expert_parallel_gradient_and_reshard(results):
    """EP2 x DP4 trains one sequence per replica; with experts' gradients averaged over the replicas holding
    them they equal the unsharded mean's; resharding EP2 -> TP2 x EP2 moves every expert to its holders."""
    assert max(_values(results, "moe_ep2_grad")) < TOL
    assert max(_values(results, "moe_reshard")) == 0.0
