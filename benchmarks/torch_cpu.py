"""resjax against PyTorch on this CPU, XLA:CPU's options, and the degradation sweep's start-up, in one run.

Run from the project root (PyTorch is an optional dependency of the benchmarks only:
``pip install -e ".[bench]"``, or ``pip install torch``)::

    python -m benchmarks.torch_cpu [--quick] [--parts step,sweep,pair,startup] [--rounds 3]
                                   [--out runs/benchmarks/torch_cpu.json]

Everything is measured in one sitting, printed as tables and written as JSON (``--out``). Nothing is
asserted. Timings on a shared machine are noisy, so resjax and PyTorch are always measured side by side in
the same process, alternating in rounds, and what is compared is each one's median and their ratio
(``torch / resjax``: above 1, resjax is faster). The 1-minute load average at the start and end is
recorded. Every measurement runs in a fresh subprocess of this module (``--worker``), so ``XLA_FLAGS``
and the device count are set before JAX starts.

1. ``step``: one CIFAR ResNet-56 training step, batch 128 (32x32x3, synthetic CIFAR-10), SGD momentum 0.9,
   learning rate 0.1, coupled weight decay 1e-4 on every parameter. resjax: ``cifar_resnet(56)`` trained by
   ``make_image_train`` (``benchmarks.resnet.build_trainer``: the trainer's own jitted, donating step; BatchNorm,
   option A shortcuts). PyTorch: the same network written here (``torch_cifar_resnet``: 3x3 convs without bias,
   BatchNorm2d with PyTorch's defaults, option A = subsample and append zero channels, global average pool,
   Linear; the parameter counts are asserted equal, 853,018) with ``torch.optim.SGD(lr=0.1, momentum=0.9,
   weight_decay=1e-4)``, ``torch.set_num_threads(2)``, eager, in NCHW and in channels-last. Median seconds per
   step after compile and a warm-up step; images/s; ``torch / resjax``. The same worker compiles the step under
   each of XLA:CPU's per-program options (``STEP_VARIANTS``: ``compile(compiler_options=...)`` and
   ``jax.default_matmul_precision``), so every option is timed against the default in the same process
   (``default``: what resjax's entry points compile, with ``resjax.CPU_XLA_FLAGS``; ``ynn_jaxlib_default``:
   jaxlib's own choice, which hands convolutions to YNNPACK; ``ynn_off``: no YNNPACK at all;
   ``no_multi_thread_eigen``; ``fast_math``; ``--variants all`` adds oneDNN and XNNPACK in YNNPACK's place, the
   fast-runtime preset and ``precision_highest``), and checks its numerics: the losses of the first steps from the same initial state and the parameters after
   one step, against the default program's. The same is done for the degradation sweep's program (plain MLP
   depth 32, MNIST-1D, batch 64, 3 seeds: ``Trainer.run_epochs`` over a few epochs, seeds vmapped
   and sharded over the devices as ``Trainer.sweep`` runs them). The worker runs three times: with every CPU
   core a JAX device (what the entry points do, ``resjax.use_every_cpu_core``), with one device
   (``RESJAX_CPU_DEVICES=1``), and with the process-wide ``XLA_FLAGS`` options that have no per-program form.
2. ``sweep``: the degradation sweep ``plain_d32`` (width 64, 3 seeds, batch 64, SGD lr 0.005, ``--epochs``
   epochs with an evaluation of the whole training and test sets after every epoch) from process start to
   the end of training, with the time split into interpreter start, imports, data, building the trainer,
   tracing, lowering to StableHLO, XLA compilation and execution (JAX's own ``/jax/core/compile/*``
   duration events); then the same sweep again in the same process (compiled: the steady state). One program
   for the whole run (``chunk_epochs=epochs``). Against tuned PyTorch eager, each a fresh process: tensors
   indexed directly (no DataLoader), the same per-epoch evaluation, manual in-place SGD, 1 or 2 threads, the
   seeds one after another (``torch.addmm``, what ``nn.Linear`` runs) or all three in one batched model
   (``torch.baddbmm``); the
   fastest is "tuned PyTorch".
2b. ``pair``: two such cells (other seeds) side by side, as ``experiments.degradation`` runs its cells: resjax
   with ``resjax.train.side_by_side`` (each cell whole on one device), PyTorch with one forked process per cell at
   the same time, 1 thread each; times per cell-epoch.
3. ``startup``: the sweep of 2 again with JAX's persistent compilation cache (``resjax.enable_compilation_cache``
   into a fresh temporary folder): the first start fills it, later starts read it.
"""

from __future__ import annotations

import time

_TOP = time.time()  # when this process reached its first line of Python (the sweep workers' start-up clock)

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

from benchmarks import positive_int, print_table  # noqa: E402  (standard library only)

ROOT = pathlib.Path(__file__).resolve().parents[1]

DEFAULTS = {"depth": 56, "batch_size": 128, "rounds": 3, "steps": 2, "check_steps": 3, "epochs": 30,
            "option_epochs": 3, "seeds": 3, "sweep_batch_size": 64, "sweep_repeats": 2, "startup_repeats": 2}
QUICK = {"depth": 8, "batch_size": 16, "rounds": 1, "steps": 2, "check_steps": 2, "epochs": 2,
         "option_epochs": 0, "seeds": 3, "sweep_batch_size": 64, "sweep_repeats": 1, "startup_repeats": 1}

