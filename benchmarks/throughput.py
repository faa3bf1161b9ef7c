"""Training throughput, seed-vmap speed-up and compile time of resjax on this machine.

Run from the project root::

    python -m benchmarks.throughput [--quick] [--out runs/benchmarks/throughput.json]

Everything is measured in one run, printed as tables and written as JSON (``--out``). Nothing is
asserted: the numbers depend on the machine and on whatever else runs on it (the 1-minute load average
at the start is recorded beside them). Every timing uses ``time.perf_counter`` around a call followed by
``jax.block_until_ready``, after one untimed warm-up call that compiles; the reported time is the best
of ``repeats`` timed calls (all of them are in the JSON).

1. Matmul references. *Peak*: a jitted ``jnp.matmul`` of two square float32 ``n x n`` matrices for n in
   (512, 1024, 2048) (quick: 256, 512), counted as ``2 n^3`` flops; the peak is the largest rate.
   *Shape-matched*: the matmul the degradation models actually do, a batched einsum of
   ``(seeds=3, batch=64, 64) @ (3, 64, 64)``. One such einsum takes microseconds, so it is timed as a
   chain of ``chain`` of them in one jitted ``lax.scan`` (dispatch amortised, as in training, where one
   program runs many steps); the weights are orthogonal, so the values neither grow nor underflow. The
   rate of a single dispatched call is reported too (it shows the per-call overhead).
2. Training throughput of the five configs of ``experiments.degradation`` (width 64, its default batch 64,
   3 seeds vmapped). What is timed is the jitted, seed-vmapped ``Trainer.train_step`` in a ``lax.scan``
   over ``steps`` precomputed minibatches (200 steps = 5 epochs of 40, a fresh permutation each
   epoch of 62; quick: 10 steps), starting from the same initial state in every call. Training steps only:
   the per-epoch evaluation (and the drawing of permutations) is excluded from both the time and the
   flop count. Examples/s counts every seed's examples. Achieved FLOP/s counts only the dense layers:
   ``6 x (sum of the dense kernel sizes of one seed) x examples`` (forward 2x, backward 4x); biases,
   norms, activations, the loss and the optimiser are not counted, so it understates the work done.
   It is printed as a fraction of the peak and of the shape-matched rate. With more than one device
   (every CPU core is one, see section 3) the same is measured with the seeds sharded over the devices,
   3 seeds rounded up to a multiple of the device count, as ``Trainer.sweep`` runs them. (``residual_d32``
   diverges within its first epoch; a diverged seed is frozen with ``jnp.where``, which does the same work as a
   normal step, so its rate is still a rate of training work.)
3. Seeds vmapped against seeds one after another, for ``plain_d32``: the same ``S`` seeds (8; quick: 2)
   run as one vmapped program on one device, as that program with the seeds sharded over the host's
   devices (what ``Trainer.sweep`` runs; ``benchmarks`` is an entry point, so every CPU core is a
   device, see ``resjax.use_every_cpu_core``), and as ``S`` calls of the single-seed program, each
   waited for before the next starts. All exclude compilation.
5. What one training step costs against its FLOPs (printed after 3): ``plain_d32`` and ``residual_bn_d32`` at batch
   16 and 64, 3 seeds vmapped on one device, 250 steps per call (quick: 10). The FLOPs are the dense layers', as
   in 2; the *floor* is those FLOPs at the square matmul peak of 1; *kernels* are the top-level operations of the
   compiled step (each fusion, dot or copy is one launch of XLA:CPU's runtime), from the compiled HLO, and the
   time above the floor per kernel is the step's overhead per launch. The same step without the divergence
   check (``guarded_step``: one finiteness reduction over the concatenated gradients and a select of every
   state leaf) shows what that check costs.
4. Compile time against depth: ``ResidualMLP(width=64, num_blocks=K, norm='batch', scan=True)`` for K in
   (10, 100, 1000) (quick: 10, 100), and ``scan=False`` (unrolled) for K in (10, 100). What is timed is
   ``jax.jit(trainer.train_step).lower(...)`` (tracing and lowering) and ``.compile()`` for one
   training step (forward, backward, SGD update, divergence check) of one seed, from abstract shapes
   (``jax.eval_shape``), so no parameters are initialised. One measurement each (compile is not cached
   between them: every K is a new function).
6. How a block's merge compiles: depth-32 ``ResidualMLP`` training steps (degradation's width and batch, 3 seeds
   vmapped on one device, ``profile_steps`` steps per call) for the merges ``pre`` (skip + branch), ``pre`` with the
   1/sqrt(2) ``rescale``, ``post`` (an activation after the sum) and ``post`` with BatchNorm, each compiled twice in
   this sitting: as resjax builds it (the merge through ``resjax.nn.computed_once``) and with ``computed_once``
   patched to return its first argument (the merge as it was before, an elementwise op of one operand that XLA
   fuses into every consumer). For each: compile seconds, step time and the most operands any fusion of the
   compiled step takes (a fusion that recomputes the stream from the stem takes about three per block).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import re
import time
from typing import Callable
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import print_table, run_and_write
from experiments.degradation import CONFIGS, DEFAULT_BATCH_SIZE, WIDTH
import resjax
from resjax.data import load_dataset
from resjax.train import make_train, run_config, shard_over_seeds, train_config

BATCH_SIZE = DEFAULT_BATCH_SIZE  # the degradation experiment's (64)
NUM_SEEDS = 3

SETTINGS = {
    "default": dict(matmul_sizes=(512, 1024, 2048), matmul_repeats=5, chain=200, steps=200, repeats=3,
                    vmap_seeds=8, scan_depths=(10, 100, 1000), unrolled_depths=(10, 100), profile_steps=250),
    "quick": dict(matmul_sizes=(256, 512), matmul_repeats=3, chain=50, steps=10, repeats=2,
                  vmap_seeds=2, scan_depths=(10, 100), unrolled_depths=(10, 100), profile_steps=10),
}


# ---- timing ----------------------------------------------------------------------------------------


def time_call(fn: Callable, *args, repeats: int) -> dict:
    """Best and all wall times (s) of ``fn(*args)`` after one untimed warm-up (compile) call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return {"best_s": min(times), "times_s": times}


