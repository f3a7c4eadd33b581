"""Asynchronous iterations (--max-staleness K, docs/async.md): every prompt trained once, the staleness bound,
the off-policy correction, and the tiny default learning with K = 1 and 2 (the job pretrain_rlhf.py builds
from those flags).

See tests/scenario_async.py for the 4-rank trainer scenario.
"""

from collections import Counter

import pytest
from scenario_async import APART

import pretrain_rlhf
from rlhf.cli import UsageError
from rlhf.ppo import layout
from rlhf.ppo.arguments import parse_args
from rlhf.testing.distributed import launch
from rlhf.testing.learning import rise_in_standard_errors


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    ranks = launch(4, "scenario_async:run", timeout_s=900, root=str(tmp_path_factory.mktemp("ckpt")))
    out = dict(ranks[0])
    for k in (0, 1, 2, "p2"):  # the prompts the reward function scored on any rank
        out[k] = {**ranks[0][k], **{run: sum((r[k][run] for r in ranks), []) for run in ("straight", "resumed")}}
    out["p2_inference_diff"] = [max(r["p2"]["metrics"][i]["inference_diff"] for r in ranks)
                                for i in range(len(ranks[0]["p2"]["metrics"]))]
    return out


@pytest.mark.parametrize("k", [0, 1, 2, "p2"])
@pytest.mark.parametrize("run", ["straight", "resumed"])
def test_every_prompt_of_the_epoch_is_trained_once(results, k, run):
    """The recording reward function scored each prompt of the epoch exactly n = 2 times (its two samples),
    with or without a save and load in the middle while batches were generated ahead ("p2": K = 2 with
    partial rollouts, samples in flight at the save)."""
    expected = Counter({p: 2 * c for p, c in Counter(results["dataset"]).items()})
    assert Counter(results[k][run]) == expected


@pytest.mark.parametrize("k", [0, 1, 2])
def test_staleness_stays_within_the_bound(results, k):
    """The batch of (0-based) iteration i is min(i, K) policy versions stale: the first K were generated
    before training started, by the initial weights; every later one K versions before its update."""
    staleness = [m.get("staleness_max", 0.0) for m in results[k]["metrics"]]
    assert staleness == [float(min(i, k)) for i in range(len(staleness))]


def test_partial_rollouts_carry_samples_across_updates_within_the_bound(results):
    """K = 2 with partial rollouts and generation slower than training: samples in flight when an update's
    weights arrive finish under them (some iteration trains samples of two versions), each token's version
    never decreases along a sample, and no token is more than K versions stale."""
    metrics = results["p2"]["metrics"]
    assert all(m["staleness_max"] <= min(i, 2) for i, m in enumerate(metrics)), metrics
    assert all(m["versions_ordered"] for m in metrics)
    assert max(m["partial_samples_fraction"] for m in metrics) > 0, metrics


def test_streamed_inference_equals_inferring_the_whole_batch(results):
    """While generation is slower, the learners infer the next batch's samples as they finish (streaming
    rounds). Some iterations' batches were partly inferred so, and every batch's reference log-probs,
    values and proximal log-probs equal inferring the whole batch again (weights frozen at lr 1e-12)."""
    streamed = [m["streamed_samples_fraction"] for m in results["p2"]["metrics"]]
    assert max(streamed) > 0, streamed
    assert max(results["p2_inference_diff"]) < 1e-5, results["p2_inference_diff"]


def test_a_frozen_policy_makes_the_correction_neutral(results):
    """At learning rate 1e-12 the proximal and behaviour policies are the same: weights 1, equal losses."""
    for plain, corrected in zip(results["frozen"], results["frozen_corrected"]):
        assert abs(corrected["tis_weight_mean"] - 1) < 1e-6
        assert corrected["policy_loss"] == pytest.approx(plain["policy_loss"], rel=1e-5, abs=1e-7)


def test_stale_samples_are_reweighted(results):
    """With a learning rate, a batch one version stale has proximal != behaviour: weights off 1."""
    weights = [m["tis_weight_mean"] for m in results["corrected"]]
    assert abs(weights[0] - 1) < 1e-6  # the first batch is not stale
    assert all(abs(w - 1) > 1e-4 for w in weights[1:]), weights


@pytest.mark.parametrize("flags, message", [
    (["--max-staleness", "-1"], "--max-staleness: max_staleness=-1 must be >= 0 policy versions"),
    (["--max-staleness", "1", "--inter-stage-fusion"], "--max-staleness: inter-stage fusion lends"),
    (["--partial-rollouts"], "--partial-rollouts: partial_rollouts hands weight updates to samples in flight"),
    (["--max-staleness", "2", "--partial-rollouts", "--release-generation-memory"],
     "--release-generation-memory: partial_rollouts keeps samples in flight"),
    (["--max-staleness", "2", "--partial-rollout-kv", "drop"],
     "--partial-rollout-kv: partial_rollout_kv 'drop' is not one of recompute, keep"),
])
def test_bad_staleness_flags_are_refused_naming_the_flag(flags, message):
    with pytest.raises(UsageError, match=message):
        parse_args(flags)