F = "LIBRARY_FUSION_TYPE_"
#: Programs compiled side by side in the step worker: name -> (``compiler_options``, matmul precision). An option
#: given here replaces the same option of ``XLA_FLAGS`` for that program. ``default`` is what a resjax entry point
#: compiles (``resjax.use_every_cpu_core``: ``resjax.CPU_XLA_FLAGS``); ``ynn_jaxlib_default`` is jaxlib's own
#: choice, what resjax compiled before it set ``CPU_XLA_FLAGS``.
STEP_VARIANTS = {
    "default": ({}, None),
    "ynn_off": ({"xla_cpu_experimental_ynn_fusion_type": ""}, None),
    # jaxlib 0.10's own set (the same program as no option), and that set without convolutions: what
    # --xla_cpu_experimental_ynn_fusion_type=-individual_convolution in XLA_FLAGS selects
    "ynn_jaxlib_default": ({"xla_cpu_experimental_ynn_fusion_type": F + "INDIVIDUAL_DOT," + F + "INDIVIDUAL_CONVOLUTION,"
                            + F + "REDUCE"}, None),
    "ynn_no_convs": ({"xla_cpu_experimental_ynn_fusion_type": F + "INDIVIDUAL_DOT," + F + "REDUCE"}, None),
    "ynn_dots_only": ({"xla_cpu_experimental_ynn_fusion_type": F + "INDIVIDUAL_DOT"}, None),
    "ynn_convs_only": ({"xla_cpu_experimental_ynn_fusion_type": F + "INDIVIDUAL_CONVOLUTION"}, None),
    "xnn_instead": ({"xla_cpu_experimental_ynn_fusion_type": "",
                     "xla_cpu_experimental_xnn_fusion_type": F + "INDIVIDUAL_DOT," + F + "INDIVIDUAL_CONVOLUTION"}, None),
    "onednn_instead": ({"xla_cpu_experimental_ynn_fusion_type": "", "xla_cpu_use_onednn": True,
                        "xla_cpu_experimental_onednn_custom_call": True,
                        "xla_cpu_experimental_onednn_fusion_type": F + "INDIVIDUAL_DOT," + F + "INDIVIDUAL_CONVOLUTION"},
                       None),
    "no_multi_thread_eigen": ({"xla_cpu_multi_thread_eigen": False}, None),
    "fast_math": ({"xla_cpu_enable_fast_math": True}, None),
    "fast_runtime_preset": ({"xla_cpu_opt_preset": "CPU_OPT_PRESET_FAST_RUNTIME"}, None),
    "precision_highest": ({}, "highest"),
}
#: The variants a default run compiles (``--variants all``: every one of ``STEP_VARIANTS``).
DEFAULT_VARIANTS = ("default", "ynn_jaxlib_default", "ynn_off", "no_multi_thread_eigen", "fast_math")
QUICK_VARIANTS = ("default", "ynn_jaxlib_default")
#: The step worker's runs: name -> (environment, variants). ``None`` in the environment removes the variable.
STEP_RUNS = {
    "every core a device": ({}, None),
    "one device": ({"RESJAX_CPU_DEVICES": "1"}, ("default", "ynn_jaxlib_default")),
    "XLA_FLAGS --xla_cpu_use_thunk_runtime=false": ({"RESJAX_EXTRA_XLA_FLAGS": "--xla_cpu_use_thunk_runtime=false"},
                                                    ("default",)),
}
TORCH_SWEEP_VARIANTS = ({"threads": 1, "mode": "batched"}, {"threads": 2, "mode": "batched"},
                        {"threads": 1, "mode": "sequential"})
TORCH_SWEEP_TIMEOUT_S = 600  # a PyTorch variant still running then is recorded as timed out (2 threads on a busy machine)
WIDTH, DEPTH, LEARNING_RATE = 64, 32, 0.005  # experiments.degradation's plain_d32


# ---- the PyTorch models ----------------------------------------------------------------------------


def torch_cifar_resnet(depth: int):
    """He et al.'s CIFAR ResNet (option A, BatchNorm, post-activation) in PyTorch, as ``cifar_resnet(depth)``:
    convs He normal fan-out without bias, BatchNorm2d (eps 1e-5, momentum 0.1), Linear at PyTorch's default."""
    import torch
    import torch.nn.functional as nnf
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv_0 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.norm_0 = nn.BatchNorm2d(cout)
            self.conv_1 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.norm_1 = nn.BatchNorm2d(cout)
            self.stride, self.extra = stride, cout - cin

        def forward(self, x):
            h = self.norm_1(self.conv_1(nnf.relu(self.norm_0(self.conv_0(x)))))
            skip = x
            if self.stride != 1 or self.extra:  # option A: subsample, append zero channels
                skip = nnf.pad(x[:, :, ::self.stride, ::self.stride], (0, 0, 0, 0, 0, self.extra))
            return nnf.relu(skip + h)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            n = (depth - 2) // 6
            self.stem_conv = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
            self.stem_norm = nn.BatchNorm2d(16)
            blocks, cin = [], 16
            for s, width in enumerate((16, 32, 64)):
                for i in range(n):
                    blocks.append(Block(cin, width, 2 if s and not i else 1))
                    cin = width
            self.blocks = nn.Sequential(*blocks)
            self.head = nn.Linear(64, 10)
            for m in self.modules():
                if isinstance(m, nn.Conv2d):
                    nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

        def forward(self, x):
            h = self.blocks(nnf.relu(self.stem_norm(self.stem_conv(x))))
            return self.head(h.mean((2, 3)))

    torch.manual_seed(0)
    return Net()


