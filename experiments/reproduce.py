"""Run every registered experiment and write ``REPORT.md``: claim, the seed document's value, the measured value, holds.

    python -m experiments.reproduce [--quick | --full] [--out DIR] [--only NAME ...] [--fresh] [--checkpoint_dir DIR]
                                    [--jobs N]

Sizes: ``--quick`` (a minute or two; what the tests run), the default (every lecture-scale figure,
well under an hour on a 2-core CPU) and ``--full`` (paper-scale runs meant for an accelerator). Each
experiment writes ``DIR/<name>/results.json`` and its figure; the report, ``DIR/REPORT.md``, links them.
Without ``--out``, ``--quick`` writes ``runs/<name>-quick`` and ``runs/REPORT-quick.md`` (where
``python -m experiments.<name> --quick`` writes too), so a quick check never replaces a real run's results.
A quick report marks each claim that does not hold with the committed default-size report's verdict on it
(``docs/report``): "also no at default size (docs/report)" or "only at quick size" (``quick_marks``).

Every experiment to be run is preflighted (``experiments.common.preflight``: every cell, every setting,
the output folders) before the first one starts.

``--jobs N`` runs the experiments side by side in N processes of their own (each ``python -m
experiments.reproduce ... --only <its experiments>``; the groups balanced by the experiments' measured times,
``QUICK_SECONDS`` and ``docs/report``), then writes the one report from their results. It is the default with
``--quick`` on a CPU host of 2 or more cores (N = 2): quick programs take longer to compile than to run, and a
compilation keeps one core busy. The default and ``--full`` sizes keep every core busy in one process (N = 1). On
a GPU or TPU host the experiments share the one device in one process: ``--jobs`` above 1 is refused there.
A stop signal is passed on to every process; each saves as it would alone, and the same command resumes.

An experiment whose ``DIR/<name>/results.json`` records the config of this run is not run again: its
results are taken as they are (``--reuse``, which asked for that, is still accepted). The others run, each
resuming from its checkpoints (``experiments.checkpoints``: a training cell finished before an interruption
loads, the interrupted one goes on), so the same command after a SIGTERM or Ctrl-C (exit 143 or 130, the
command printed) carries on where it stopped. ``--fresh`` runs every experiment again, every cell from its
start; ``--checkpoint_dir DIR`` keeps the checkpoints in ``DIR/<name>`` (``none``: none kept).
``rebuild_report(DIR)`` (``python -c "from experiments.reproduce import rebuild_report;
rebuild_report('docs/report')"``) writes ``DIR/REPORT.md`` again from the stored results
without running anything, whatever their configs.

Experiments that train on a TFDS data set (``cifar_tau``, ``taki_cifar``: they define
``required_data(config)``) run their seed settings when the data is prepared; when it is not, the report
says so with the command that prepares it, runs their ``--quick`` version on synthetic stand-in data (a
pipeline check) and marks their claims "not measured".

To register an experiment, add its module name to ``REGISTRY``; the module follows the contract in
``experiments/__init__.py`` (``NAME``, ``get_config``, ``run``, ``CLAIMS``, optionally
``report_section(metrics) -> str`` for tables beyond the claims).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

from experiments import checkpoints, common, image_runs
from resjax.paths import as_path, is_url

REGISTRY = (
    # lecture (seed 000)
    "degradation", "shattered_gradients", "gradient_scale", "variance_growth", "path_lengths",
    "batchnorm_example", "batch_noise", "running_estimates", "scale_invariance", "batchnorm_loss_surface",
    "normalisation_axes", "architecture_counts",
    # Zhang et al. (seed 003)
    "tau_stability", "tau_batchnorm_growth", "fixup_one_step", "tau_training", "resnet_signal",
    # Taki (seed 004)
    "taki_init",
    # image training (seeds 003, 004): need CIFAR prepared; otherwise a synthetic stand-in, "not measured"
    "cifar_tau", "taki_cifar",
    # MNIST-1D's own paper (Greydanus 2020): its model table
    "mnist1d_models",
)


PROBE_MARK = "*(threshold set after a probe)*"
LEGEND = ("'seed document' is the claim's value in the seed document it comes from (a lecture or a paper; not a "
          "random seed). 'holds' is judged against the seed's claim as stated (tolerances are in each claim's text); "
          "'reported' marks numbers shown beside the seed's without a pass/fail test; 'not measured' marks "
          "claims of an experiment whose data set was not prepared (it ran on a synthetic stand-in). "
          f"{PROBE_MARK} marks a claim whose pass/fail threshold was set after a probe run of its experiment "
          "(the experiment's docstring says which run), not fixed before any run. A claim's text states the seed "
          "document's settings; '(this run: ...)' after it names the settings this run used where they differ.")
QUICK_NOTE = ("**Quick sizes: not a reproduction.** Every experiment here ran at its `--quick` size (small networks, "
              "few seeds, draws and epochs), which checks that it runs end to end in minutes. Its numbers are not "
              "expected to reproduce the seed documents, so a quick 'no' alone says nothing about the experiment's "
              "own size: each 'no' is marked with the committed default-size report's verdict on the same claim "
              "(`docs/report`, the report of `python -m experiments.reproduce`): 'also no at default size "
              "(docs/report)', or 'only at quick size' where it holds there.")
OUTCOMES = (("yes", "hold"), ("**no**", "do not hold"), ("reported", "are reported without a pass/fail test"),
            ("not measured", "were not measured"))


def claim_text(claim: common.Claim) -> str:
    """The claim's text as the report shows it: marked when its threshold was set after a probe run."""
    return f"{claim.text} {PROBE_MARK}" if claim.probe_threshold else claim.text