# ---- 1. matmul references --------------------------------------------------------------------------


def matmul_peak(sizes, repeats: int) -> dict:
    """GFLOP/s of a jitted square float32 matmul for every n; ``peak_gflops`` is the largest."""
    matmul = jax.jit(jnp.matmul)
    rows = {}
    for n in sizes:
        ka, kb = jax.random.split(jax.random.key(n))
        a = jax.random.normal(ka, (n, n), jnp.float32)
        b = jax.random.normal(kb, (n, n), jnp.float32)
        t = time_call(matmul, a, b, repeats=repeats)
        rows[str(n)] = {**t, "gflops": 2 * n**3 / t["best_s"] / 1e9}
    return {"sizes": rows, "peak_gflops": max(r["gflops"] for r in rows.values())}


def _orthogonal(key, seeds: int, width: int) -> jnp.ndarray:
    q, _ = jnp.linalg.qr(jax.random.normal(key, (seeds, width, width), jnp.float32))
    return q


def shape_matched_matmul(seeds: int, batch: int, width: int, chain: int, repeats: int) -> dict:
    """GFLOP/s of ``(seeds, batch, width) @ (seeds, width, width)``: chained in one program, and one call."""
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (seeds, batch, width), jnp.float32)
    w = _orthogonal(kw, seeds, width)
    flops = 2 * seeds * batch * width * width

    def one(h, w):
        return jnp.einsum("sbi,sij->sbj", h, w)

    def chained(h, w):
        return jax.lax.scan(lambda c, _: (one(c, w), None), h, None, length=chain)[0]

    t_chain = time_call(jax.jit(chained), x, w, repeats=repeats)
    t_one = time_call(jax.jit(one), x, w, repeats=max(repeats, 20))
    return {"shape": f"({seeds}, {batch}, {width}) @ ({seeds}, {width}, {width})", "chain": chain,
            "chained": {**t_chain, "gflops": chain * flops / t_chain["best_s"] / 1e9},
            "single_call": {**t_one, "gflops": flops / t_one["best_s"] / 1e9}}