# ---- worker: the training step side by side --------------------------------------------------------


def progress(message: str) -> None:
    """A worker's progress line (stderr; the parent passes it through)."""
    print(f"  [{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _median_times(times):
    return {"times_s": times, "median_s": statistics.median(times)}


def _block(tree):
    import jax
    return jax.block_until_ready(tree)


def step_worker(spec: dict) -> dict:
    """ResNet step (and degradation sweep program) under each variant, with PyTorch alongside."""
    import hashlib
    import re

    import resjax
    resjax.use_every_cpu_core()
    extra = os.environ.get("RESJAX_EXTRA_XLA_FLAGS")
    if extra:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {extra}".strip()
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from benchmarks.resnet import a_batch, build_trainer

    torch.set_num_threads(2)
    variants = {name: STEP_VARIANTS[name] for name in spec["variants"]}
    depth, batch = spec["depth"], spec["batch_size"]
    out = {"xla_flags": os.environ.get("XLA_FLAGS", ""), "devices": jax.device_count(), "jax": jax.__version__,
           "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "variants": {}}

    def program_key(compiled) -> str:  # the optimised HLO without source locations
        text = re.sub(r", metadata=\{[^}]*\}", "", compiled.as_text())
        return hashlib.sha1(text.encode()).hexdigest()[:12]

    # resjax: one trainer, one program per variant, each from the same initial state
    trainer = build_trainer(depth, batch, min(batch, 32))
    x_np, y_np = a_batch(batch)
    x, y = jnp.asarray(x_np), jnp.asarray(y_np)
    state0 = trainer.init(0)
    step_fn = trainer._compiled("step", False)
    resjax_params = sum(int(np.prod(a.shape)) for a in jax.tree_util.tree_leaves(state0.state.params))
    programs = {}
    for name, (options, precision) in variants.items():
        start = time.perf_counter()
        if precision:
            with jax.default_matmul_precision(precision):
                lowered = jax.jit(trainer._step_one, donate_argnums=0).lower(state0, x, y)
        else:
            lowered = step_fn.lower(state0, x, y)
        compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
        programs[name] = compiled
        progress(f"compiled the step: {name} ({time.perf_counter() - start:.0f} s)")
        out["variants"][name] = {"options": options, "precision": precision, "program": program_key(compiled),
                                 "fusions": sorted(set(re.findall(r'"kind":"(__\w+)"', compiled.as_text()))),
                                 "step_compile_s": time.perf_counter() - start}
        del lowered

    def params_vector(state):
        return np.concatenate([np.ravel(np.asarray(a)) for a in jax.tree_util.tree_leaves(state.state.params)])

    states = {}
    for name, compiled in programs.items():  # numerics: the first steps from the same state
        state = jax.tree_util.tree_map(jnp.copy, state0)
        losses = []
        for k in range(spec["check_steps"]):
            state, (loss, _) = compiled(state, x, y)
            losses.append(float(loss))
            if k == 0:
                after_one = params_vector(state)
        states[name] = state
        out["variants"][name].update(losses=losses, _after_one=after_one)
    ref = out["variants"].get("default", next(iter(out["variants"].values())))
    for v in out["variants"].values():
        p = v.pop("_after_one")
        v["max_loss_diff"] = float(np.max(np.abs(np.array(v["losses"]) - np.array(ref["losses"]))))
        v["params_after_one_step_max_rel_diff"] = float(np.max(np.abs(p - ref.setdefault("_p", p))) /
                                                        np.max(np.abs(ref["_p"])))
    ref.pop("_p", None)

    # PyTorch: the same network, NCHW and channels-last
    net = torch_cifar_resnet(depth)
    torch_params = sum(p.numel() for p in net.parameters())
    assert torch_params == resjax_params, (torch_params, resjax_params)
    xt = torch.from_numpy(np.ascontiguousarray(x_np.transpose(0, 3, 1, 2)))
    yt = torch.from_numpy(y_np.astype(np.int64))
    torch_runs = {}
    for layout in ("nchw", "channels_last"):
        model = torch_cifar_resnet(depth)
        inputs = xt
        if layout == "channels_last":
            model = model.to(memory_format=torch.channels_last)
            inputs = xt.contiguous(memory_format=torch.channels_last)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)

        def torch_step(model=model, opt=opt, inputs=inputs):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(inputs), yt)
            loss.backward()
            opt.step()
            return loss

        torch_step()  # warm-up
        torch_runs["torch_" + layout] = torch_step

    # the degradation sweep's program (plain depth 32), seeds sharded as Trainer.sweep runs them
    mlp = None
    if spec.get("option_epochs"):
        from resjax.data import load_dataset
        from resjax.train import make_train, run_config, shard_over_seeds, train_config

        epochs = spec["option_epochs"]
        tcfg = train_config(learning_rate=LEARNING_RATE, momentum=0.0, epochs=epochs, batch_size=spec["sweep_batch_size"])
        mtrainer = make_train(run_config({"kind": "plain_mlp", "width": WIDTH, "depth": DEPTH}, tcfg, "mnist1d"),
                              load_dataset("mnist1d"))
        num = spec["seeds"]
        keys = jax.random.split(jax.random.key(0), num)
        hp = mtrainer.check_hparams({"learning_rate": np.full(num, LEARNING_RATE, np.float32)}, num)
        pad = (-num) % jax.device_count()
        if pad:
            keys, hp = jax.tree_util.tree_map(lambda a: jnp.concatenate([a, jnp.repeat(a[-1:], pad, 0)]), (keys, hp))
        keys, hp = shard_over_seeds((keys, hp))
        program = jax.jit(jax.vmap(lambda r, h: mtrainer.run_epochs(r, h, epochs)), donate_argnums=0)  # sweep's chunk
        lowered = program.lower(mtrainer._init_runs(keys, hp), hp)
        mlp = {"programs": {}, "epochs": epochs}
        for name, (options, precision) in variants.items():
            if precision:
                with jax.default_matmul_precision(precision):
                    low = program.lower(mtrainer._init_runs(keys, hp), hp)
            else:
                low = lowered
            start = time.perf_counter()
            compiled = low.compile(compiler_options=options) if options else low.compile()
            run, _ = compiled(mtrainer._init_runs(keys, hp), hp)  # untimed first call
            loss = np.asarray(run.history["train_loss"])[:num, 0]
            mlp["programs"][name] = compiled
            progress(f"compiled the sweep program: {name} ({time.perf_counter() - start:.0f} s)")
            out["variants"][name].update(sweep_compile_s=time.perf_counter() - start,
                                         sweep_first_epoch_loss=[float(v) for v in loss])

    # timing: rounds; in each round every program runs `steps` calls, the order rotating between rounds
    names = list(programs) + list(torch_runs)
    times = {n: [] for n in names}
    cpu = {n: [] for n in names}
    sweep_times = {n: [] for n in (mlp["programs"] if mlp else ())}
    for r in range(spec["rounds"]):
        progress(f"timing round {r + 1}/{spec['rounds']}")
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            for _ in range(spec["steps"]):
                c0, t0 = time.process_time(), time.perf_counter()
                if n in torch_runs:
                    torch_runs[n]()
                else:
                    states[n], o = programs[n](states[n], x, y)
                    _block((states[n], o))
                times[n].append(time.perf_counter() - t0)
                cpu[n].append(time.process_time() - c0)
        for n in (list(sweep_times)[r % max(len(sweep_times), 1):] + list(sweep_times)[:r % max(len(sweep_times), 1)]):
            run0 = _block(mtrainer._init_runs(keys, hp))
            t0 = time.perf_counter()
            _block(mlp["programs"][n](run0, hp))
            sweep_times[n].append(time.perf_counter() - t0)
    for n in names:
        d = {**_median_times(times[n]), "cpu_s_per_step": statistics.median(cpu[n]),
             "images_per_s": batch / statistics.median(times[n])}
        d["cpu_utilisation"] = d["cpu_s_per_step"] / d["median_s"]
        if n in torch_runs:
            out[n] = d
        else:
            out["variants"][n].update(step=d)
    for n, ts in sweep_times.items():
        out["variants"][n]["sweep"] = {**_median_times(ts), "per_epoch_s": statistics.median(ts) / mlp["epochs"]}
    out["params"] = {"resjax": resjax_params, "torch": torch_params}
    return out


