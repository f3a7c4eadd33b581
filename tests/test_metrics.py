"""rlhf/metrics.py: stage timing on a fake clock, the reduction rule on 4 gloo ranks,
the JSON Lines resume rule, TensorBoard events, W&B (offline) and MLflow (a file store) runs read
back against the JSON Lines file, resumed runs continuing them, the progress bar, printed text, the
summary line that ends a run, and the Chrome trace."""

import json
import math
import re
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rlhf.cli import UsageError
from rlhf.config import CheckpointConfig, ConfigError, LoggingConfig
from rlhf.metrics import RUNS_FILE, MetricsWriter, StageTimer, reduce_metrics, reduce_op, with_rates
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
                                           ({"progress": "yes"}, "progress"),
                                           ({"wandb_project": ""}, "wandb_project"),
                                           ({"wandb_run_name": "tiny"}, "wandb_run_name"),
                                           ({"mlflow_experiment": "rlhf"}, "mlflow_experiment")])
def test_logging_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field) as err:
        LoggingConfig(**kwargs)
    assert err.value.field_name == f"logging.{field}"


@pytest.mark.parametrize("flags, pip", [(["--wandb-project", "rlhf"], "pip install wandb"),
                                        (["--mlflow-tracking-uri", "file:mlruns"], "pip install mlflow-skinny")])
def test_a_backend_without_its_package_is_refused_in_one_line_naming_the_flag(tmp_path, monkeypatch, flags, pip):
    from rlhf.ppo.arguments import parse_args as ppo_args
    from rlhf.reward_model.arguments import parse_args as reward_args

    monkeypatch.setattr("rlhf.config.find_spec", lambda module: None)  # as where the package is absent
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("")
    for parse in (ppo_args, lambda argv: reward_args(["--train-data", str(pairs), *argv])):
        with pytest.raises(UsageError) as err:
            parse(flags)
        message = str(err.value)
        assert message.startswith(f"{flags[0]}: {flags[0][2:].replace('-', '_')} needs the ")
        assert pip in message and "\n" not in message


def test_a_sql_tracking_uri_without_sqlalchemy_is_refused(monkeypatch):
    monkeypatch.setattr("rlhf.config.find_spec", lambda module: None if module == "sqlalchemy" else object())
    with pytest.raises(ConfigError, match="SQL store, which needs the full mlflow package") as err:
        LoggingConfig(mlflow_tracking_uri="sqlite:///mlflow.db")
    assert err.value.field_name == "logging.mlflow_tracking_uri"
    LoggingConfig(mlflow_tracking_uri="http://127.0.0.1:5000")  # a server needs only the client


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
        writer.log(3, {"reward_mean": 0.5, "gold_reward_mean": 0.25, "kl_mean": 0.125, "time_generation_s": 1.0})
    err = capsys.readouterr().err
    assert "3/4" in err and "reward=0.5, gold=0.25, kl=0.125" in err and "time" not in err


def test_printed_text_goes_above_the_bar_on_rank_0_only(capsys):
    with MetricsWriter(LoggingConfig(), total_iterations=2, rank=0) as writer:
        writer.log(1, {"reward_mean": 0.5})
        writer.print_text("prompt: 1 2 3\nresponse: 4 5 (reward 0.5)")
        writer.log(2, {"reward_mean": 0.75})
    out, err = capsys.readouterr()
    assert out.startswith("prompt: 1 2 3\nresponse: 4 5 (reward 0.5)\nppo done: iterations 1-2")
    assert "2/2" in err and "reward=0.75" in err and "prompt" not in err  # the bar goes on below the text
    with MetricsWriter(LoggingConfig(), total_iterations=1, rank=1) as writer:
        writer.print_text("not on rank 1")
        writer.log(1, {"reward_mean": 0.5})
    assert capsys.readouterr() == ("", "")


# --- W&B and MLflow ----------------------------------------------------------------------------

def _backend_run(config, ckpt, iterations, start=0):
    """A writer keeping its backend runs in checkpoint root ``ckpt`` (resumed from it when ``start``)."""
    checkpoint = CheckpointConfig(save=str(ckpt), load=str(ckpt) if start else None)
    with MetricsWriter(config, total_iterations=5, rank=0, start_iteration=start, checkpoint=checkpoint) as writer:
        for it in iterations:
            writer.log(it, {"reward_mean": it / 4, "gold_reward_mean": -it / 8, "time_generation_s": 0.5,
                            "kl_mean": math.nan})