# ---- 2. and 3. training throughput -----------------------------------------------------------------


def build_trainer(model: dict, data, width: int = WIDTH, batch_size: int = BATCH_SIZE):
    return make_train(run_config({**model, "width": width}, train_config(batch_size=batch_size)), data)


def dense_kernel_size(trainer) -> int:
    """Number of entries in all ``Dense`` kernels of one seed's parameters (from abstract shapes)."""
    carry = jax.eval_shape(trainer.init, jax.random.key(0))
    leaves = jax.tree_util.tree_flatten_with_path(carry.state.params)[0]
    return sum(int(np.prod(leaf.shape)) for path, leaf in leaves if path[-1].key == "kernel")


def train_steps_fn(trainer) -> Callable:
    """``(run, batches, hparams) -> run``: ``Trainer.train_step`` scanned over ``batches`` of indices (the
    minibatch gathered from the device-resident training set inside the step, as ``Trainer.train_epoch`` does)."""
    x, y = jnp.asarray(trainer.data.x_train), jnp.asarray(trainer.data.y_train)

    def run(carry, batches, hparams):
        return jax.lax.scan(lambda c, idx: trainer.train_step(c, (x[idx], y[idx]), hparams), carry, batches)[0]

    return run


def seed_inputs(trainer, num_seeds: int, steps: int):
    """Initial carries, ``(S, steps, batch)`` minibatch indices and hparams for ``num_seeds`` seeds."""
    keys = jax.random.split(jax.random.key(0), num_seeds)
    hparams = {k: jnp.broadcast_to(v, (num_seeds,)) for k, v in trainer.default_hparams().items()}
    carry = jax.jit(jax.vmap(trainer.init))(keys, hparams)
    n, b = len(trainer.data.y_train), trainer.config.train.batch_size
    batches = jax.vmap(lambda k: minibatches(k, n, b, steps))(keys)
    return carry, batches, hparams