# ---- worker: the degradation sweep from process start ----------------------------------------------


class _Events:
    """Accumulates JAX's monitoring events (durations and counts) from registration on."""

    def __init__(self):
        from jax import monitoring
        self.totals: dict[str, float] = {}
        monitoring.register_event_duration_secs_listener(self._duration)
        monitoring.register_event_listener(self._event)

    def _duration(self, name, seconds, **kwargs):
        self.totals[name] = self.totals.get(name, 0.0) + seconds

    def _event(self, name, **kwargs):
        self.totals[name] = self.totals.get(name, 0) + 1

    def snapshot(self) -> dict:
        return dict(self.totals)


def _diff(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def sweep_worker(spec: dict) -> dict:
    """The degradation sweep plain_d32 as an entry point runs it; phases from this process's start."""
    phases, stamps = {}, {"top": _TOP}
    t = time.time()

    def mark(name):
        nonlocal t
        now = time.time()
        phases[name] = now - t
        t = now

    import resjax
    resjax.use_every_cpu_core()  # what experiments.common.start() does first
    import jax
    mark("import_jax")
    import flax.linen  # noqa: F401
    import optax  # noqa: F401
    mark("import_flax_optax")
    import orbax.checkpoint  # noqa: F401  (resjax.train.checkpoint imports it)
    mark("import_orbax")
    import numpy as np

    from experiments.degradation import CONFIGS  # what python -m experiments.degradation imports
    from resjax.data import load_dataset
    from resjax.train import make_train, run_config, side_by_side, train_config
    mark("import_resjax_experiments")
    cache = None
    if spec.get("cache"):
        os.environ["RESJAX_COMPILATION_CACHE"] = spec["cache"]
        cache = resjax.enable_compilation_cache()
    events = _Events()
    mark("cache_setup")
    data = load_dataset("mnist1d")
    mark("data")
    tcfg = train_config(learning_rate=LEARNING_RATE, momentum=0.0, epochs=spec["epochs"],
                        batch_size=spec["sweep_batch_size"])
    trainer = make_train(run_config({"width": WIDTH, **CONFIGS["plain_d32"]}, tcfg, "mnist1d"), data)
    mark("build_trainer")
    e0 = events.snapshot()
    num, cells = spec["seeds"], spec.get("cells", 1)
    keys = jax.random.split(jax.random.key(0), num * cells)
    lrs = np.full(num, LEARNING_RATE, np.float32)
    jobs = [functools.partial(trainer.sweep, keys[c * num:(c + 1) * num], {"learning_rate": lrs},
                              chunk_epochs=spec["epochs"]) for c in range(cells)]

    def sweep():  # one cell: its seeds over every device; several: side by side, each on one device
        return jobs[0]() if cells == 1 else side_by_side(jobs)[0]

    _, metrics = sweep()
    mark("first_sweep")
    stamps["first_sweep_done"] = time.time()
    ev = _diff(events.snapshot(), e0)
    compile_ev = {"trace_s": ev.get("/jax/core/compile/jaxpr_trace_duration", 0.0),
                  "lower_s": ev.get("/jax/core/compile/jaxpr_to_mlir_module_duration", 0.0),
                  "compile_s": ev.get("/jax/core/compile/backend_compile_duration", 0.0),
                  "cache_hits": ev.get("/jax/compilation_cache/cache_hits", 0),
                  "cache_misses": ev.get("/jax/compilation_cache/cache_misses", 0),
                  "cache_retrieval_s": ev.get("/jax/compilation_cache/cache_retrieval_time_sec", 0.0)}
    compile_ev["execute_and_rest_s"] = phases["first_sweep"] - (compile_ev["trace_s"] + compile_ev["lower_s"]
                                                                  + compile_ev["compile_s"])
    out = {"phases": phases, "first_sweep": compile_ev, "stamps": stamps, "devices": jax.device_count(),
           "cache": cache, "final_train_error_pct": [float(v) for v in 100 * metrics["train_error"][:, -1]],
           "final_train_loss": [float(v) for v in metrics["train_loss"][:, -1]]}
    if spec.get("steady"):
        start = time.perf_counter()
        sweep()
        out["steady_s"] = time.perf_counter() - start
        out["steady_per_epoch_s"] = out["steady_s"] / spec["epochs"] / cells  # per cell
    return out


def torch_sweep_worker(spec: dict) -> dict:
    """The same sweep in PyTorch eager, tuned: tensors indexed directly, in-place SGD, no per-step sync."""
    phases, stamps = {}, {"top": _TOP}
    t = time.time()

    def mark(name):
        nonlocal t
        now = time.time()
        phases[name] = now - t
        t = now

    import torch
    import torch.nn.functional as nnf
    mark("import_torch")
    from resjax.data import load_dataset  # numpy only, no JAX
    data = load_dataset("mnist1d")
    xtr, ytr = torch.from_numpy(data.x_train).float(), torch.from_numpy(data.y_train).long()
    xte, yte = torch.from_numpy(data.x_test).float(), torch.from_numpy(data.y_test).long()
    mark("data")
    torch.set_num_threads(spec["threads"])
    epochs, batch, num, lr = spec["epochs"], spec["sweep_batch_size"], spec["seeds"], LEARNING_RATE
    n = len(ytr)
    steps = n // batch
    sizes = [(xtr.shape[1], WIDTH)] + [(WIDTH, WIDTH)] * DEPTH + [(WIDTH, 10)]

    def init(seeds: int, key: int):  # He uniform on the fan-in (kaiming_uniform_'s defaults), zero biases
        g = torch.Generator().manual_seed(1234 + key)
        lead = (seeds,) if seeds > 1 else ()  # one seed: plain 2-D weights (addmm, as nn.Linear)
        ws = [((torch.rand(*lead, i, o, generator=g) * 2 - 1) * (6 / i) ** 0.5).requires_grad_() for i, o in sizes]
        bs = [torch.zeros(*lead, 1, o, requires_grad=True) for _, o in sizes]
        return ws, bs

    def forward(ws, bs, h):  # h: (seeds, batch, 40) or (batch, 40)
        mm = torch.baddbmm if h.dim() == 3 else torch.addmm
        for k, (w, b) in enumerate(zip(ws, bs)):
            h = mm(b, h, w)
            if k < len(ws) - 1:
                h = torch.relu(h)
        return h

    def train(seeds: int, key: int):
        ws, bs = init(seeds, key)
        params = ws + bs
        gen = torch.Generator().manual_seed(key)
        lead = (seeds,) if seeds > 1 else ()
        x_all, x_test = (xtr.expand(seeds, -1, -1), xte.expand(seeds, -1, -1)) if seeds > 1 else (xtr, xte)
        history = []
        for _ in range(epochs):
            idx = torch.stack([torch.randperm(n, generator=gen)[: steps * batch] for _ in range(seeds)], 1)
            idx = idx.view(steps, batch, seeds).permute(0, 2, 1).reshape(steps, *lead, batch)
            loss_sum = torch.zeros(())
            for i in range(steps):
                xb, yb = xtr[idx[i]], ytr[idx[i]]  # (seeds, batch, 40) or (batch, 40)
                logits = forward(ws, bs, xb)
                losses = nnf.cross_entropy(logits.reshape(-1, 10), yb.reshape(-1), reduction="none")
                loss = losses.view(seeds, -1).mean(1).sum()  # each seed's own mean loss
                grads = torch.autograd.grad(loss, params)
                with torch.no_grad():
                    torch._foreach_add_(params, grads, alpha=-lr)
                    loss_sum += loss.detach()
            with torch.inference_mode():  # the whole training and test sets, as Trainer.train_epoch
                train_wrong = (forward(ws, bs, x_all).argmax(-1) != ytr).float().mean(-1).reshape(seeds)
                test_logits = forward(ws, bs, x_test)
                test_loss = nnf.cross_entropy(test_logits.reshape(-1, 10), yte.repeat(seeds))
            history.append((loss_sum / steps / seeds, train_wrong, test_loss))
        return history

    def cell(c: int) -> list:
        if spec["mode"] == "batched":
            histories = [train(num, num * c)]
        else:  # one seed after another, each a (1, ...) model: the same arithmetic as nn.Linear
            histories = [train(1, num * c + s) for s in range(num)]
        return [float(v) for v in torch.cat([h[-1][1] for h in histories])]

    cells = spec.get("cells", 1)
    if cells == 1:
        final = cell(0)
    else:  # independent cells side by side: one forked process each, at the same time
        import multiprocessing
        ctx = multiprocessing.get_context("fork")  # forked: the children run `cell` without pickling it
        results = ctx.Queue()
        children = [ctx.Process(target=lambda c=c: results.put((c, cell(c)))) for c in range(cells)]
        for child in children:
            child.start()
        final = dict(results.get() for _ in children)[0]
        for child in children:
            child.join()
    mark("run")
    stamps["run_done"] = time.time()
    return {"phases": phases, "stamps": stamps, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "final_train_error_pct": [100 * v for v in final],
            "run_per_epoch_s": phases["run"] / epochs / cells}  # per cell


WORKERS = {"step": step_worker, "sweep": sweep_worker, "torch_sweep": torch_sweep_worker}


# ---- the parent: run the workers, one sitting ------------------------------------------------------


def spawn(kind: str, spec: dict, env_changes: dict | None = None, timeout: float | None = None) -> dict | None:
    """Run one worker in a fresh process; its result, with ``wall_s`` (spawn to exit) and the spawn time;
    ``None`` when it ran past ``timeout`` seconds. Its progress lines (stderr) are passed through."""
    env = dict(os.environ)
    for k, v in (env_changes or {}).items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    spawned = time.time()
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.torch_cpu", "--worker", kind, "--spec",
                               json.dumps(spec)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=None, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"  {kind} timed out after {timeout} s", flush=True)
        return None
    wall = time.perf_counter() - start
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"worker {kind} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}")
    res = json.loads(lines[-1][len("RESULT "):])
    res["wall_s"] = wall
    stamps = res.get("stamps", {})
    if "top" in stamps:
        res["interpreter_start_s"] = stamps["top"] - spawned
    for key in ("first_sweep_done", "run_done"):
        if key in stamps:
            res["from_start_s"] = stamps[key] - spawned
    return res


