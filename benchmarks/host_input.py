"""Host input throughput: CIFAR-shaped batches of the host feeder, before (hand-written loader) and after (Grain).

Run from the project root::

    python -m benchmarks.host_input [--quick] [--examples 50000] [--repeats 5] [--before REV]
                                    [--out runs/benchmarks/host_input.json]

What is timed: one training epoch of ``ImageSource.from_arrays('cifar10', images, labels)`` -- ``examples`` random
uint8 images ``32 x 32 x 3`` in memory (default 50000, a CIFAR-10 training split), batch 128, shuffled, with
the crop_flip augmentation (4-pixel zero padding, random window, random flip) and the normalisation to float32:
``source.epoch(1, 128, seed=0, augment=True)`` from the call to the last batch, so an epoch's start (the order,
and with Grain's worker processes their start) is included. Images/s counts the examples of the full batches
(``examples // 128 * 128``). Also recorded: the seconds to the first batch, and the rate from the first batch
to the last (the steady state, which leaves the start out). An untimed epoch-0 batch comes first in each run.

How "before" is obtained. The hand-written loader (``BatchSource.epoch`` as a Python generator) was replaced,
not kept beside Grain, so this checkout no longer has it. The script exports the library as it was at commit
``--before`` (default :data:`BEFORE`, the last commit before the Grain feeder) with ``git archive REV resjax`` into
a temporary directory, and times it there: every run is a child process (``python -c``) whose working directory
is the tree it times, so ``import resjax`` is that tree's (the export for "before", this checkout for the
others). Runs alternate -- before, then each Grain setting, then before again ... -- ``repeats`` rounds in one
sitting; each variant's median is printed, and its ratio to before as the median over the rounds of its run's
rate over that round's before run (neighbours in time, so a load that comes and goes cancels more than in the
ratio of the medians). (``--before none``, or a clone
without that commit, e.g. a shallow CI checkout, measures the Grain settings only.)

Variants: ``before``; ``grain`` (the default settings: no worker process, no reader thread); ``grain threads=1``
(one Grain reader thread making batches ahead); ``grain workers=1`` and ``grain workers=2`` (Grain worker
processes, ``mp_prefetch``). Every variant must give the same batches: a digest of the first and the last batch
of each run is compared, and a mismatch is reported. Nothing else is asserted: the numbers depend on the machine
and its load (the 1-minute load average at the start and end is recorded).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tarfile
import tempfile

from benchmarks import positive_int, print_table, run_and_write

#: The last commit whose host feeder is the hand-written loader (the default of ``--before``).
BEFORE = "4ee7784db4c3aae756a48ee5fff1705db9864bf4"
ROOT = pathlib.Path(__file__).resolve().parent.parent
BATCH = 128
#: name -> the ``loader`` settings of the source (None: the tree as it is, for the old loader, which has none)
VARIANTS = {"before": None, "grain": {}, "grain threads=1": {"threads": 1}, "grain workers=1": {"workers": 1},
            "grain workers=2": {"workers": 2}}
QUICK_VARIANTS = ("before", "grain", "grain workers=1")

#: The timed run, in a child process whose working directory is the tree timed (``python -c CHILD SPEC``).
CHILD = r'''
import hashlib, json, sys, time
import numpy as np
from resjax.data import ImageSource

spec = json.loads(sys.argv[1])
n, batch = spec["examples"], spec["batch"]
rng = np.random.default_rng(0)
images = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
labels = rng.integers(0, 10, n).astype(np.int32)
source = ImageSource.from_arrays("cifar10", images, labels)
if spec["loader"] is not None:
    source = source.loader(**spec["loader"])
warm = source.epoch(0, batch, seed=0, augment=True)
next(warm)
getattr(warm, "close", lambda: None)()
count, first, last = 0, None, None
start = time.perf_counter()
for x, y in source.epoch(1, batch, seed=0, augment=True):
    if first is None:
        first_s, first = time.perf_counter() - start, (x, y)
    count, last = count + len(y), (x, y)
seconds = time.perf_counter() - start
digest = hashlib.sha256()
for a in (*first, *last):
    digest.update(np.ascontiguousarray(a).tobytes())
print("RESULT " + json.dumps({"seconds": seconds, "first_batch_s": first_s, "images": count,
                              "digest": digest.hexdigest()}), flush=True)
'''


def export(rev: str, into: pathlib.Path) -> str | None:
    """``resjax/`` of commit ``rev`` written under ``into``; None when done, else why not (no git, no such
    commit in this clone)."""
    try:
        blob = subprocess.run(["git", "archive", "--format=tar", rev, "resjax"], cwd=ROOT, capture_output=True,
                              check=False)
    except OSError as err:
        return f"git archive failed: {err}"
    if blob.returncode:
        return f"commit {rev} is not in this clone ({blob.stderr.decode().strip()}); git fetch --unshallow"
    with tarfile.open(fileobj=io.BytesIO(blob.stdout)) as tar:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4 (and 3.10.12)
            tar.extractall(into, filter="data")
        else:
            tar.extractall(into)
    return None


def run_once(tree: pathlib.Path, examples: int, loader: dict | None) -> dict:
    """One timed epoch in a child process working in ``tree``; its RESULT line as a dict."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    spec = json.dumps({"examples": examples, "batch": BATCH, "loader": loader})
    proc = subprocess.run([sys.executable, "-c", CHILD, spec], cwd=tree, env=env, capture_output=True, text=True,
                          check=False, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"the timed run in {tree} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def measure(examples: int, repeats: int, variants: tuple[str, ...], before: str) -> dict:
    """Every variant ``repeats`` times, alternating (see the module docstring); the results."""
    res = {"settings": {"examples": examples, "batch": BATCH, "repeats": repeats, "before": before,
                        "variants": list(variants), "cpus": os.cpu_count()},
           "load_avg_start": os.getloadavg()[0], "runs": {v: [] for v in variants}}
    with tempfile.TemporaryDirectory(prefix="host_input_before_") as tmp:
        trees = {v: ROOT for v in variants}
        if "before" in variants:
            why = "--before none" if before.lower() == "none" else export(before, pathlib.Path(tmp))
            if why is None:
                trees["before"] = pathlib.Path(tmp)
            else:
                print(f"before: not measured ({why})")
                res["before_skipped"] = why
                variants = tuple(v for v in variants if v != "before")
                res["runs"].pop("before")
        for r in range(repeats):
            for v in variants:
                out = run_once(trees[v], examples, VARIANTS[v])
                out["images_per_s"] = out["images"] / out["seconds"]
                batches = out["images"] // BATCH
                steady = out["seconds"] - out["first_batch_s"]
                out["steady_images_per_s"] = (batches - 1) * BATCH / steady if batches > 1 and steady > 0 else None
                res["runs"][v].append(out)
                print(f"  round {r + 1}/{repeats}  {v:16s} {out['images_per_s']:9.0f} images/s", flush=True)
    res["load_avg_end"] = os.getloadavg()[0]
    summary = {}
    for v, runs in res["runs"].items():
        steady = [r["steady_images_per_s"] for r in runs if r["steady_images_per_s"]]
        summary[v] = {"images_per_s": statistics.median(r["images_per_s"] for r in runs),
                      "first_batch_s": statistics.median(r["first_batch_s"] for r in runs),
                      "steady_images_per_s": statistics.median(steady) if steady else None}
    before_runs = res["runs"].get("before")
    for v in summary:  # each round's run against that round's before run (next to it in time), then the median
        summary[v]["ratio_to_before"] = statistics.median(
            r["images_per_s"] / b["images_per_s"] for r, b in zip(res["runs"][v], before_runs)) if before_runs else None
    res["summary"] = summary
    digests = {r["digest"] for runs in res["runs"].values() for r in runs}
    res["same_batches"] = len(digests) == 1
    return res


def report(res: dict) -> None:
    s = res["settings"]
    rows = []
    for v, m in res["summary"].items():
        rows.append([v, f"{m['images_per_s']:.0f}", f"{m['steady_images_per_s']:.0f}" if m["steady_images_per_s"] else "-",
                     f"{m['first_batch_s'] * 1000:.0f}",
                     f"{m['ratio_to_before']:.2f}x" if m["ratio_to_before"] else "-"])
    print_table(f"Host input: {s['examples']} uint8 32x32x3 images, crop_flip, batch {s['batch']}, one epoch "
                f"(median of {s['repeats']}; load {res['load_avg_start']:.1f} -> {res['load_avg_end']:.1f}, "
                f"{s['cpus']} CPUs)",
                ["loader", "images/s", "steady images/s", "first batch ms", "vs before (paired)"], rows)
    summ = res["summary"]
    if "before" in summ:
        b, g = summ["before"], summ.get("grain")
        if g:
            print(f"\nbefore (hand-written, {s['before'][:7]}): {b['images_per_s']:.0f} images/s; after (Grain, default "
                  f"settings): {g['images_per_s']:.0f} images/s; after/before = {g['ratio_to_before']:.2f} (median "
                  f"of the rounds' ratios; ratio of the medians {g['images_per_s'] / b['images_per_s']:.2f})")
    print(f"same batches from every variant: {'yes' if res['same_batches'] else 'NO'}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.host_input", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="10240 examples, 3 rounds, variants before, grain and grain workers=1")
    parser.add_argument("--examples", type=positive_int, help="images in memory (default 50000; quick 10240)")
    parser.add_argument("--repeats", type=positive_int, help="rounds of alternating runs (default 5; quick 3)")
    parser.add_argument("--variants", help=f"comma-separated subset of {', '.join(VARIANTS)} (default all; quick "
                                           f"{', '.join(QUICK_VARIANTS)})")
    parser.add_argument("--before", default=BEFORE, help="the commit of the hand-written loader, or 'none' "
                                                         "(default %(default)s)")
    parser.add_argument("--out", default="runs/benchmarks/host_input.json", help="JSON output (default: %(default)s)")
    args = parser.parse_args(argv)
    examples = args.examples or (10240 if args.quick else 50000)
    if examples < BATCH:
        parser.error(f"--examples: want at least one batch of {BATCH}")
    repeats = args.repeats or (3 if args.quick else 5)
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip()) if args.variants else (
        QUICK_VARIANTS if args.quick else tuple(VARIANTS))
    unknown = set(variants) - set(VARIANTS)
    if unknown or not variants:
        parser.error(f"--variants: name some of {tuple(VARIANTS)}; unknown {sorted(unknown)}")
    return run_and_write(lambda: measure(examples, repeats, variants, args.before), report, args.out)


if __name__ == "__main__":
    main()
