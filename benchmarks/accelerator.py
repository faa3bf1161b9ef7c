"""One-command accelerator check: matmul peaks, training throughput and on-device correctness.

Run from the project root (on a GPU/TPU host: ``pip install -U "jax[cuda12]"`` or ``"jax[tpu]"`` and the
README install, nothing else)::

    python -m benchmarks.accelerator [--quick] [--out runs/benchmarks/accelerator.json]

The default run was sized to take under 8 minutes on one GPU or TPU (most of it compiling the ResNets); on an
NVIDIA H200 the first three sections took 169 s and ResNet-56's five programs the next 161 s (2026-12-04);
``--quick`` (tiny sizes) is what the tests run: about 5 minutes on this project's 2-core CPU (mostly
compiling), 90 s in ``tests/test_accelerator_benchmark.py``, which turns most XLA optimisations off. Everything is
measured in one run and nothing is hard-coded or asserted: a failed correctness check is reported
(``"passed": false``), not raised. ``benchmarks/accelerator_check.sh`` is the prepared script for a lent machine.

The sections run in this order, the cheap and telling ones first. Each prints its table when it finishes, and the
JSON (``--out``) is written after each section and each ResNet program (``"finished": false`` until the end):
a run stopped by a lease's time limit keeps what it measured. A section (or one ResNet program) that raises is
recorded with its error and traceback, and the rest still run.

Timing reuses ``benchmarks.throughput`` (best of ``repeats`` calls after a warm-up call) and
``benchmarks.resnet`` (median of timed calls, programs lowered and compiled once, XLA cost analysis).

1. Device: ``jax.devices()[0].device_kind``, the platform and the device count. Matmul peak of a jitted square
   ``n x n`` matmul (``2 n^3`` flops, largest rate over the sizes) three ways: float32 inputs under
   ``jax.default_matmul_precision('highest')`` (true float32), float32 inputs at the default precision
   (on GPUs with TF32 and on TPUs this is a reduced-precision pass), and bfloat16 inputs. On a CPU the three
   can be close; they are reported as measured.
2. Correctness on the default device, every computation under ``jax.default_matmul_precision('highest')``,
   each check with what it measured, its criterion and passed (a and b: the max abs and max rel difference,
   passed when ``|a - b| <= atol + rtol |b|`` everywhere):
   a. scan vs unrolled: a BatchNorm ``ResidualMLP`` with ``scan=True`` equals the unrolled one on the same
      parameters (converted with ``resjax.nn.stack_unrolled``), outputs with ``train=True`` and
      ``train=False``, and the updated ``batch_stats`` (back with ``unstack_scanned``).
   b. vmapped sweep vs alone: seed 1 of a 3-seed ``Trainer.sweep`` has the same per-epoch metrics
      (train loss/error, test error) as seed 1 run alone.
   c. device vs float64: one CIFAR ResNet training step (same initial state and batch) in float32 on the
      default device and on ``jax.devices('cpu')[0]``, each against the same step in float64 on the CPU
      (``jax.enable_x64``): the error ``||x - ref|| / ||ref||`` of every floating-point leaf (the loss and the
      new state). Passes when the device's worst leaf is at most 4 times the CPU's worst: the device computes
      as accurately as the CPU. A BatchNorm ResNet's step is ill-conditioned (the first convolutions'
      gradients pass through every BN's ``1 / sigma``): the CPU's float32 step is itself about 1e-3 from float64
      on its worst leaf, so no fixed tolerance between two float32 backends holds. The two float32 runs' own
      difference is recorded (``device_vs_cpu``). On a CPU-only machine the device is the CPU
      (``same_device: true``, said in the output) and the check is trivial.
3. The five ``experiments.degradation`` configs' (quick: the first one) training throughput (``throughput.training_throughput``:
   3 seeds vmapped, batch 100, width 64, steps in one ``lax.scan``): examples/s, dense-layer GFLOP/s and
   that as a fraction of each of the three peaks; and ``throughput.vmap_vs_sequential`` for ``plain_d32``
   (seeds as one vmapped program against one single-seed program per seed, in turn).
4. CIFAR ResNet-56 and ResNet-110 (quick: ResNet-8) training steps at batch 128 (quick: 8) on one device:
   one seed, and 4 seeds (quick: 2) with ``seed_axis='vmap'`` (each seed its own batch), each with the
   stages scanned (``scan=True``) and unrolled. Images/s (median of the timed steps), compile time, the dense
   FLOPs per step (``benchmarks.flops`` over the lowered program: the same on every backend, where XLA's cost
   analysis, also recorded, leaves cuDNN's convolutions out on a GPU and counts a scan's body once) and
   achieved FLOP/s as a fraction of the bfloat16 peak (the models
   run in float32 at the default precision, so on an accelerator that is the relevant ceiling); and one seed
   unrolled in mixed precision (``dtype='bfloat16'``: bfloat16 compute, float32 parameters and statistics).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import pathlib
import platform
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import flops, run_and_write
from benchmarks import resnet as rn
from benchmarks.throughput import SETTINGS as THROUGHPUT_SETTINGS
from benchmarks.throughput import NUM_SEEDS, print_table, time_call, training_throughput, vmap_vs_sequential
from experiments.degradation import CONFIGS
import resjax
from resjax.data import Dataset, synthetic_image_dataset
from resjax.nn import ResidualMLP, stack_unrolled, unstack_scanned
from resjax.nn.resnet import cifar_resnet
from resjax.train import image_train_config, make_image_train, make_train, run_config, train_config

SETTINGS = {
    "default": dict(matmul_sizes=(1024, 2048, 4096, 8192), matmul_repeats=5, steps=200, repeats=3, vmap_seeds=8,
                    depths=(56, 110), batch_size=128, seeds=4, timed_steps=5, check_depth=20, check_batch=32,
                    configs=tuple(CONFIGS)),
    "quick": dict(matmul_sizes=(128, 256), matmul_repeats=2, steps=2, repeats=1, vmap_seeds=2,
                  depths=(8,), batch_size=8, seeds=2, timed_steps=1, check_depth=8, check_batch=4,
                  configs=tuple(CONFIGS)[:1]),
}
PEAKS = ("highest", "default", "bfloat16")
TOLERANCES = {"scan_vs_unrolled": dict(rtol=1e-5, atol=1e-5),
              "vmapped_sweep_vs_alone": dict(rtol=1e-5, atol=1e-6),
              # the device's worst per-leaf error against float64 at most this many times the CPU's
              "device_vs_float64": dict(factor=4.0)}


# ---- 1. device and matmul peaks --------------------------------------------------------------------


def device_info() -> dict:
    d = jax.devices()[0]
    return {"device_kind": d.device_kind, "platform": d.platform, "device_count": jax.device_count(),
            "backend": jax.default_backend(), "devices": [str(x) for x in jax.devices()], "jax": jax.__version__,
            "host": platform.platform(), "cpu_count": os.cpu_count(), "load_avg_1min_at_start": os.getloadavg()[0]}


def matmul_rates(sizes, repeats: int, how: str) -> dict:
    """GFLOP/s of a jitted square matmul per size; ``how``: 'highest' / 'default' (float32 inputs at that
    matmul precision) or 'bfloat16' (bfloat16 inputs, default precision). ``peak_gflops``: the largest."""
    dtype = jnp.bfloat16 if how == "bfloat16" else jnp.float32
    precision = "highest" if how == "highest" else None
    matmul = jax.jit(lambda a, b: a @ b)
    rows = {}
    with jax.default_matmul_precision(precision):
        for n in sizes:
            a, b = (jax.random.normal(k, (n, n), dtype) for k in jax.random.split(jax.random.key(n)))
            t = time_call(matmul, a, b, repeats=repeats)
            rows[str(n)] = {**t, "gflops": 2 * n**3 / t["best_s"] / 1e9}
    return {"dtype": jnp.dtype(dtype).name, "precision": precision or "default", "sizes": rows,
            "peak_gflops": max(r["gflops"] for r in rows.values())}


# ---- 2. degradation configs ------------------------------------------------------------------------


def degradation(s: dict, peaks: dict) -> dict:
    from resjax.data import load_dataset

    data = load_dataset("mnist1d")
    rows = {name: training_throughput(model, data, NUM_SEEDS, s["steps"], s["repeats"])
            for name, model in CONFIGS.items() if name in s["configs"]}
    for r in rows.values():
        r["fraction_of_peak"] = {how: r["gflops"] / peaks[how] for how in PEAKS}
    return {"configs": rows,
            "vmap_vs_sequential": vmap_vs_sequential(CONFIGS["plain_d32"], data, s["vmap_seeds"], s["steps"],
                                                     s["repeats"])}


# ---- 3. CIFAR ResNets ------------------------------------------------------------------------------


def image_trainer(depth: int, batch_size: int, scan: bool, seed_axis: str = "vmap", dtype: str | None = None):
    """``benchmarks.resnet.build_trainer``'s trainer with the model's ``scan`` and ``dtype`` chosen."""
    train = image_train_config(seed_axis=seed_axis, batch_size=batch_size, eval_batch_size=batch_size, epochs=1,
                               schedule="constant")
    return make_image_train(run_config(train=train), synthetic_image_dataset("cifar10", batch_size),
                            model=cifar_resnet(depth, scan=scan, dtype=dtype))


def resnet_step(depth: int, batch_size: int, scan: bool, num_seeds: int | None, steps: int, peak: float,
                dtype: str | None = None) -> dict:
    """One training step (``num_seeds=None``: one seed; else that many seeds vmapped, each its own batch);
    ``dtype='bfloat16'``: mixed precision (float32 parameters and statistics)."""
    trainer = image_trainer(depth, batch_size, scan, dtype=dtype)
    x, y = rn.a_batch(batch_size)
    if num_seeds is None:
        state, images = trainer.init(0), batch_size
    else:
        state, images = trainer.init(list(range(num_seeds))), num_seeds * batch_size
        x, y = (np.broadcast_to(a, (num_seeds, *a.shape)) for a in (x, y))
    x, y = jnp.asarray(x), jnp.asarray(y)
    prog = rn.compile_program(trainer._compiled("step", num_seeds is not None), state, x, y)
    times = rn.time_calls(rn.Stepper(prog["compiled"], state, x, y), steps)
    # the dense FLOPs of the program as lowered (before XLA's passes: the same on every backend, a scan counted by
    # its trip count): XLA's cost analysis leaves cuDNN's convolutions out on a GPU
    dense, _ = flops.Program(prog["lowered"].as_text(dialect="hlo")).flops()
    return {**rn.summary(times, images, dense, peak, prog["compile_s"]), "xla_cost_analysis_flops": prog["flops"]}


def resnet_programs(s: dict, peak_bf16: float):
    """``(key, build)`` per ResNet program, in the order they run: each depth's four float32 programs (one seed
    and ``seeds`` vmapped, scanned and unrolled) and then its mixed-precision one (the accelerator users'
    setting: bfloat16 compute, float32 parameters and statistics), the shallower depth first."""
    for depth in s["depths"]:
        for seeds in (None, s["seeds"]):
            for scan in (True, False):
                key = f"resnet{depth}/{'1 seed' if seeds is None else f'{seeds} seeds vmapped'}/" \
                      f"{'scan' if scan else 'unrolled'}"
                yield key, functools.partial(_resnet_row, depth, s, seeds, scan, peak_bf16, "float32")
        yield f"resnet{depth}/1 seed/unrolled/bfloat16", functools.partial(
            _resnet_row, depth, s, None, False, peak_bf16, "bfloat16")


def _resnet_row(depth: int, s: dict, seeds: int | None, scan: bool, peak_bf16: float, dtype: str) -> dict:
    return {"depth": depth, "batch_size": s["batch_size"], "seeds": seeds or 1, "scan": scan, "dtype": dtype,
            **resnet_step(depth, s["batch_size"], scan, seeds, s["timed_steps"], peak_bf16,
                          dtype=None if dtype == "float32" else dtype)}


# ---- 4. correctness --------------------------------------------------------------------------------


def _numeric_leaves(tree) -> list[np.ndarray]:
    """Leaves as float64 arrays (a PRNG key as its key data)."""
    def numeric(x):
        if jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x, np.float64)
    return [numeric(x) for x in jax.tree_util.tree_leaves(tree)]


def compare(a, b, rtol: float, atol: float) -> dict:
    """Max abs / rel difference over two pytrees of arrays and whether ``|a-b| <= atol + rtol |b|`` holds."""
    la, lb = _numeric_leaves(a), _numeric_leaves(b)
    both_nan = [np.isnan(x) & np.isnan(y) for x, y in zip(la, lb)]  # e.g. a run's unfilled history: equal
    la = [np.where(n, 0.0, x) for n, x in zip(both_nan, la)]
    lb = [np.where(n, 0.0, y) for n, y in zip(both_nan, lb)]
    if len(la) != len(lb) or any(x.shape != y.shape for x, y in zip(la, lb)):
        return {"max_abs_diff": math.inf, "max_rel_diff": math.inf, "rtol": rtol, "atol": atol, "passed": False,
                "note": "structures differ"}
    abs_d = max((float(np.max(np.abs(x - y), initial=0.0)) for x, y in zip(la, lb)), default=0.0)
    rel_d = max((float(np.max(np.abs(x - y) / np.maximum(np.abs(y), np.finfo(np.float32).tiny), initial=0.0))
                 for x, y in zip(la, lb)), default=0.0)
    ok = all(np.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True) for x, y in zip(la, lb))
    return {"max_abs_diff": abs_d, "max_rel_diff": rel_d, "rtol": rtol, "atol": atol, "passed": bool(ok),
            "leaves": len(la)}


def check_scan_vs_unrolled() -> dict:
    kw = dict(width=16, num_blocks=5, num_layers=2, norm="batch")
    unrolled, scanned = ResidualMLP(**kw), ResidualMLP(**kw, scan=True)
    x = jax.random.normal(jax.random.key(1), (32, 12))
    v = unrolled.init(jax.random.key(0), x, train=False)
    v = jax.tree_util.tree_map(lambda a: a + 0.1 * jax.random.normal(jax.random.key(a.size), a.shape), v)
    vs = {c: stack_unrolled(col, kw["num_blocks"]) for c, col in v.items()}
    a, b = [], []
    for train in (True, False):
        yu, su = unrolled.apply(v, x, train=train, mutable=["batch_stats"])
        ys, ss = scanned.apply(vs, x, train=train, mutable=["batch_stats"])
        a += [ys, unstack_scanned(ss["batch_stats"], kw["num_blocks"])]
        b += [yu, su["batch_stats"]]
    return {"what": "ResidualMLP(width=16, num_blocks=5, norm='batch') scan=True vs unrolled: outputs "
                    "(train=True, train=False) and batch_stats", **compare(a, b, **TOLERANCES["scan_vs_unrolled"])}


def check_vmapped_sweep_vs_alone() -> dict:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 10)).astype(np.float32)
    y = ((x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 1).astype(np.int32)) % 3
    data = Dataset(x[:64], y[:64], x[64:], y[64:])
    config = run_config(dict(kind="residual_mlp", width=8, num_blocks=3, norm="batch"),
                        train_config(batch_size=16, epochs=3, learning_rate=0.05))
    trainer = make_train(config, data)
    keys = jax.random.split(jax.random.key(1), 3)
    _, together = trainer.sweep(keys)
    _, alone = jax.jit(trainer)(keys[1])
    names = ("train_loss", "train_error", "test_error")
    return {"what": "seed 1 of a 3-seed vmapped Trainer.sweep vs that seed alone: per-epoch " + ", ".join(names),
            **compare([together[n][1] for n in names], [alone[n] for n in names],
                      **TOLERANCES["vmapped_sweep_vs_alone"])}


def _float_leaves(tree) -> list[tuple[str, np.ndarray]]:
    """(path, float64 array) of every floating-point leaf (PRNG keys and counters left out)."""
    return [(jax.tree_util.keystr(path), np.asarray(x, np.float64))
            for path, x in jax.tree_util.tree_leaves_with_path(tree)
            if not jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key)
            and jnp.issubdtype(jnp.result_type(x), jnp.floating)]


def relative_errors(tree, reference) -> list[tuple[float, str]]:
    """``||x - ref|| / ||ref||`` per floating-point leaf (``||x - ref||`` where ``ref`` is all zeros), largest
    first, with the leaf's path. NaN where both are NaN counts as equal (a run's unfilled history); a NaN in
    ``x`` only, or a leaf of another shape, is an infinite error."""
    out = []
    for (path, x), (_, ref) in zip(_float_leaves(tree), _float_leaves(reference), strict=True):
        if x.shape != ref.shape or np.any(np.isnan(x) != np.isnan(ref)):
            out.append((math.inf, path))
            continue
        x, ref = np.nan_to_num(x, nan=0.0), np.nan_to_num(ref, nan=0.0)
        norm = np.linalg.norm(ref)
        out.append((float(np.linalg.norm(x - ref) / norm if norm > 0 else np.linalg.norm(x - ref)), path))
    return sorted(out, reverse=True)


def check_device_vs_float64(depth: int, batch_size: int) -> dict:
    """One CIFAR ResNet training step (same initial state and batch) in float32 on the default device and on
    the CPU, each against the same step in float64 on the CPU. Passes when the device's worst per-leaf relative
    error is at most ``factor`` times the CPU's: the device computes as accurately as the CPU does."""
    device, cpu = jax.devices()[0], jax.devices("cpu")[0]
    trainer = rn.build_trainer(depth, batch_size, batch_size)
    batch = rn.a_batch(batch_size)
    step = trainer._compiled("step", False)  # donates the state: a fresh (identical) initial state each time

    def one_step(d, float64=False):
        state, x, y = trainer.init(0), *batch
        if float64:
            state, x = jax.tree_util.tree_map(
                lambda a: a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, (state, x))
        new_state, (loss, _) = step(*jax.device_put((state, x, y), d))
        return jax.device_get((loss, new_state))

    with jax.enable_x64(True):
        reference = one_step(cpu, float64=True)
    on_device, on_cpu = one_step(device), one_step(cpu)
    errors = {"device": relative_errors(on_device, reference), "cpu": relative_errors(on_cpu, reference)}
    factor = TOLERANCES["device_vs_float64"]["factor"]
    worst = {k: e[0][0] for k, e in errors.items()}
    return {"what": f"one CIFAR ResNet-{depth} training step (batch {batch_size}) in float32 on {device} and on "
                    f"{cpu}, each against the step in float64 on {cpu}: per-leaf ||x - ref|| / ||ref|| over the "
                    "loss and every leaf of the new state",
            "device": str(device), "cpu_device": str(cpu), "same_device": device == cpu,
            "device_error": worst["device"], "cpu_error": worst["cpu"],
            "device_worst_leaf": errors["device"][0][1], "cpu_worst_leaf": errors["cpu"][0][1],
            "device_median_error": float(np.median([e for e, _ in errors["device"]])),
            "cpu_median_error": float(np.median([e for e, _ in errors["cpu"]])),
            "dtypes": {"device": str(np.result_type(on_device[0])), "cpu": str(np.result_type(on_cpu[0])),
                       "reference": str(np.result_type(reference[0]))},  # of the loss
            "factor": factor, "passed": bool(worst["device"] <= factor * worst["cpu"]),
            "leaves": len(errors["device"]),
            # how far the two float32 runs are apart
            "device_vs_cpu": {k: v for k, v in compare(on_device, on_cpu, rtol=0.0, atol=0.0).items()
                              if k in ("max_abs_diff", "max_rel_diff")}}


