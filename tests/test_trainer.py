"""The PPO trainer against textbook PPO (one iteration on given samples, every log-prob of logits / T at
T=0.7) and exact resume, 4 gloo ranks.

actor_train TP2xPP2, critic_train PP2xDP2 reversed, ref and reward TP1 on rank
subsets; two PPO epochs of one mini-batch each (and again with multi-turn samples whose observations
are holes in the loss mask); the same against the placement the planner picks for
this job (rlhf/planner on 4 CPU ranks). Resume: 2 iterations, save, load
into a fresh trainer, 2 more, against 4 straight. Optimizer paths: 2 iterations with the
distributed optimizer (and with overlapped gradient reduction) against the plain one. Fusion: 2 iterations with a searched fused
actor/critic schedule against serial 1F1B. Memory: 2 iterations with the reference and reward offloaded
and actor_gen's weights and KV cache released against 2 without (results, and bytes per rank and stage).
Non-finite values: samples a reward function scores NaN or infinite, dropped with --skip-nonfinite-samples,
against textbook PPO without them; a run whose every step is skipped stops at --max-skipped-steps.
The actor's loss carries an entropy bonus (--entropy-coef 0.01) throughout, whose gradient at TP2 is checked
against an unsharded loss; the logged losses are the losses the optimizer steps minimised, under all four
--loss-agg modes.
See tests/scenario_trainer.py.
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


@pytest.mark.parametrize("model", ["actor", "critic"])
def test_packed_micro_batches_train_like_padded_ones(results, model):
    """--max-tokens-per-microbatch 16: micro-batches of one or two samples packed into one row each (a varying
    number per DP replica and pipeline), the same update as padded micro-batches of 2 and as textbook PPO;
    the reference's, the reward model's and the critic's inference packed too."""
    assert results[0][f"packed_{model}_moved"] > 1e-4
    assert results[0][f"packed_{model}_vs_padded"] < TOL
    assert results[0][f"packed_{model}_max_diff"] < TOL
    for field in ("ref_logprobs", "scores", "values", "advantages", "returns"):
        assert results[0][f"packed_{field}_max_diff"] < TOL, field
    # the losses and gradient norms the two runs logged (the steps' means)
    loss = {"actor": ("policy_loss", "actor_grad_norm"), "critic": ("value_loss", "critic_grad_norm")}[model]
    for key in loss:
        assert results[0]["packed_metrics"][key] == pytest.approx(results[0]["metrics"][key], rel=TOL), key


@pytest.mark.parametrize("model", ["actor", "critic"])
def test_multi_turn_samples_train_only_on_the_models_tokens(results, model):
    """Samples of two turns with a 2-token observation between them (Batch.loss_mask 0 there, as the episode
    runner makes them): the same update as textbook PPO whose masks leave the observations out of the KL,
    GAE (verl's multi-turn loop: they are skipped), the whitening, the policy and the value loss."""
    r = results[0]
    assert r[f"multi_turn_{model}_moved"] > 1e-4
    assert r[f"multi_turn_{model}_max_diff"] < TOL
    for field in ("ref_logprobs", "scores", "values", "advantages", "returns"):
        assert r[f"multi_turn_{field}_max_diff"] < TOL, field
    # 5 of the 8 responses (lengths 4, 7, 5, 6, 7) have two turns and a 2-token observation
    assert r["multi_turn_metrics"]["turns_mean"] == pytest.approx(13 / 8)
    assert r["multi_turn_metrics"]["multi_turn_fraction"] == pytest.approx(5 / 8)
    assert r["multi_turn_metrics"]["observation_tokens_mean"] == pytest.approx(10 / 8)
    assert r["multi_turn_metrics"]["policy_loss"] != pytest.approx(r["metrics"]["policy_loss"], rel=1e-3)


@pytest.mark.parametrize("model", ["actor", "critic"])
def test_samples_of_non_finite_scores_are_dropped_as_if_absent(results, model):
    """--skip-nonfinite-samples with a reward function scoring sample 1 NaN and sample 4 infinite: the iteration
    goes on, on all 8 samples (the critic's 2 DP replicas keep their shares), and trains as textbook PPO does
    on the other 6: weights, advantages and returns (0 for the dropped two), kl_mean and reward_mean over the
    six; nonfinite_samples_dropped counts the two."""
    r = results[0]
    assert r[f"skip_{model}_moved"] > 1e-4 and r[f"skip_{model}_max_diff"] < TOL
    for field in ("advantages", "returns"):
        assert r[f"skip_{field}_max_diff"] < TOL and r[f"skip_dropped_{field}_max"] == 0.0
    metrics = r["skip_metrics"]
    assert metrics["nonfinite_samples_dropped"] == 2.0
    assert metrics["kl_mean"] == pytest.approx(r["skip_kl_mean"], rel=TOL)
    assert metrics["reward_mean"] == pytest.approx(r["skip_reward_mean"], rel=TOL)
    assert r["metrics"]["nonfinite_samples_dropped"] == 0.0  # logged without the flag too


