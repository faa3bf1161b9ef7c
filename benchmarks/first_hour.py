"""What a new user's commands cost on this machine: the README's two commands and the documentation site, timed
as a user runs them, in one table.

Run from the project root, in the virtual environment the README makes::

    python -m benchmarks.first_hour [--only install,install_unbounded,quick,tests,docs,reproduce] [--json PATH]
                                    [--keep-others]

Each step runs as a child process of its own, from an empty compilation cache (``RESJAX_COMPILATION_CACHE`` set to
a new temporary folder, so nothing compiled by an earlier run is reused) and writing into a temporary folder:

- ``install``: a new virtual environment and ``pip install -e '.[test]' -c constraints.txt`` into it, as the
  README's first line does, with an empty pip cache (its time is mostly the package index's downloads, so it
  depends on the network); ``install_unbounded``: the same without the constraints file (issue #62: the resolver's
  backtracking through boto3's releases, which the file's bounds spare);
- ``quick``: ``python -m experiments.reproduce --quick``, the pipeline check of every experiment at small sizes;
- ``tests``: ``python -m pytest -q tests``, the README's test command (the suite on every core);
- ``docs``: ``python -m sphinx -W --keep-going -b html docs OUT``, the site with its tutorials executed;
- ``reproduce``: ``python -m experiments.reproduce``, every experiment at its default (lecture) size.

The default is ``quick,tests,docs``: the full reproduction takes 20 to 35 minutes on a 2-core CPU, so without
``reproduce`` among the steps its row is read from the committed report instead (``docs/report/REPORT.md``'s
"this run took N s", a default run of ``experiments.reproduce``), and the table says so.

For every step the table gives its wall seconds, the CPU seconds of the child and everything it waited for
(``os.wait4``), and the largest resident set. The first line names the machine (the processor, its instruction-set
extensions, the cores, JAX's devices and versions) and the float32 matmul peak measured in this process, so a
reader can scale the numbers to their own machine. ``--keep-others`` adds the steps timed now to the rows
of an earlier run on the same machine (``--json``), so that one table can hold steps timed at different
sittings; the first line then says which rows are kept. Each step's whole output is kept in
``runs/benchmarks/first_hour-<step>.log``, and a reproduction's report in ``first_hour-<step>-REPORT.md``.
Nothing is asserted. The page ``docs/benchmarks.md`` holds this table as printed; every timing the README and
Getting started mention comes from it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: Where each step's whole output is kept.
LOGS = ROOT / "runs" / "benchmarks"

#: The install steps: a new virtual environment in the step's folder, and the README's ``pip install -e '.[test]'
#: -c constraints.txt`` into it with an empty cache (``--no-cache-dir``: every package downloaded, as on a new
#: machine); the arguments after the folder are added to pip's.
INSTALL = ("import subprocess, sys, venv\n"
           "venv.create(sys.argv[1], with_pip=True)\n"
           "sys.exit(subprocess.call([sys.argv[1] + '/bin/python', '-m', 'pip', 'install', '-q', '--no-cache-dir', "
           "'-e', '.[test]', *sys.argv[2:]]))")

#: step name -> (what it does, the command's arguments after ``python``; ``{out}`` is the step's temporary folder)
STEPS = {
    "install": ("a new virtual environment with resjax and its test extra (downloads included, an empty pip cache)",
                ["-c", INSTALL, "{out}", "-c", "constraints.txt"]),
    "install_unbounded": ("the same without `constraints.txt`: pip's resolver tries boto3's releases one by one",
                          ["-c", INSTALL, "{out}"]),
    "quick": ("every experiment at small sizes (a pipeline check)",
              ["-m", "experiments.reproduce", "--quick", "--out", "{out}"]),
    "tests": ("the test suite, on every core", ["-m", "pytest", "-q", "tests", "-p", "no:cacheprovider"]),
    "docs": ("the documentation site, tutorials executed",
             ["-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", "docs", "{out}"]),
    "reproduce": ("every experiment at its default size", ["-m", "experiments.reproduce", "--out", "{out}"]),
}

#: The command a user types for each step (the table's first column).
SHOWN = {"install": "python3.11 -m venv .venv && pip install -e '.[test]' -c constraints.txt",
         "install_unbounded": "python3.11 -m venv .venv && pip install -e '.[test]'",
         "quick": "python -m experiments.reproduce --quick", "tests": "python -m pytest -q tests",
         "docs": "python -m sphinx -W --keep-going -b html docs docs/_build/html",
         "reproduce": "python -m experiments.reproduce"}


def run_step(name: str) -> dict:
    """Runs one step in a child process from an empty compilation cache; its wall and CPU seconds, peak memory,
    exit status and the last lines of its output."""
    with tempfile.TemporaryDirectory(prefix=f"first_hour_{name}_") as tmp:
        out = os.path.join(tmp, "out")
        env = dict(os.environ, RESJAX_COMPILATION_CACHE=os.path.join(tmp, "jax_cache"))
        args = [sys.executable] + [a.format(out=out) for a in STEPS[name][1]]
        log = os.path.join(tmp, "log")
        start = time.perf_counter()
        with open(log, "w") as f:
            process = subprocess.Popen(args, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - start
        kept = LOGS / f"first_hour-{name}.log"  # the whole output, for a step that failed
        kept.parent.mkdir(parents=True, exist_ok=True)
        with open(log) as f:
            text = f.read()
        kept.write_text(text)
        if os.path.isfile(os.path.join(out, "REPORT.md")):  # a reproduction's report: its verdicts, kept too
            (LOGS / f"first_hour-{name}-REPORT.md").write_bytes(pathlib.Path(out, "REPORT.md").read_bytes())
        tail = text[-2000:]
    return {"step": name, "command": SHOWN[name], "seconds": seconds,
            "cpu_seconds": usage.ru_utime + usage.ru_stime, "peak_rss_mb": usage.ru_maxrss / 1024,
            "returncode": os.waitstatus_to_exitcode(status), "tail": tail}


def from_report(path: pathlib.Path = ROOT / "docs" / "report" / "REPORT.md") -> dict | None:
    """The committed report's own time: a default ``experiments.reproduce`` run, read from its header."""
    try:
        text = path.read_text()
    except OSError:
        return None
    found = re.search(r"this run took (\d+) s", text)
    if not found:
        return None
    machine = re.search(r"^Machine: (.+?)\.?$", text, re.M)
    return {"step": "reproduce", "command": SHOWN["reproduce"], "seconds": float(found.group(1)), "cpu_seconds": None,
            "peak_rss_mb": None, "returncode": 0,
            "source": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path),
            "machine": machine.group(1) if machine else None}


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s ({seconds / 60:.1f} min)"