def minibatches(key, n: int, batch_size: int, steps: int) -> jnp.ndarray:
    """``(steps, batch_size)`` indices: epochs of fresh permutations, each epoch's last partial batch dropped."""
    per_epoch = n // batch_size
    epochs = -(-steps // per_epoch)
    perms = [jax.random.permutation(jax.random.fold_in(key, e), n)[: per_epoch * batch_size] for e in range(epochs)]
    return jnp.concatenate(perms).reshape(-1, batch_size)[:steps]


def training_throughput(model: dict, data, num_seeds: int, steps: int, repeats: int, shard: bool = False) -> dict:
    """Seed-vmapped training steps on one device, or (``shard=True``) with the seeds sharded over every
    device as ``Trainer.sweep`` runs them."""
    trainer = build_trainer(model, data)
    carry, batches, hparams = seed_inputs(trainer, num_seeds, steps)
    inputs = shard_over_seeds((carry, batches, hparams)) if shard else (carry, batches, hparams)
    t = time_call(jax.jit(jax.vmap(train_steps_fn(trainer))), *inputs, repeats=repeats)
    kernels = dense_kernel_size(trainer)
    examples = num_seeds * steps * trainer.config.train.batch_size
    return {**t, "seeds": num_seeds, "dense_kernel_size": kernels, "examples": examples,
            "examples_per_s": examples / t["best_s"], "gflops": 6 * kernels * examples / t["best_s"] / 1e9}


def vmap_vs_sequential(model: dict, data, num_seeds: int, steps: int, repeats: int) -> dict:
    """The same seeds as one vmapped program and as one single-seed program per seed, in turn."""
    trainer = build_trainer(model, data)
    carry, batches, hparams = seed_inputs(trainer, num_seeds, steps)
    run = train_steps_fn(trainer)
    vmapped = time_call(jax.jit(jax.vmap(run)), carry, batches, hparams, repeats=repeats)

    one_seed = jax.jit(run)
    per_seed = [jax.tree_util.tree_map(lambda a, i=i: a[i], (carry, batches, hparams)) for i in range(num_seeds)]

    def sequential():
        for args in per_seed:
            jax.block_until_ready(one_seed(*args))

    sequential_t = time_call(sequential, repeats=repeats)
    out = {"seeds": num_seeds, "steps": steps, "devices": jax.device_count(), "vmapped": vmapped,
           "sequential": sequential_t, "sequential_over_vmapped": sequential_t["best_s"] / vmapped["best_s"]}
    if jax.device_count() > 1 and num_seeds % jax.device_count() == 0:  # what Trainer.sweep runs
        sharded = time_call(jax.jit(jax.vmap(run)), *shard_over_seeds((carry, batches, hparams)), repeats=repeats)
        out.update(sharded=sharded, sequential_over_sharded=sequential_t["best_s"] / sharded["best_s"])
    return out


# ---- 5. what a step costs against its FLOPs ---------------------------------------------------------------

#: Instructions of a compiled computation that launch no work of their own (tuple plumbing, views).
_FREE_OPS = ("parameter", "get-tuple-element", "tuple", "constant", "bitcast")


def step_kernels(hlo_text: str, steps: int) -> dict:
    """The operations one training step launches: the top-level instructions of the body of the compiled
    ``while`` loop that runs ``steps`` times (XLA:CPU runs each as one kernel, a "thunk": a fusion, a dot, a
    copy ...), counted by kind. Instructions inside a fusion are not counted: a fusion is one kernel."""
    bodies = re.findall(r'body=(%[\w.\-]+)[^\n]*"known_trip_count":\{"n":"' + str(steps) + '"', hlo_text)
    if not bodies:
        return {}
    body = re.search(re.escape(bodies[0]) + r" [^\n]*\{\n(.*?)\n\}", hlo_text, re.S).group(1)
    kinds: dict = {}
    for line in body.splitlines():
        m = re.search(r"= [^=]*?\b([a-z][a-z\-]*)\(", line)
        if m and m.group(1) not in _FREE_OPS:
            kinds[m.group(1)] = kinds.get(m.group(1), 0) + 1
    return kinds


def _unguarded_step(state, tx, grads, loss, batch_stats, diverged_epoch, epoch):
    """``resjax.train.state.guarded_step`` without the divergence check and freeze (for timing only)."""
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    return state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                         batch_stats=batch_stats, opt_state=opt_state), diverged_epoch


def step_profile(model: dict, data, batch_size: int, num_seeds: int, steps: int, repeats: int) -> dict:
    """One training step of ``model`` (``num_seeds`` seeds vmapped on one device): its dense layers' FLOPs
    (``6 x kernel entries x examples``, as section 2 counts them), the kernels it launches, and its time, with
    and without the divergence guard (``guarded_step``: the finiteness check of every gradient and the freeze)."""
    trainer = build_trainer(model, data, batch_size=batch_size)
    carry, batches, hparams = seed_inputs(trainer, num_seeds, steps)
    flops = 6 * dense_kernel_size(trainer) * batch_size * num_seeds  # the dense layers' work, as in section 2
    out = {"model": model, "batch_size": batch_size, "seeds": num_seeds, "steps": steps}
    for name, guard in (("full", None), ("unguarded", _unguarded_step)):
        with mock.patch("resjax.train.core.guarded_step", guard) if guard else contextlib.nullcontext():
            compiled = jax.jit(jax.vmap(train_steps_fn(trainer))).lower(carry, batches, hparams).compile()
        t = time_call(compiled, carry, batches, hparams, repeats=repeats)
        kernels = step_kernels(compiled.as_text(), steps)
        out[name] = {**t, "ms_per_step": t["best_s"] / steps * 1e3, "flops_per_step": flops,
                     "kernels": kernels, "kernels_per_step": sum(kernels.values())}
    return out


