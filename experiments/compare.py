"""Compare runs of one experiment: each metric's mean and spread over seeds side by side, the settings that
differ, and every curve overlaid in one figure.

    python -m experiments.compare RUN_A RUN_B [RUN ...] [--out compare.png] [--metrics TEXT ...] [--curves TEXT ...]

A run is a folder that an experiment wrote (``python -m experiments.<name> --out RUN``): it holds
``results.json`` = ``{"experiment", "config", "metrics", "seconds"}``. Every run must be of the same experiment.

What it prints: the runs (label = the folder's name; "ran N s in all" is ``results.json``'s ``seconds``, the whole
run's time, every session of a resumed run counted), the settings that differ between them (every flattened
``config`` entry, ``--train.learning_rate`` style), and a table with one row per metric that is a number or a list
of numbers (a list over seeds, usually): per run ``mean +- std (n)``, the standard deviation over the list's
entries (``ddof=1``; ``n/a`` for one entry) and the count of numbers; ``null`` entries (a run that never
diverged, a value that was not finite) are counted apart, ``k null``. With two runs a last column gives the
difference of the means (second minus first). Nested lists that are not curves are left out of the table.

What it draws: every metric named ``curves.*`` (a list per seed of values per epoch, or one list) in a panel of
its own, the runs overlaid in one colour each: the mean over seeds solid, the range over seeds shaded; each y axis
labelled with the quantity and its unit (``y_label``). The legend lists every run, also runs that share no curve
(runs of different cells), each with its value of every setting that differs. The figure is written to
``--out`` (default ``compare.png`` in the working directory). ``--metrics`` / ``--curves`` keep only the metrics /
curves whose names contain one of the given texts.

Exit status: 0 when the comparison was made; 2 (with the reason) for a folder that is not a run (no
``results.json``, or one without ``experiment``, ``config`` and ``metrics``), runs of different experiments, or
fewer than two runs. ``tools/compare_results.py`` is the other tool: it checks that two sets of results are equal
metric by metric (the refactor guard).
"""

from __future__ import annotations

import json
import math
import pathlib
import re
import sys
import warnings
from collections.abc import Sequence

import numpy as np

from experiments import common
from resjax.paths import as_path, is_url

__all__ = ["load_run", "differing_settings", "summarise", "metric_table", "y_label", "run_label", "plot_curves", "main"]


class NotARun(ValueError):
    """A folder that is not a run of an experiment (the message says why)."""


def load_run(folder) -> dict:
    """The ``results.json`` of the run in ``folder``; :class:`NotARun` saying why when it is not a run."""
    folder = as_path(folder, "run")  # a local folder or a bucket URL
    path = folder / "results.json"
    if not folder.exists():
        raise NotARun(f"{folder}: no such folder")
    if not folder.is_dir():
        raise NotARun(f"{folder}: not a folder (give the run's folder, the one holding results.json)")
    if not path.is_file():
        inner = sorted(p.parent.name for p in folder.glob("*/results.json"))
        hint = (f"; it holds the runs {', '.join(inner[:6])}{' ...' if len(inner) > 6 else ''}: give those folders"
                if inner else "; a run's folder is the --out of python -m experiments.<name>")
        raise NotARun(f"{folder}: not a run (no results.json){hint}")
    try:
        results = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise NotARun(f"{path}: unreadable ({type(err).__name__}: {err})") from None
    missing = [k for k in ("experiment", "config", "metrics") if not isinstance(results, dict) or k not in results]
    if missing:
        raise NotARun(f"{path}: not an experiment's results (no {', '.join(missing)})")
    return results


def _labels(folders: Sequence[pathlib.Path]) -> list[str]:
    """Short unique names for the runs: the folders' names, with as many parent folders as it takes."""
    parts = [tuple(str(f).rstrip("/").split("/")) if is_url(f) else pathlib.Path(f).resolve().parts for f in folders]
    for k in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-k:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [f"run {i + 1}" for i in range(len(folders))]


def differing_settings(configs: Sequence[dict]) -> dict[str, list]:
    """``{setting: [value in each run]}`` for every flattened setting whose value is not the same in every run (a
    setting one run lacks is ``None`` there)."""
    import ml_collections

    flat = [common.flatten(ml_collections.ConfigDict(c)) for c in configs]
    names = list(dict.fromkeys(k for f in flat for k in f))
    out = {}
    for name in names:
        values = [f.get(name) for f in flat]
        if any(common.to_jsonable(v) != common.to_jsonable(values[0]) for v in values[1:]):
            out[name] = values
    return out


