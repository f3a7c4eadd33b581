"""Activation recomputation and the per-rank memory parts, on 4 gloo ranks (tests/scenario_memory.py).

Recomputation must train exactly as without it (actor_train TP2xPP2, critic_train PP2xDP2 reversed) and
keep fewer activation bytes saved for backward; the memory parts each rank reports must equal the
parts counted from the model shapes.
"""

import pytest

from rlhf.testing.distributed import launch

RECOMPUTED = ("full", "full2", "selective")


@pytest.fixture(scope="module")
def results():
    return launch(4, "scenario_memory:run", timeout_s=600)


@pytest.mark.parametrize("setting", RECOMPUTED)
def test_recomputation_trains_exactly_as_without(results, setting):
    for rank in results:
        assert rank[setting]["recompute"]["actor_train"] == rank[setting]["recompute"]["critic_train"] \
            == {"full2": "full"}.get(setting, setting)
        assert all(rank[setting]["recompute"][t] is None for t in rank[setting]["recompute"]
                   if t not in ("actor_train", "critic_train"))  # inference and generation never recompute
        for task, diff in rank[setting]["max_diff"].items():
            assert diff <= 1e-6, (rank["rank"], setting, task, diff)
            assert rank[setting]["moved"][task] > 1e-4  # the update did move the weights
    base, run = results[0]["none"]["metrics"], results[0][setting]["metrics"]
    for key in ("actor_grad_norm", "critic_grad_norm", "policy_loss", "value_loss"):
        assert run[key] == pytest.approx(base[key], rel=1e-6, abs=1e-9), key


def test_recomputation_lowers_the_saved_activation_bytes(results):
    for rank in results:
        saved = {s: rank[s]["parts"]["training"]["activations"] for s in ("none", *RECOMPUTED)}
        assert saved["none"] > 0
        # full keeps a chunk's input only; chunks of 2 layers keep half the inputs of chunks of 1 but recompute
        # twice the layers at once; selective drops the attention's softmax and score tensors
        assert saved["full"] < saved["selective"] < saved["none"], (rank["rank"], saved)
        assert saved["full2"] < saved["none"], (rank["rank"], saved)


def test_the_memory_parts_match_the_shape_count(results):
    for rank in results:
        parts, expected = rank["none"]["parts"], rank["none"]["expected"]
        training = parts["training"]
        for part in ("parameters", "gradients", "optimizer", "kv"):
            assert training[part] == expected[part], (rank["rank"], part)
        assert parts["reshard"]["parameters"] == expected["parameters"]  # learn() runs no generation
        assert parts["reshard"]["kv"] == expected["kv"]
        assert "gradients" in parts["inference"]  # noted in every stage; reported for training only


def test_memory_metrics_report_the_heaviest_rank(results):
    metrics = results[0]["none"]["metrics"]
    for part in ("parameters", "gradients", "optimizer", "kv"):
        key = f"memory_training_{part}_bytes_max"
        assert metrics[key] == max(r["none"]["expected"][part] for r in results), key
    assert metrics["memory_training_activations_bytes_max"] == max(
        r["none"]["parts"]["training"]["activations"] for r in results)
    assert metrics["memory_training_total_bytes_max"] == max(sum(r["none"]["parts"]["training"].values())
                                                             for r in results)
    assert metrics["memory_training_bytes_max"] == max(r["none"]["expected"]["parameters"] + r["none"]["expected"]["kv"]
                                                       for r in results)
    assert "memory_inference_gradients_bytes_max" not in metrics
    assert metrics["memory_reshard_kv_bytes_max"] == max(r["none"]["expected"]["kv"] for r in results)


def test_recompute_arguments_are_megatron_ones_or_refused():
    from rlhf.models.gpt import recompute_fields

    assert recompute_fields(None, None, 4) == {}
    assert recompute_fields("full", None, 4) == {"recompute_granularity": "full", "recompute_method": "uniform",
                                                 "recompute_num_layers": 1}
    assert recompute_fields("selective", None, 4) == {"recompute_granularity": "selective",
                                                      "recompute_modules": ["core_attn"]}
    for args, message in ((("full", 3, 4), "recompute_num_layers=3 must divide the 4 layers"),
                          (("full", 0, 4), "recompute_num_layers=0 must divide"),
                          (("selective", 1, 4), "applies to recompute_granularity 'full' only"),
                          ((None, 2, 4), "recompute_num_layers=2 needs recompute_granularity 'full'"),
                          (("block", None, 4), "recompute_granularity='block' is not one of")):
        with pytest.raises(ValueError, match=message):
            recompute_fields(*args)
