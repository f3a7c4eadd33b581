"""The PPO trainer against textbook PPO (one iteration on given samples) and exact resume, 4 gloo ranks.

actor_train TP2xPP2, critic_train PP2xDP2 reversed, ref and reward TP1 on rank
subsets; two PPO epochs of one mini-batch each. Resume: 2 iterations, save, load
into a fresh trainer, 2 more, against 4 straight. Fusion: 2 iterations with a searched fused
actor/critic schedule against serial 1F1B. See tests/scenario_trainer.py.
"""

import pytest

from rlhf.testing.distributed import launch

TOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch(4, "scenario_trainer:run", root=str(tmp_path_factory.mktemp("ckpt")))


@pytest.mark.parametrize("field", ["ref_logprobs", "scores", "values", "advantages", "returns"])
def test_batch_fields_match_textbook(results, field):
    assert results[0][f"{field}_max_diff"] < TOL


@pytest.mark.parametrize("model", ["actor", "critic"])
def test_parameters_match_textbook_ppo(results, model):
    assert results[0]["smallest_grad_norm"] > 0.05  # every step clipped (PPO.clip_grad)
    assert results[0][f"{model}_moved"] > 1e-4  # the iteration changed the weights
    assert results[0][f"{model}_max_diff"] < TOL


def test_resume_continues_exactly(results):
    r = results[0]
    assert r["loaded_at"] == 2
    assert len(set(r["kl_coefs"])) == 4  # the adaptive KL coefficient moved every iteration: its state matters
    for straight, resumed in zip(r["straight_metrics"], r["resumed_metrics"]):
        for key, value in straight.items():
            if not key.startswith("time_") and not key.endswith("_per_s") and key != "training_bubble_fraction":
                assert resumed[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    assert r["resume_param_diff"] < 1e-6


def test_fused_schedule_trains_like_serial_1f1b(results):
    r = results[0]
    assert r["fused_moved"] > 1e-4
    assert r["fused_param_diff"] < 1e-5
    assert r["fused_value_loss"][1] == pytest.approx(r["fused_value_loss"][0], rel=1e-5)


def test_searched_schedule_after_the_first_iteration_trains_like_serial(results):
    r = results[0]
    assert r["searched_schedule"] == ("actor", "critic")  # measured, searched and used from iteration 2
    assert r["searched_param_diff"] < 1e-5
    assert r["cached_schedule_reused"]  # saved beside the checkpoint, taken on resume
    assert all(0.0 <= b < 1.0 for b in r["bubble"])