def _numbers(value) -> tuple[list[float], int] | None:
    """``(numbers, nulls)`` of a metric that is a number or a flat list of numbers / nulls; None otherwise."""
    items = value if isinstance(value, list) else [value]
    if any(isinstance(v, (list, dict, str)) for v in items):
        return None
    numbers = [float(v) for v in items if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
    nulls = sum(1 for v in items if v is None or (isinstance(v, float) and not math.isfinite(v)))
    if len(numbers) + nulls != len(items) and not all(isinstance(v, bool) for v in items):
        return None
    numbers += [float(v) for v in items if isinstance(v, bool)]
    return numbers, nulls


def summarise(value) -> dict | None:
    """``{'mean', 'std', 'n', 'nulls'}`` of a number or a list of numbers (``std``: ``ddof=1``, None for n < 2);
    None for anything else (curves, nested lists, text)."""
    parsed = _numbers(value)
    if parsed is None:
        return None
    numbers, nulls = parsed
    n = len(numbers)
    return {"mean": float(np.mean(numbers)) if n else None, "std": float(np.std(numbers, ddof=1)) if n > 1 else None,
            "n": n, "nulls": nulls}


def _fmt(x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x:.4g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.3e}"


def _cell(s: dict | None) -> str:
    if s is None:
        return "-"
    null = f", {s['nulls']} null" if s["nulls"] else ""
    if s["n"] == 0:
        return f"all null ({s['nulls']})" if s["nulls"] else "(empty)"
    if s["n"] == 1:
        return f"{_fmt(s['mean'])} (n=1{null})"
    return f"{_fmt(s['mean'])} +- {_fmt(s['std'])} (n={s['n']}{null})"


def metric_table(metrics: Sequence[dict], labels: Sequence[str], keep: Sequence[str] = ()) -> list[list[str]]:
    """Rows ``[metric, cell per run (, difference)]`` for every metric that is a number or a list of numbers in
    some run (``curves.*`` left out), in the first run's order; ``keep``: only names containing one of these."""
    names = list(dict.fromkeys(k for m in metrics for k in m))
    rows = [["metric", *labels] + (["second - first (means)"] if len(labels) == 2 else [])]
    for name in names:
        if name.startswith("curves.") or (keep and not any(t in name for t in keep)):
            continue
        stats = [summarise(m[name]) if name in m else None for m in metrics]
        if all(s is None for s in stats):
            continue
        row = [name, *(_cell(s) for s in stats)]
        if len(labels) == 2:
            a, b = (s["mean"] if s else None for s in stats)
            row.append(_fmt(b - a) if a is not None and b is not None else "-")
        rows.append(row)
    return rows


def _print_table(rows: list[list[str]], out=None) -> None:
    out = out or sys.stdout
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for k, row in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip(), file=out)
        if k == 0:
            print("  ".join("-" * w for w in widths), file=out)


def _curve(value) -> np.ndarray | None:
    """A ``curves.*`` metric as a (runs, points) float array (one list: one run); None if it is not one."""
    try:
        a = np.array([[np.nan if v is None else v for v in r] for r in value] if value and isinstance(value[0], list)
                     else [[np.nan if v is None else v for v in value]], float)
    except (TypeError, ValueError):
        return None
    return a if a.ndim == 2 and a.size else None


def _drawable(value) -> bool:
    curve = _curve(value) if value is not None else None
    return curve is not None and bool(np.isfinite(curve).any())


#: The y axis of a curve, by the quantity its name ends with (or holds): what it is and its unit.
QUANTITIES = {"train_error_pct": "training error (%)", "test_error_pct": "test error (%)",
              "test_accuracy": "test accuracy (%)", "test_acc": "test accuracy (fraction, 0 to 1)"}
#: ``train.loss`` (``resjax.train.objective.LOSSES``) as a loss curve's unit.
LOSS_UNITS = {"cross_entropy": "cross-entropy, nats", "mse": "mean squared error, squared target units"}
_TAG = re.compile(r"(d|L|B|step|k)\d+")  # a depth, batch or step tag in a curve's name: not its quantity


