"""``python -m benchmarks.reproduce``: a row per experiment, each run in its own process, with its peak memory."""
import json

from benchmarks import reproduce


def test_a_row_per_experiment_with_its_own_results_and_peak_memory(tmp_path, capsys):
    names = ["batchnorm_example", "architecture_counts"]  # the two quickest experiments
    rows = reproduce.main(["--size", "quick", "--only", ",".join(names), "--out", str(tmp_path / "runs"),
                           "--json", str(tmp_path / "rows.json")])
    assert [name for name, _ in rows] == names
    for name, row in rows:
        assert row["status"] == 0, (tmp_path / "runs" / f"{name}.log").read_text()
        assert (tmp_path / "runs" / name / "results.json").exists()  # reproduce ran it, into --out
        assert row["seconds"] > 0
        assert row["peak_rss_mb"] > 50  # the child's own peak (Python, NumPy and JAX loaded), not 0 or the parent's
    assert set(json.loads((tmp_path / "rows.json").read_text())["rows"]) == set(names)
    table = capsys.readouterr().out
    assert all(name in table for name in names) and "total" in table
