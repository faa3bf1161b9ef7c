"""The FLOP ledger of ``experiments.reproduce``: for each experiment, run in its own process, the dense FLOPs it
computes, its wall and compile seconds, the fraction of this machine's matmul peak it reaches and its peak memory.

Run from the project root::

    python -m benchmarks.reproduce [--size quick|default] [--only a,b] [--skip a,b] [--out DIR] [--whole]
                                   [--json PATH] [--peak quick|default] [--no-flops]

What is measured. Each experiment runs as ``python -m benchmarks.flops LEDGER --only NAME --out DIR --fresh``
(with ``--quick`` for ``--size quick``): ``experiments.reproduce.main`` with those arguments, exactly what
reproduce runs for it (its config, its checkpoints, a synthetic stand-in for a data set that is not prepared),
in a child process of its own, with a FLOP counter installed (``--no-flops``: ``python -m experiments.reproduce``
itself, without the counter; the FLOP columns are then empty). For each child the table shows:

- GFLOP: the dense FLOPs of every XLA program the child executed, counted from the compiled programs
  (``benchmarks.flops``): ``2 m n k`` for every ``dot`` (matmul), ``2 x output elements x kernel elements /
  output features`` for every ``convolution``, a loop's body times its trip count (read when the program runs
  when it is an argument), times the devices the program ran on; elementwise operations, reductions,
  normalisation, random numbers and the optimiser are not counted, so this understates the arithmetic done.
  Not XLA's ``cost_analysis()``, which on XLA:CPU counts a ``lax.scan``/``fori_loop`` body once whatever its
  trip count.
- seconds: the child's wall time, from start to exit (the interpreter's start, imports and compilation are in
  it; the compilation cache is as the environment leaves it).
- compile s: the seconds XLA spent compiling programs (or loading them from the persistent compilation cache),
  JAX's ``/jax/core/compile/backend_compile_duration`` events; tracing and lowering are in the JSON beside it.
- GFLOP/s and of peak: GFLOP / seconds, and that as a fraction of the matmul peak, the largest rate of a jitted
  square float32 matmul (``benchmarks.throughput.matmul_peak``: n in 512, 1024, 2048; ``--peak quick``: 256,
  512), measured once in this process before the first child starts. The seconds are wall seconds, start-up and
  compilation included, so the fraction is of the whole run, not of the time spent computing.
- peak RSS MB: ``ru_maxrss`` of the child from ``os.wait4`` (the largest resident set the child, or any of its
  descendants it waited for, reached; KiB on Linux).

The total row sums the FLOPs, seconds and compile seconds (its GFLOP/s and fraction are of those sums) and takes
the largest peak. The counter makes each call of a program with dense FLOPs pay Python dispatch (tens of
microseconds; see ``benchmarks.flops``), which is in the seconds.

``--whole`` measures instead the one process users run, every experiment asked for (the default: all of
reproduce's list) in one process, as one row: its peak is the largest resident set of the whole run, whatever
experiment or accumulation across experiments set it.

Times depend on the machine and its load; FLOPs and memory barely do. Nothing is asserted. ``--json`` writes the
rows, the peak measurement and the total, with the counter's details for each child (executions, compiles,
tracing and lowering seconds, loops whose trip count could not be read, the programs with the most FLOPs).
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

FLOPS_NOTE = ("GFLOP: dense FLOPs of the XLA programs run (2mnk per dot, 2 x out x kernel / out-features per "
              "convolution, loops x trip count; elementwise ops not counted); seconds: wall, start-up and "
              "compilation included; of peak: GFLOP/s / matmul peak")


def measure(names: list[str], size: str, out: pathlib.Path, flops: bool = True) -> dict:
    """Run ``experiments.reproduce`` for ``names`` in one child process (with the FLOP counter unless ``flops`` is
    false); ``{seconds, peak_rss_mb, status, log, flops, compile_s, ledger}`` (``flops``, ``compile_s`` and
    ``ledger`` None without the counter or when the child wrote no ledger)."""
    stem = "+".join(names) if len(names) < 4 else "reproduce"
    ledger = out / f"{stem}.flops.json"
    runner = ["benchmarks.flops", str(ledger)] if flops else ["experiments.reproduce"]
    cmd = [sys.executable, "-m", *runner, "--only", *names, "--out", str(out), "--fresh"]
    if size == "quick":
        cmd.append("--quick")
    log = out / f"{stem}.log"
    out.mkdir(parents=True, exist_ok=True)
    ledger.unlink(missing_ok=True)
    start = time.perf_counter()
    with open(log, "w") as sink:
        child = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)  # so Popen does not wait for it again
    counted = json.loads(ledger.read_text()) if flops and ledger.exists() else None
    return {"seconds": seconds, "peak_rss_mb": usage.ru_maxrss / 1024, "status": child.returncode, "log": str(log),
            "flops": None if counted is None else counted["flops"],
            "compile_s": None if counted is None else counted["compile_s"], "ledger": counted}


def rates(row: dict, peak_gflops: float | None) -> dict:
    """``row`` with ``gflop``, ``gflops`` (GFLOP per wall second) and ``of_peak`` (None where unknown)."""
    gflop = None if row.get("flops") is None else row["flops"] / 1e9
    gflops = None if gflop is None or not row["seconds"] > 0 else gflop / row["seconds"]
    of_peak = None if gflops is None or not peak_gflops else gflops / peak_gflops
    return {**row, "gflop": gflop, "gflops": gflops, "of_peak": of_peak}


def total(rows: list[tuple[str, dict]], peak_gflops: float | None) -> dict:
    """The sums of the rows' FLOPs, seconds and compile seconds (None when a row lacks it), the largest peak."""
    def sum_of(key):
        values = [r[key] for _, r in rows]
        return None if any(v is None for v in values) else sum(values)

    return rates({"flops": sum_of("flops"), "seconds": sum_of("seconds"), "compile_s": sum_of("compile_s"),
                  "peak_rss_mb": max(r["peak_rss_mb"] for _, r in rows),
                  "status": max((r["status"] for _, r in rows), key=abs)}, peak_gflops)


