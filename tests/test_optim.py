"""rlhf.optim: the config's validation, and megatron DDP + optimizer + LR schedule on 4 gloo ranks.

Named layouts (tests/scenario_optim.py): ``tp2_pp2`` (LM), ``pp2_dp2`` (value
model, reversed pipeline), with megatron's distributed optimizer
``pp2_dp2_distopt`` (LM) and ``tp2_dp2_distopt`` (value model), and with
overlapped gradient reduction ``pp2_dp2_overlap`` and ``tp2_dp2_distopt_overlap``
(steps of 4, 2, 6 and 4 micro-batches). Each takes 4
AdamW steps with clipping active and a warm-up + cosine LR; parameters, the
reported gradient norms and LRs must match unsharded torch training, with two
steps of NaN gradients slipped in before the second (skipped on every rank, counted in a row).
"""

import math

import pytest

from rlhf.optim import OptimizerConfig
from rlhf.testing.distributed import launch
from scenario_optim import CLIP, LAYOUTS, STEPS, lr_at

TOL = 1e-5


@pytest.mark.parametrize("fields,message", [
    ({"optimizer": "adagrad"}, "OptimizerConfig.optimizer='adagrad': choose one of ('adam', 'sgd')"),
    ({"lr": 0.0}, "OptimizerConfig.lr=0.0: must be > 0"),
    ({"lr": 1e-3, "min_lr": 2e-3}, "OptimizerConfig.min_lr=0.002: must be in [0, lr=0.001]"),
    ({"lr_warmup_init": 1.0}, "OptimizerConfig.lr_warmup_init=1.0: must be in [0, lr=1e-06]"),
    ({"lr_warmup_iters": -1}, "OptimizerConfig.lr_warmup_iters=-1: must be an integer >= 0"),
    ({"lr_decay_style": "cosine"}, "OptimizerConfig.lr_decay_style='cosine': needs lr_decay_iters"),
    ({"lr_decay_iters": 10}, "OptimizerConfig.lr_decay_iters=10: has no effect with lr_decay_style='constant'"),
    ({"lr_decay_style": "linear", "lr_warmup_iters": 5, "lr_decay_iters": 5},
     "OptimizerConfig.lr_decay_iters=5: must be an integer > lr_warmup_iters=5"),
    ({"lr_decay_style": "step", "lr_decay_iters": 5}, "OptimizerConfig.lr_decay_style='step': choose one of"),
    ({"weight_decay": -0.1}, "OptimizerConfig.weight_decay=-0.1: must be >= 0"),
    ({"adam_beta2": 1.0}, "OptimizerConfig.adam_beta2=1.0: must be in [0, 1)"),
    ({"adam_eps": 0.0}, "OptimizerConfig.adam_eps=0.0: must be > 0"),
    ({"clip_grad": -1.0}, "OptimizerConfig.clip_grad=-1.0: must be >= 0 (0 turns clipping off)"),
    ({"use_distributed_optimizer": 1}, "OptimizerConfig.use_distributed_optimizer=1: must be True or False"),
    ({"overlap_grad_reduce": "yes"}, "OptimizerConfig.overlap_grad_reduce='yes': must be True, False or None"),
])
def test_config_errors_name_the_field(fields, message):
    with pytest.raises(ValueError) as err:
        OptimizerConfig(**fields)
    assert message in str(err.value)


def test_config_accepts_a_schedule():
    cfg = OptimizerConfig(lr=1e-5, min_lr=1e-6, lr_warmup_iters=10, lr_decay_iters=100, lr_decay_style="cosine")
    assert (cfg.lr_decay_iters, cfg.clip_grad, cfg.use_distributed_optimizer) == (100, 1.0, False)


def test_lr_formula_covers_warmup_peak_decay_and_floor():
    assert [lr_at(n) for n in (0, 1, 3)] == [2e-4, 1e-3, 1e-4]
    assert math.isclose(lr_at(2), 5.5e-4)


@pytest.fixture(scope="module")
def results():
    return launch(4, "scenario_optim:run")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parameters_match_torch_adamw(results, layout):
    for r in results:
        assert r[layout]["moved"] > 1e-3  # the steps changed the weights
        assert r[layout]["err"] < TOL


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grad_norm_is_the_unsharded_norm_and_clips(results, layout):
    for r in results:
        ref = r[layout]["ref_grad_norm"]
        assert len(ref) == STEPS and min(ref) > CLIP  # clipping was active on every step
        for norm, expected in zip(r[layout]["grad_norm"], ref):
            assert abs(norm - expected) <= TOL * expected


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_step_of_non_finite_gradients_is_skipped_on_every_rank(results, layout):
    """Two NaN-loss steps before step 2: every rank reports them skipped with a NaN norm and counts them in a
    row (1, 2; back to 0 at the next update), and the run's weights (test_parameters_match_torch_adamw) and
    learning rates match a run without them."""
    for r in results:
        assert [p["skipped"] for p in r[layout]["poisoned"]] == [1.0, 1.0]
        assert all(math.isnan(p["grad_norm"]) for p in r[layout]["poisoned"])
        assert r[layout]["skipped"] == [0.0] * STEPS
        assert r[layout]["in_a_row"] == [0, 1, 2, 0, 0, 0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lr_follows_warmup_and_cosine(results, layout):
    for r in results:
        assert [math.isclose(lr, lr_at(n), rel_tol=1e-12) for n, lr in enumerate(r[layout]["lr"])] == [True] * STEPS
