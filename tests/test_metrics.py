"""rlhf/metrics.py: stage timing on a fake clock, the reduction rule on 4 gloo ranks,
the JSON Lines resume rule, TensorBoard events, the progress bar and the Chrome trace."""

import json
import math

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rlhf.config import ConfigError
from rlhf.config import LoggingConfig
from rlhf.metrics import MetricsWriter, StageTimer, reduce_metrics, reduce_op, with_rates
from rlhf.testing.distributed import launch
from scenario_metrics import FakeClock


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    trace = tmp_path_factory.mktemp("trace") / "trace.json"
    return launch(4, "scenario_metrics:run", trace_path=str(trace)), trace


def _timer():
    clock, syncs = FakeClock(10.0), []
    return StageTimer(clock=clock, sync=lambda: syncs.append(clock())), clock, syncs


# --- stage timer -------------------------------------------------------------------------------

def test_stage_timer_accumulates_repeated_stages_and_resets_per_iteration():
    timer, clock, _ = _timer()
    timer.start_iteration(1)
    for seconds in (1.5, 0.25):
        with timer.stage("training"):
            clock.advance(seconds)
        clock.advance(1.0)  # between stages: counted only in the iteration
    assert timer.metrics() == {"time_training_s": 1.75, "time_iteration_s": 3.75}
    timer.start_iteration(2)
    with timer.stage("reshard"):
        clock.advance(0.5)
    assert timer.metrics() == {"time_reshard_s": 0.5, "time_iteration_s": 0.5}
    assert timer.timeline is None  # not traced


def test_nested_stages_each_count_their_full_span():
    timer, clock, syncs = _timer()
    timer.start_iteration(1)
    with timer.stage("inference"):
        clock.advance(0.5)
        with timer.stage("ref_inf"):
            clock.advance(2.0)
        with timer.stage("reward_inf"):
            clock.advance(1.0)
    assert timer.seconds == {"ref_inf": 2.0, "reward_inf": 1.0, "inference": 3.5}
    assert syncs == [10.0, 10.5, 12.5, 12.5, 13.5, 13.5]  # at every stage boundary


def test_stage_cannot_nest_in_itself_and_a_failing_stage_still_counts():
    timer, clock, _ = _timer()
    timer.start_iteration(1)
    with pytest.raises(ValueError, match="already open"):
        with timer.stage("generation"):
            clock.advance(1.0)
            with timer.stage("generation"):
                pass
    assert timer.seconds == {"generation": 1.0}
    timer.start_iteration(2)  # nothing left open


def test_start_iteration_inside_a_stage_raises():
    timer, _, _ = _timer()
    with timer.stage("generation"), pytest.raises(RuntimeError, match="open stage"):
        timer.start_iteration(2)


# --- reduction rule ----------------------------------------------------------------------------

@pytest.mark.parametrize("key, op", [("time_generation_s", "max"), ("time_iteration_s", "max"),
                                     ("response_length_max", "max"), ("samples_count", "sum"),
                                     ("reward_sum", "sum"), ("reward_mean", "mean"), ("value_loss", "mean"),
                                     ("clip_fraction", "mean"), ("samples_per_s", "mean")])
def test_reduce_op_follows_the_key_name(key, op):
    assert reduce_op(key) == op


def test_reduce_metrics_over_ranks_that_reported_each_key(scenario):
    results, _ = scenario
    expected = {"gold_reward_mean": 0.25, "penalty_max": -3.0, "response_length_max": 7.0,
                "reward_mean": 1.5, "reward_sum": -2.0, "samples_count": 16.0,
                "time_generation_s": 2.0, "value_loss": 2.5}
    for r in results:
        assert r["world"] == expected
        assert list(r["world"]) == sorted(expected)
        assert all(type(v) is float for v in r["world"].values())
        assert r["empty"] == {}
        assert r["only_rank0"] == {"kl_mean": 0.5}


def test_reduce_metrics_over_a_subgroup(scenario):
    results, _ = scenario
    expected = {"gold_reward_mean": 0.25, "response_length_max": 7.0, "reward_mean": 1.5,
                "samples_count": 8.0, "time_generation_s": 2.0, "value_loss": 1.0}
    assert [r.get("pair") for r in results] == [None, expected, expected, None]


def test_reduce_metrics_refuses_a_tensor_with_more_than_one_element():
    with pytest.raises(ValueError, match="'value_loss' must be a float or a one-element tensor"):
        reduce_metrics({"value_loss": torch.ones(2)})  # raised before any collective


def test_with_rates_divides_counts_by_the_slowest_iteration():
    metrics = {"samples_count": 16.0, "tokens_count": 512.0, "time_iteration_s": 4.0}
    assert with_rates(metrics) == {**metrics, "samples_per_s": 4.0, "tokens_per_s": 128.0}
    assert with_rates({"samples_count": 16.0}) == {"samples_count": 16.0}


# --- config ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, field", [({"metrics_file": ""}, "metrics_file"),
                                           ({"metrics_file": "."}, "metrics_file"),
                                           ({"tensorboard_dir": 3}, "tensorboard_dir"),
                                           ({"trace_iteration": 0}, "trace_iteration"),
                                           ({"trace_iteration": True}, "trace_iteration"),
                                           ({"trace_file": None}, "trace_file"),
                                           ({"progress": "yes"}, "progress")])
