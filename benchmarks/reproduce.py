"""Wall time and peak resident memory of each experiment of ``experiments.reproduce``, each in its own process.

Run from the project root::

    python -m benchmarks.reproduce [--size quick|default] [--only a,b] [--skip a,b] [--out DIR] [--whole]
                                   [--json PATH]

What is measured. Each experiment runs as ``python -m experiments.reproduce --only NAME --out DIR --fresh``
(with ``--quick`` for ``--size quick``): exactly what reproduce runs for it (its config, its checkpoints, a
synthetic stand-in for a data set that is not prepared), in a child process of its own. For each child the table
shows its wall seconds (from start to exit, so the interpreter's start, imports and compilation are in it; the
compilation cache is as the environment leaves it) and its peak resident memory: ``ru_maxrss`` of the child from
``os.wait4`` (the largest resident set the child, or any of its descendants it waited for, reached; KiB on Linux).
The totals are the sum of the times and the largest peak.

``--whole`` measures instead the one process users run, ``python -m experiments.reproduce`` with every
experiment asked for (the default: all of reproduce's list) in one process, as one row: its peak is the
largest resident set of the whole run, whatever experiment or accumulation across experiments set it.

Times depend on the machine and its load; memory barely does. Nothing is asserted. ``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from experiments.reproduce import REGISTRY


def measure(names: list[str], size: str, out: pathlib.Path) -> dict:
    """Run ``experiments.reproduce`` for ``names`` in one child process; ``{seconds, peak_rss_mb, status}``."""
    cmd = [sys.executable, "-m", "experiments.reproduce", "--only", *names, "--out", str(out), "--fresh"]
    if size == "quick":
        cmd.append("--quick")
    log = out / f"{'+'.join(names) if len(names) < 4 else 'reproduce'}.log"
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log, "w") as sink:
        child = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)  # so Popen does not wait for it again
    return {"seconds": seconds, "peak_rss_mb": usage.ru_maxrss / 1024, "status": child.returncode, "log": str(log)}


def table(rows: list[tuple[str, dict]]) -> str:
    lines = [f"{'experiment':<24} {'seconds':>9} {'peak RSS MB':>12} {'exit':>5}"]
    for name, r in rows:
        lines.append(f"{name:<24} {r['seconds']:>9.1f} {r['peak_rss_mb']:>12.0f} {r['status']:>5}")
    if len(rows) > 1:
        lines.append(f"{'total (sum / max)':<24} {sum(r['seconds'] for _, r in rows):>9.1f} "
                     f"{max(r['peak_rss_mb'] for _, r in rows):>12.0f}")
    return "\n".join(lines)


def main(argv=None) -> list[tuple[str, dict]]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.reproduce", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=("quick", "default"), default="default")
    parser.add_argument("--only", default="", help="comma-separated experiments (default: all of reproduce's)")
    parser.add_argument("--skip", default="", help="comma-separated experiments left out")
    parser.add_argument("--out", default=None, help="folder for the runs' results (default: a temporary folder)")
    parser.add_argument("--whole", action="store_true",
                        help="one row: every experiment in one experiments.reproduce process, as users run it")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    names = [n for n in (args.only.split(",") if args.only else REGISTRY) if n]
    unknown = [n for n in names + args.skip.split(",") if n and n not in REGISTRY]
    if unknown:
        parser.error(f"unknown experiments {unknown}; known: {', '.join(REGISTRY)}")
    names = [n for n in names if n not in args.skip.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-reproduce-") as tmp:
        out = pathlib.Path(args.out or tmp)
        rows = []
        if args.whole:
            rows.append(("reproduce (one process)", measure(names, args.size, out)))
            print(table(rows), flush=True)
        else:
            for name in names:
                rows.append((name, measure([name], args.size, out)))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
            print(table(rows))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"size": args.size, "rows": dict(rows)}, indent=1))
    return rows


if __name__ == "__main__":
    main()