def y_label(name: str, configs: Sequence[dict] = ()) -> str:
    """The y-axis label of the curve ``name`` (``curves.plain_d8.train_error_pct``), with its unit: a known quantity
    (``QUANTITIES``; ``train_loss``/``test_loss`` in the unit of the runs' ``train.loss``), a ``log10_*`` quantity in
    decades, a ``*_pct`` one in %; any other, the quantity's name as the results give it."""
    parts = [p for p in name.split(".")[1:] if not _TAG.fullmatch(p)]
    for part in reversed(parts):
        if part in QUANTITIES:
            return QUANTITIES[part]
        if part in ("train_loss", "test_loss"):
            losses = {str((c.get("train") or {}).get("loss", "cross_entropy")) for c in configs
                      if isinstance(c, dict)} or {"cross_entropy"}
            unit = LOSS_UNITS.get(losses.pop()) if len(losses) == 1 else None
            return f"{'training' if part == 'train_loss' else 'test'} loss" + (f" ({unit})" if unit else
                                                                              " (each run's train.loss)")
    quantity = next((p for p in parts if "log10" in p or p.endswith("_pct")), parts[-1] if parts else name)
    if "log10" in quantity:
        return f"{quantity.replace('_', ' ')} (decades)"
    if quantity.endswith("_pct"):
        return f"{quantity[:-4].replace('_', ' ')} (%)"
    return f"{quantity.replace('_', ' ')} (as recorded)"


def run_label(label: str, diff: dict, i: int, width: int = 60) -> str:
    """Run ``i``'s legend label: its name and its value of every setting that differs between the runs (``diff``,
    ``differing_settings``), a long value shortened, wrapped at ``width`` characters."""
    def short(v):
        text = common.show_value(v)
        if len(text) <= 32:
            return text
        close = {"(": ")", "[": "]", "{": "}"}.get(text[0], "")  # a list shortened still reads as one
        return text[:29 - len(close)].rstrip(", ") + " ..." + close

    lines = [label + (":" if diff else "")]
    for n, (k, v) in enumerate(diff.items()):  # a setting and its value kept on one line
        item = f"{k} {short(v[i])}" + ("," if n < len(diff) - 1 else "")
        if len(lines[-1]) + 1 + len(item) > width:
            lines.append(" ")
        lines[-1] += " " + item
    return "\n".join(lines)


def plot_curves(metrics: Sequence[dict], labels: Sequence[str], path, title: str, keep: Sequence[str] = (),
                configs: Sequence[dict] = ()) -> list[str]:
    """Every ``curves.*`` metric (``keep``: names containing one of these) with a finite value in some run, in a
    panel of its own, the runs overlaid, its y axis labelled with the quantity and its unit (``y_label``; the
    runs' ``configs`` give a loss's unit); written to ``path``. The legend has every run, in its colour, also one
    whose curves are in none of the panels of another (runs of different cells share no curve); a run with
    nothing drawn says so. Returns the names drawn (none: nothing is written)."""
    names = [k for k in dict.fromkeys(k for m in metrics for k in m)
             if k.startswith("curves.") and (not keep or any(t in k for t in keep))
             and any(_drawable(m.get(k)) for m in metrics)]
    if not names:
        return []
    plt = common.pyplot()
    from matplotlib.lines import Line2D

    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    legend = [Line2D([], [], color=colours[i % len(colours)], lw=1.6) for i in range(len(metrics))]
    texts = [label if any(_drawable(m.get(k)) for k in names) else f"{label}\n  (no curve drawn: none has a finite "
             "value)" for m, label in zip(metrics, labels)]
    ncol = 1 if max(len(t) for t in "\n".join(texts).splitlines()) > 40 else min(len(texts), 4)
    rows = sum(t.count("\n") + 1 for t in texts) if ncol == 1 else -(-len(texts) // ncol)
    header = 0.5 + 0.17 * rows  # inches above the panels: the title and the legend
    ncols = min(3, len(names))
    nrows = -(-len(names) // ncols)
    height = 3.6 * nrows + header
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, height), squeeze=False)
    for ax, name in zip(axes.flat, names):
        seeds = False
        for i, (m, label) in enumerate(zip(metrics, labels)):
            runs = _curve(m[name]) if name in m else None
            if runs is None or not np.isfinite(runs).any():
                continue
            seeds = seeds or runs.shape[0] > 1
            x = np.arange(1, runs.shape[1] + 1) if runs.shape[0] > 1 else np.arange(runs.shape[1])
            colour = colours[i % len(colours)]
            with np.errstate(all="ignore"), warnings.catch_warnings():  # an epoch where every seed diverged
                warnings.simplefilter("ignore", RuntimeWarning)
                mean, lo, hi = np.nanmean(runs, 0), np.nanmin(runs, 0), np.nanmax(runs, 0)
            ax.plot(x, mean, color=colour, lw=1.6, label=label, marker="o" if len(x) < 4 else None, ms=3)
            if runs.shape[0] > 1:
                ax.fill_between(x, lo, hi, color=colour, alpha=0.15, lw=0)
        ax.set_title(name[len("curves."):], fontsize=9)
        ax.set_xlabel("epoch" if seeds else "index")
        ax.set_ylabel(y_label(name, configs), fontsize=8)
        if seeds:
            common.integer_ticks(ax)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names):]:
        ax.set_axis_off()
    fig.legend(legend, texts, loc="upper center", ncol=ncol, fontsize=8, bbox_to_anchor=(0.5, 1 - 0.4 / height))
    fig.suptitle(title, fontsize=10, y=1.0 - 0.12 / height, va="top")
    fig.tight_layout(rect=(0, 0, 1, 1 - header / height))
    from experiments.figures import write_figure

    path = as_path(path, "out")  # a local file or a bucket object
    if not is_url(path):
        path.parent.mkdir(parents=True, exist_ok=True)
    write_figure(fig, path, 100)
    plt.close(fig)
    return names