# ---- 6. the merge's compilation ---------------------------------------------------------------------

MERGES = {"pre": dict(order="pre"), "pre, rescale": dict(order="pre", scaling="rescale"),
          "post": dict(order="post"), "post, BatchNorm": dict(order="post", norm="batch")}


def largest_fusion(hlo_text: str) -> int:
    """The most operands any fused computation of a compiled program takes."""
    return max((len(re.findall(r"param_\d+\.\d+:", line)) for line in hlo_text.splitlines()
                if line.startswith("%") and "param_" in line), default=0)


def merge_compilation(data, num_seeds: int, steps: int, repeats: int) -> dict:
    """``MERGES`` at depth 32, each with ``computed_once`` (as resjax builds them) and without it."""
    out = {}
    for name, merge in MERGES.items():
        trainer = build_trainer(dict(kind="residual_mlp", num_blocks=32, **merge), data)
        carry, batches, hparams = seed_inputs(trainer, num_seeds, steps)
        for variant, patch in (("computed once", contextlib.nullcontext()),
                               ("fused into consumers", mock.patch("resjax.nn.residual.computed_once",
                                                                   lambda out, summed: out))):
            with patch:
                start = time.perf_counter()
                compiled = jax.jit(jax.vmap(train_steps_fn(trainer))).lower(carry, batches, hparams).compile()
                compile_s = time.perf_counter() - start
            t = time_call(compiled, carry, batches, hparams, repeats=repeats)
            out[f"{name} / {variant}"] = {"compile_s": compile_s, "ms_per_step": t["best_s"] / steps * 1e3,
                                          "largest_fusion": largest_fusion(compiled.as_text()), **t}
    return out


# ---- 4. compile time -------------------------------------------------------------------------------


def compile_time(num_blocks: int, scan: bool, data) -> dict:
    """Seconds to trace+lower and to compile one training step of a BatchNorm ResidualMLP."""
    model = dict(kind="residual_mlp", num_blocks=num_blocks, norm="batch", scan=scan)
    trainer = build_trainer(model, data)
    carry = jax.eval_shape(trainer.init, jax.random.key(0))
    b = trainer.config.train.batch_size
    batch = (jax.ShapeDtypeStruct((b, *trainer.example_shape), jnp.float32), jax.ShapeDtypeStruct((b,), jnp.int32))
    hparams = jax.eval_shape(trainer.default_hparams)
    step = jax.jit(trainer.train_step)
    start = time.perf_counter()
    lowered = step.lower(carry, batch, hparams)
    lowered_at = time.perf_counter()
    lowered.compile()
    done = time.perf_counter()
    return {"lower_s": lowered_at - start, "compile_s": done - lowered_at, "total_s": done - start}


# ---- report ----------------------------------------------------------------------------------------


