"""CIFAR ResNet training throughput on this machine: one device, data-parallel, against the matmul peak.

Run from the project root::

    python -m benchmarks.resnet [--quick] [--depth 56] [--batch-size 128] [--eval-batch-size 1000]
                                [--steps 5] [--seeds 4] [--no-seeds] [--out runs/benchmarks/resnet.json]

On this project's 2-core CPU the default run takes about 10 minutes, half of it in (d) (``--no-seeds``
skips it); ``--quick`` (ResNet-8, batch 16) under a minute, mostly compiling.

The model is ``cifar_resnet(depth)`` (He et al.: basic blocks, option A shortcuts, BatchNorm, unrolled),
trained by ``make_image_train`` with SGD (momentum 0.9, coupled weight decay) on synthetic CIFAR-10
batches (``synthetic_image_dataset``; the data do not change the work). Everything is measured in one run,
printed as a table and written as JSON (``--out``). Nothing is asserted: the numbers depend on the machine
and on whatever else runs on it (the 1-minute load average at the start and end is recorded).

Each program is the trainer's own jitted function (``ImageTrainer._compiled``, what ``step``,
``fit`` and ``evaluate`` call), lowered and compiled once from the placed inputs (the compile time is
reported, not counted); it is then run once untimed (first-run allocations) and ``--steps`` times timed,
each call from ``time.perf_counter`` to ``jax.block_until_ready`` of its outputs. Training steps donate and
carry the state forward, as in training. The reported time is the MEDIAN of the timed calls (all are in
the JSON). Host work (loading, augmenting and placing batches) is excluded: the batch is placed once.

a. One training step on one device: ``step`` (the jitted core ``train_step``) of a trainer without a mesh.
b. Data-parallel: the same with ``mesh=make_data_mesh()`` over every device (the batch's example axis
   sharded, the state replicated; GSPMD makes BatchNorm's statistics global). ``benchmarks`` is an entry
   point, so on a CPU every core is a JAX device (``resjax.use_every_cpu_core``); on a GPU/TPU host the
   devices are the accelerators. Skipped when the batch does not split evenly over the devices.
c. FLOPs per step from XLA's cost analysis of the one-device step (``compiled.cost_analysis()['flops']``:
   forward, backward and update, a multiply-add counted as 2), as achieved FLOP/s and as a fraction of
   the machine's float32 matmul peak measured by ``benchmarks.throughput.matmul_peak`` (a jitted square
   matmul on one device). The data-parallel row uses the same FLOPs per step (the same work).
d. ``--seeds`` seeds in one step (``fit([0, 1, ...])``'s step, one device, each seed its own batch of
   ``--batch-size``) with the seed axis vmapped, unrolled into one program, and looped (the single-seed
   program per seed on slices of the stacked state: ``config.train.seed_axis``), against the same number of
   single-seed steps one after another (the program of (a), each waited for before the next).
e. Evaluation: the trainer's evaluation program (``evaluate``'s, running BatchNorm statistics) on one
   batch of ``--eval-batch-size`` images, one device.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import positive_int, run_and_write
from benchmarks.throughput import SETTINGS as MATMUL_SETTINGS
from benchmarks.throughput import matmul_peak, print_table
import resjax
from resjax.data import synthetic_image_dataset
from resjax.nn.resnet import cifar_resnet
from resjax.train import image_train_config, make_data_mesh, make_image_train, run_config

DEFAULTS = {"depth": 56, "batch_size": 128, "eval_batch_size": 1000, "steps": 5, "seeds": 4}
QUICK = {"depth": 8, "batch_size": 16, "eval_batch_size": 32, "steps": 2, "seeds": 2}


# ---- building and timing ---------------------------------------------------------------------------


def build_trainer(depth: int, batch_size: int, eval_batch_size: int, mesh=None, seed_axis: str = "auto"):
    train = image_train_config(seed_axis=seed_axis, batch_size=batch_size, eval_batch_size=eval_batch_size, epochs=1,
                               schedule="constant")
    source = synthetic_image_dataset("cifar10", batch_size)
    return make_image_train(run_config(train=train), source, model=cifar_resnet(depth), mesh=mesh)


def a_batch(num_examples: int, split: str = "train"):
    """One synthetic CIFAR-10 batch on the host: (images float32 [B, 32, 32, 3], labels int32 [B])."""
    source = synthetic_image_dataset("cifar10", num_examples, split=split)
    return next(source.epoch(0, num_examples, shuffle=False))


def compile_program(fn, *args) -> dict:
    """``fn.lower(*args).compile()``, its wall time and XLA's FLOP count (``flops``: its cost analysis, which on
    a GPU leaves out the convolutions that run as cuDNN calls); ``lowered``: the program as lowered."""
    start = time.perf_counter()
    lowered = fn.lower(*args)
    compiled = lowered.compile()
    seconds = time.perf_counter() - start
    return {"compiled": compiled, "lowered": lowered, "compile_s": seconds, "flops": cost_flops(compiled)}


def cost_flops(compiled) -> float:
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):  # older JAX: one dict per program
        analysis = analysis[0] if analysis else None
    return float(analysis.get("flops", math.nan)) if analysis else math.nan


def time_calls(call, steps: int) -> list[float]:
    """Seconds of ``steps`` timed calls of ``call()`` (which blocks), after one untimed call."""
    call()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


class Stepper:
    """Calls a donating step on a carried state: ``self()`` runs one step and waits for it."""

    def __init__(self, compiled, state, *batch):
        self.compiled, self.state, self.batch = compiled, state, batch

    def __call__(self):
        self.state, out = self.compiled(self.state, *self.batch)
        jax.block_until_ready((self.state, out))


def summary(times: list[float], images: int, flops: float, peak_gflops: float, compile_s: float) -> dict:
    median = statistics.median(times)
    gflops = flops / median / 1e9
    return {"times_s": times, "median_s": median, "images": images, "images_per_s": images / median,
            "flops_per_call": flops, "gflops": gflops, "fraction_of_peak": gflops / peak_gflops,
            "compile_s": compile_s}


# ---- the measurements ------------------------------------------------------------------------------


def one_device(depth, batch_size, eval_batch_size, steps, peak) -> tuple[dict, object, dict]:
    """(a) and (c): the one-device training step. Returns its summary, the trainer and the program."""
    trainer = build_trainer(depth, batch_size, eval_batch_size)
    x, y = (jnp.asarray(a) for a in a_batch(batch_size))
    state = trainer.init(0)
    prog = compile_program(trainer._compiled("step", False), state, x, y)
    times = time_calls(Stepper(prog["compiled"], state, x, y), steps)
    return summary(times, batch_size, prog["flops"], peak, prog["compile_s"]), trainer, prog


def data_parallel(depth, batch_size, eval_batch_size, steps, peak, flops_per_step) -> dict | None:
    """(b): the step with the batch sharded over every device (None when it does not split evenly)."""
    mesh = make_data_mesh()
    if batch_size % mesh.size:
        return None
    trainer = build_trainer(depth, batch_size, eval_batch_size, mesh=mesh)
    x, y = (trainer._place(a, seeded=False) for a in a_batch(batch_size))  # as fit places a batch
    state = trainer.init(0)
    prog = compile_program(trainer._compiled("step", False), state, x, y)
    times = time_calls(Stepper(prog["compiled"], state, x, y), steps)
    out = summary(times, batch_size, flops_per_step, peak, prog["compile_s"])
    out.update(devices=int(mesh.size), flops_per_device_program=prog["flops"])
    return out


def seeds_vmapped_vs_sequential(trainer, step_prog, depth, num_seeds, batch_size, steps, peak) -> dict:
    """(d): ``num_seeds`` seeds in one step, vmapped and unrolled (``config.train.seed_axis``), against
    ``num_seeds`` single-seed steps in turn."""
    x, y = a_batch(batch_size)
    xs = jnp.asarray(np.broadcast_to(x, (num_seeds, *x.shape)))
    ys = jnp.asarray(np.broadcast_to(y, (num_seeds, *y.shape)))
    one_program = {}
    for mode in ("vmap", "unroll", "loop"):
        t = build_trainer(depth, batch_size, trainer.config.train.eval_batch_size, seed_axis=mode)
        state = t.init(list(range(num_seeds)))
        if mode == "loop":  # the single-seed program per seed, with the slicing and stacking fit does
            step, flops, compile_s = t._compiled("step", True), num_seeds * step_prog["flops"], 0.0
        else:
            prog = compile_program(t._compiled("step", True), state, xs, ys)
            step, flops, compile_s = prog["compiled"], prog["flops"], prog["compile_s"]
        times = time_calls(Stepper(step, state, xs, ys), steps)
        one_program[mode] = summary(times, num_seeds * batch_size, flops, peak, compile_s)

    x, y = jnp.asarray(x), jnp.asarray(y)
    steppers = [Stepper(step_prog["compiled"], trainer.init(s), x, y) for s in range(num_seeds)]

    def sequential():
        for stepper in steppers:
            stepper()

    seq = time_calls(sequential, steps)
    images = num_seeds * batch_size
    return {"seeds": num_seeds, "vmapped": one_program["vmap"], "unrolled": one_program["unroll"],
            "looped": one_program["loop"],
            "sequential_over_looped": statistics.median(seq) / one_program["loop"]["median_s"],
            "sequential": summary(seq, images, num_seeds * step_prog["flops"], peak, 0.0),
            "sequential_over_vmapped": statistics.median(seq) / one_program["vmap"]["median_s"],
            "sequential_over_unrolled": statistics.median(seq) / one_program["unroll"]["median_s"]}


def evaluation(trainer, eval_batch_size, steps, peak) -> dict:
    """(e): the evaluation program on one batch (running statistics, masked loss and accuracy sums)."""
    x, y = a_batch(eval_batch_size, split="test")
    args = (jnp.asarray(x), jnp.asarray(y), jnp.ones(eval_batch_size, bool))
    state = trainer.init(0)
    prog = compile_program(trainer._compiled("eval", False), state, *args)
    times = time_calls(lambda: jax.block_until_ready(prog["compiled"](state, *args)), steps)
    return summary(times, eval_batch_size, prog["flops"], peak, prog["compile_s"])


# ---- report ----------------------------------------------------------------------------------------


def report(res: dict) -> None:
    s, peak = res["settings"], res["matmul"]["peak_gflops"]
    rows = []

    def row(label, r, devices):
        rows.append([label, devices, r["images"], f"{r['median_s'] * 1e3:,.1f}", f"{r['images_per_s']:,.1f}",
                     f"{r['gflops']:.1f}", f"{r['fraction_of_peak']:.1%}",
                     f"{r['compile_s']:.1f}" if r["compile_s"] else "-"])

    row("(a) train step, one device", res["one_device"], 1)
    if res["data_parallel"] is not None:
        row("(b) train step, data-parallel", res["data_parallel"], res["data_parallel"]["devices"])
    d = res["seeds"]
    if d is not None:
        row(f"(d) {d['seeds']} seeds vmapped, one step", d["vmapped"], 1)
        row(f"(d) {d['seeds']} seeds unrolled in one step (seed_axis='unroll')", d["unrolled"], 1)
        row(f"(d) {d['seeds']} seeds, fit's CPU default (seed_axis='loop')", d["looped"], 1)
        row(f"(d) {d['seeds']} seeds sequential, {d['seeds']} steps", d["sequential"], 1)
    row("(e) evaluation", res["evaluation"], 1)
    print_table(f"CIFAR ResNet-{s['depth']} (BatchNorm), float32, {res['machine']['backend']}: median of "
                f"{s['steps']} timed calls after compile and one warm-up call",
                ["program", "devices", "images/call", "time (ms)", "images/s", "GFLOP/s", "(c) of peak",
                 "compile (s)"], rows)
    a = res["one_device"]
    print(f"FLOPs per training image (XLA cost analysis of the one-device step): "
          f"{a['flops_per_call'] / s['batch_size'] / 1e6:,.1f} M; float32 matmul peak: {peak:.1f} GFLOP/s")
    if res["data_parallel"] is not None:
        print(f"data-parallel / one device: {res['data_parallel']['images_per_s'] / a['images_per_s']:.2f}x")
    else:
        print(f"(b) skipped: batch {s['batch_size']} does not split over {jax.device_count()} devices")
    if d is not None:
        print(f"sequential / vmapped time for {d['seeds']} seeds: {d['sequential_over_vmapped']:.2f}x, "
              f"sequential / unrolled: {d['sequential_over_unrolled']:.2f}x, sequential / loop: "
              f"{d['sequential_over_looped']:.2f}x (above 1: faster than single-seed steps one after another)")


# ---- main ------------------------------------------------------------------------------------------


def run(quick: bool, seeds_too: bool = True, **overrides) -> dict:
    s = {**(QUICK if quick else DEFAULTS), **{k: v for k, v in overrides.items() if v is not None}}
    mm = MATMUL_SETTINGS["quick" if quick else "default"]
    res = {"settings": {"quick": quick, **s},
           "machine": {"backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
                       "cpu_count": os.cpu_count(), "platform": platform.platform(), "jax": jax.__version__,
                       "load_avg_1min_at_start": os.getloadavg()[0]}}
    res["matmul"] = matmul_peak(mm["matmul_sizes"], mm["matmul_repeats"])
    peak = res["matmul"]["peak_gflops"]
    res["one_device"], trainer, step_prog = one_device(s["depth"], s["batch_size"], s["eval_batch_size"],
                                                        s["steps"], peak)
    res["data_parallel"] = data_parallel(s["depth"], s["batch_size"], s["eval_batch_size"], s["steps"], peak,
                                         res["one_device"]["flops_per_call"])
    res["seeds"] = (seeds_vmapped_vs_sequential(trainer, step_prog, s["depth"], s["seeds"], s["batch_size"], s["steps"],
                                                peak)
                    if seeds_too else None)
    res["evaluation"] = evaluation(trainer, s["eval_batch_size"], s["steps"], peak)
    res["machine"]["load_avg_1min_at_end"] = os.getloadavg()[0]
    return res


def main(argv=None) -> dict:
    resjax.use_every_cpu_core()  # one JAX device per CPU core, before JAX's first computation
    parser = argparse.ArgumentParser(prog="python -m benchmarks.resnet", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="ResNet-8, batch 16, 2 steps, 2 seeds (seconds)")
    parser.add_argument("--depth", type=int, help=f"CIFAR ResNet depth 6n+2 (default {DEFAULTS['depth']})")
    parser.add_argument("--batch-size", type=positive_int, help=f"training batch (default {DEFAULTS['batch_size']})")
    parser.add_argument("--eval-batch-size", type=positive_int,
                        help=f"evaluation batch (default {DEFAULTS['eval_batch_size']})")
    parser.add_argument("--steps", type=positive_int, help=f"timed calls per program (default {DEFAULTS['steps']})")
    parser.add_argument("--seeds", type=positive_int, help=f"seeds of (d) (default {DEFAULTS['seeds']})")
    parser.add_argument("--no-seeds", action="store_true",
                        help="skip (d); on a CPU it is most of the run (a vmapped ResNet-56 step takes ~50 s)")
    parser.add_argument("--out", default="runs/benchmarks/resnet.json", help="JSON output (default: %(default)s)")
    args = parser.parse_args(argv)
    return run_and_write(lambda: run(args.quick, not args.no_seeds, depth=args.depth, batch_size=args.batch_size,
              eval_batch_size=args.eval_batch_size, steps=args.steps, seeds=args.seeds), report, args.out)


if __name__ == "__main__":
    main()