def table(rows: list[dict]) -> str:
    lines = ["| command | what it does | wall time | CPU seconds | peak memory | exit |", "|---|---|---|---|---|---|"]
    for row in rows:
        what = STEPS[row["step"]][0]
        if row.get("source"):
            made = f"made on {row['machine']}" if row.get("machine") else "its machine is not recorded there"
            what += f"; the time of the run of `{row['source']}` ({made}), not timed here"
        cpu = f"{row['cpu_seconds']:.0f}" if row["cpu_seconds"] is not None else "-"
        rss = f"{row['peak_rss_mb'] / 1024:.1f} GB" if row["peak_rss_mb"] is not None else "-"
        lines.append(f"| `{row['command']}` | {what} | {_minutes(row['seconds'])} | {cpu} | {rss} | "
                     f"{row['returncode']} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="quick,tests,docs",
                        help="comma-separated steps to time, of: " + ", ".join(STEPS))
    parser.add_argument("--json", default="runs/benchmarks/first_hour.json", help="where the rows are written")
    parser.add_argument("--keep-others", action="store_true",
                        help="keep the rows of the steps not timed now from --json's earlier run, when it ran on the "
                             "same machine (processor, cores, versions): the table then has every step measured")
    args = parser.parse_args(argv)
    steps = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        parser.error(f"--only: unknown step(s) {', '.join(unknown)}; the steps are {', '.join(STEPS)}")

    from benchmarks.throughput import matmul_peak
    from experiments.reproduce import machine

    path = pathlib.Path(args.json)
    earlier = {}
    if args.keep_others:
        try:
            before = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            parser.error(f"--keep-others: no earlier run to keep rows of in {path} ({err})")
        measured_on = before.get("machine_only") or re.sub(r"^Machine: (.*?); float32 matmul peak .*$", r"\1",
                                                            before.get("machine", ""), flags=re.S)
        if measured_on != machine():
            parser.error(f"--keep-others: {path} was measured on another machine ({measured_on}), "
                         f"not this one ({machine()})")
        earlier = {row["step"]: row for row in before["rows"] if not row.get("source")}
    peak = matmul_peak((512, 1024, 2048), repeats=5)["peak_gflops"]
    header = (f"Machine: {machine()}; float32 matmul peak {peak:.0f} GFLOP/s. "
              f"Measured {datetime.date.today().isoformat()} by `python -m benchmarks.first_hour"
              f"{' --only ' + args.only if args.only != 'quick,tests,docs' else ''}`"
              + (f"; the rows of {', '.join(s for s in earlier if s not in steps)} kept from an earlier run on this "
                 "machine (`--keep-others`)" if set(earlier) - set(steps) else "") + ".")
    print(header, flush=True)
    rows = []
    for name in STEPS:
        if name not in steps and name in earlier:
            rows.append(earlier[name])
        elif name in steps:
            print(f"timing {name}: {SHOWN[name]} ...", flush=True)
            rows.append(run_step(name))
            print(f"  {_minutes(rows[-1]['seconds'])}, exit {rows[-1]['returncode']}", flush=True)
            if rows[-1]["returncode"] != 0:
                print(rows[-1]["tail"], file=sys.stderr)
        elif name == "reproduce" and (row := from_report()) is not None:
            rows.append(row)
    print()
    print(header)
    print()
    print(table(rows))
    result = {"machine": header, "machine_only": machine(), "matmul_peak_gflops": peak, "rows": rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