def _load() -> float:
    return os.getloadavg()[0]


def part_step(s: dict, quick: bool, variants_all: tuple[str, ...]) -> dict:
    out = {}
    for label, (env, variants) in STEP_RUNS.items():
        if quick and label != "every core a device":
            continue
        names = QUICK_VARIANTS if quick else (variants or variants_all)
        spec = {**s, "variants": list(names)}
        print(f"step: {label}: {len(names)} programs ...", flush=True)
        out[label] = spawn("step", spec, env)
    return out


def part_sweep(s: dict, quick: bool, cells: int = 1) -> dict:
    """The sweep of one cell (``cells=1``) or of ``cells`` independent cells side by side (resjax:
    ``side_by_side``, each cell on one device; PyTorch: one process per cell at the same time, 1 thread each)."""
    chosen = [v for v in TORCH_SWEEP_VARIANTS if cells == 1 or v["threads"] == 1]
    resjax_runs, torch_runs = [], {json.dumps(v): [] for v in chosen}
    variants = [json.dumps(v) for v in (chosen[:1] if quick else chosen)]
    for r in range(s["sweep_repeats"]):
        print(f"sweep of {cells} cell(s): repeat {r + 1}/{s['sweep_repeats']} ...", flush=True)
        no_cache = {"RESJAX_COMPILATION_CACHE": "0", "JAX_COMPILATION_CACHE_DIR": None}
        resjax_runs.append(spawn("sweep", {**s, "steady": True, "cells": cells}, no_cache))
        for v in variants:
            done = spawn("torch_sweep", {**s, **json.loads(v), "cells": cells}, timeout=TORCH_SWEEP_TIMEOUT_S)
            torch_runs[v].append(done if done else {"timed_out_s": TORCH_SWEEP_TIMEOUT_S})
        # a PyTorch variant 3x slower than the fastest (or timed out) is not "tuned PyTorch": not repeated
        per_epoch = {v: _med([t.get("run_per_epoch_s", float("inf")) for t in torch_runs[v]]) for v in variants}
        variants = [v for v in variants if per_epoch[v] < 3 * min(per_epoch.values())]
    torch_runs = {k: v for k, v in torch_runs.items() if v}
    return {"resjax": resjax_runs, "torch": torch_runs}