def table_text(text: str) -> str:
    """``text`` in a cell of the report's markdown tables: a ``|`` (``|h_L|/|h_0|``) escaped as ``\\|``, so it shows
    as itself instead of ending the cell."""
    return str(text).replace("|", "\\|")


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "/")


def claim_rows(module, results: dict) -> list[tuple[str, str, str, str, str]]:
    """``(text, source, seed document's value, measured, holds)`` of every claim of ``module`` for ``results``; the
    text says where this run's settings differ from the seed's (``common.run_settings_note``)."""
    metrics = results["metrics"]
    stand_in = image_runs.not_measured(metrics)
    rows = []
    for claim in module.CLAIMS:
        measured, ok = ("not measured", "not measured") if stand_in else _holds(claim, metrics)
        # a stand-in run measured nothing a claim reads: its settings are in the section, not in each claim
        text = claim_text(claim) + ("" if stand_in else common.run_settings_note(module, results.get("config"), claim))
        rows.append((text, claim.source, claim.seed_value, measured, ok))
    return rows


#: A quick 'no' marked with the committed default-size report's verdict on the claim (``quick_marks``).
ALSO_NO = "also no at default size (docs/report)"
ONLY_QUICK = "only at quick size"
DEFAULT_VERDICT_MARKS = {"**no**": ALSO_NO, "yes": ONLY_QUICK,
                         "reported": "at default size reported without a pass/fail test (docs/report)",
                         "not measured": "not measured at default size either (docs/report ran a stand-in)"}


def quick_marks(module, rows: list[tuple], reference: pathlib.Path | None = None) -> list[str | None]:
    """For each claim row of a quick run (``claim_rows``) that does not hold, what the committed default-size report
    says of the same claim: ``ALSO_NO``, ``ONLY_QUICK`` (it holds there), or why it cannot say (the report lacks the
    experiment, or the claim: its results lack a metric the claim reads); None for the other rows. The default
    verdicts are the claims evaluated on ``reference/<name>/results.json`` (``REFERENCE``: ``docs/report``), as
    ``rebuild_report`` writes them into ``docs/report/REPORT.md``."""
    path = (reference or REFERENCE) / module.NAME / "results.json"
    if not any(r[4] == "**no**" for r in rows):
        return [None] * len(rows)
    if not path.is_file():
        default = [("", "lacks")] * len(module.CLAIMS)
    else:
        default = [(measured, ok) for *_, measured, ok in claim_rows(module, json.loads(path.read_text()))]
    marks = []
    for row, (measured, ok) in zip(rows, default):
        if row[4] != "**no**":
            marks.append(None)
        elif ok == "lacks":
            marks.append(f"docs/report lacks this experiment ({module.NAME}): no verdict at default size")
        elif str(measured).startswith("missing"):
            marks.append("docs/report lacks this claim (its results lack a metric the claim reads): no verdict at "
                         "default size")
        else:
            marks.append(DEFAULT_VERDICT_MARKS[ok])
    return marks


