"""benchmarks.first_hour: the table of a new user's commands reads the committed report's time where the full
reproduction is not timed, and times a step as a child process (its wall and CPU seconds, its exit status)."""

import pytest

from benchmarks import first_hour


def test_report_time_is_read_from_the_committed_report(tmp_path):
    report = tmp_path / "REPORT.md"
    report.write_text("Size: `default`. The experiments took 1260 s in all; this run took 1271 s.\n")
    row = first_hour.from_report(report)
    assert row["seconds"] == 1271 and row["step"] == "reproduce" and row["machine"] is None
    assert "its machine is not recorded there" in first_hour.table([row])
    report.write_text(report.read_text() + "\nMachine: a 2-core CPU, 2 cores; jax 0.10.2.\n")
    row = first_hour.from_report(report)
    assert row["machine"] == "a 2-core CPU, 2 cores; jax 0.10.2"
    assert "made on a 2-core CPU, 2 cores; jax 0.10.2), not timed here" in first_hour.table([row])
    assert first_hour.from_report(tmp_path / "missing.md") is None
    # the committed report itself has the line the README's "about N minutes" comes from
    assert first_hour.from_report() is not None


def test_a_step_is_timed_in_a_child_process(monkeypatch, tmp_path):
    monkeypatch.setattr(first_hour, "LOGS", tmp_path)
    monkeypatch.setitem(first_hour.STEPS, "spin", ("burns CPU", ["-c", "import os, sys, time\nt = time.process_time()\n"
                                                                 "while time.process_time() - t < 0.3: pass\n"
                                                                 "os.makedirs(sys.argv[1])\n"
                                                                 "open(sys.argv[1] + '/REPORT.md', 'w').write('x')\n"
                                                                 "sys.exit(3)", "{out}"]))
    monkeypatch.setitem(first_hour.SHOWN, "spin", "python -c ...")
    row = first_hour.run_step("spin")
    assert row["returncode"] == 3
    assert row["cpu_seconds"] >= 0.3 and row["seconds"] >= row["cpu_seconds"] * 0.5
    assert (tmp_path / "first_hour-spin.log").is_file()
    assert (tmp_path / "first_hour-spin-REPORT.md").read_text() == "x"
    text = first_hour.table([row])
    assert "| `python -c ...` | burns CPU |" in text and "| 3 |" in text


def test_unknown_step_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        first_hour.main(["--only", "quick,bogus"])
    assert "bogus" in capsys.readouterr().err


def test_rows_of_an_earlier_run_are_kept_only_from_the_same_machine(monkeypatch, tmp_path, capsys):
    import json

    from benchmarks import throughput
    from experiments.reproduce import machine

    monkeypatch.setattr(throughput, "matmul_peak", lambda *a, **k: {"peak_gflops": 100.0})
    monkeypatch.setattr(first_hour, "LOGS", tmp_path)
    monkeypatch.setitem(first_hour.STEPS, "spin", ("exits", ["-c", "pass"]))
    monkeypatch.setitem(first_hour.SHOWN, "spin", "python -c pass")
    install = {"step": "install", "command": first_hour.SHOWN["install"], "seconds": 471.0, "cpu_seconds": 300.0,
               "peak_rss_mb": 200.0, "returncode": 0}
    earlier = tmp_path / "first_hour.json"
    earlier.write_text(json.dumps({"machine_only": machine(), "rows": [install]}))
    result = first_hour.main(["--only", "spin", "--json", str(earlier), "--keep-others"])
    steps = {r["step"]: r for r in result["rows"]}
    assert {"install", "spin"} <= set(steps) and "quick" not in steps and steps["install"]["seconds"] == 471.0
    assert "the rows of install kept from an earlier run on this machine" in result["machine"]
    earlier.write_text(json.dumps({"machine_only": "another CPU", "rows": [install]}))
    with pytest.raises(SystemExit):
        first_hour.main(["--only", "spin", "--json", str(earlier), "--keep-others"])
    assert "measured on another machine (another CPU)" in capsys.readouterr().err