def part_startup(s: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="resjax-jax-cache-") as cache:
        print("startup: first start with an empty compilation cache ...", flush=True)
        own = {"JAX_COMPILATION_CACHE_DIR": None}  # this folder, not one the environment names (a test run's)
        cold = spawn("sweep", {**s, "cache": cache}, own)
        warm = []
        for r in range(s["startup_repeats"]):
            print(f"startup: start {r + 2} reading the cache ...", flush=True)
            warm.append(spawn("sweep", {**s, "cache": cache}, own))
        size = sum(f.stat().st_size for f in pathlib.Path(cache).rglob("*") if f.is_file())
        entries = sum(1 for f in pathlib.Path(cache).rglob("*") if f.is_file())
    return {"cold": cold, "warm": warm, "cache_bytes": size, "cache_files": entries}


def _med(values):
    return statistics.median(values) if values else float("nan")


def summarise(res: dict) -> dict:
    """The headline numbers: ratios before and after."""
    out = {}
    step = res.get("step", {}).get("every core a device")
    if step:
        torch_best = min(step["torch_nchw"]["median_s"], step["torch_channels_last"]["median_s"])
        out["resnet_step"] = {n: {"resjax_s": v["step"]["median_s"], "torch_s": torch_best,
                                  "torch_over_resjax": torch_best / v["step"]["median_s"]}
                              for n, v in step["variants"].items()}
    for part in ("sweep", "pair"):
        sweep = res.get(part)
        if not sweep:
            continue
        rj = sweep["resjax"]
        done = {k: [r for r in v if "run_per_epoch_s" in r] for k, v in sweep["torch"].items()}
        done = {k: v for k, v in done.items() if v}
        best_key = min(done, key=lambda k: _med([r["run_per_epoch_s"] for r in done[k]]))
        tb = done[best_key]
        out[part] = sw = {"torch_variant": json.loads(best_key),
                          "resjax_steady_per_epoch_s": _med([r["steady_per_epoch_s"] for r in rj]),
                          "torch_per_epoch_s": _med([r["run_per_epoch_s"] for r in tb]),
                          "resjax_from_start_s": _med([r["from_start_s"] for r in rj]),
                          "torch_from_start_s": _med([r["from_start_s"] for r in tb])}
        sw["steady_torch_over_resjax"] = sw["torch_per_epoch_s"] / sw["resjax_steady_per_epoch_s"]
        sw["from_start_torch_over_resjax"] = sw["torch_from_start_s"] / sw["resjax_from_start_s"]
    if "sweep" in out:
        sw = out["sweep"]
        if res.get("startup"):
            warm = _med([r["from_start_s"] for r in res["startup"]["warm"]])
            sw["resjax_from_start_cached_s"] = warm
            sw["from_start_torch_over_resjax_cached"] = sw["torch_from_start_s"] / warm
    return out


