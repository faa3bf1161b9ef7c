"""``reproduce --jobs N``: the experiments run side by side in N processes of their own (the default with --quick on
2 or more cores), with the results of one process, one report, and stop signals passed on."""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

from experiments import reproduce

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
SMALL = ["architecture_counts", "batchnorm_example", "gradient_scale", "batch_noise"]  # about a second each


def test_groups_balance_the_measured_times_and_keep_the_order():
    names = ["a", "b", "c", "d", "e"]
    groups = reproduce._groups(names, [10.0, 30.0, None, 5.0, 20.0], 2)  # None: the mean of the known (16.25)
    assert sorted(sum(groups, [])) == names and all(g == sorted(g) for g in groups)  # each in the given order
    assert groups == [["a", "b"], ["c", "d", "e"]]  # 40 against 41.25 (b, e, c, a, d: each to the lighter)
    assert reproduce._groups(["a", "b"], [1.0, 2.0], 4) == [["b"], ["a"]]  # no more groups than experiments


def _metrics(out: pathlib.Path, name: str) -> dict:
    return json.loads((out / name / "results.json").read_text())["metrics"]


def test_two_processes_give_the_results_and_the_report_of_one(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    reproduce.main(["--quick", "--jobs", "1", "--out", str(one), "--only", *SMALL])
    done = subprocess.run([sys.executable, "-m", "experiments.reproduce", "--quick", "--jobs", "2", "--out", str(two),
                           "--only", *SMALL], env=ENV, cwd=ROOT, capture_output=True, text=True, check=True)
    assert "4 experiments in 2 processes side by side" in done.stdout and "reusing" not in done.stdout
    # each process names itself in its progress lines, which interleave: every experiment run by one of the two
    said = re.findall(r"^reproduce \(process (\d)/2\): \[\d/\d\] running (\w+) ", done.stdout, re.M)
    assert sorted(n for _, n in said) == sorted(SMALL) and {p for p, _ in said} == {"1", "2"}, done.stdout
    for name in SMALL:
        assert _metrics(two, name) == _metrics(one, name), name
    report_one, report_two = ([line for line in (d / "REPORT.md").read_text().split("\n\n")[2:]
                               if not line.startswith("Ran in ")] for d in (one, two))  # the timings left out
    assert report_two == report_one  # every section and claim, in the registry's order
    assert done.stdout.count("wrote") == 1  # one report: the processes of --jobs write none
    # the processes' results are this run's: a second run reuses every one of them
    again = subprocess.run([sys.executable, "-m", "experiments.reproduce", "--quick", "--out", str(two),
                            "--only", *SMALL], env=ENV, cwd=ROOT, capture_output=True, text=True, check=True)
    assert again.stdout.count("reusing") == 4 and "side by side" not in again.stdout


def _workers_of(out: pathlib.Path) -> list[int]:
    """Process ids of the --jobs processes writing into ``out``."""
    pids = []
    for entry in pathlib.Path("/proc").iterdir():
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"--no_report" in cmd and str(out).encode() in cmd:
            pids.append(int(entry.name))
    return pids


@pytest.mark.skipif(not pathlib.Path("/proc").exists(), reason="reads /proc for the processes of --jobs")
def test_sigterm_is_passed_on_to_every_process_and_the_same_command_resumes(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "experiments.reproduce", "--quick", "--jobs", "2", "--out", str(out),
           "--only", "degradation", "shattered_gradients"]
    proc = subprocess.Popen(cmd, env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if "running degradation" in line:  # its process has started training
            break
    time.sleep(2)
    workers = _workers_of(out)
    assert len(workers) == 2, workers
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "reproduce: stopped by SIGTERM" in stderr and "Run the same command again" in stderr
    assert _workers_of(out) == []  # none left running
    assert not (out / "degradation" / "results.json").exists()  # its process stopped, not left to finish
    assert stderr.count("stopped by SIGTERM") >= 2  # its process's message and this one's
    assert not (out / "REPORT-quick.md").exists() and not (out / "REPORT.md").exists()
    done = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (out / "REPORT.md").exists() and (out / "degradation" / "results.json").exists()


def test_a_bad_jobs_value_is_refused_before_anything_runs(tmp_path, capsys):
    with pytest.raises(SystemExit) as err:
        reproduce.main(["--quick", "--jobs", "0", "--out", str(tmp_path / "o")])
    assert err.value.code == 2 and "--jobs: must be at least 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_processes_side_by_side_only_on_a_cpu_host(tmp_path, capsys, monkeypatch):
    """On a GPU or TPU host the experiments share the one device: --quick's default is one process there, and an
    asked-for --jobs 2 is refused before anything runs (each process would claim the device: the first one's
    preallocation leaves a GPU's memory to no other, a TPU opens in one process only)."""
    assert reproduce.default_jobs("quick", "cpu", 2) == 2
    assert reproduce.default_jobs("quick", "cpu", 1) == 1
    assert reproduce.default_jobs("default", "cpu", 16) == 1
    for backend in ("gpu", "tpu"):
        assert reproduce.default_jobs("quick", backend, 16) == 1
        monkeypatch.setattr(reproduce, "_backend", lambda: backend)
        with pytest.raises(SystemExit) as err:
            reproduce.main(["--quick", "--jobs", "2", "--out", str(tmp_path / "o")])
        assert err.value.code == 2
        assert f"--jobs 2: processes side by side are for a CPU host; on this {backend} host" in capsys.readouterr().err
        assert not (tmp_path / "o").exists()