def correctness(s: dict) -> dict:
    with jax.default_matmul_precision("highest"):
        return {"scan_vs_unrolled": check_scan_vs_unrolled(),
                "vmapped_sweep_vs_alone": check_vmapped_sweep_vs_alone(),
                "device_vs_float64": check_device_vs_float64(s["check_depth"], s["check_batch"])}


# ---- report ----------------------------------------------------------------------------------------


def print_matmul(pk: dict) -> None:
    print_table("1. matmul peak (square n x n @ n x n, best of repeats after warm-up)",
                ["inputs / precision", "peak GFLOP/s", "at n"],
                [[f"{m['dtype']}, precision {m['precision']}", f"{m['peak_gflops']:.1f}",
                  max(m["sizes"], key=lambda n: m["sizes"][n]["gflops"])] for m in pk.values()])


def print_correctness(c: dict) -> None:
    def measured(r):
        if "factor" in r:
            return f"worst leaf's error: device {r['device_error']:.2e}, CPU {r['cpu_error']:.2e}"
        return f"max abs diff {r['max_abs_diff']:.2e}, max rel diff {r['max_rel_diff']:.2e}"

    def criterion(r):
        return f"device <= {r['factor']:g} x CPU" if "factor" in r else f"|a-b| <= {r['atol']:g} + {r['rtol']:g}|b|"

    print_table("2. correctness under jax.default_matmul_precision('highest')",
                ["check", "measured", "passes when", "result"],
                [[k, measured(r), criterion(r), "pass" if r["passed"] else "FAIL"] for k, r in c.items()])
    if c["device_vs_float64"]["same_device"]:
        print(f"note: the default device is the CPU ({c['device_vs_float64']['device']}): device_vs_float64 compares "
              "the CPU with itself")