def report(res: dict) -> None:
    mm, ref = res["matmul"], res["shape_matched_matmul"]
    peak, matched = mm["peak_gflops"], ref["chained"]["gflops"]
    print_table("1. float32 matmul (best of repeats, after warm-up)", ["shape", "time (ms)", "GFLOP/s"],
                [[f"{n} x {n} @ {n} x {n}", f"{r['best_s'] * 1e3:.2f}", f"{r['gflops']:.1f}"]
                 for n, r in mm["sizes"].items()]
                + [[f"{ref['shape']}, chain of {ref['chain']}", f"{ref['chained']['best_s'] * 1e3:.2f}",
                    f"{matched:.1f}"],
                   [f"{ref['shape']}, one call", f"{ref['single_call']['best_s'] * 1e3:.3f}",
                    f"{ref['single_call']['gflops']:.1f}"]])
    print(f"peak (square): {peak:.1f} GFLOP/s; shape-matched (chained): {matched:.1f} GFLOP/s")

    s = res["settings"]
    for key, how in (("training", "vmapped on one device"),
                     ("training_sharded", f"vmapped and sharded over {jax.device_count()} devices")):
        if key not in res:
            continue
        seeds = next(iter(res[key].values()))["seeds"]
        print_table(f"2. training throughput: {seeds} seeds {how}, batch {BATCH_SIZE}, width {WIDTH}, "
                    f"{s['steps']} train steps per call (no evaluation)",
                    ["config", "kernel params", "time (s)", "examples/s", "GFLOP/s", "of peak", "of shape-matched"],
                    [[name, r["dense_kernel_size"], f"{r['best_s']:.3f}", f"{r['examples_per_s']:,.0f}",
                      f"{r['gflops']:.2f}", f"{r['gflops'] / peak:.1%}", f"{r['gflops'] / matched:.1%}"]
                     for name, r in res[key].items()])

    v = res["vmap_vs_sequential"]
    rows = [["vmapped (one program, one device)", f"{v['vmapped']['best_s']:.3f}"],
            ["sequential (one seed at a time)", f"{v['sequential']['best_s']:.3f}"]]
    if "sharded" in v:
        rows.append([f"vmapped and sharded over {v['devices']} devices (Trainer.sweep)", f"{v['sharded']['best_s']:.3f}"])
    print_table(f"3. plain_d32, {v['seeds']} seeds, {v['steps']} train steps each", ["mode", "time (s)"], rows)
    print(f"sequential / vmapped: {v['sequential_over_vmapped']:.2f}x (above 1: vmapping the seeds is faster)")
    if "sharded" in v:
        print(f"sequential / vmapped and sharded: {v['sequential_over_sharded']:.2f}x")

    peak_ms = lambda flops: flops / (peak * 1e9) * 1e3  # noqa: E731  (a step's FLOPs at the square matmul peak)
    rows = []
    for r in res["step_profile"]:
        full, ung = r["full"], r["unguarded"]
        floor = peak_ms(full["flops_per_step"])
        per_kernel = (full["ms_per_step"] - floor) / max(full["kernels_per_step"], 1) * 1e3
        rows.append([f"{r['model']['kind']} {r['model'].get('depth') or r['model'].get('num_blocks')}"
                     f"{' bn' if r['model'].get('norm') == 'batch' else ''}", r["batch_size"],
                     f"{full['flops_per_step'] / 1e6:.1f}", f"{floor:.3f}", f"{full['ms_per_step']:.3f}",
                     f"{floor / full['ms_per_step']:.0%}", full["kernels_per_step"], f"{per_kernel:.1f}",
                     f"{ung['ms_per_step']:.3f}", ung["kernels_per_step"]])
    print_table(f"5. one training step against its FLOPs ({res['step_profile'][0]['seeds']} seeds vmapped, one "
                "device; FLOPs: the dense layers'; floor: those FLOPs at the square matmul peak)",
                ["model", "batch", "MFLOP", "floor (ms)", "step (ms)", "floor/step", "kernels",
                 "us/kernel above floor", "unguarded (ms)", "kernels"], rows)
    print("kernels: top-level operations of the compiled step (fusions, dots, copies), each one launch of XLA:CPU's "
          "runtime; 'unguarded': the same step without the divergence check and freeze (guarded_step)")

    m = res.get("merge_compilation")
    if m:
        print_table(f"6. a block's merge, ResidualMLP depth 32, width {WIDTH}, batch {BATCH_SIZE}, {NUM_SEEDS} seeds "
                    "vmapped on one device", ["merge / its output", "compile (s)", "step (ms)", "largest fusion"],
                    [[name, f"{r['compile_s']:.2f}", f"{r['ms_per_step']:.3f}", r["largest_fusion"]]
                     for name, r in m.items()])
        print("'computed once': resjax.nn.computed_once; 'fused into consumers': the merge before it (patched out)")

    c = res["compile"]
    print_table("4. compile time of one training step, ResidualMLP(width=64, norm='batch')",
                ["blocks K", "mode", "trace+lower (s)", "compile (s)", "total (s)"],
                [[k, mode, f"{r['lower_s']:.2f}", f"{r['compile_s']:.2f}", f"{r['total_s']:.2f}"]
                 for mode in ("scan", "unrolled") for k, r in c[mode].items()])
    scan = c["scan"]
    ks = sorted(scan, key=int)
    if len(ks) > 1:
        lo, hi = ks[0], ks[-1]
        print(f"scan: compile({hi}) / compile({lo}) = {scan[hi]['compile_s'] / scan[lo]['compile_s']:.2f} "
              f"(total with tracing: {scan[hi]['total_s'] / scan[lo]['total_s']:.2f})")