def marks_summary(marks: list[str | None]) -> str:
    """``'Of the 21 claims marked no: 3 also no at default size (docs/report), 18 only at quick size.'``"""
    given = [m for m in marks if m is not None]
    if not given:
        return ""
    also, only = given.count(ALSO_NO), given.count(ONLY_QUICK)
    parts = [f"{also} {ALSO_NO}"] * bool(also) + [f"{only} {ONLY_QUICK}"] * bool(only) + (
        [f"{len(given) - also - only} without a pass/fail verdict at default size (each says why)"]
        if len(given) > also + only else [])
    return f"Of the {len(given)} claims marked **no**: " + ", ".join(parts) + "."


def summary(rows: list[tuple], experiments: int) -> str:
    """``'**Summary:** of 75 claims in 20 experiments, 40 hold, 19 do not hold, ...'`` from the claims' rows
    (``claim_rows``): counts of each 'holds' value, and of the claims that could not be evaluated because the run
    did not produce a metric they read (counted apart from 'do not hold')."""
    missing = sum(1 for r in rows if r[4] == "**no**" and str(r[3]).startswith("missing"))
    outcomes = [r[4] for r in rows]
    counts = {key: outcomes.count(key) - (missing if key == "**no**" else 0) for key, _ in OUTCOMES}
    parts = [f"{counts[key]} {words}" for key, words in OUTCOMES if counts[key]]
    if missing:
        parts.append(f"{missing} could not be evaluated (a metric the run did not produce)")
    return (f"**Summary:** of {len(rows)} claims in {experiments} experiment{'s' if experiments != 1 else ''}, "
            + ", ".join(parts) + ".")


#: Instruction-set extensions that change what XLA:CPU compiles (vector width, matrix units), hence the last bits of
#: floating-point results: a report's numbers are those of a machine with these.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "neon", "sve")


def machine() -> str:
    """The machine the run's numbers come from, in one line: the processor (``/proc/cpuinfo``'s model name on
    Linux, else ``platform.processor()``), its instruction-set extensions of ``ISA_FLAGS``, the CPU cores, JAX's
    devices, and the jax and jaxlib versions. XLA compiles for the processor it runs on, so the same code and
    seeds can round differently on another machine (every verdict of ``docs/report/`` the same on two CPUs, the
    last bits of 17 experiments' metrics not); the report says which machine made it."""
    import platform

    import jax
    import jaxlib

    model, flags = platform.processor() or platform.machine(), []
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        info = ""
    for line in info.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model") and model in ("", platform.machine(), platform.processor()):
            model = value.strip()
        elif key.strip() in ("flags", "Features") and not flags:
            present = set(value.split())
            flags = [f for f in ISA_FLAGS if f in present]
    devices = jax.devices()
    return (f"{model}" + (f" ({', '.join(flags)})" if flags else "") + f", {os.cpu_count()} cores; "
            f"{len(devices)} JAX {devices[0].platform} device{'s' if len(devices) > 1 else ''}; "
            f"jax {jax.__version__}, jaxlib {jaxlib.__version__}")


def front_matter(rows: list[tuple], experiments: int, quick: bool, marks: list | None = None) -> list[str]:
    """The report's lines after its run line: the summary of every claim, the note that quick sizes are not a
    reproduction (``quick``) with the counts of its 'no' marks (``quick_marks`` of every row), the legend."""
    counted = marks_summary(marks or []) if quick else ""
    return ([summary(rows, experiments), ""] + ([QUICK_NOTE + (" " + counted if counted else ""), ""] if quick else [])
            + [LEGEND, ""])


def _holds(claim: common.Claim, metrics: dict) -> tuple[str, str]:
    try:
        measured = _cell(claim.measure(metrics))
        ok = claim.holds(metrics)
    except (KeyError, ValueError, TypeError, IndexError) as err:  # a metric the run did not produce
        return f"missing ({type(err).__name__}: {err})", "no"
    return measured, {True: "yes", False: "**no**", None: "reported"}[ok]