def print_degradation(g: dict, s: dict) -> None:
    print_table(f"3. degradation configs: {NUM_SEEDS} seeds vmapped, {s['steps']} train steps per call",
                ["config", "examples/s", "GFLOP/s", *(f"of {h} peak" for h in PEAKS)],
                [[name, f"{r['examples_per_s']:,.0f}", f"{r['gflops']:.2f}",
                  *(f"{r['fraction_of_peak'][h]:.1%}" for h in PEAKS)] for name, r in g["configs"].items()])
    v = g["vmap_vs_sequential"]
    print(f"plain_d32, {v['seeds']} seeds: vmapped {v['vmapped']['best_s']:.3f} s, sequential "
          f"{v['sequential']['best_s']:.3f} s, sequential / vmapped {v['sequential_over_vmapped']:.2f}x")


def print_resnets(rows: dict) -> None:
    print_table("4. CIFAR ResNet training step, one device (median of timed steps)",
                ["program", "images/step", "images/s", "compile (s)", "GFLOP/step", "of bf16 peak"],
                [[k, r["images"], f"{r['images_per_s']:,.1f}", f"{r['compile_s']:.1f}",
                  f"{r['flops_per_call'] / 1e9:.2f}", f"{r['fraction_of_peak']:.1%}"]
                 for k, r in rows.items() if "error" not in r])


