"""Run every registered experiment and write ``REPORT.md``: claim, seed value, measured value, holds.

    python -m experiments.reproduce [--quick | --full] [--out DIR] [--only NAME ...] [--reuse]

Sizes: ``--quick`` (a minute or two; what the tests run), the default (every lecture-scale figure,
well under an hour on a 2-core CPU) and ``--full`` (paper-scale runs meant for an accelerator). Each
experiment writes ``DIR/<name>/results.json`` and its figure; the report, ``DIR/REPORT.md``, links them.
Without ``--out``, ``--quick`` writes ``runs/<name>-quick`` and ``runs/REPORT-quick.md`` (where
``python -m experiments.<name> --quick`` writes too), so a quick check never replaces a real run's results.

Every experiment to be run is preflighted (``experiments.common.preflight``: every cell, every setting,
the output folders) before the first one starts.

``--reuse`` takes an experiment's existing ``DIR/<name>/results.json`` instead of running it again when
its recorded config equals the config of this run (to resume an interrupted reproduction, or to
rebuild the report). ``rebuild_report(DIR)`` (``python -c "from experiments.reproduce import
rebuild_report; rebuild_report('docs/report')"``) writes ``DIR/REPORT.md`` again from the stored results
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
import pathlib
import time

from experiments import common, image_runs

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
)


PROBE_MARK = "*(threshold set after a probe)*"
LEGEND = ("'holds' is judged against the seed's claim as stated (tolerances are in each claim's text); "
          "'reported' marks numbers shown beside the seed's without a pass/fail test; 'not measured' marks "
          "claims of an experiment whose data set was not prepared (it ran on a synthetic stand-in). "
          f"{PROBE_MARK} marks a claim whose pass/fail threshold was set after a probe run of its experiment "
          "(the experiment's docstring says which run), not fixed before any run.")


def claim_text(claim: common.Claim) -> str:
    """The claim's text as the report shows it: marked when its threshold was set after a probe run."""
    return f"{claim.text} {PROBE_MARK}" if claim.probe_threshold else claim.text


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "/")


def _holds(claim: common.Claim, metrics: dict) -> tuple[str, str]:
    try:
        measured = _cell(claim.measure(metrics))
        ok = claim.holds(metrics)
    except (KeyError, ValueError, TypeError, IndexError) as err:  # a metric the run did not produce
        return f"missing ({type(err).__name__}: {err})", "no"
    return measured, {True: "yes", False: "**no**", None: "reported"}[ok]


def report_section(module, results: dict, out_dir: pathlib.Path, report_dir: pathlib.Path,
                   missing: str | None = None) -> str:
    metrics = results["metrics"]
    lines = [f"## {module.NAME}", ""]
    stand_in = image_runs.not_measured(metrics)
    if stand_in:
        lines += ["**Not measured.** This run trained on the synthetic stand-in data (`--quick`), which checks the "
                  "pipeline but measures nothing the seed claims. " + (f"The data is not prepared:\n\n```\n{missing}\n```\n\n"
                  if missing else "") + f"With the data prepared, `python -m experiments.{module.NAME}` runs the "
                  "seed's settings (an accelerator is needed for the full run).", ""]
    lines += [f"Ran in {results['seconds']:.0f} s. Config: `{results['config']}`.", "",
              "| claim | source | seed | measured | holds |", "|---|---|---|---|---|"]
    for claim in module.CLAIMS:
        measured, ok = ("not measured", "not measured") if stand_in else _holds(claim, metrics)
        lines.append(f"| {claim_text(claim)} | {claim.source} | {claim.seed_value} | {measured} | {ok} |")
    lines.append("")
    if hasattr(module, "report_section"):
        lines += [module.report_section(metrics), ""]
    figure = (out_dir / f"{module.NAME}.png").relative_to(report_dir)
    lines += [f"![{module.NAME}]({figure})", ""]
    return "\n".join(lines)


def _previous(out_dir: pathlib.Path, config) -> dict | None:
    """The results in ``out_dir`` if they were produced with exactly ``config``."""
    path = out_dir / "results.json"
    if not path.exists():
        return None
    results = json.loads(path.read_text())
    return results if results.get("config") == common.to_jsonable(config) else None


