"""Invalid placements fail fast with a message naming the task and the rule."""

import json

import pytest

from rlhf.models import ModelConfig
from rlhf.parallel import ParallelStrategy, Placement, PlacementError, TaskMesh

CFG = ModelConfig(num_layers=4, num_attention_heads=4, num_kv_heads=2, hidden_size=64, vocab_size=256)
MODELS = {"actor": CFG, "critic": CFG, "reward": CFG, "reference": CFG}


def _place(plan, world=4):
    placement = Placement.from_plan(plan, world)
    placement.validate_models(MODELS)
    return placement


@pytest.mark.parametrize("plan, message", [
    ({"actor_train": {"ranks": "0-3", "dp": 1, "pp": 2, "tp": 1}}, r"actor_train: dp\*pp\*tp = 1\*2\*1 = 2 but the mesh has 4"),
    ({"critic_train": {"ranks": "0-2", "tp": 2}}, r"critic_train: pp\*tp = 1\*2 does not divide the mesh size 3"),
    ({"actor_gen": {"tp": 4, "ranks": "0-3"}}, r"actor_gen: tp=4 does not divide the KV heads \(num_kv_heads=2\)"),
    ({"ref_inf": {"pp": 8, "ranks": "0-7"}}, r"ref_inf: ranks '0-7' reach rank 7, outside the world of 4 ranks"),
    ({"ref_inf": {"ranks": [0, 4]}}, r"ref_inf: rank\(s\) \[4\] are outside the world of 4 ranks"),
    ({"ref_inf": {"ranks": "0-99999999999999"}}, r"ref_inf: ranks '0-99999999999999' reach rank 99999999999999, "
                                                 r"outside the world of 4 ranks \(valid: 0..3\)"),  # never expanded
    ({"ref_inf": {"ranks": []}}, r"ref_inf: ranks \[\] names no rank"),
    ({"reward_inf": {"ranks": [0, 1, 1]}}, r"reward_inf: rank\(s\) \[1\] appear twice"),
    ({"critic_inf": {"ranks": "0-1", "dp": 3}}, r"critic_inf: dp\*pp\*tp = 3\*1\*1 = 3 but the mesh has 2"),
    ({"actor_training": {}}, r"unknown task\(s\) \['actor_training'\]"),
    ({"actor_train": {"ranks": "0-3", "tpp": 2}}, r"actor_train: unknown key\(s\) \['tpp'\]"),
    ({"actor_train": {"ranks": "a-b"}}, r"actor_train: cannot parse ranks 'a-b'"),
    ({"actor_train": {"ranks": [1, 0], "tp": 2}}, r"actor_train: TP group \[1, 0\] must list its ranks in ascending order"),
])
def test_invalid_placement_names_task_and_rule(plan, message):
    with pytest.raises(PlacementError, match=message):
        _place(plan)


def test_tp_not_dividing_attention_heads():
    cfg = ModelConfig(num_layers=4, num_attention_heads=6, num_kv_heads=6, hidden_size=48, vocab_size=256)
    placement = Placement.from_plan({"actor_train": {"tp": 4}}, 4)
    with pytest.raises(PlacementError, match=r"actor_train: tp=4 does not divide num_attention_heads=6"):
        placement.validate_models({"actor": cfg})


MOE = ModelConfig(num_layers=4, num_attention_heads=4, num_kv_heads=2, hidden_size=64, vocab_size=256, num_experts=4)


@pytest.mark.parametrize("plan, models, message", [
    ({"actor_train": {"ranks": "0-3", "dp": 4, "ep": 3}}, {"actor": MOE},
     r"actor_train: ep=3 does not divide dp=4; expert parallelism splits the experts over ep of the data-parallel"),
    ({"actor_train": {"ranks": "0-3", "ep": 0}}, {"actor": MOE}, r"actor_train: ep=0 must be a positive integer"),
    ({"actor_train": {"ranks": "0-3", "dp": 4, "ep": 2}}, {"actor": CFG},
     r"actor_train: ep=2 needs a mixture-of-experts model \(num_experts > 0\); this one is dense"),
    ({"critic_train": {"ranks": "0-7", "dp": 8, "ep": 8}}, {"critic": MOE},
     r"critic_train: ep=8 does not divide num_experts=4"),
    ({"actor_gen": {"ranks": "0-3", "dp": 4, "ep": 2}}, {"actor": MOE},
     r"actor_gen: ep=2: the engine's replicas step independently and hold every expert; use ep=1"),
    ({"actor_train": {"ranks": "0-3", "tp": 2}}, {"actor": MOE},
     r"actor_train: tp=2 with a mixture of experts: megatron trains MoE layers at tp > 1 only with sequence "
     r"parallelism"),
])
def test_invalid_expert_parallel_layouts_name_the_task_and_rule(plan, models, message):
    with pytest.raises(PlacementError, match=message):
        Placement.from_plan(plan, 8).validate_models(models)


