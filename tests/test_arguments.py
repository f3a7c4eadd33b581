"""pretrain_rlhf.py flags -> the frozen JobConfig, and bad values refused naming their flag."""

import dataclasses
import json
from pathlib import Path

import pytest

from rlhf.cli import UsageError, usage_errors
from rlhf.config import ConfigError, PlacementConfig, RunConfig
from rlhf.data import ByteTokenizer
from rlhf.models.config import MODEL_PRESETS
from rlhf.parallel import Placement, PlacementError
from rlhf.ppo import layout
from rlhf.ppo.arguments import build_parser, flag_of, parse_args
from rlhf.ppo.config import FusionConfig, JobConfig, PPOConfig
from rlhf.reward_model.arguments import reward_flag_of
from rlhf.reward_model.config import RewardTrainingConfig
from rlhf.tasks import MODELS
from test_tokenizers import make_hf_dir


def test_defaults_are_the_tiny_job():
    cfg = parse_args([])
    assert cfg == JobConfig()
    assert cfg.run == RunConfig(iterations=30, seed=1234)
    assert cfg.models["actor"] == cfg.models["reference"] == dataclasses.replace(MODEL_PRESETS["tiny"], vocab_size=259)
    assert cfg.models["critic"] == cfg.models["reward"] == dataclasses.replace(MODEL_PRESETS["tiny-critic"],
                                                                               vocab_size=259)
    assert cfg.ppo.rollout_samples == 64 and cfg.ppo.minibatches == 2 and cfg.ppo.uses_critic
    assert cfg.logging.progress and cfg.logging.metrics_file is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.run = RunConfig()


def test_mixture_of_experts_is_one_flag_per_model_with_expert_parallel_placements():
    cfg = parse_args(["--actor-model", "tiny-moe", "--critic-model", "tiny-moe-critic", "--routing-replay",
                      "--actor-train", "pp=2,ep=2,ranks=0-3"])
    assert cfg.models.actor.is_moe and cfg.models["critic"].num_experts == 4 and cfg.ppo.routing_replay
    assert cfg.models.actor.vocab_size == ByteTokenizer.VOCAB_SIZE  # a preset takes the tokenizer's ids
    assert cfg.placement.plan()["actor_train"] == {"ranks": "0-3", "pp": 2, "ep": 2}


def test_flags_fill_the_configs(tmp_path):
    shape = tmp_path / "actor.json"
    shape.write_text(json.dumps({"num_layers": 4, "vocab_size": 256}))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"actor_train": {"ranks": "0-3", "pp": 2}, "ref_inf": {"ranks": [2, 3]}}))
    cfg = parse_args(["--placement", str(plan), "--actor-train", "tp=2,pp=2,ranks=0-3",
                      "--critic-train", "dp=2,pp=2,ranks=0,1,2-3,reverse_pp", "--actor-model", str(shape),
                      "--train-iters", "3", "--seed", "7", "--max-prompt-len", "8", "--max-response-len", "24",
                      "--temperature", "0.7", "--rollout-batch-size", "8", "--n-samples-per-prompt", "2",
                      "--ppo-mini-batch-size", "8", "--micro-batch-size", "2", "--lr", "3e-4",
                      "--value-clip", "none", "--kl-target", "6", "--advantage-estimator", "grpo",
                      "--recompute-logprobs", "--max-skipped-steps", "0", "--skip-nonfinite-samples",
                      "--metrics-file", str(tmp_path / "m.jsonl"), "--no-progress"])
    assert cfg.run == RunConfig(iterations=3, seed=7)
    assert (cfg.generation.max_prompt_len, cfg.generation.max_response_len, cfg.generation.temperature) == (8, 24, 0.7)
    assert cfg.ppo == PPOConfig(rollout_batch_size=8, n_samples_per_prompt=2, ppo_mini_batch_size=8,
                                micro_batch_size=2, lr=3e-4, value_clip=None, kl_target=6.0,
                                advantage_estimator="grpo", recompute_logprobs=True, max_skipped_steps=0)
    assert not cfg.ppo.uses_critic and cfg.reward.skip_nonfinite_samples
    assert cfg.logging.metrics_file == str(tmp_path / "m.jsonl") and not cfg.logging.progress
    assert cfg.models.actor.num_layers == 4 and cfg.models["reference"].vocab_size == 256
    # a flag's fields merge into the file's entry for its task; other file entries stay
    assert cfg.placement.plan() == {
        "actor_train": {"ranks": "0-3", "tp": 2, "pp": 2},
        "critic_train": {"ranks": "0,1,2-3", "dp": 2, "pp": 2, "reverse_pp": True},
        "ref_inf": {"ranks": [2, 3]},
    }