def report_section(module, results: dict, out_dir: pathlib.Path, report_dir: pathlib.Path,
                   missing: str | None = None, quick: bool = False) -> str:
    """The experiment's section of the report: its run, the settings that differ from the seed's, the claims'
    table (``quick``: each 'no' marked with the default-size report's verdict, ``quick_marks``), its own tables
    and its figure."""
    metrics = results["metrics"]
    lines = [f"## {module.NAME}", ""]
    stand_in = image_runs.not_measured(metrics)
    if stand_in:
        lines += ["**Not measured.** This run trained on the synthetic stand-in data (`--quick`), which checks the "
                  "pipeline but measures nothing the seed claims. " + (f"The data is not prepared:\n\n```\n{missing}\n```\n\n"
                  if missing else "") + f"With the data prepared, `python -m experiments.{module.NAME}` runs the "
                  "seed's settings (an accelerator is needed for the full run).", ""]
    changed = common.changed_settings(module, results.get("config"))
    differ = ("Settings that differ from the seed document's (the default size): "
              + ", ".join(f"`{k}` {common.show_value(v)}" for k, v in changed.items()) + "." if changed else "")
    lines += [f"Ran in {results['seconds']:.0f} s. Config: `{results['config']}`.", ""] + ([differ, ""] if differ else []) + [
              "| claim | source | seed document | measured | holds |", "|---|---|---|---|---|"]
    rows = claim_rows(module, results)
    marks = quick_marks(module, rows) if quick else [None] * len(rows)
    for (text, source, seed_value, measured, ok), mark in zip(rows, marks):
        ok = f"{ok}: {mark}" if mark else ok
        lines.append(f"| {table_text(text)} | {table_text(source)} | {table_text(seed_value)} | {measured} | {ok} |")
    lines.append("")
    if hasattr(module, "report_section"):
        lines += [module.report_section(metrics), ""]
    figure = pathlib.PurePosixPath(str(out_dir / f"{module.NAME}.png")).relative_to(str(report_dir))
    lines += [f"![{module.NAME}]({figure})", ""]
    return "\n".join(lines)


def _previous(out_dir: pathlib.Path, config) -> dict | None:
    """The results in ``out_dir`` if they were produced with exactly ``config`` (None also for a file that
    cannot be read: the experiment runs again, resuming from its checkpoints)."""
    path = out_dir / "results.json"
    if not path.exists():
        return None
    try:
        results = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(results, dict):
        return None
    return results if _without_added(results.get("config")) == _without_added(common.to_jsonable(config)) else None


#: An experiment's settings added after results were first written, with the default that runs as before them:
#: ``pack_cells`` 'auto' packs cells on accelerators only, so on the CPUs that wrote those results it trains each
#: cell alone, as the code before it did.
ADDED_SETTINGS = {"pack_cells": "auto"}


def _without_added(config):
    """A results' ``config`` (JSON) without the settings added after results were first written, where they hold
    their defaults (``resjax.train.core.ADDED``: ``train.steps`` 0, ...; :data:`ADDED_SETTINGS`): results written
    before them are results of the same run."""
    from resjax.train.core import ADDED

    if not isinstance(config, dict):
        return config
    config = {k: v for k, v in config.items() if ADDED_SETTINGS.get(k, object()) != v}
    if not isinstance(config.get("train"), dict):
        return config
    train = {k: v for k, v in config["train"].items() if ADDED.get(f"train.{k}", object()) != v}
    return {**config, "train": train}


def _checkpoint_arg(value: str | None, name: str) -> str | None:
    """An experiment's ``checkpoint_dir`` from reproduce's ``--checkpoint_dir`` (None: its own default)."""
    if value is None or value.strip().lower() == checkpoints.NONE or value.strip() == "":
        return value
    return f"{value.rstrip('/')}/{name}" if is_url(value) else str(pathlib.Path(value) / name)


def _checkpoint_root(value: str | None, folder: pathlib.Path, name: str) -> pathlib.Path | None:
    return checkpoints.resolve(_checkpoint_arg(value, name), folder)