def test_a_model_whose_steps_all_skip_stops_the_run_on_every_rank(results):
    """The reference infers NaN, so every step of both models is skipped (2 an iteration): with
    --max-skipped-steps 3 train() stops after its second iteration, every rank with the same line naming the
    actor (its metrics sort first) and its 4 skips in a row; no weight moved."""
    expected = ("ppo.max_skipped_steps", "actor: 4 optimizer steps in a row skipped for non-finite gradients (the "
                "limit is 3), so it no longer learns; look for NaN or infinity in its inputs, or lower its learning "
                "rate")
    assert [r["skip_stop"] for r in results] == [{"error": expected, "iteration": 2, "moved": 0.0}] * 4


@pytest.mark.parametrize("model", ["actor", "critic"])
def test_sequence_mean_aggregation_matches_its_formula_over_dp(results, model):
    """--loss-agg seq-mean-token-mean: every sequence weighs the same, over the critic's 2 DP replicas and the
    micro-batches of unequal lengths, as the textbook's mean of per-sequence token means."""
    assert results[0][f"seq_mean_{model}_moved"] > 1e-4
    assert results[0][f"seq_mean_{model}_max_diff"] < TOL
    # another update than token-mean's, by more than the tolerance: the check can tell them apart
    assert results[0][f"seq_mean_{model}_vs_token_mean"] > 10 * TOL


@pytest.mark.parametrize("run, agg", [("", "token-mean"), ("seq_mean_", "seq-mean-token-mean"),
                                      ("planned_", "seq-mean-token-sum"), ("multi_turn_", "seq-mean-token-sum-norm")])
def test_logged_losses_are_the_losses_the_steps_minimised(results, run, agg):
    """``policy_loss``, ``entropy_loss`` and ``value_loss`` are the means over the iteration's optimizer steps of
    the terms of the loss each step minimised (the textbook's, aggregated over the whole mini-batch), under
    every --loss-agg, with the critic's two DP replicas holding unequal numbers of tokens (and, on the
    planner's placement, whatever split it picks); seq-mean-token-sum-norm divides by --max-response-len."""
    logged, textbook = results[0][f"{run}metrics"], results[0][f"{run}textbook_losses"]
    for name, value in textbook.items():
        assert logged[name] == pytest.approx(value, rel=TOL, abs=1e-7), (agg, name)


def test_the_entropy_bonus_gradient_at_tp2_is_the_unsharded_one(results):
    """--entropy-coef 0.01 at TP2 (each rank a half of the vocabulary, two padded ids): the actor loss's gradient
    w.r.t. each rank's logits equals its slice of the unsharded written-out loss's within 1e-6, finite at the
    padded ids; without the bonus the gradient differs by far more, so the check can tell."""
    for r in results:
        assert r["entropy_tp"] == 2 and r["entropy_grad_finite"]
        assert r[f"entropy_grad_diff_rank{r['rank']}"] < 1e-6
    assert results[0]["entropy_grad_effect"] > 100 * 1e-6


@pytest.mark.parametrize("model", ["actor", "critic"])
def test_logged_grad_norm_and_lr_are_the_updates(results, model):
    """``<model>_grad_norm`` is the mean over the iteration's steps of the global norm before clipping, as the
    textbook's torch clip_grad_norm_ returns it; ``<model>_lr`` the learning rate they used."""
    metrics = results[0]["metrics"]
    assert metrics[f"{model}_grad_norm"] == pytest.approx(results[0]["grad_norms"][model], rel=1e-5)
    assert metrics[f"{model}_lr"] == pytest.approx({"actor": 5e-4, "critic": 1e-3}[model])


def test_the_planners_placement_trains_like_textbook_ppo(results):
    """tools/plan_placement.py's choice for this job (a layout unlike the scenario's own) runs in the trainer
    and gives the same iteration."""
    r = results[0]
    assert not r["planned_like_plan"], r["planned_plan"]
    for model in ("actor", "critic"):
        assert r[f"planned_{model}_moved"] > 1e-4 and r[f"planned_{model}_max_diff"] < TOL
    for field in ("advantages", "returns", "scores", "ref_logprobs", "values"):
        assert r[f"planned_{field}_max_diff"] < TOL


