"""Comparing runs (#26): ``python -m experiments.compare`` (settings that differ, mean and spread over seeds,
overlaid curves; folders that are not runs refused) and ``tools/compare_results.py`` (the refactor guard: non-zero
exit for differences and for nothing to compare)."""

import importlib.util
import json
import pathlib

import pytest

from experiments import common, compare, degradation

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("compare_results", ROOT / "tools" / "compare_results.py")
compare_results = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare_results)

SMALL = ["--quick", "--cells", "plain:2", "--train.epochs", "2", "--num_seeds", "2"]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two quick degradation runs of one small cell that differ only in the learning rate."""
    root = tmp_path_factory.mktemp("runs")
    for name, lr in (("lr_small", "0.005"), ("lr_large", "0.05")):
        common.main(degradation, [*SMALL, "--train.learning_rate", lr, "--out", str(root / name)])
    return root


def test_compare_shows_the_differing_setting_a_mean_spread_table_and_overlaid_curves(two_runs, tmp_path, capsys):
    figure = tmp_path / "both.png"
    assert compare.main([str(two_runs / "lr_small"), str(two_runs / "lr_large"), "--out", str(figure)]) == 0
    out = capsys.readouterr().out
    assert "2 runs of degradation" in out
    settings = out.split("Settings that differ:")[1].split("Metrics:")[0]
    (row,) = [line.split() for line in settings.splitlines() if line.startswith("train.learning_rate")]
    assert row == ["train.learning_rate", "0.005", "0.05"]
    assert len([line for line in settings.splitlines() if line.strip()]) == 3  # header, rule, the one setting
    (metric,) = [line for line in out.splitlines() if line.startswith("final_train_error_pct.plain_d2 ")]
    assert metric.count("+-") == 2 and metric.count("(n=2)") == 2  # mean +- std (n) for each run, and a difference
    small, large = (json.loads((two_runs / n / "results.json").read_text())["metrics"]["final_train_error_pct.plain_d2"]
                    for n in ("lr_small", "lr_large"))
    assert f"{sum(small) / 2:.4g}" in metric and f"{sum(large) / 2:.4g}" in metric
    assert "all null (2)" in out  # diverged_epoch of runs that never diverged: null, counted apart
    assert f"Overlaid 3 curves in {figure}" in out and figure.stat().st_size > 10_000
    assert compare.summarise([1.0, None, 3.0]) == {"mean": 2.0, "std": pytest.approx(2 ** 0.5), "n": 2, "nulls": 1}


def test_compare_refuses_folders_that_are_not_runs_and_runs_of_different_experiments(two_runs, tmp_path, capsys):
    run = str(two_runs / "lr_small")
    other = tmp_path / "other"
    other.mkdir()
    (other / "results.json").write_text(json.dumps({"experiment": "shattered_gradients", "config": {}, "metrics": {}}))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "results.json").write_text("{}")
    for argv, words in (([run, str(tmp_path / "empty")], "no such folder"),
                        ([run, str(two_runs)], "not a run (no results.json); it holds the runs lr_large, lr_small"),
                        ([run, str(broken)], "not an experiment's results"),
                        ([run, str(other)], "runs of different experiments"),
                        ([run], "at least two")):
        with pytest.raises(SystemExit) as exit:
            compare.main(argv)
        assert exit.value.code == 2
        assert words in capsys.readouterr().err


def test_compare_results_exits_non_zero_for_differences_and_for_nothing_to_compare(two_runs, tmp_path, capsys):
    small, large = str(two_runs / "lr_small"), str(two_runs / "lr_large")
    assert compare_results.main([small, small]) == 0  # a run folder against itself: every metric bit-identical
    out = capsys.readouterr().out
    assert "degradation: 7 of 7 metrics bit-identical" in out and "DIFFERS" not in out
    assert compare_results.main([small, large]) == 1
    assert "DIFFERS" in capsys.readouterr().out
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert compare_results.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    assert "nothing to compare" in capsys.readouterr().err
    assert compare_results.main([str(tmp_path / "a"), str(tmp_path / "missing")]) == 2
