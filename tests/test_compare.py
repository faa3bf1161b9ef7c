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


def _fake_run(folder, cells: str, momentum: float, curves: dict, seconds: float = 182.0):
    """A run folder without training: the results.json a run of ``cells`` at ``momentum`` would write."""
    config = degradation.get_config("quick")
    config.cells, config.train.momentum = tuple(cells.split(",")), momentum
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps({"experiment": "degradation", "config": common.to_jsonable(config),
                                                     "metrics": curves, "seconds": seconds}))
    return str(folder)


def test_compare_overlay_has_every_run_labelled_with_every_differing_setting_and_y_units(tmp_path, monkeypatch,
                                                                                          capsys):
    """#53: runs of different cells share no curve: each is still in the legend, with every setting the table lists
    as differing (momentum among them); each panel's y axis names its quantity and unit; a run with no finite curve
    says so; "ran N s in all" is results.json's seconds."""
    from experiments import figures

    written = []
    monkeypatch.setattr(figures, "write_figure", lambda fig, path, dpi: written.append(fig))
    curve = {"train_error_pct": [[80.0, 70.0], [82.0, 71.0]], "train_loss": [[2.3, 2.0], [2.3, 2.1]]}
    a = _fake_run(tmp_path / "a", "plain:2", 0.0, {f"curves.plain_d2.{k}": v for k, v in curve.items()}, 182.0)
    b = _fake_run(tmp_path / "b", "plain:4,plain:8,plain:16,plain:32,residual_bn:32", 0.9,
                  {f"curves.plain_d4.{k}": v for k, v in curve.items()})
    assert compare.main([a, b, "--out", str(tmp_path / "x.png")]) == 0
    out = capsys.readouterr().out
    assert "a: " + a + ", ran 182 s in all" in out
    differing = out.split("Settings that differ:")[1].split("Metrics:")[0]
    assert "train.momentum" in differing and "cells" in differing
    (fig,) = written
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert len(legend) == 2 and legend[0].startswith("a: ") and legend[1].startswith("b: ")
    for text, momentum in zip(legend, ("0.0", "0.9")):
        flat = " ".join(text.split())
        assert f"train.momentum {momentum}" in flat and "cells (plain:" in flat, text
    assert "..." in legend[1]  # the long cell list shortened, not left out
    drawn = [ax for ax in fig.axes if ax.axison]
    assert {ax.get_title(): ax.get_ylabel() for ax in drawn} == {
        "plain_d2.train_error_pct": "training error (%)", "plain_d2.train_loss": "training loss (cross-entropy, nats)",
        "plain_d4.train_error_pct": "training error (%)", "plain_d4.train_loss": "training loss (cross-entropy, nats)"}
    colours = {ax.get_title().split(".")[0]: ax.lines[0].get_color() for ax in drawn}
    assert [h.get_color() for h in fig.legends[0].legend_handles] == [colours["plain_d2"], colours["plain_d4"]]

    nan = {"curves.plain_d4.train_loss": [[None, None]]}  # a run whose every curve diverged: in the legend, said so
    assert compare.plot_curves([{"curves.plain_d4.train_loss": [[2.0, 1.0]]}, nan], ["first", "second"],
                               tmp_path / "y.png", "t") == ["curves.plain_d4.train_loss"]
    assert [t.get_text() for t in written[-1].legends[0].get_texts()] == [
        "first", "second\n  (no curve drawn: none has a finite value)"]
    assert compare.y_label("curves.log10_norm.bn.d8") == "log10 norm (decades)"
    assert compare.y_label("curves.cifar10.tau_sqrt.L8.test_acc") == "test accuracy (fraction, 0 to 1)"
    assert compare.y_label("curves.plain.L4.train_loss", [{"train": {"loss": "mse"}}]).startswith(
        "training loss (mean squared error")