# ---- report ----------------------------------------------------------------------------------------


def _sweep_rows(sw: dict) -> list[list]:
    """The rows of a sweep part's table: each resjax and PyTorch run, from process start, by phase."""
    rows = []
    for r in sw["resjax"]:
        p, f = r["phases"], r["first_sweep"]
        rows.append(["resjax (no compilation cache)", f"{r['from_start_s']:.2f}", f"{r['interpreter_start_s']:.2f}",
                     f"{sum(v for k, v in p.items() if k.startswith('import')):.2f}", f"{p['data']:.2f}",
                     f"{p['build_trainer']:.2f}", f"{f['trace_s']:.2f}", f"{f['lower_s']:.2f}", f"{f['compile_s']:.2f}",
                     f"{f['execute_and_rest_s']:.2f}", f"{r['steady_per_epoch_s'] * 1e3:.1f}"])
    for key, runs in sw["torch"].items():
        v = json.loads(key)
        for r in runs:
            if "timed_out_s" in r:
                rows.append([f"PyTorch {v['mode']}, {v['threads']} thread(s)", f"> {r['timed_out_s']} (stopped)"]
                            + ["-"] * 9)
                continue
            p = r["phases"]
            rows.append([f"PyTorch {v['mode']}, {v['threads']} thread(s)", f"{r['from_start_s']:.2f}",
                         f"{r['interpreter_start_s']:.2f}", f"{p['import_torch']:.2f}", f"{p['data']:.2f}", "-", "-",
                         "-", "-", f"{p['run']:.2f}", f"{r['run_per_epoch_s'] * 1e3:.1f}"])
    return rows