def _as_logged(lines):
    """The JSON Lines records as {iteration: {key: value}}, null read back as NaN's stand-in None."""
    return {line["iteration"]: {k: v for k, v in line.items() if k != "iteration"} for line in lines}


def _nan_as_none(values: dict) -> dict:
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in values.items()}


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B in offline mode writing under ``tmp_path`` only. W&B reads its environment once per process
    (its first ``wandb.init``): ``wandb.teardown()`` after the test makes the next one read it again."""
    import wandb

    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield tmp_path / "wandb"
    wandb.teardown()


def _wandb_history(run_dir: Path) -> list[dict]:
    """The history rows of an offline W&B run, read from its ``run-<id>.wandb``: a LevelDB log (a 7-byte
    ``:W&B`` header, then 32 KiB blocks of records: crc32c, length, kind (1 full, 2 first, 3 middle,
    4 last), data) of protobuf ``Record``s."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, rows = next(run_dir.glob("run-*.wandb")).read_bytes(), []
    assert data[:4] == b":W&B"
    pos, chunk = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = chunk + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.HasField("history"):
                rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item})
    return rows


def test_wandb_offline_run_holds_the_metrics_file_and_a_resume_continues_it(tmp_path, wandb_offline):
    config = _config(tmp_path, wandb_project="rlhf-tests", wandb_run_name="tiny")
    ckpt = tmp_path / "ckpt"
    _backend_run(config, ckpt, [1, 2, 3])
    _backend_run(config, ckpt, [4, 5], start=3)  # resumed from the iteration-3 checkpoint
    run_id = json.loads((ckpt / RUNS_FILE).read_text())["wandb"]["id"]
    folders = sorted(wandb_offline.glob("offline-run-*"))  # by start time (<id>-1 when in the same second)
    assert [re.fullmatch(r"offline-run-\d{8}_\d{6}-(\w+?)(-1)?", f.name)[1] for f in folders] == [run_id] * 2
    rows = [row for folder in folders for row in _wandb_history(folder)]
    logged = {row["_step"]: {k: v for k, v in row.items() if not k.startswith("_")} for row in rows}
    assert list(logged) == [1, 2, 3, 4, 5]
    assert {it: _nan_as_none(values) for it, values in logged.items()} == _as_logged(_lines(tmp_path))
    _backend_run(config, ckpt, [1])  # a fresh run into the same root: a new W&B run
    assert json.loads((ckpt / RUNS_FILE).read_text())["wandb"]["id"] != run_id


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    """A local MLflow file store's URI; MLFLOW_ALLOW_FILE_STORE, which the writer sets, is restored after."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")  # remembers the variable's state before the test ...
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")  # ... and unsets it for the test
    return (tmp_path / "mlruns").as_uri()


def test_mlflow_run_holds_the_metrics_file_and_a_resume_continues_it(tmp_path, mlflow_store):
    from mlflow.tracking import MlflowClient

    config = _config(tmp_path, mlflow_tracking_uri=mlflow_store, mlflow_experiment="rlhf-tests")
    ckpt = tmp_path / "ckpt"
    _backend_run(config, ckpt, [1, 2, 3])
    _backend_run(config, ckpt, [4, 5], start=3)
    client = MlflowClient(tracking_uri=mlflow_store)
    experiment = client.get_experiment_by_name("rlhf-tests")
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == json.loads((ckpt / RUNS_FILE).read_text())["mlflow"]["run_id"]
    assert run.info.status == "FINISHED" and run.data.tags["rlhf.program"] == "ppo"
    logged: dict = {}
    for key in run.data.metrics:
        for m in client.get_metric_history(run.info.run_id, key):
            logged.setdefault(m.step, {})[key] = m.value
    assert {it: _nan_as_none(values) for it, values in sorted(logged.items())} == _as_logged(_lines(tmp_path))
    _backend_run(config, ckpt, [1])  # a fresh run: a second MLflow run
    assert len(client.search_runs([experiment.experiment_id])) == 2
    kept = json.loads((ckpt / RUNS_FILE).read_text())
    kept["mlflow"]["run_id"] = "0" * 32  # a run the store no longer has
    (ckpt / RUNS_FILE).write_text(json.dumps(kept))
    _backend_run(config, ckpt, [2], start=1)  # resumed: a third run, with a warning
    assert len(client.search_runs([experiment.experiment_id])) == 3


def test_backends_write_from_rank_0_only_and_a_failed_run_says_so(tmp_path, wandb_offline, mlflow_store):
    from mlflow.tracking import MlflowClient

    config = LoggingConfig(progress=False, wandb_project="rlhf-tests", mlflow_tracking_uri=mlflow_store)
    checkpoint = CheckpointConfig(save=str(tmp_path / "ckpt"))
    _log_run(config, [1, 2], rank=1)
    assert not wandb_offline.exists() and not (tmp_path / "mlruns").exists()
    with pytest.raises(RuntimeError):
        with MetricsWriter(config, total_iterations=2, rank=0, checkpoint=checkpoint) as writer:
            writer.log(1, {"reward_mean": 1.0})
            raise RuntimeError("a rank died")
    [run] = MlflowClient(tracking_uri=mlflow_store).search_runs(["0"])  # MLflow's Default experiment
    assert run.info.status == "FAILED"
    assert len(list(wandb_offline.glob("offline-run-*"))) == 1  # its own folder: W&B read this test's WANDB_DIR


# --- the end of a run --------------------------------------------------------------------------

def _ppo_metrics(it):
    """Iteration ``it``: reward it/10, gold reward it/100, 0.5 s (2 s from iteration 11 on)."""
    return {"reward_mean": it / 10, "gold_reward_mean": it / 100, "kl_mean": 0.5,
            "time_iteration_s": 0.5 if it <= 10 else 2.0}


def test_a_finished_run_ends_with_one_summary_line(tmp_path, capsys):
    config = _config(tmp_path, tensorboard_dir=str(tmp_path / "tb"))
    with MetricsWriter(config, total_iterations=30, rank=0) as writer:
        for it in range(1, 31):
            writer.log(it, _ppo_metrics(it))
    metrics, tb = tmp_path / "metrics.jsonl", tmp_path / "tb"
    # reward: mean of 0.1..1.0 = 0.55 and of 2.1..3.0 = 2.55; 10 x 0.5 s and 20 x 2 s = 1.5 s each
    assert capsys.readouterr().out == (
        "ppo done: iterations 1-30, 1.5 s/iteration; reward_mean 0.55 (1-10) -> 2.55 (21-30); "
        f"gold_reward_mean 0.055 (1-10) -> 0.255 (21-30); metrics: {metrics}; "
        f"TensorBoard: {tb} (tensorboard --logdir {tb}); plot: python tools/plot_metrics.py --metrics {metrics} "
        f"--out {tmp_path / 'metrics.png'} --keys reward_mean gold_reward_mean\n")


def test_a_resumed_run_summarises_the_whole_metrics_file(tmp_path, capsys):
    config = _config(tmp_path)
    with MetricsWriter(config, total_iterations=30, rank=0) as writer:
        for it in range(1, 26):  # killed after 25; the checkpoint is at 20
            writer.log(it, _ppo_metrics(it))
    with MetricsWriter(config, total_iterations=30, rank=0, start_iteration=20) as writer:
        for it in range(21, 31):
            writer.log(it, {**_ppo_metrics(it), "reward_mean": it / 5})  # recomputed: other values
    line = capsys.readouterr().out
    assert line.startswith("ppo done: iterations 1-30, 1.5 s/iteration; reward_mean 0.55 (1-10) -> 5.1 (21-30); ")
    assert line.count("\n") == 1


def test_the_reward_program_summarises_its_fit_and_no_line_ends_an_unfinished_run(tmp_path, capsys):
    postfix = (("loss", "loss"), ("acc", "accuracy"))
    with MetricsWriter(LoggingConfig(progress=False), total_iterations=4, rank=0, desc="reward",
                       postfix=postfix) as writer:
        for it in range(1, 5):
            writer.log(it, {"loss": 1.0 / it, "accuracy": it / 4, **({"eval_accuracy": 0.75} if it == 4 else {})})
    assert capsys.readouterr().out == (
        "reward done: iterations 1-4; loss 0.75 (1-2) -> 0.2917 (3-4); accuracy 0.375 (1-2) -> 0.875 (3-4); "
        "eval_accuracy 0.75 (4-4) -> 0.75 (4-4); no metrics file (--metrics-file FILE keeps one to plot)\n")
    with MetricsWriter(LoggingConfig(progress=False), total_iterations=4, rank=0) as writer:
        writer.log(1, {"reward_mean": 1.0})  # stopped before the last iteration
    with pytest.raises(RuntimeError), MetricsWriter(LoggingConfig(progress=False), total_iterations=1, rank=0) as w:
        w.log(1, {"reward_mean": 1.0})
        raise RuntimeError("failed while closing the last iteration")
    assert capsys.readouterr().out == ""


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