def _cell(value, spec: str, width: int) -> str:
    if value is None:
        return f"{'-':>{width}}"
    if spec == "%":  # a fraction as a percentage, three significant digits however small
        return f"{f'{100 * value:.3g}%':>{width}}"
    return f"{value:>{width}{spec}}"


COLUMNS = (("GFLOP", "gflop", ".4g", 10), ("seconds", "seconds", ".1f", 9), ("compile s", "compile_s", ".1f", 10),
           ("GFLOP/s", "gflops", ".4g", 9), ("of peak", "of_peak", "%", 9), ("peak RSS MB", "peak_rss_mb", ".0f", 12),
           ("exit", "status", "", 5))


def row_line(name: str, row: dict) -> str:
    return f"{name:<24}" + "".join(" " + _cell(row.get(key), spec, width) for _, key, spec, width in COLUMNS)


def header(peak_gflops: float | None) -> list[str]:
    peak = "not measured" if peak_gflops is None else f"{peak_gflops:.4g} GFLOP/s"
    return [f"{FLOPS_NOTE} ({peak}).",
            f"{'experiment':<24}" + "".join(f" {title:>{width}}" for title, _, _, width in COLUMNS)]


def table(rows: list[tuple[str, dict]], peak_gflops: float | None = None) -> str:
    """The ledger: a line saying how FLOPs are counted, the column names, a row per experiment and a total row
    (sums; its rate and fraction of the sums; the largest peak memory)."""
    lines = header(peak_gflops) + [row_line(name, rates(r, peak_gflops)) for name, r in rows]
    if len(rows) > 1:
        lines.append(row_line("total (sum / max)", total(rows, peak_gflops)))
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
    parser.add_argument("--peak", choices=("quick", "default"), default="default",
                        help="matmul sizes of the peak measurement (quick: 256 and 512; default: 512 to 2048)")
    parser.add_argument("--no-flops", dest="flops", action="store_false",
                        help="run experiments.reproduce without the FLOP counter (and measure no peak)")
    args = parser.parse_args(argv)
    names = [n for n in (args.only.split(",") if args.only else REGISTRY) if n]
    unknown = [n for n in names + args.skip.split(",") if n and n not in REGISTRY]
    if unknown:
        parser.error(f"unknown experiments {unknown}; known: {', '.join(REGISTRY)}")
    names = [n for n in names if n not in args.skip.split(",")]
    peak = measure_peak(args.peak) if args.flops else None
    peak_gflops = None if peak is None else peak["peak_gflops"]
    with tempfile.TemporaryDirectory(prefix="bench-reproduce-") as tmp:
        out = pathlib.Path(args.out or tmp)
        rows = []
        if args.whole:
            rows.append(("reproduce (one process)", measure(names, args.size, out, args.flops)))
        else:
            print("\n".join(header(peak_gflops)), flush=True)
            for name in names:
                rows.append((name, measure([name], args.size, out, args.flops)))
                print(row_line(name, rates(rows[-1][1], peak_gflops)), flush=True)
            print()
        print(table(rows, peak_gflops), flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(
            {"size": args.size, "flops_counted": FLOPS_NOTE, "peak": peak,
             "rows": {name: rates(r, peak_gflops) for name, r in rows}, "total": total(rows, peak_gflops)},
            indent=1))
    return [(name, rates(r, peak_gflops)) for name, r in rows]


def measure_peak(size: str) -> dict:
    """``benchmarks.throughput.matmul_peak`` at its ``size`` settings, in this process (every CPU core a device, as
    the experiments run)."""
    import resjax

    resjax.use_every_cpu_core()
    from benchmarks import throughput

    settings = throughput.SETTINGS[size]
    return throughput.matmul_peak(settings["matmul_sizes"], settings["matmul_repeats"])


if __name__ == "__main__":
    main()