@pytest.mark.parametrize("argv,message", [
    (["--micro-batch-size", "-1"], "--micro-batch-size: micro_batch_size must be an integer >= 1, got -1"),
    (["--iterations", "0"], "--iterations: iterations must be an integer >= 1, got 0"),
    (["--max-response-len", "250"], "--max-response-len: max_prompt_len + max_response_len = 266 exceeds the "
                                    "actor model's context max_seq_len=256"),
    (["--ppo-mini-batch-size", "5"], "--ppo-mini-batch-size: ppo_mini_batch_size 5 must divide the 64 samples"),
    (["--advantage-estimator", "ppo2"], "--advantage-estimator: advantage_estimator 'ppo2' is not one of"),
    (["--kl-estimator", "k9"], "--kl-estimator: KLConfig.estimator='k9' must be one of"),
    (["--top-p", "0"], "--top-p: top_p=0.0 must be in (0, 1]"),
    (["--trace-iteration", "31"], "--trace-iteration: trace_iteration 31 is past the last iteration 30"),
    (["--search-budget", "nan"], "--search-budget: search_budget must be a finite number, got nan"),
    (["--kl-coef", "nan"], "--kl-coef: kl_coef must be a finite number, got nan"),
    (["--kl-target", "inf"], "--kl-target: kl_target must be a finite number or None, got inf"),
    (["--temperature", "inf"], "--temperature: temperature must be a finite number, got inf"),
    (["--min-lr=-inf"], "--min-lr: min_lr must be a finite number, got -inf"),
    (["--seed", "-1"], "--seed: seed=-1 must be in [0, 268435455]"),
    (["--seed", str(2**28)], "--seed: seed=268435456 must be in [0, 268435455]"),
    (["--search-budget", "0"], "--search-budget: search_budget=0.0 must be a finite number of seconds > 0"),
    (["--schedule", "s.json"], "--schedule: a schedule is run only with intra_stage_fusion"),
    (["--migration-threshold", "0.3"], "--migration-threshold: a migration threshold is used only with "
                                        "inter_stage_fusion"),
    (["--inter-stage-fusion", "--migration-threshold", "1.5"], "--migration-threshold: migration_threshold=1.5 "
                                                               "must be a fraction of the batch in [0, 1]"),
    (["--migrate-kv", "maybe"], "--migrate-kv: migrate_kv 'maybe' is not one of yes, no, auto"),
    (["--migration-check-every", "0"], "--migration-check-every: migration_check_every must be an integer >= 1"),
    (["--long-tail-median", "40"], "--long-tail-median: long_tail_median=40 must be in [0, max_response_len]"),
    (["--save-interval", "5"], "--save-interval: save_interval needs a checkpoint root to save to (save)"),
    (["--keep-last", "2"], "--keep-last: keep_last needs a checkpoint root to save to (save)"),
    (["--save", "ckpt", "--keep-last", "0"], "--keep-last: keep_last"),
    (["--environment", "a:B", "--agent", "c:d"], "--agent: give an environment or an agent, not both"),
    (["--agent", "c:d", "--reward-fn", "a:b"], "--reward-fn: reward.reward_fn cannot go with an environment or agent"),
    (["--environment", "a:B", "--max-staleness", "1"], "--max-staleness: ppo.max_staleness cannot go with"),
    (["--environment", "a.B"], "--environment: environment='a.B' is not MODULE:NAME"),
    (["--load", "/nonexistent/ckpt"], "--load: load='/nonexistent/ckpt' is not a directory"),
    (["--actor-train", "tp=x"], "--actor-train: cannot parse 'tp=x' in 'tp=x'"),
    (["--critic-model", "nope"], "--critic-model nope: [Errno 2] No such file or directory"),
    (["--recompute-granularity", "block"], "--recompute-granularity: recompute_granularity 'block' is not one of "
                                           "full, selective (or none)"),
    (["--recompute-num-layers", "1"], "--recompute-num-layers: recompute_num_layers 1 sets the layers per chunk of "
                                      "--recompute-granularity full (got none)"),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "1"],
     "--recompute-num-layers: recompute_num_layers 1 sets the layers per chunk of --recompute-granularity full "
     "(got selective)"),
    (["--recompute-granularity", "full", "--recompute-num-layers", "0"],
     "--recompute-num-layers: recompute_num_layers=0 must be >= 1 layers per recomputed chunk"),
    (["--max-tokens-per-microbatch", "31"], "--max-tokens-per-microbatch: max_tokens_per_microbatch 31 is smaller "
                                            "than the longest sample: max_prompt_len 16 + max_response_len 16 = 32 "
                                            "tokens; give at least 32"),
    (["--max-tokens-per-microbatch", "-1"],
     "--max-tokens-per-microbatch: max_tokens_per_microbatch=-1 must be >= 1 tokens"),
    (["--max-skipped-steps", "-1"], "--max-skipped-steps: max_skipped_steps=-1 must be >= 0 optimizer steps (0: "
                                    "never stop)"),
    (["--agent", "c:d", "--skip-nonfinite-samples"], "--skip-nonfinite-samples: reward.skip_nonfinite_samples cannot "
                                                     "go with an environment or agent"),
    (["--routing-replay"], "--routing-replay: routing_replay replays the experts the engine chose, but the actor is "
                           "dense (num_experts 0)"),
    (["--actor-model", "tiny-moe", "--routing-replay", "--recompute-granularity", "full"],
     "--routing-replay: routing_replay with recompute_granularity 'full': the recomputed forward in the backward "
     "would route on its own"),
    (["--actor-model", "tiny-moe", "--lora-rank", "4"], "--lora-rank: LoRA adapters on a mixture-of-experts actor "
                                                        "are not supported"),
    (["--actor-train", "ep=two"], "--actor-train: cannot parse 'ep=two' in 'ep=two'"),
])
def test_bad_values_name_their_flag(argv, message):
    with pytest.raises(UsageError) as exc:
        parse_args(argv)
    assert str(exc.value).startswith(message)