def test_logging_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field) as err:
        LoggingConfig(**kwargs)
    assert err.value.field_name == f"logging.{field}"


def test_logging_config_rejects_a_file_as_tensorboard_dir(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match="existing file"):
        LoggingConfig(tensorboard_dir=str(tmp_path / "f"))


# --- outputs -----------------------------------------------------------------------------------

def _config(tmp_path, **kwargs):
    return LoggingConfig(metrics_file=str(tmp_path / "metrics.jsonl"), progress=False, **kwargs)


def _log_run(config, iterations, start=0, rank=0, reward=1.0):
    with MetricsWriter(config, total_iterations=iterations[-1], rank=rank, start_iteration=start) as writer:
        for it in iterations:
            writer.log(it, {"reward_mean": reward * it, "time_generation_s": 0.5, "kl_mean": math.nan})


def _lines(tmp_path):
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_jsonl_one_sorted_line_per_iteration(tmp_path):
    _log_run(_config(tmp_path), [1, 2, 3])
    text = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert text[0] == '{"iteration": 1, "kl_mean": null, "reward_mean": 1.0, "time_generation_s": 0.5}'
    assert [line["reward_mean"] for line in _lines(tmp_path)] == [1.0, 2.0, 3.0]


def test_resume_drops_lines_after_the_checkpoint_and_partial_lines(tmp_path):
    config = _config(tmp_path)
    _log_run(config, [1, 2, 3, 4])
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"iteration": 5, "rew')  # killed mid-line
    _log_run(config, [3, 4, 5], start=2, reward=10.0)  # resumed from the iteration-2 checkpoint
    assert [(line["iteration"], line["reward_mean"]) for line in _lines(tmp_path)] == \
        [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0), (5, 50.0)]
    _log_run(config, [1])  # a fresh run starts the file again
    assert [line["iteration"] for line in _lines(tmp_path)] == [1]


def test_only_rank0_writes_and_iterations_must_increase(tmp_path):
    config = _config(tmp_path, tensorboard_dir=str(tmp_path / "tb"))
    _log_run(config, [1, 2], rank=1)
    assert list(tmp_path.iterdir()) == []
    with MetricsWriter(config, total_iterations=3, rank=0, start_iteration=1) as writer:
        with pytest.raises(ValueError, match="must increase"):
            writer.log(1, {})


def test_tensorboard_scalars_and_resume_purge(tmp_path):
    config = LoggingConfig(tensorboard_dir=str(tmp_path / "tb"), progress=False)
    _log_run(config, [1, 2, 3])
    _log_run(config, [2], start=1, reward=10.0)  # resumed: the old 2 and 3 are hidden
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {"reward_mean", "time_generation_s", "kl_mean"} <= set(events.Tags()["scalars"])
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [(1, 1.0), (2, 20.0)]
    assert [e.value for e in events.Scalars("time_generation_s")] == [0.5, 0.5]


def test_progress_bar_counts_from_the_resumed_iteration(tmp_path, capsys):
    with MetricsWriter(LoggingConfig(), total_iterations=4, rank=0, start_iteration=2) as writer:
        writer.log(3, {"reward_mean": 0.5, "kl_mean": 0.125, "time_generation_s": 1.0})
    err = capsys.readouterr().err
    assert "3/4" in err and "reward=0.5" in err and "kl=0.125" in err and "time" not in err


# --- trace -------------------------------------------------------------------------------------

def test_timer_metrics_on_every_rank(scenario):
    results, _ = scenario
    for rank, r in enumerate(results):
        extra = {"time_ref_inf_s": 0.5} if rank >= 2 else {}
        inference = 0.75 if rank >= 2 else 0.25
        expected = {"time_generation_s": rank + 1.0, "time_inference_s": inference, "time_training_s": 1.0,
                    "time_iteration_s": rank + 2.0 + inference, **extra}
        assert r["timer"] == {1: expected, 2: expected}


def test_trace_has_one_process_per_rank_and_the_stage_spans(scenario):
    _, path = scenario
    trace = json.loads(path.read_text())
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    assert names == {r: f"rank {r}" for r in range(4)}
    for rank in range(4):
        spans = {e["name"]: (e["cat"], e["ts"] / 1e6, e["dur"] / 1e6) for e in events
                 if e["ph"] == "X" and e["pid"] == rank}
        gen_end = rank + 1.0
        inf_end = gen_end + (0.75 if rank >= 2 else 0.25)
        expected = {"generation": ("STAGE", 0.0, gen_end), "inference": ("STAGE", gen_end, inf_end - gen_end),
                    "training": ("STAGE", inf_end, 1.0), "actor F0": ("FORWARD", inf_end + 0.125, 0.25)}
        if rank >= 2:
            expected["ref_inf"] = ("STAGE", gen_end + 0.25, 0.5)
        assert spans.keys() == expected.keys()
        for name, (cat, ts, dur) in expected.items():
            assert spans[name] == (cat, pytest.approx(ts), pytest.approx(dur)), name