def rebuild_report(out="runs", size_name: str = "default", names=None) -> pathlib.Path:
    """Write ``DIR/REPORT.md`` again from the stored ``DIR/<name>/results.json`` without running anything
    (after a change to the claims or to the report's layout; ``--reuse`` would run again every experiment
    whose config changed since). The run line of an existing report (the size and timings of the run that
    made the results) is kept. For a stand-in run of an experiment that needs a TFDS data set, the report
    shows the command that prepares the data set as this machine sees it (``size_name``'s config)."""
    out = pathlib.Path(out)
    path = out / "REPORT.md"
    sections, seconds = [], 0.0
    for name in names or REGISTRY:
        module = importlib.import_module(f"experiments.{name}")
        results = json.loads((out / name / "results.json").read_text())
        missing = (image_runs.missing_data(module, module.get_config(size_name))
                   if hasattr(module, "required_data") and image_runs.not_measured(results["metrics"]) else None)
        seconds += results["seconds"]
        sections.append(report_section(module, results, out / name, out, missing))
    run_line = None
    if path.exists():
        run_line = next((p for p in path.read_text().split("\n\n") if p.startswith("Size: ")), None)
    if run_line is None:
        run_line = (f"Size: `{size_name}`. The experiments took {seconds:.0f} s in all. Rebuilt from their stored "
                    "results by `experiments.reproduce.rebuild_report`.")
    path.write_text("\n".join(["# resjax reproduction report", "", run_line, "", LEGEND, ""] + sections))
    return path


#: The committed report's results (default size): each experiment's time there weighs the time-left estimate.
REFERENCE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "report"


def _expected_seconds(name: str, label: str) -> float | None:
    """The experiment's time in the committed default-size report (None for other sizes or when absent)."""
    path = REFERENCE / name / "results.json"
    if label != "default" or not path.exists():
        return None
    try:
        return float(json.loads(path.read_text())["seconds"])
    except (ValueError, KeyError, TypeError):
        return None


def _whereabouts(start: float, expected: list, k: int) -> str:
    """``'12:03 elapsed, about 20:00 left'``: the time left is the reference report's times of the remaining
    experiments scaled by how this machine compares on the finished ones (by count when no times are known)."""
    from resjax.train.monitor import format_seconds

    elapsed = time.time() - start
    if k == 0:
        return f"{format_seconds(elapsed)} elapsed"
    known = [e for e in expected if e is not None]
    mean = sum(known) / len(known) if known else 1.0
    weights = [mean if e is None else e for e in expected]
    left = elapsed * sum(weights[k:]) / max(sum(weights[:k]), 1e-9)
    return f"{format_seconds(elapsed)} elapsed, about {format_seconds(left)} left"


def main(argv=None) -> pathlib.Path:
    common.start()
    parser = argparse.ArgumentParser(prog="python -m experiments.reproduce", description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small, fast versions (tests)")
    size.add_argument("--full", action="store_true", help="paper-scale runs (accelerator)")
    parser.add_argument("--out", default=None,
                        help="output folder (default: runs; with --quick each experiment's folder is <name>-quick "
                             "and the report REPORT-quick.md)")
    parser.add_argument("--only", nargs="*", choices=REGISTRY, help="run only these experiments")
    parser.add_argument("--reuse", action="store_true",
                        help="reuse DIR/<name>/results.json when its config equals this run's")
    args = parser.parse_args(argv)
    size_name = "quick" if args.quick else "full" if args.full else "default"
    out = pathlib.Path(args.out) if args.out else pathlib.Path("runs")
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
        except ValueError as err:
            parser.error(f"{name}: {' '.join(str(err).split())}")
        plan.append((module, config, label, missing, out / f"{name}{suffix}"))
    sections, experiment_seconds, reused = [], 0.0, []
    expected = [_expected_seconds(module.NAME, label) for module, _, label, _, _ in plan]
    for k, (module, config, label, missing, folder) in enumerate(plan):
        name = module.NAME
        results = _previous(folder, config) if args.reuse else None
        if results is None:
            print(f"reproduce: [{k + 1}/{len(plan)}] running {name} ({label}); {_whereabouts(start, expected, k)}",
                  flush=True)
            results = common.run_experiment(module, config, folder)
        else:
            print(f"reproduce: reusing {folder / 'results.json'}", flush=True)
            reused.append(name)
        experiment_seconds += results["seconds"]
        sections.append(report_section(module, results, folder, out, missing))
    header = [
        "# resjax reproduction report", "",
        f"Size: `{size_name}`. The experiments took {experiment_seconds:.0f} s in all; this run took "
        f"{time.time() - start:.0f} s" + (f", reusing the results of {len(reused)} of them" if reused else "")
        + f". Generated by `python -m experiments.reproduce{'' if size_name == 'default' else ' --' + size_name}`.",
        "",
        LEGEND, "",
    ]
    path = out / f"REPORT{suffix}.md"
    if common.is_main():
        path.write_text("\n".join(header + sections))
        print(f"reproduce: wrote {path}")
    return path


if __name__ == "__main__":
    main()