def rebuild_report(out="runs", size_name: str = "default", names=None) -> pathlib.Path:
    """Write ``DIR/REPORT.md`` again from the stored ``DIR/<name>/results.json`` without running anything
    (after a change to the claims or to the report's layout; ``--reuse`` would run again every experiment
    whose config changed since). The run line of an existing report (the size and timings of the run that
    made the results) is kept, and so is its machine line. For a stand-in run of an experiment that needs a TFDS
    data set, the report shows the command that prepares the data set as this machine sees it (``size_name``'s
    config)."""
    out = as_path(out, "out")
    path = out / "REPORT.md"
    sections, seconds, rows, marks = [], 0.0, [], []
    quick = size_name == "quick"
    if path.exists() and not quick:
        quick = any(p.startswith("Size: `quick`") for p in path.read_text().split("\n\n"))
    for name in names or REGISTRY:
        module = importlib.import_module(f"experiments.{name}")
        results = json.loads((out / name / "results.json").read_text())
        missing = (image_runs.missing_data(module, module.get_config(size_name))
                   if hasattr(module, "required_data") and image_runs.not_measured(results["metrics"]) else None)
        seconds += results["seconds"]
        sections.append(report_section(module, results, out / name, out, missing, quick))
        rows += claim_rows(module, results)
        marks += quick_marks(module, claim_rows(module, results)) if quick else []
    run_line = machine_line = None
    if path.exists():
        paragraphs = path.read_text().split("\n\n")
        run_line = next((p for p in paragraphs if p.startswith("Size: ")), None)
        machine_line = next((p for p in paragraphs if p.startswith("Machine: ")), None)  # the run's, kept
    if run_line is None:
        run_line = (f"Size: `{size_name}`. The experiments took {seconds:.0f} s in all. Rebuilt from their stored "
                    "results by `experiments.reproduce.rebuild_report`.")
    head = ["# resjax reproduction report", "", run_line, ""] + ([machine_line, ""] if machine_line else [])
    common.write_atomically(path, lambda tmp: tmp.write_text("\n".join(head + front_matter(rows, len(sections), quick,
                                                                                          marks) + sections)))
    return path


#: The committed report's results (default size): each experiment's time there weighs the time-left estimate.
REFERENCE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "report"
#: Each experiment's seconds at ``--quick`` size (compilation included), measured from an empty compilation cache:
#: they weigh a quick run's time-left estimate (``record_quick_seconds`` writes the file from a quick run's results).
QUICK_SECONDS = pathlib.Path(__file__).resolve().parent / "quick_seconds.json"


def _expected_seconds(name: str, label: str) -> float | None:
    """The experiment's measured time at this size: the committed default-size report's for ``default``,
    ``QUICK_SECONDS``'s for ``quick`` and a ``quick stand-in``; None for other sizes or when absent."""
    path, key = ((REFERENCE / name / "results.json", "seconds") if label == "default"
                 else (QUICK_SECONDS, name) if label.startswith("quick") else (None, None))
    if path is None or not path.exists():
        return None
    try:
        return float(json.loads(path.read_text())[key])
    except (ValueError, KeyError, TypeError):
        return None


def record_quick_seconds(*outs, path=QUICK_SECONDS) -> dict:
    """Write ``QUICK_SECONDS`` from the ``results.json`` of quick runs (``python -m experiments.reproduce --quick
    --fresh --out DIR`` with ``RESJAX_COMPILATION_CACHE`` pointing at an empty folder, on an idle machine, with the
    default ``--jobs``: each experiment's time as it runs beside the other process's): each
    experiment's ``seconds``, the mean over the runs in ``outs`` (default: ``runs``), in ``REGISTRY`` order. Run
    ``python -c "from experiments.reproduce import record_quick_seconds; record_quick_seconds('DIR1', 'DIR2')"``."""
    seconds = {}
    for name in REGISTRY:
        runs = [json.loads((pathlib.Path(out) / name / "results.json").read_text())["seconds"]
                for out in outs or ("runs",)]
        seconds[name] = round(sum(runs) / len(runs), 1)
    pathlib.Path(path).write_text(json.dumps(seconds, indent=1) + "\n")
    return seconds


def _weights(expected: list) -> list[float]:
    """Measured times with each unknown one (None) as the mean of the known (1 when none is known); 0 (reused,
    not run) stays 0."""
    known = [e for e in expected if e]
    mean = sum(known) / len(known) if known else 1.0
    return [mean if e is None else e for e in expected]