# ---- main ------------------------------------------------------------------------------------------


def run(quick: bool) -> dict:
    s = SETTINGS["quick" if quick else "default"]
    data = load_dataset("mnist1d")
    res = {"settings": {"quick": quick, **s, "batch_size": BATCH_SIZE, "width": WIDTH, "seeds": NUM_SEEDS},
           "machine": {"backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
                       "cpu_count": os.cpu_count(), "platform": platform.platform(), "jax": jax.__version__,
                       "load_avg_1min_at_start": os.getloadavg()[0]}}
    res["matmul"] = matmul_peak(s["matmul_sizes"], s["matmul_repeats"])
    res["shape_matched_matmul"] = shape_matched_matmul(NUM_SEEDS, BATCH_SIZE, WIDTH, s["chain"], s["matmul_repeats"])
    res["training"] = {name: training_throughput(model, data, NUM_SEEDS, s["steps"], s["repeats"])
                       for name, model in CONFIGS.items()}
    if jax.device_count() > 1:  # every core busy: as many seeds per device as the 3 need, sharded
        seeds = -(-NUM_SEEDS // jax.device_count()) * jax.device_count()
        res["training_sharded"] = {
            name: training_throughput(model, data, seeds, s["steps"], s["repeats"], shard=True)
            for name, model in CONFIGS.items()}
    for r in [*res["training"].values(), *res.get("training_sharded", {}).values()]:
        r["fraction_of_peak"] = r["gflops"] / res["matmul"]["peak_gflops"]
        r["fraction_of_shape_matched"] = r["gflops"] / res["shape_matched_matmul"]["chained"]["gflops"]
    res["vmap_vs_sequential"] = vmap_vs_sequential(CONFIGS["plain_d32"], data, s["vmap_seeds"], s["steps"],
                                                   s["repeats"])
    res["step_profile"] = [step_profile(CONFIGS[name], data, b, NUM_SEEDS, s["profile_steps"], s["repeats"])
                           for name in ("plain_d32", "residual_bn_d32") for b in (16, 64)]
    res["merge_compilation"] = merge_compilation(data, NUM_SEEDS, s["profile_steps"], s["repeats"])
    res["compile"] = {"scan": {str(k): compile_time(k, True, data) for k in s["scan_depths"]},
                      "unrolled": {str(k): compile_time(k, False, data) for k in s["unrolled_depths"]}}
    return res


def main(argv=None) -> dict:
    resjax.use_every_cpu_core()  # one JAX device per CPU core, before JAX's first computation
    parser = argparse.ArgumentParser(prog="python -m benchmarks.throughput", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats (seconds, not minutes)")
    parser.add_argument("--out", default="runs/benchmarks/throughput.json", help="JSON output (default: %(default)s)")
    args = parser.parse_args(argv)
    return run_and_write(lambda: run(args.quick), report, args.out)


if __name__ == "__main__":
    main()