def test_resume_continues_exactly(results):
    r = results[0]
    assert r["loaded_at"] == 2
    assert len(set(r["kl_coefs"])) == 4  # the adaptive KL coefficient moved every iteration: its state matters
    for straight, resumed in zip(r["straight_metrics"], r["resumed_metrics"]):
        for key, value in straight.items():
            if not key.startswith("time_") and not key.endswith("_per_s") and key != "training_bubble_fraction":
                assert resumed[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    assert r["resume_param_diff"] < 1e-6
    assert r["megatron_export_diff"] == 0.0  # --save-format torch_dist: the same actor, as Megatron-LM's
    assert r["kept_checkpoints"] == [3, 4]  # --keep-last 2: the resumed run's two saves, iteration 2 deleted


@pytest.mark.parametrize("path", ["distributed", "overlapped"])
def test_distributed_optimizer_and_overlapped_reduce_train_like_the_plain_optimizer(results, path):
    r = results[0]
    assert r["optimizer_moved"] > 1e-4
    assert r[f"{path}_param_diff"] < TOL


def test_fused_schedule_trains_like_serial_1f1b(results):
    r = results[0]
    assert r["fused_moved"] > 1e-4
    assert r["fused_param_diff"] < 1e-5
    assert r["fused_value_loss"][1] == pytest.approx(r["fused_value_loss"][0], rel=1e-5)


def test_packed_micro_batches_keep_the_fused_schedules_count_and_train_like_serial(results):
    """--max-tokens-per-microbatch with --intra-stage-fusion: each replica's share in the schedule's 2
    micro-batches, balanced by tokens and packed; 2 iterations equal padded serial 1F1B's."""
    assert results[0]["packed_fused_param_diff"] < 1e-5


def test_searched_schedule_after_the_first_iteration_trains_like_serial(results):
    r = results[0]
    assert r["searched_schedule"] == ("actor", "critic")  # measured, searched and used from iteration 2
    assert r["searched_param_diff"] < 1e-5
    assert r["cached_schedule_reused"]  # saved beside the checkpoint, taken on resume
    assert all(0.0 <= b < 1.0 for b in r["bubble"])


def test_offload_and_generation_release_change_no_result(results):
    r = results[0]
    assert len(r["lean_metrics"]) == len(r["kept_metrics"]) == 2
    for kept, lean in zip(r["kept_metrics"], r["lean_metrics"]):
        compared = [k for k in kept if not k.startswith(("time_", "memory_")) and not k.endswith("_per_s")
                    and k != "training_bubble_fraction"]
        assert len(compared) > 10 and set(compared) <= set(lean)
        for key in compared:  # the same computation on the same values: bit for bit
            assert lean[key] == kept[key], key
    assert r["lean_param_diff"] == 0.0
    assert "call sync_generation_weights() first" in r["generate_refused"]  # not on released weights


@pytest.mark.parametrize("rank", range(4))
def test_stage_bytes_drop_by_what_is_offloaded_and_released(results, rank):
    """Per rank and stage: the reference/reward weights leave the device outside their inference, and
    actor_gen's weights and KV cache outside reshard + generation (every rank holds actor_gen here)."""
    r = results[rank]
    kept, lean = r["kept_bytes"], r["lean_bytes"]
    gen, off = r["generation_bytes"], r["offloaded_bytes"]
    assert gen > 0 and off > 0  # each rank holds actor_gen and one of ref_inf / reward_inf
    assert set(kept) == set(lean) == {"reshard", "generation", "inference", "training"}
    assert len(set(kept.values())) == 1  # without either flag nothing moves: the same bytes at every stage
    assert lean["reshard"] == kept["reshard"] - off  # actor_gen allocated again, ref/reward on the host
    assert lean["generation"] == kept["generation"] - off
    assert lean["inference"] == kept["inference"] - gen  # ref/reward loaded, actor_gen released
    assert lean["training"] == kept["training"] - gen - off


def test_stage_bytes_are_reported_as_metrics(results):
    r = results[0]
    kept, lean = r["kept_metrics"][-1], r["lean_metrics"][-1]
    for stage in ("reshard", "generation", "inference", "training"):
        key = f"memory_{stage}_bytes_max"
        assert kept[key] == max(results[rank]["kept_bytes"][stage] for rank in range(4))
        assert lean[key] == max(results[rank]["lean_bytes"][stage] for rank in range(4))
    assert lean["memory_training_bytes_max"] < kept["memory_training_bytes_max"]


def test_critic_warmup_trains_the_critic_alone_first(results):
    first, second = results[0]["warmup_1"], results[0]["warmup_2"]
    assert first["actor_moved"] == 0.0 and first["critic_moved"] > 1e-5
    assert not first["policy_loss_logged"] and first["value_loss_logged"]
    assert second["actor_moved"] > 1e-5 and second["policy_loss_logged"]


@pytest.mark.parametrize("model", ["actor", "critic"])
def test_mixture_of_experts_trains_like_textbook_ppo(results, model):
    """QK-norm MoE actor and critic (4 experts, top-2) split over EP2 in every task but generation (actor
    EP2 x PP2 x DP2, critic EP2 x DP4): one iteration equals textbook PPO on the same MoE modules."""
    r = results[0]
    assert r[f"moe_{model}_moved"] > 1e-4
    assert r[f"moe_{model}_max_diff"] < TOL
    for name, value in r["moe_textbook_losses"].items():
        assert abs(r["moe_metrics"][name] - value) < TOL, name


def test_routing_replay_makes_the_trainer_compute_what_the_engine_sampled(results):
    """actor_gen's routers perturbed after the weight sync (near-even routing, noise 1e-4): engine and trainer
    pick other experts for about 5% of (token, layer) choices. With --routing-replay the recomputed old
    log-probs use the engine's experts and mismatch_kl stays below 1e-6; without it the flipped experts show."""
    replay, plain = results[0]["moe_replay_metrics"], results[0]["moe_no_replay_metrics"]
    for metrics in (replay, plain):
        assert 0.8 < metrics["routing_agreement"] < 1.0  # some choices disagree, most agree
    assert replay["mismatch_kl"] < 1e-6
    assert plain["mismatch_kl"] > 100 * replay["mismatch_kl"] and plain["mismatch_kl"] > 1e-5
    assert results[0]["moe_replay_vs_plain"] > 1e-5  # the update moves with the experts the old log-probs used


def test_an_expert_parallel_checkpoint_loads_into_another_expert_layout(results):
    """The replayed MoE run (actor EP2 x PP2 x DP2, critic EP2 x DP4) saved and loaded into actor EP4 x DP4,
    critic DP4: every expert back where the new layout holds it, equal."""
    assert results[0]["moe_resume_diff"] == 0.0


def test_load_balancing_loss_is_logged_and_trains_the_router(results):
    """The actor's and critic's load-balancing losses (coefficient 0.01, 2 MoE layers) are logged, between 0 and
    coefficient x layers x experts; with the coefficient 0 they are not logged and the routers end elsewhere."""
    metrics = results[0]["moe_replay_metrics"]
    for model in ("actor", "critic"):
        assert 0 < metrics[f"{model}_load_balancing_loss"] <= 0.01 * 2 * 4
    assert "actor_load_balancing_loss" not in results[0]["moe_no_aux_metrics"]
    assert results[0]["moe_aux_router_diff"] > 1e-4


def test_tiny_default_learns_with_a_mixture_of_experts_actor_and_critic(results):
    """The job's trainer from --actor-model tiny-moe --critic-model tiny-moe-critic --routing-replay
    --recompute-logprobs on 4 ranks, the gold rule as the reward: the built-in plan splits the experts over EP2
    in every task but generation (training at tp 1); over 12 iterations the reward of the last 6 is above the
    first 6's by more than 3 standard errors (docs/moe.md: gold 0.16 -> 0.96 over 30 with the trained reward
    model); the load-balancing loss and the routing agreement are logged, mismatch_kl at rounding."""
    from rlhf.testing.learning import rise_in_standard_errors

    plan, records = results[0]["moe_learning_plan"], results[0]["moe_learning"]
    assert plan["actor_train"] == "dp2xpp2xtp1xep2" and plan["critic_inf"] == "dp2xpp1xtp2xep2"
    assert plan["actor_gen"] == "dp2xpp1xtp2"
    assert rise_in_standard_errors([r["reward_mean"] for r in records], window=6) > 3
    assert all(0 < r["actor_load_balancing_loss"] < 0.01 * 2 * 4 for r in records)
    assert all(0 < r["routing_agreement"] <= 1 and r["mismatch_kl"] < 1e-6 for r in records)
