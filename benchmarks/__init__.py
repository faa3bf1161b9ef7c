"""Benchmarks of resjax: training throughput, seed-vmap speed-up and compile time (``python -m benchmarks.throughput``).

Importing this package changes nothing in the process; each benchmark's ``main`` first makes every CPU core
a JAX device (``resjax.use_every_cpu_core``), as the experiments run.
"""

from __future__ import annotations

import json
import pathlib
import argparse
import time
from collections.abc import Callable


def run_and_write(run: Callable[[], dict], report: Callable[[dict], None], out: str) -> dict:
    """The end every benchmark's ``main`` shares: ``run()`` timed (``wall_s``), ``report`` printed, the
    results written as JSON to ``out`` (folders made); returns the results."""
    start = time.perf_counter()
    res = run()
    res["wall_s"] = time.perf_counter() - start
    report(res)
    path = pathlib.Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))
    print(f"\nbenchmark took {res['wall_s']:.0f} s; wrote {path}")
    return res


def print_table(title: str, header: list[str], rows: list[list]) -> None:
    """``rows`` under ``title`` as a text table: the first column left-aligned, the others right-aligned."""
    cells = [[str(c) for c in row] for row in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def line(r):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    print(f"\n{title}")
    print(line(cells[0]))
    print("  ".join("-" * w for w in widths))
    for r in cells[1:]:
        print(line(r))


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value
