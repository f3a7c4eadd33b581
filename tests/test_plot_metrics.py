"""tools/plot_metrics.py: first/last window statistics of a metrics file, and the plot."""

import json


from rlhf.testing.tools import load_tool

plot_metrics = load_tool("plot_metrics")


def test_window_stats_and_plot(tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    gold = [0.1, 0.2, 0.3, 0.5, 0.7, 0.9]
    path.write_text("".join(json.dumps({"iteration": i + 1, "gold_reward_mean": g, "reward_mean": 2 * g}) + "\n"
                            for i, g in enumerate(gold)))
    out = tmp_path / "p.png"
    assert plot_metrics.main(["--metrics", str(path), "--out", str(out), "--window", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # first 3: mean 0.2, stdev 0.1 -> sem 0.1/sqrt(3); last 3: mean 0.7, stdev 0.2 -> sem 0.2/sqrt(3)
    assert lines[1] == "gold_reward_mean: first 3 0.2000 +- 0.0577, last 3 0.7000 +- 0.1155"
    assert lines[0] == "reward_mean: first 3 0.4000 +- 0.1155, last 3 1.4000 +- 0.2309"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_input_names_the_file_or_key(tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    path.write_text('{"iteration": 1, "reward_mean": 0.1}\nnot json\n')
    assert plot_metrics.main(["--metrics", str(path), "--out", str(tmp_path / "p.png")]) == 2
    assert capsys.readouterr().err.startswith(f"plot_metrics.py: {path}:2: not JSON")
    path.write_text('{"iteration": 1, "reward_mean": 0.1}\n')
    assert plot_metrics.main(["--metrics", str(path), "--out", str(tmp_path / "p.png")]) == 2
    assert capsys.readouterr().err.startswith("plot_metrics.py: --keys ['gold_reward_mean'] not in")


def test_a_key_of_some_iterations_is_plotted_where_it_is(tmp_path, capsys):
    """train_reward.py writes eval_accuracy on eval iterations only: its window counts those."""
    path = tmp_path / "m.jsonl"
    records = [{"iteration": i, "loss": 1.0 / i} | ({"eval_accuracy": i / 10} if i % 2 == 0 else {})
               for i in range(1, 7)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    argv = ["--metrics", str(path), "--out", str(tmp_path / "p.png"), "--keys", "eval_accuracy", "--window", "2"]
    assert plot_metrics.main(argv) == 0
    # eval iterations 2, 4, 6: first 2 (0.2, 0.4) and last 2 (0.4, 0.6), sem 0.1/sqrt(2)
    assert capsys.readouterr().out.splitlines() == ["eval_accuracy: first 2 0.3000 +- 0.1000, last 2 0.5000 +- 0.1000"]