@pytest.mark.parametrize("fields, message", [
    ({"num_experts": 4, "moe_router_topk": 5}, "moe_router_topk=5 must be in 1..num_experts=4"),
    ({"num_experts": 1}, "num_experts must be 0 (dense) or >= 2, got 1"),
    ({"num_experts": 4, "moe_aux_loss_coeff": -0.1}, "moe_aux_loss_coeff must be a finite number >= 0, got -0.1"),
    ({"hidden_size": 60, "num_attention_heads": 8}, "hidden_size=60 must be divisible by num_attention_heads=8 (or "
                                                    "give the head dimension as kv_channels)"),
])
def test_bad_moe_shapes_name_the_flag_and_field(tmp_path, fields, message):
    shape = tmp_path / "actor.json"
    shape.write_text(json.dumps(fields))
    with pytest.raises(UsageError) as exc:
        parse_args(["--actor-model", str(shape)])
    assert str(exc.value).startswith(f"--actor-model {shape}: {message}")


def test_preset_models_have_the_tokenizers_ids(tmp_path):
    """A preset's vocabulary is the job tokenizer's ids (the byte tokenizer's 259 by default, an HF one's with
    --tokenizer), for all four models and train_reward.py's; a JSON shape keeps its own vocab_size."""
    from rlhf.reward_model.arguments import parse_args as reward_args

    assert ByteTokenizer().vocab_size == 259
    assert {m: parse_args([]).models[m].vocab_size for m in MODELS} == dict.fromkeys(MODELS, 259)
    hf = make_hf_dir(tmp_path / "tok")  # 14 ids
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello world"}) + "\n")
    cfg = parse_args(["--tokenizer", hf, "--prompt-data", str(prompts), "--reward-fn", "m:f"])
    assert {m: cfg.models[m].vocab_size for m in MODELS} == dict.fromkeys(MODELS, 14)
    shape = tmp_path / "critic.json"
    shape.write_text(json.dumps({"vocab_size": 300}))
    cfg = parse_args(["--critic-model", str(shape)])
    assert {m: cfg.models[m].vocab_size for m in MODELS} == {"actor": 259, "reference": 259, "critic": 300,
                                                              "reward": 300}
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "Q", "chosen": "a", "rejected": "b"}) + "\n")
    assert reward_args(["--train-data", str(pairs)]).model.vocab_size == 259
    assert reward_args(["--train-data", str(pairs), "--model", "tiny-critic", "--tokenizer", hf]).model.vocab_size == 14
    assert reward_args(["--train-data", str(pairs), "--model", str(shape)]).model.vocab_size == 300


