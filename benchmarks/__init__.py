"""Benchmarks of resjax: training throughput, seed-vmap speed-up and compile time (``python -m benchmarks.throughput``).

Importing this package changes nothing in the process; each benchmark's ``main`` first makes every CPU core
a JAX device (``resjax.use_every_cpu_core``), as the experiments run.
"""

from __future__ import annotations

import json
import pathlib
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