def dry_run(capsys, world_size: int, *flags) -> tuple:
    """(exit status, stdout, stderr) of ``pretrain_rlhf.py --dry-run --world-size N flags``."""
    rc = pretrain_rlhf.main(["--dry-run", "--world-size", str(world_size), *flags])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_generation_sharing_ranks_with_training_is_refused(capsys):
    """Without --placement an asynchronous job runs the built-in asynchronous plan (on 4 ranks docs/async.md's,
    the flags of APART) and says so in one line; the launch check (the dry run's, which the job runs too)
    still refuses a per-task flag that puts a task on actor_gen's ranks."""
    assert layout.job_plan(parse_args(["--max-staleness", "1"]), 4) == layout.ASYNC_PLANS[4]
    assert parse_args(APART).placement.plan() == layout.ASYNC_PLANS[4]
    rc, out, _ = dry_run(capsys, 4, "--max-staleness", "1")
    assert rc == 0
    assert ("placement: the built-in asynchronous plan of 4 ranks (--max-staleness 1 without --placement): "
            "actor_gen on ranks of its own, the other tasks on the rest (per-task flags merge into it)\n"
            "tasks (parameters per rank: the largest pipeline stage / tp):\n"
            "  actor_gen     ranks [0, 1] dp2xpp1xtp1; ") in out
    assert "  critic_train  ranks [2, 3] dp1xpp2xtp1 (reversed pipeline); " in out
    assert ("generation: 2 instance(s), samples end at EOS or --max-response-len; asynchronous: 1 iteration(s) "
            "ahead of training on ranks of its own (--max-staleness 1), the old log-probs") in out
    rc, _, err = dry_run(capsys, 4, "--max-staleness", "1", "--ref-inf", "ranks=0-1")
    assert rc == 2
    assert ("pretrain_rlhf.py: --max-staleness: max_staleness 1 generates while the other tasks train, so "
            "actor_gen needs ranks of its own, but ref_inf shares rank(s) [0, 1] with it") in err
    rc, out, _ = dry_run(capsys, 4, "--max-staleness", "2", "--partial-rollouts", *APART)
    assert rc == 0
    assert ("ahead of training on ranks of its own (--max-staleness 2), running free with partial rollouts (samples "
            "in flight take each update's weights, K/V: recompute)") in out


@pytest.mark.parametrize("world_size, flags, gen, learners", [
    (2, [], "[0] dp1", "[1] dp1"),
    (6, ["--rollout-batch-size", "12", "--ppo-mini-batch-size", "48"], "[0, 1, 2] dp3", "[3, 4, 5] dp3"),
])
def test_other_world_sizes_get_generation_apart(capsys, world_size, flags, gen, learners):
    """Other world sizes: actor_gen data parallel on the first half of the ranks, every other task on the rest."""
    rc, out, _ = dry_run(capsys, world_size, "--max-staleness", "1", *flags)
    assert rc == 0
    assert f"placement: the built-in asynchronous plan of {world_size} ranks (--max-staleness 1" in out
    assert f"  actor_gen     ranks {gen}xpp1xtp1; " in out
    for task in ("ref_inf", "reward_inf", "critic_inf", "actor_train", "critic_train"):
        assert f"  {task:13s} ranks {learners}xpp1xtp1; " in out


def test_one_rank_cannot_generate_apart(capsys):
    """On 1 rank no plan puts actor_gen apart: refused, showing the flags of the 4-rank plan (APART's plan)."""
    rc, _, err = dry_run(capsys, 1, "--max-staleness", "1")
    assert rc == 2
    flags = ("--actor-gen ranks=0-1,tp=1,dp=2 --actor-train ranks=2-3,tp=1,pp=2 --critic-train "
             "ranks=2-3,dp=1,pp=2,reverse_pp --ref-inf ranks=2-3 --reward-inf ranks=2-3 --critic-inf ranks=2-3,tp=1")
    assert err == ("pretrain_rlhf.py: --max-staleness: max_staleness 1 generates while the other tasks train, so "
                   "actor_gen needs ranks of its own, which 1 rank cannot give; launch on 2 or more ranks, where the "
                   f"job puts actor_gen apart by itself (on 4 ranks: {flags}), or drop --max-staleness\n")
    assert parse_args(flags.split()).placement.plan() == layout.ASYNC_PLANS[4]


@pytest.mark.parametrize("k", [1, 2])
def test_tiny_default_learns_asynchronously(results, k):
    """The main job's trainer built from the flags with generation on ranks 0-1 and training on 2-3 (K = 1: no
    placement flag, the built-in asynchronous plan; K = 2: APART's flags), the synthetic task's gold rule as the
    reward: over 20 iterations the reward of the last 10 is above the first
    10's by more than 3 standard errors, every iteration's staleness is at most K (K from iteration K + 1 on)
    and each side reports how long it waited for the other."""
    records = results[f"learning_k{k}"]
    assert [r["staleness_max"] for r in records] == [float(min(i, k)) for i in range(len(records))]
    assert all(0 <= r["generation_idle_fraction"] <= 1 and 0 <= r["training_idle_fraction"] <= 1 for r in records)
    reward = [r["reward_mean"] for r in records]
    assert rise_in_standard_errors(reward, window=10) > 3, reward