def test_dry_run_reports_the_tokenizers_vocabulary():
    """The dry run describes the models the job builds: the tiny presets at the byte tokenizer's 259 ids."""
    from rlhf.ppo.dry_run import dry_run

    lines = dry_run(parse_args([]), 4).splitlines()
    for model in MODELS:
        line = next(line for line in lines if line.startswith(f"  {model} "))
        assert ", vocab 259, context 256" in line, line


def test_usage_errors_turn_job_errors_into_flag_errors(tmp_path):
    """The one mapping both entry points use (pretrain_rlhf.py with flag_of, train_reward.py with reward_flag_of)."""
    job = JobConfig(placement=PlacementConfig(overrides={"actor_train": {"tp": "two"}}))
    with pytest.raises(UsageError) as exc, usage_errors(flag_of):
        layout.build_placement(job, 4)
    assert str(exc.value) == "invalid placement: actor_train: tp='two' must be a positive integer (e.g. tp=2)"
    with pytest.raises(UsageError) as exc, usage_errors(flag_of):
        layout.build_placement(JobConfig(), 3)  # every task dp 3: the mini-batch of 32 does not split
    assert str(exc.value).startswith("--ppo-mini-batch-size: ppo_mini_batch_size 32 must be a multiple of")
    with pytest.raises(UsageError) as exc, usage_errors(reward_flag_of):
        RewardTrainingConfig(micro_batch_size=0)
    assert str(exc.value) == "--micro-batch-size: micro_batch_size must be an integer >= 1, got 0"
    with usage_errors(flag_of):  # anything else passes through unchanged
        with pytest.raises(KeyError):
            raise KeyError("not an input error")


def test_recompute_flags_reach_the_config_and_chunks_must_divide_a_training_stage():
    cfg = parse_args(["--recompute-granularity", "full", "--recompute-num-layers", "2"])
    assert cfg.memory.recompute == {"recompute_granularity": "full", "recompute_num_layers": 2}
    assert parse_args([]).memory.recompute == {"recompute_granularity": None, "recompute_num_layers": None}
    two_stages = Placement.from_plan({"actor_train": {"ranks": "0-1", "pp": 2}}, 2)  # tiny: 2 layers, 1 per stage
    with pytest.raises(ConfigError, match="recompute_num_layers 2 must divide the 1 layers of each of "
                                          "actor_train's pipeline stages") as exc:
        layout.check_placement(cfg, two_stages)
    assert exc.value.field_name == "memory.recompute_num_layers"
    layout.check_placement(cfg, Placement.from_plan({}, 2))  # 2 layers on one stage: one chunk
    layout.check_placement(parse_args(["--recompute-granularity", "full"]), two_stages)  # the default chunk of 1


def test_train_reward_takes_the_same_recompute_flags(tmp_path):
    from rlhf.reward_model.arguments import parse_args as reward_args
    from rlhf.reward_model.trainer import check_placement

    with pytest.raises(UsageError) as exc, usage_errors(reward_flag_of):
        RewardTrainingConfig(recompute_granularity="selective", recompute_num_layers=2)
    assert str(exc.value).startswith("--recompute-num-layers: recompute_num_layers 2 sets the layers per chunk of "
                                     "--recompute-granularity full (got selective)")
    train = tmp_path / "pairs.jsonl"
    train.write_text(json.dumps({"prompt": "Q", "chosen": "a", "rejected": "b"}) + "\n")
    cfg = reward_args(["--model", "tiny", "--train-data", str(train), "--recompute-granularity", "full",
                       "--recompute-num-layers", "2"])
    assert (cfg.training.recompute_granularity, cfg.training.recompute_num_layers) == ("full", 2)
    two_stages = Placement.from_plan({"reward_inf": {"ranks": "0-1", "pp": 2}}, 2)  # tiny-critic: 2 layers
    with pytest.raises(ConfigError, match="recompute_num_layers 2 must divide the 1 layers of each of "
                                          "reward_inf's pipeline stages") as err:
        check_placement(cfg, two_stages)
    assert err.value.field_name == "training.recompute_num_layers"
    check_placement(dataclasses.replace(cfg, training=RewardTrainingConfig(recompute_granularity="full",
                                                                           global_batch_size=8)), two_stages)