# ---- main ------------------------------------------------------------------------------------------

#: The order the sections run in: the cheap, telling ones first, so that a run stopped by a time limit (a lent
#: machine's lease) has kept them; the ResNets, most of whose time is compilation, last.
SECTIONS = ("matmul", "correctness", "degradation", "resnets")


def _failure(e: BaseException) -> dict:
    return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}


def run(quick: bool, keep=lambda res: None) -> dict:
    """Every section in ``SECTIONS`` order. ``keep(res)`` is called after each section and each ResNet program
    (``main`` writes the JSON there, ``"finished": false`` until the end), so a run stopped part-way has kept
    what it measured. A section (or one ResNet program) that raises is recorded as ``{"error", "traceback"}``
    and the others still run: one broken path on a new backend does not cost the rest of the check."""
    s = SETTINGS["quick" if quick else "default"]
    res = {"settings": {"quick": quick, **s, "degradation_seeds": NUM_SEEDS,
                        "throughput_settings": THROUGHPUT_SETTINGS["quick" if quick else "default"]},
           "device": device_info(), "finished": False, "section_s": {}}
    d = res["device"]
    print(f"device: {d['device_kind']} (platform {d['platform']}, {d['device_count']} device(s), jax {d['jax']})",
          flush=True)
    peaks = dict.fromkeys(PEAKS, math.nan)

    def matmul():
        out = {how: matmul_rates(s["matmul_sizes"], s["matmul_repeats"], how) for how in PEAKS}
        peaks.update({how: m["peak_gflops"] for how, m in out.items()})
        return out

    def resnet_rows():
        rows = res["resnets"] = {}
        for key, build in resnet_programs(s, peaks["bfloat16"]):
            try:
                rows[key] = build()
            except Exception as e:  # noqa: BLE001 - recorded, the next program still runs
                rows[key] = _failure(e)
            keep(res)
        return rows

    steps = {"matmul": (matmul, print_matmul), "correctness": (lambda: correctness(s), print_correctness),
             "degradation": (lambda: degradation(s, peaks), lambda g: print_degradation(g, res["settings"])),
             "resnets": (resnet_rows, print_resnets)}
    for name in SECTIONS:
        compute, show = steps[name]
        start = time.perf_counter()
        try:
            res[name] = compute()
            show(res[name])
        except Exception as e:  # noqa: BLE001 - recorded and reported, the next section still runs
            res[name] = _failure(e)
            print(f"\n{name}: FAILED\n{res[name]['traceback']}")
        res["section_s"][name] = time.perf_counter() - start
        print(f"({name}: {res['section_s'][name]:.0f} s)", flush=True)
        keep(res)
    res["device"]["load_avg_1min_at_end"] = os.getloadavg()[0]
    res["finished"] = True
    return res


def main(argv=None) -> dict:
    resjax.use_every_cpu_core()  # on a CPU host every core is a device, as the other benchmarks run
    parser = argparse.ArgumentParser(prog="python -m benchmarks.accelerator", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the CPU test run: about 5 minutes here, 90 s in the tests)")
    parser.add_argument("--out", default="runs/benchmarks/accelerator.json", help="JSON output (default: %(default)s)")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)

    def keep(res: dict) -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1))

    def failures(res: dict) -> None:  # the tables were printed as their sections finished
        broken = [name for name in SECTIONS if "error" in res[name]]
        if "error" not in res["resnets"]:
            broken += [f"resnets/{key}" for key, row in res["resnets"].items() if "error" in row]
        print(f"\nfailed: {', '.join(broken)}" if broken else "\nevery section ran")

    return run_and_write(lambda: run(args.quick, keep), failures, args.out)


if __name__ == "__main__":
    main()