#: How much the measured times themselves weigh in the time-left estimate's scale, as a fraction of the whole job's
#: measured time: the scale is ``(finished seconds + prior) / (their measured seconds + prior)``, so that one finished
#: experiment (the first of a process, which also pays its warm-up) does not scale the whole rest by itself. In a cold
#: quick run of 2026-12-06 whose processes compiled every source they imported (PYTHONDONTWRITEBYTECODE set),
#: the first experiments took 1.4-1.9x their measured times and the rest 1.1x: replayed on its log, the worst line's
#: error was +65% with no prior, +22% with 0.1 (and +12% after each process's first line on that log slowed 1.7x).
#: On three cold runs with bytecode kept, the worst lines were -15 to -18% either way.
PRIOR_WEIGHT = 0.1


def _whereabouts(start: float, expected: list, k: int, ran: list | None = None) -> str:
    """``'12:03 elapsed, about 20:00 left'`` before experiment ``k`` (0-based) of ``expected``, their measured times
    at this size (None: unknown, weighed as the mean of the known; 0: reused, not run). The time left is the
    measured times of the remaining experiments, scaled by how this run compares with them on the finished ones:
    by ``ran``, the seconds the finished experiments took (``results.json``'s ``seconds``), or else by the time
    elapsed since ``start``, which counts the process's start and JAX's too (before the first has finished: the
    measured times as they are), the ratio drawn towards 1 by ``PRIOR_WEIGHT``; by count, with no prior, when no
    times are known."""
    from resjax.train.monitor import format_seconds

    elapsed = time.time() - start
    if k == 0 and not any(expected):
        return f"{format_seconds(elapsed)} elapsed"
    weights = _weights(expected)
    done = sum(weights[:k])
    took = sum(ran) if ran is not None else elapsed
    prior = PRIOR_WEIGHT * sum(weights) if any(expected) else 0.0  # by count: a count is no measured time
    scale = (took + prior) / (done + prior) if done > 0 and took > 0 else 1.0
    return f"{format_seconds(elapsed)} elapsed, about {format_seconds(sum(weights[k:]) * scale)} left"


def _jax_process_count() -> int:
    """How many JAX processes run this job (several hosts: ``--jobs`` does not split them)."""
    import jax

    return jax.process_count()


def _backend() -> str:
    """JAX's default backend in this process: 'cpu', 'gpu' or 'tpu'."""
    import jax

    return jax.default_backend()


def default_jobs(size_name: str, backend: str, cores: int) -> int:
    """``--jobs``' default: 2 for ``--quick`` on a CPU host of 2 or more cores (its small programs compile on one
    core each), otherwise 1. On an accelerator the experiments share the device: processes side by side would
    each claim it (a GPU's memory is preallocated by the first, a TPU opens in one process only)."""
    return 2 if size_name == "quick" and backend == "cpu" and cores >= 2 else 1


def _groups(names: list, expected: list, jobs: int) -> list[list]:
    """``names`` split into at most ``jobs`` groups of about equal measured time (each next longest experiment to
    the group with the least so far), each group in ``names``' order."""
    weight = dict(zip(names, _weights(expected)))
    groups: list[list] = [[] for _ in range(min(jobs, len(names)))]
    for name in sorted(names, key=lambda n: -weight[n]):
        min(groups, key=lambda g: sum(weight[n] for n in g)).append(name)
    return [sorted(g, key=names.index) for g in groups]


def _run_in_processes(groups: list[list], argv: list[str]) -> None:
    """Each group of experiments run by a process of its own (``python -m experiments.reproduce ARGV --only
    GROUP --jobs 1 --no_report --process I/N``: it writes no report, and names itself in its progress lines,
    ``reproduce (process I/N): [k/n] running ...``, which interleave with the other processes'; in a session of its
    own, so that a terminal's Ctrl-C reaches this process only), all at once; wait for them. A stop signal is passed on to every process (each
    saves its training cells and stops) and this one then stops with 128 + the signal number; a process that
    failed ends this one with its exit status, once the others have finished."""
    procs = [subprocess.Popen([sys.executable, "-m", "experiments.reproduce", *argv, "--only", *g, "--jobs", "1",
                               "--no_report", "--process", f"{i}/{len(groups)}"],
                              start_new_session=True) for i, g in enumerate(groups, 1)]
    received: list[int] = []

    def forward(signum, frame):
        received.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        codes = [p.wait() for p in procs]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if received:
        from resjax.train.preemption import resume_command

        print(f"reproduce: stopped by {signal.Signals(received[0]).name}; each experiment's finished training "
              f"cells are saved. Run the same command again to resume:\n  {resume_command()}", file=sys.stderr,
              flush=True)
        raise SystemExit(128 + received[0])
    failed = [(g, c) for g, c in zip(groups, codes) if c]
    if failed:
        group, code = failed[0]
        print(f"reproduce: the process running {', '.join(group)} ended with status {code} (its output above)",
              file=sys.stderr, flush=True)
        raise SystemExit(code)