def test_expert_parallel_groups_are_carved_out_of_data_parallel_replicas():
    """EP2 over DP4 (TP2): replicas {0, 1} and {2, 3} split the experts; replicas holding the same experts
    ({0, 2}, {1, 3}) are the expert-data-parallel groups; inference tasks may use tp with MoE."""
    placement = Placement.from_plan({"ref_inf": {"ranks": "0-7", "tp": 2, "dp": 4, "ep": 2}}, 8)
    placement.validate_models({"reference": MOE})
    mesh = placement["ref_inf"]
    assert str(mesh.strategy) == "dp4xpp1xtp2xep2"
    assert mesh.ep_ranks(0, 3, 1) == [5, 7] and mesh.ep_index(0, 3, 1) == 1
    assert mesh.expert_dp_ranks(0, 1, 0) == [2, 6]


def test_pp_larger_than_layers():
    with pytest.raises(PlacementError, match=r"critic_train: pp=8 is larger than num_layers=4"):
        Placement.from_plan({"critic_train": {"pp": 8}}, 8).validate_models(MODELS)


def test_valid_placement_layout_and_reverse_pipeline():
    placement = _place({
        "actor_train": {"ranks": "0-3", "tp": 2, "pp": 2},
        "critic_train": {"ranks": "0-3", "dp": 2, "pp": 2, "reverse_pp": True},
        "reward_inf": {"ranks": [0, 1]},
    })
    actor, critic = placement["actor_train"], placement["critic_train"]
    assert actor.strategy == ParallelStrategy(dp=1, pp=2, tp=2)
    assert [actor.tp_ranks(p, 0) for p in range(2)] == [[0, 1], [2, 3]]
    # reversed: logical stage 0 on the last ranks, so actor stage 0 shares ranks with critic's last stage
    assert critic.pp_ranks(dp=0, tp=0) == [2, 0] and critic.pp_ranks(dp=1, tp=0) == [3, 1]
    assert critic.coord(0).pp == 1 and critic.coord(3).pp == 0 and critic.coord(3).dp == 1
    assert placement["reward_inf"].strategy.dp == 2 and placement["ref_inf"].ranks == (0, 1, 2, 3)
    assert TaskMesh("x", (5, 6), ParallelStrategy(dp=2)).coord(4) is None


def test_placement_file_json_and_yaml(tmp_path):
    plan = {"actor_train": {"ranks": "0-1", "tp": 2}}
    (tmp_path / "p.json").write_text(json.dumps(plan))
    (tmp_path / "p.yaml").write_text("actor_train:\n  ranks: 0-1\n  tp: 2\n")
    for name in ("p.json", "p.yaml"):
        assert Placement.from_file(tmp_path / name, 2)["actor_train"].strategy.tp == 2
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(PlacementError, match="placement file .*bad.json"):
        Placement.from_file(tmp_path / "bad.json", 2)


@pytest.mark.parametrize("entry,message", [
    ({"tp": 2.9}, "actor_train: tp=2.9 must be a positive integer"),
    ({"tp": "two"}, "actor_train: tp='two' must be a positive integer"),
    ({"dp": True}, "actor_train: dp=True must be a positive integer"),
    ({"pp": 0}, "actor_train: pp=0 must be a positive integer"),
    ({"reverse_pp": "false"}, "actor_train: reverse_pp='false' must be true or false"),
    ({"ranks": "3-0"}, "actor_train: cannot parse ranks '3-0'"),
    ({"ranks": [0, 1.5]}, r"actor_train: ranks \[0, 1.5\] must be integers"),
    ({"ranks": 3}, "actor_train: ranks 3 is a int"),
])
def test_plan_values_are_checked_not_coerced(entry, message):
    with pytest.raises(PlacementError, match=message):
        Placement.from_plan({"actor_train": entry}, 4)
