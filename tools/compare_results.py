"""Compare two result folders (``experiments.reproduce --out A`` and ``--out B``) metric by metric.

    python tools/compare_results.py BEFORE AFTER [--rtol 0] [--rename OLD=NEW ...] [--ignore PATTERN ...]

For every experiment present in either folder it reads ``<name>/results.json`` (or, for a folder that is itself a
run, i.e. holds ``results.json``, that run under its experiment's name) and compares the
``metrics``: numbers and (nested) lists of numbers element by element (``None``, i.e. NaN or a missing
value, equals ``None``), strings by equality. It prints every metric that differs (its largest absolute and
relative difference), every metric present on one side only, and per experiment a one-line summary; a
renamed metric is compared under its new name when ``--rename OLD=NEW`` says so, and the mapping is printed.
``--ignore`` skips metrics whose name contains the pattern (timings: ``seconds`` is ignored by default).
Exit status 0 when nothing differs beyond ``--rtol``, 1 when something differs (a metric, an experiment or a metric
on one side only), 2 when there is nothing to compare (a folder that does not exist, or two folders without any
results). The settings (``config``) are not compared: a refactor may reshape them. To compare runs made with
different settings (means and spread over seeds, the settings that differ, overlaid curves), use
``python -m experiments.compare``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from resjax.paths import as_path


def _flat(value, prefix=""):
    """(index path, leaf) pairs of a nested list."""
    if isinstance(value, list):
        for i, v in enumerate(value):
            yield from _flat(v, f"{prefix}[{i}]")
    else:
        yield prefix, value


def compare_values(a, b) -> tuple[bool, float, float, str]:
    """``(equal, max abs diff, max rel diff, note)`` of two metric values."""
    fa, fb = list(_flat(a)), list(_flat(b))
    if [p for p, _ in fa] != [p for p, _ in fb]:
        return False, math.inf, math.inf, f"shapes differ ({len(fa)} vs {len(fb)} leaves)"
    equal, worst_abs, worst_rel, note = True, 0.0, 0.0, ""
    for (path, x), (_, y) in zip(fa, fb):
        if x is None or y is None or isinstance(x, str) or isinstance(y, str) or isinstance(x, bool):
            if x != y:
                equal, note = False, f"{path or 'value'}: {x!r} vs {y!r}"
                worst_abs = worst_rel = math.inf
            continue
        if x == y or (isinstance(x, float) and isinstance(y, float) and math.isinf(x) and x == y):
            continue
        d = abs(x - y)
        equal = False
        worst_abs = max(worst_abs, d)
        worst_rel = max(worst_rel, d / max(abs(x), abs(y), 1e-300))
    return equal, worst_abs, worst_rel, note


def load(folder) -> dict:
    """``{experiment: metrics}`` of the runs in ``folder`` (``<name>/results.json``), or of the run ``folder`` is
    (it holds ``results.json`` itself: keyed by its experiment)."""
    folder = as_path(folder, "folder")  # a local folder or a bucket URL (resjax.paths)
    if (folder / "results.json").is_file():
        results = json.loads((folder / "results.json").read_text())
        return {results.get("experiment", folder.name): results["metrics"]}
    out = {}
    for f in sorted(folder.glob("*/results.json")):
        out[f.parent.name] = json.loads(f.read_text())["metrics"]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", help="a folder of runs or one run's folder: a local path or a bucket URL")
    parser.add_argument("after", help="the same, to compare with")
    parser.add_argument("--rtol", type=float, default=0.0, help="relative difference still counted as equal")
    parser.add_argument("--rename", nargs="*", default=[], metavar="OLD=NEW", help="metric renamed between the two")
    parser.add_argument("--ignore", nargs="*", default=["seconds"], metavar="PATTERN")
    args = parser.parse_args(argv)
    renames = dict(r.split("=", 1) for r in args.rename)
    for old, new in renames.items():
        print(f"mapping: {old} -> {new}")
    for folder in (args.before, args.after):
        if not as_path(folder, "folder").is_dir():
            print(f"compare_results: {folder} is not a folder; nothing to compare", file=sys.stderr)
            return 2
    before, after = load(args.before), load(args.after)
    if not before and not after:
        print(f"compare_results: nothing to compare: neither {args.before} nor {args.after} holds results.json or "
              "<experiment>/results.json", file=sys.stderr)
        return 2
    failed = False
    for name in sorted(set(before) | set(after)):
        if name not in before or name not in after:
            print(f"{name}: only in {'after' if name in after else 'before'}")
            failed = True
            continue
        a = {renames.get(k, k): v for k, v in before[name].items()}
        b = after[name]
        keys = sorted(k for k in set(a) | set(b) if not any(p in k for p in args.ignore))
        same = exact = 0
        for k in keys:
            if k not in a or k not in b:
                print(f"  {name}: {k} only in {'after' if k in b else 'before'}")
                failed = True
                continue
            equal, d_abs, d_rel, note = compare_values(a[k], b[k])
            if equal:
                exact += 1
                same += 1
            elif d_rel <= args.rtol:
                same += 1
                print(f"  {name}: {k} within rtol: max abs {d_abs:.3g}, max rel {d_rel:.3g}")
            else:
                failed = True
                print(f"  {name}: {k} DIFFERS: max abs {d_abs:.3g}, max rel {d_rel:.3g} {note}")
        print(f"{name}: {exact} of {len(keys)} metrics bit-identical, {same} within rtol {args.rtol:g}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