def test_batch_sizes_checked_against_the_placement():
    cfg = JobConfig(ppo=PPOConfig(rollout_batch_size=4, n_samples_per_prompt=2, ppo_mini_batch_size=4,
                                  micro_batch_size=2))
    layout.check_placement(cfg, Placement.from_plan({"actor_train": {"dp": 2, "ranks": "0-1"},
                                                     "critic_train": {"ranks": "0-1", "pp": 2}}, 2))
    with pytest.raises(ConfigError, match="ppo_mini_batch_size 4 must be a multiple of actor_train's dp 4 x "
                                          "micro_batch_size 2") as exc:
        layout.check_placement(cfg, Placement.from_plan({}, 4))
    assert exc.value.field_name == "ppo.ppo_mini_batch_size"


def test_configs_validate_without_the_parser():
    with pytest.raises(ConfigError, match="unknown task") as exc:
        PlacementConfig(overrides={"actor_training": {}})
    assert exc.value.field_name == "placement.overrides"
    with pytest.raises(ConfigError) as exc:
        RunConfig(iterations=0)
    assert exc.value.field_name == "run.iterations"
    with pytest.raises(ConfigError) as exc:
        PPOConfig(gamma=1.5)
    assert exc.value.field_name == "ppo.gamma"
    with pytest.raises(PlacementError, match="placement file .*missing.json"):
        PlacementConfig(file="missing.json").plan()


def test_help_explains_every_flag():
    parser = build_parser()
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"{action.option_strings} has no help text"


def test_built_in_four_rank_plan_is_the_example_file():
    from rlhf.ppo.layout import DEFAULT_PLANS
    from rlhf.parallel.placement import load_plan

    example = Path(__file__).resolve().parents[1] / "examples" / "placement_4ranks.json"
    assert layout.job_plan(JobConfig(), 4) == DEFAULT_PLANS[4] == load_plan(example)
    assert layout.job_plan(JobConfig(), 2) == {}  # other world sizes: every task data parallel on all ranks
    placed = JobConfig(placement=PlacementConfig(overrides={"ref_inf": {"ranks": "0-3"}}))
    assert layout.job_plan(placed, 4)["ref_inf"] == {"ranks": "0-3"}
    # e.g. --ref-inf tp=2 keeps the built-in entry's ranks
    assert PlacementConfig(overrides={"ref_inf": {"tp": 2}}).plan(DEFAULT_PLANS[4])["ref_inf"] == {"ranks": "2-3", "tp": 2}