def main(argv=None) -> pathlib.Path:
    common.start(argv)
    parser = common.ArgumentParser(prog="python -m experiments.reproduce", description=__doc__.split("\n\n")[0],
                                   epilog="Each experiment's own --help says what its --quick and --full change.")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="every experiment at its small, fast size (minutes in all; what the tests run): a pipeline "
                           "check whose numbers are NOT expected to reproduce the seed documents")
    size.add_argument("--full", action="store_true",
                      help="every experiment at paper scale (more seeds, draws and epochs; meant for an accelerator)")
    parser.add_argument("--out", default=None,
                        help="output folder (default: runs; with --quick each experiment's folder is <name>-quick "
                             "and the report REPORT-quick.md)")
    parser.add_argument("--only", nargs="*", choices=REGISTRY, metavar="NAME",
                        help="run only these experiments, in this order (names: " + ", ".join(REGISTRY) + ")")
    parser.add_argument("--reuse", action="store_true",
                        help="kept for old command lines: an experiment whose DIR/<name>/results.json has this run's "
                             "config is taken as it is, now always (unless --fresh)")
    parser.add_argument("--fresh", action="store_true",
                        help="run every experiment again, every training cell from its start (ignoring finished "
                             "results and checkpoints)")
    parser.add_argument("--checkpoint_dir", default=None, metavar="DIR",
                        help="where the experiments checkpoint, DIR/<name> each (default: each experiment's "
                             "<folder>/checkpoints; 'none': no checkpoints, an interrupted experiment starts over)")
    parser.add_argument("--jobs", type=int, default=None, metavar="N",
                        help="experiments run side by side in N processes of their own, on a CPU host (default: 2 "
                             "with --quick on a CPU host of 2 or more cores, whose programs take longer to compile "
                             "than to run and compile on one core; otherwise 1: the default and --full sizes keep "
                             "every core busy, and on a GPU or TPU the experiments share the one device)")
    parser.add_argument("--no_report", action="store_true", help=argparse.SUPPRESS)  # a process of --jobs
    parser.add_argument("--process", default=None, help=argparse.SUPPRESS)  # which one: I/N, in its progress lines
    args = parser.parse_args(argv)
    if args.jobs is not None and args.jobs < 1:
        parser.error(f"--jobs: must be at least 1, got {args.jobs}")
    backend = _backend()
    if args.jobs is not None and args.jobs > 1 and backend != "cpu":
        parser.error(f"--jobs {args.jobs}: processes side by side are for a CPU host; on this {backend} host each "
                     "would claim the one device (run with --jobs 1, the default here)")
    size_name = "quick" if args.quick else "full" if args.full else "default"
    out = as_path(args.out, "out") if args.out else pathlib.Path("runs")  # a local folder or a bucket URL
    suffix = "-quick" if size_name == "quick" and not args.out else ""  # common.default_out's rule
    if common.is_main():  # with several processes, process 0 writes every file
        out.mkdir(parents=True, exist_ok=True)

    start = time.time()
    plan = []  # (module, config, label, missing, folder): every experiment preflighted before the first runs
    for name in args.only or REGISTRY:
        module = importlib.import_module(f"experiments.{name}")
        config = module.get_config(size_name)
        missing = image_runs.missing_data(module, config) if hasattr(module, "required_data") else None
        if missing:
            print(f"reproduce: {name}: data not prepared; running its --quick stand-in\n{missing}", flush=True)
            config = module.get_config("quick")
            label = "quick stand-in"
        else:
            label = size_name
        try:
            common.preflight(module, config, out / f"{name}{suffix}")
            checkpoints.check_root(_checkpoint_root(args.checkpoint_dir, out / f"{name}{suffix}", name))
        except ValueError as err:
            parser.error(f"{name}: {' '.join(str(err).split())}")
        plan.append((module, config, label, missing, out / f"{name}{suffix}"))
    sections, experiment_seconds, reused, rows, ran, marks = [], 0.0, [], [], [], []
    quick = size_name == "quick"
    previous = [None if args.fresh else _previous(folder, config) for _, config, _, _, folder in plan]
    expected = [0.0 if prev is not None else _expected_seconds(module.NAME, label)  # reused: no time
                for (module, _, label, _, _), prev in zip(plan, previous)]
    jobs = args.jobs or default_jobs(size_name, backend, os.cpu_count() or 1)
    todo = [k for k, prev in enumerate(previous) if prev is None]
    side_by_side, processes = set(), 1  # experiments run by the processes of --jobs, and how many
    if jobs > 1 and len(todo) > 1 and _jax_process_count() == 1:
        groups = _groups([plan[k][0].NAME for k in todo], [expected[k] for k in todo], jobs)
        print(f"reproduce: {len(todo)} experiments in {len(groups)} processes side by side: "
              + "; ".join(", ".join(g) for g in groups), flush=True)
        same = ([f"--{size_name}"] if size_name != "default" else []) + (["--out", args.out] if args.out else []) \
            + (["--fresh"] if args.fresh else []) \
            + (["--checkpoint_dir", args.checkpoint_dir] if args.checkpoint_dir is not None else [])
        _run_in_processes(groups, same)
        processes = len(groups)
        for k in todo:
            module, config, _, _, folder = plan[k]
            previous[k] = _previous(folder, config)
            side_by_side.add(k)
    # SIGTERM/SIGINT: a clean exit 143/130, resumable (#22); unusable checkpoints: a message, exit 1
    # a folder another run holds: one line naming its process, exit 1 (#32)
    who = "reproduce" if args.process is None else f"reproduce (process {args.process})"
    with common.folder_in_use_ends_the_run("reproduce"), common.unusable_checkpoints_end_the_run("reproduce"), \
            checkpoints.stop_signals("reproduce"):
        for k, (module, config, label, missing, folder) in enumerate(plan):
            name = module.NAME
            results = previous[k]  # finished with this config: not run again (#22)
            if results is None:
                print(f"{who}: [{k + 1}/{len(plan)}] running {name} ({label}); "
                      f"{_whereabouts(start, expected, k, ran)}", flush=True)
                results = common.run_experiment(module, config, folder, _checkpoint_arg(args.checkpoint_dir, name),
                                                args.fresh)
                ran.append(results["seconds"])
                common.release_memory()  # the next experiment starts from a small heap, not on this one's
            elif k not in side_by_side:
                print(f"{who}: [{k + 1}/{len(plan)}] {name} finished earlier with this config: reusing "
                      f"{folder / 'results.json'} (--fresh runs it again)", flush=True)
                reused.append(name)
            experiment_seconds += results["seconds"]
            sections.append(report_section(module, results, folder, out, missing, quick))
            rows += claim_rows(module, results)
            marks += quick_marks(module, claim_rows(module, results)) if quick else []
    header = [
        "# resjax reproduction report", "",
        f"Size: `{size_name}`. The experiments took {experiment_seconds:.0f} s in all"
        + (f" ({len(side_by_side)} of them side by side in {processes} processes)" if side_by_side else "")
        + "; this run took "
        f"{time.time() - start:.0f} s" + (f", reusing the results of {len(reused)} of them" if reused else "")
        + f". Generated by `python -m experiments.reproduce{'' if size_name == 'default' else ' --' + size_name}`.",
        "",
        f"Machine: {machine()}.",
        "",
        *front_matter(rows, len(sections), quick, marks),
    ]
    path = out / f"REPORT{suffix}.md"
    if common.is_main() and not args.no_report:
        # whole or not at all, and a stop signal waits for the write to end (#54): never a truncated report
        with common.folder_in_use_ends_the_run("reproduce"), checkpoints.stop_signals("reproduce"), \
                checkpoints.signals_deferred():
            common.write_atomically(path, lambda tmp: tmp.write_text("\n".join(header + sections)))
        print(f"reproduce: wrote {path}")
    return path


if __name__ == "__main__":
    main()