def main(argv: Sequence[str] | None = None) -> int:
    parser = common.ArgumentParser(prog="python -m experiments.compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN",
                        help="run folders of one experiment (each holds results.json; at least two)")
    parser.add_argument("--out", default="compare.png", metavar="FILE",
                        help="the overlay figure's path (default: compare.png in the working directory)")
    parser.add_argument("--metrics", nargs="*", default=[], metavar="TEXT",
                        help="table only the metrics whose names contain one of these texts (default: every one)")
    parser.add_argument("--curves", nargs="*", default=[], metavar="TEXT",
                        help="draw only the curves whose names contain one of these texts (default: every curves.* "
                             "metric)")
    args = parser.parse_args(argv)
    if len(args.runs) < 2:
        parser.error("give at least two run folders to compare")
    results = []
    for folder in args.runs:
        try:
            results.append(load_run(folder))
        except NotARun as err:
            parser.error(str(err))
    experiments = [r["experiment"] for r in results]
    if len(set(experiments)) > 1:
        parser.error("runs of different experiments cannot be compared: " + ", ".join(
            f"{f} is {e}" for f, e in zip(args.runs, experiments)))
    labels = _labels(list(args.runs))
    name = experiments[0]
    print(f"{len(results)} runs of {name}:")
    for label, folder, r in zip(labels, args.runs, results):
        seconds = r.get("seconds")
        ran = f", ran {seconds:.0f} s in all" if isinstance(seconds, (int, float)) else ""  # every session's
        print(f"  {label}: {folder}{ran}")
    diff = differing_settings([r["config"] for r in results])
    print()
    if diff:
        print("Settings that differ:")
        _print_table([["setting", *labels]] + [[k, *("(absent)" if v is None else common.show_value(v) for v in values)]
                                                for k, values in diff.items()])
    else:
        print("Settings that differ: none (the same config in every run)")
    print()
    print("Metrics: mean +- std over the list's entries (seeds, usually), n numbers; k null = entries that are null "
          "(never diverged, not finite):")
    _print_table(metric_table([r["metrics"] for r in results], labels, args.metrics))
    legend = [run_label(label, diff, i) for i, label in enumerate(labels)]  # every setting the table lists
    title = (f"{name}: {len(results)} runs; mean over seeds (line) and their range (shaded); settings that differ: "
             + (", ".join(list(diff)[:6]) + (" ..." if len(diff) > 6 else "") if diff else "none"))
    drawn = plot_curves([r["metrics"] for r in results], legend, args.out, title, args.curves,
                        [r["config"] for r in results])
    curves = [k for k in dict.fromkeys(k for r in results for k in r["metrics"]) if k.startswith("curves.")]
    empty = [k for k in curves if k not in drawn and (not args.curves or any(t in k for t in args.curves))]
    print()
    print(f"Overlaid {len(drawn)} curves in {args.out}" if drawn else "No curves.* metrics to draw; no figure written")
    if empty:
        print(f"Not drawn (no finite value in any run, e.g. diverged): {', '.join(empty)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