def test_fused_schedule_checked_against_the_placement(tmp_path):
    from rlhf.schedule.generators import greedy_fused
    from rlhf.schedule.io import save_schedule
    from rlhf.schedule.problem import ModelSpec, Problem
    from rlhf.schedule.schedule import Schedule

    specs = tuple(ModelSpec(name, 2, 1, 2, direction, [1.0, 1.0], [2.0, 2.0], [1.0, 1.0])
                  for name, direction in (("actor", "down"), ("critic", "up")))
    path = tmp_path / "fused.json"
    save_schedule(path, Schedule.from_orders(Problem(2, specs), greedy_fused(Problem(2, specs))))
    cfg = parse_args(["--intra-stage-fusion", "--schedule", str(path), "--rollout-batch-size", "4",
                      "--n-samples-per-prompt", "2", "--ppo-mini-batch-size", "8", "--micro-batch-size", "2"])
    fits = Placement.from_plan({"actor_train": {"ranks": "0-3", "dp": 2, "pp": 2},
                                "critic_train": {"ranks": "0-3", "dp": 2, "pp": 2, "reverse_pp": True}}, 4)
    assert layout.fused_schedule(cfg, fits).problem.stages == 2
    with pytest.raises(ConfigError, match=f"{path}: model 'actor': schedule pp=2 but placement pp=1") as exc:
        layout.check_placement(cfg, Placement.from_plan({}, 2))  # dp2: the micro-batch counts agree, pp does not
    assert exc.value.field_name == "fusion.schedule"
    with pytest.raises(ConfigError, match="check 'direction' in the schedule against reverse_pp"):
        layout.check_placement(cfg, Placement.from_plan({"actor_train": {"ranks": "0-3", "dp": 2, "pp": 2},
                                                         "critic_train": {"ranks": "0-3", "dp": 2, "pp": 2}}, 4))
    with pytest.raises(ConfigError, match="schedule has 2 micro-batches per pipeline but the executor was given 4"):
        layout.check_placement(parse_args(["--intra-stage-fusion", "--schedule", str(path), "--rollout-batch-size", "8",
                    "--n-samples-per-prompt", "2", "--ppo-mini-batch-size", "16",
                    "--micro-batch-size", "2"]), fits)



def test_inter_stage_fusion_needs_two_generation_instances():
    cfg = JobConfig(fusion=FusionConfig(inter_stage_fusion=True, migration_threshold=None))
    plan = {"actor_train": {"ranks": "0-1", "tp": 2}, "actor_gen": {"ranks": "0-1", "tp": 2}}
    with pytest.raises(ConfigError, match="inter-stage fusion migrates samples between generation instances, but "
                                          "actor_gen has dp 1; place actor_gen with dp >= 2"):
        layout.check_placement(cfg, Placement.from_plan(plan, 2))
    layout.check_placement(cfg, Placement.from_plan({"actor_train": {"ranks": "0-1", "tp": 2}}, 2))  # actor_gen dp 2


def test_unplaced_tasks():
    grpo = parse_args(["--advantage-estimator", "grpo", "--critic-train", "none", "--critic-inf", "none"])
    placement = Placement.from_plan(layout.job_plan(grpo, 4), 4)
    assert set(placement.meshes) == {"actor_gen", "ref_inf", "reward_inf", "actor_train"}
    layout.check_placement(grpo, placement)  # grpo runs no critic tasks
    with pytest.raises(PlacementError, match="critic_inf is not placed"):
        placement["critic_inf"]
    gae = parse_args(["--critic-inf", "none"])
    with pytest.raises(ConfigError, match="advantage estimator 'gae' needs a critic, but critic_inf is not placed") as exc:
        layout.check_placement(gae, Placement.from_plan(layout.job_plan(gae, 4), 4))
    assert exc.value.field_name == "ppo.advantage_estimator"
    no_gen = parse_args(["--actor-gen", "none"])
    with pytest.raises(PlacementError, match="actor_gen must be placed"):
        layout.check_placement(no_gen, Placement.from_plan(layout.job_plan(no_gen, 4), 4))


def test_searched_fusion_checks_the_placement_first():
    cfg = parse_args(["--intra-stage-fusion"])
    with pytest.raises(ConfigError, match="^intra_stage_fusion: .*'critic'") as exc:
        layout.check_placement(cfg, Placement.from_plan(layout.job_plan(cfg, 4), 4))  # actor TP2xPP2, critic TP1
    assert exc.value.field_name == "fusion.intra_stage_fusion"
    fused = Placement.from_plan({"actor_train": {"ranks": "0-3", "dp": 2, "pp": 2},
                                 "critic_train": {"ranks": "0-3", "dp": 2, "pp": 2, "reverse_pp": True}}, 4)
    assert layout.fused_schedule(cfg, fused) is None  # fits: searched after the first iteration
    problem = layout.fusion_problem(cfg, fused, {"actor": ([1.0, 1.5], [2.0, 3.0]), "critic": None})
    assert [(m.name, m.pp, m.pipelines, m.microbatches, m.direction, m.fwd) for m in problem.models] == [
        ("actor", 2, 1, 4, "down", (1.0, 1.5)), ("critic", 2, 1, 4, "up", (1.0, 1.0))]