def report(res: dict) -> None:
    s = res["settings"]
    for label, run in res.get("step", {}).items():
        torch_best = min(run["torch_nchw"]["median_s"], run["torch_channels_last"]["median_s"])
        rows = []
        for n, v in run["variants"].items():
            st = v["step"]
            same = "same" if v["program"] == run["variants"].get("default", v)["program"] else "differs"
            sweep = v.get("sweep")
            rows.append([n, f"{st['median_s'] * 1e3:,.0f}", f"{st['images_per_s']:.1f}", f"{st['cpu_utilisation']:.2f}",
                         f"{torch_best / st['median_s']:.2f}", f"{v['step_compile_s']:.1f}", same,
                         f"{v['max_loss_diff']:.1e}", f"{v['params_after_one_step_max_rel_diff']:.1e}",
                         f"{sweep['per_epoch_s'] * 1e3:.1f}" if sweep else "-"])
        for layout in ("torch_nchw", "torch_channels_last"):
            t = run[layout]
            rows.append([f"PyTorch {layout[6:]} ({run['torch_threads']} threads)",
                         f"{t['median_s'] * 1e3:,.0f}", f"{t['images_per_s']:.1f}", f"{t['cpu_utilisation']:.2f}",
                         "-", "-", "-", "-", "-", "-"])
        print_table(f"1/3. CIFAR ResNet-{s['depth']} training step, batch {s['batch_size']}, {label} "
                    f"({run['devices']} device(s)); median of {s['rounds']} rounds x {s['steps']} steps; "
                    f"sweep: plain_d32, {s['seeds']} seeds, {s['option_epochs']} epochs",
                    ["program", "step (ms)", "images/s", "CPU s / s", "torch/resjax", "compile (s)", "HLO",
                     "loss diff", "param diff", "sweep ms/epoch"], rows)
        print(f"XLA_FLAGS={run['xla_flags']!r}")
    for part in ("sweep", "pair"):
        if part not in res:
            continue
        rows = _sweep_rows(res[part])
        if part == "sweep" and "startup" in res:
            st = res["startup"]
            for label, r in [("resjax, cache: first start (fills it)", st["cold"])] + [
                    ("resjax, cache: later start (reads it)", w) for w in st["warm"]]:
                p, f = r["phases"], r["first_sweep"]
                rows.append([label, f"{r['from_start_s']:.2f}", f"{r['interpreter_start_s']:.2f}",
                             f"{sum(v for k, v in p.items() if k.startswith('import')):.2f}", f"{p['data']:.2f}",
                             f"{p['build_trainer']:.2f}", f"{f['trace_s']:.2f}", f"{f['lower_s']:.2f}",
                             f"{f['compile_s']:.2f}", f"{f['execute_and_rest_s']:.2f}", "-"])
        what = ("" if part == "sweep" else
                f"; {PAIR} cells side by side (resjax: side_by_side, one per device; PyTorch: one process per cell at "
                "once), steady ms per cell-epoch")
        print_table(f"2/4. Degradation sweep plain_d32 (width 64, {s['seeds']} seeds, batch {s['sweep_batch_size']}, "
                    f"{s['epochs']} epochs) from process start (s){what}",
                    ["run", "total", "interpreter", "imports", "data", "build", "trace", "lower", "compile",
                     "execute+rest", "steady ms/epoch"], rows)
    summ = res.get("summary", {})
    if "resnet_step" in summ:
        d = summ["resnet_step"]
        print("\nResNet step, torch/resjax (above 1: resjax faster): " +
              ", ".join(f"{n} {v['torch_over_resjax']:.2f}" for n, v in d.items()))
    for part, label in (("sweep", "sweep"), ("pair", f"{PAIR} cells side by side")):
        if part not in summ:
            continue
        sw = summ[part]
        line = (f"{label}: tuned PyTorch ({sw['torch_variant']['mode']}, {sw['torch_variant']['threads']} threads) / "
                f"resjax: steady {sw['steady_torch_over_resjax']:.2f}x, from process start "
                f"{sw['from_start_torch_over_resjax']:.2f}x")
        if "from_start_torch_over_resjax_cached" in sw:
            line += f", from start with the compilation cache {sw['from_start_torch_over_resjax_cached']:.2f}x"
        print(line)


# ---- main ------------------------------------------------------------------------------------------


PARTS = ("step", "sweep", "pair", "startup")
PAIR = 2  # the cells of the "pair" part: one per core of this project's 2-core CPU


def run(quick: bool, parts=PARTS, variants: tuple[str, ...] = DEFAULT_VARIANTS, out: pathlib.Path | None = None,
        **overrides) -> dict:
    s = {**(QUICK if quick else DEFAULTS), **{k: v for k, v in overrides.items() if v is not None}}
    import torch  # noqa: F401  (fail early, with the install hint, when PyTorch is missing)

    res = {"settings": {"quick": quick, "parts": list(parts), **s},
           "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0],
                       "load_avg_1min_at_start": _load()}}
    parts_fn = {"step": lambda: part_step(s, quick, variants), "sweep": lambda: part_sweep(s, quick),
                "pair": lambda: part_sweep(s, quick, cells=PAIR), "startup": lambda: part_startup(s)}
    for part in PARTS:
        if part in parts:
            res[part] = parts_fn[part]()
            if out is not None:  # what is done so far, in case a later part is stopped
                out.write_text(json.dumps(res, indent=1))
    res["machine"]["load_avg_1min_at_end"] = _load()
    res["summary"] = summarise(res)
    return res


def main(argv=None) -> dict | None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.torch_cpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="ResNet-8 at batch 16, two programs, no sweep programs in the step part, 2 epochs, "
                             "one PyTorch variant (80 s on a 2-core CPU)")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of %(default)s")
    parser.add_argument("--rounds", type=positive_int, help="timing rounds of the step worker (default 3)")
    parser.add_argument("--epochs", type=positive_int, help="epochs of the sweep from process start (default 30)")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"programs of the step part, or 'all' ({', '.join(STEP_VARIANTS)}); default %(default)s")
    parser.add_argument("--out", default="runs/benchmarks/torch_cpu.json", help="JSON output (default: %(default)s)")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        result = WORKERS[args.worker](json.loads(args.spec))
        print("RESULT " + json.dumps(result), flush=True)
        return None
    try:
        import torch  # noqa: F401
    except ImportError:
        parser.error('PyTorch is not installed: pip install -e ".[bench]" (or pip install torch)')
    parts = tuple(p.strip() for p in args.parts.split(",") if p.strip())
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"--parts: unknown {sorted(unknown)}; choose from {PARTS}")
    variants = tuple(STEP_VARIANTS) if args.variants == "all" else tuple(
        v.strip() for v in args.variants.split(",") if v.strip())
    unknown = set(variants) - set(STEP_VARIANTS)
    if unknown or "default" not in variants:
        parser.error(f"--variants: must include 'default' and name only {tuple(STEP_VARIANTS)}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    res = run(args.quick, parts, variants, out, rounds=args.rounds, epochs=args.epochs)
    res["wall_s"] = time.perf_counter() - start
    report(res)
    out.write_text(json.dumps(res, indent=1))
    print(f"\nbenchmark took {res['wall_s']:.0f} s; wrote {out}")
    return res


if __name__ == "__main__":
    main()
