"""RLHF-state checkpoints: layout changes (TP2xPP2 / reversed PP2xDP2 -> TP1) with megatron's
optimizer (plain and distributed, either side) and crash safety."""

import os
import subprocess
import sys

import pytest
import torch

from rlhf.checkpoint import CheckpointError
from rlhf.checkpoint.rlhf_state import load_rlhf_state
from rlhf.checkpoint.sources import read_full_state
from rlhf.testing.distributed import launch

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("rlhf_state"))
    return root, launch(4, "scenario_rlhf_state:run", root=root)


def test_state_is_restored_on_every_rank(results):
    _, res = results
    for r in res:
        assert r["iteration"] == 5 and r["data_position"] == {"epoch": 1, "index": 17}
        assert r["rng"], "per-rank RNG not restored"


CHECKS = ("weights", "moments", "step", "scheduler", "names")


@pytest.mark.parametrize("model,ranks", [("actor", [0, 1]), ("critic", [2])])
def test_tp1_load_has_identical_weights_and_optimizer(results, model, ranks):
    _, res = results
    assert [i for i, r in enumerate(res) if model in r] == ranks
    for i in ranks:
        assert {k: res[i][model][k] for k in CHECKS} == dict.fromkeys(CHECKS, True)


def test_optimizer_state_ranges_tile_every_parameter(results):
    _, res = results
    actor = [res[i]["actor"] for i in (0, 1)]  # TP1 x DP2, distributed optimizer: two shares per tensor
    for name, numel in actor[0]["numel"].items():
        pieces = sorted(r["ranges"][name] for r in actor if name in r["ranges"])
        assert pieces[0][0] == 0 and pieces[-1][1] == numel, name
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:])), name
    critic = res[2]["critic"]  # TP1, plain optimizer: every tensor whole
    assert critic["ranges"] == {n: (0, numel) for n, numel in critic["numel"].items()}


@pytest.mark.parametrize("model,ranks", [("actor", [0, 1]), ("critic", [2])])
def test_next_step_matches_torch_adamw_from_the_saved_state(results, model, ranks):
    _, res = results
    for i in ranks:
        assert res[i][model]["next_step_moved"] > 1e-4  # the step changed the weights
        assert res[i][model]["next_step_err"] < 1e-5


def test_files_one_per_saved_stage(results):
    root, res = results
    files = set(res[0]["files"])
    for model in ("actor", "critic"):
        assert {f"{model}_stage{s}of2.safetensors" for s in range(2)} <= files
    assert {f"rng_rank{r}.json" for r in range(4)} <= files
    cfg, role, full = read_full_state(root, "critic")
    assert role == "value" and full["output_layer.weight"].shape == (1, cfg.hidden_size)


def test_killed_save_leaves_previous_checkpoint(tmp_path):
    from scenario_rlhf_state import tiny_slot

    root = str(tmp_path)
    code = f"import scenario_rlhf_state as s; s.save_then_die({root!r})"  # `python -c` imports from its cwd
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=TESTS_DIR)
    assert proc.returncode == 9, proc.stderr
    partial = [n for n in os.listdir(root) if n.startswith(".tmp_iter_0000002")]
    assert partial and "actor_stage0of1.safetensors" in os.listdir(os.path.join(root, partial[0]))

    slot, expected = tiny_slot(seed=5), tiny_slot(seed=1)
    state = load_rlhf_state(root, {"actor": slot}, restore_rng=False)
    assert state.iteration == 1 and state.data_position == {"index": 1}
    for (n, p), q in zip(slot.model.named_parameters(), expected.model.parameters()):
        assert torch.equal(p, q), n
        assert torch.equal(slot.optimizer.state[p]["exp_avg"], expected.optimizer.state[q]["exp_avg"])

    with pytest.raises(CheckpointError, match="incomplete: directory missing"):
        load_rlhf_state(root, {"actor": slot}, iteration=2)
    os.rename(os.path.join(root, partial[0]), os.path.join(root, "iter_0000002"))  # a partial dir in plain sight
    with pytest.raises(CheckpointError, match="incomplete: manifest missing"):
        load_rlhf_state(root, {"actor": slot}, iteration=2)
    assert load_rlhf_state(root, {"actor": slot}, restore_rng=False).iteration == 1


def test_non_finite_optimizer_state_is_never_saved(tmp_path):
    """An Adam moment holding NaN (weights finite): the save is refused with one line naming the model's shard and
    the tensor, and the previous checkpoint still loads with its own moments."""
    from rlhf.checkpoint.rlhf_state import save_rlhf_state
    from scenario_rlhf_state import tiny_slot

    root = str(tmp_path)
    save_rlhf_state(root, 1, {"actor": tiny_slot(seed=1)}, data_position={"index": 1})
    slot = tiny_slot(seed=2)
    moments = slot.optimizer.state[slot.model.output_layer.weight]["exp_avg"]
    moments[0, 0] = float("nan")
    with pytest.raises(CheckpointError) as info:
        save_rlhf_state(root, 2, {"actor": slot}, data_position={"index": 2})
    assert str(info.value) == (
        f"checkpoint 2 in {root} not written: rank 0: CheckpointError: shard 'actor_stage0of1': tensor "
        f"'exp_avg/output_layer.weight' holds 1 NaN or infinite value(s) of {moments.numel()}; a checkpoint is never "
        "written from non-finite values")
    expected = tiny_slot(seed=1)
    state = load_rlhf_state(root, {"actor": slot}, restore_rng=False)
    assert state.iteration == 1
    assert torch.equal(slot.optimizer.state[slot.model.output_layer.weight]["exp_avg"],
                       expected.optimizer.state[expected.model.output_layer.weight]["exp_avg"])
