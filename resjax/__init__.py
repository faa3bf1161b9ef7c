"""resjax: residual-network research in JAX/Flax.

Subpackages:
  nn        Flax linen modules (residual contract, MLPs, norms, initialisers)
  train     one training core and two feeders: on-device (``make_train``, seed-vmapped lax.scan runs) and
            host (``make_image_train``, batches from a data source)
  data      data sets (MNIST-1D generated offline; TFDS loaders)
  analysis  pure functions of (module, variables, inputs)
  interop   weights from and to the peers' PyTorch models (torchvision, tau-ResNet, Fixup)

``resjax.analysis``, ``resjax.train`` and ``resjax.data`` (and each of their modules) list their public
names in ``__all__``, the packages re-exporting the main ones of their submodules. Importing ``resjax``
itself imports no subpackage (and no JAX).
"""

from __future__ import annotations

import os

__all__ = ["enable_compilation_cache", "use_every_cpu_core"]

__version__ = "0.1.0"


#: XLA:CPU options that ``use_every_cpu_core`` adds to ``XLA_FLAGS`` (each unless ``XLA_FLAGS`` names it already):
#: convolutions are left to XLA's own (Eigen) kernels instead of YNNPACK, which jaxlib 0.10 hands them to by
#: default; YNNPACK keeps its dots and reductions. On this project's 2-core CPU a CIFAR ResNet-56 training step
#: is faster so (``python -m benchmarks.torch_cpu``: 3.46 s against 3.79 s, idle; 4.79 s against 7.43 s on a loaded
#: machine); programs without convolutions compile unchanged. ``RESJAX_XLA_CPU_FLAGS=0`` leaves it out.
CPU_XLA_FLAGS = ("--xla_cpu_experimental_ynn_fusion_type=-individual_convolution",)
#: Values of ``RESJAX_XLA_CPU_FLAGS`` and ``RESJAX_COMPILATION_CACHE`` that turn the option off.
OFF_VALUES = ("0", "off", "false", "no", "none")
#: The first jaxlib that knows every flag of ``CPU_XLA_FLAGS`` (XLA aborts on a flag it does not know).
CPU_XLA_FLAGS_SINCE = (0, 10, 1)
#: Values of ``RESJAX_FAST_COMPILE`` that turn fast compiles on.
ON_VALUES = ("1", "on", "true", "yes")


def _jaxlib_version() -> tuple[int, ...] | None:
    import re
    from importlib.metadata import PackageNotFoundError, version

    try:
        text = version("jaxlib")
    except PackageNotFoundError:
        return None
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", text)
    return tuple(int(g) for g in match.groups()) if match else None


def _disable_most_optimizations() -> None:
    """XLA's optimisation passes off for this process and the processes it starts, unless
    ``JAX_DISABLE_MOST_OPTIMIZATIONS`` says otherwise already (JAX reads it when it is imported; an imported JAX
    is told directly)."""
    import sys

    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
    if "jax" in sys.modules:
        value = os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"].strip().lower() in ON_VALUES
        sys.modules["jax"].config.update("jax_disable_most_optimizations", value)


def use_every_cpu_core(fast_compile: bool | None = None) -> None:
    """Make every CPU core its own JAX host device, so that seed sweeps shard across cores, and set
    resjax's XLA:CPU options (``CPU_XLA_FLAGS``).

    XLA:CPU runs one small-matmul program on one core about as fast as on two (and a seed-vmapped
    program slower), while one program per core scales with the cores; ``Trainer.sweep`` shards its
    seeds across devices. This sets ``--xla_force_host_platform_device_count`` in ``XLA_FLAGS`` and only
    takes effect before JAX's first computation; it does not change a count that ``XLA_FLAGS`` already
    sets. ``RESJAX_CPU_DEVICES`` overrides the count (1 turns it off). All these devices share one
    thread pool, so a one-device program (a ResNet step) still uses every core.

    ``CPU_XLA_FLAGS`` are added with a jaxlib from ``CPU_XLA_FLAGS_SINCE`` on, each unless ``XLA_FLAGS``
    names that option already; ``RESJAX_XLA_CPU_FLAGS=0`` leaves them out. Accelerator backends are
    unaffected by either.

    ``fast_compile=True`` (default: ``RESJAX_FAST_COMPILE`` set to ``1``) is for runs that compile more than they
    compute: XLA's optimisation passes off (``JAX_DISABLE_MOST_OPTIMIZATIONS=1`` unless that is set already). The
    experiments' ``--quick`` sizes and the test suite run so. Such programs round differently from a default
    compile, and training carries rounding differences further: results are not bit-identical to it. (XLA:CPU's
    older loop emitters, ``--xla_cpu_use_fusion_emitters=false``, would halve the compile time of small programs
    again, but a run chunked differently, or resumed from a checkpoint, then no longer ends bit-identical to the
    run in one program: not used.)
    """
    if fast_compile is None:
        fast_compile = os.environ.get("RESJAX_FAST_COMPILE", "").strip().lower() in ON_VALUES
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        count = int(os.environ.get("RESJAX_CPU_DEVICES", os.cpu_count() or 1))
        if count > 1:
            flags = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    options = []
    if os.environ.get("RESJAX_XLA_CPU_FLAGS", "1").strip().lower() not in OFF_VALUES + ("",):
        options += CPU_XLA_FLAGS
    if fast_compile:
        _disable_most_optimizations()
    jaxlib = _jaxlib_version() if options else None
    if jaxlib is not None and jaxlib >= CPU_XLA_FLAGS_SINCE:
        for flag in options:
            if flag.split("=")[0] not in flags:
                flags = f"{flags} {flag}".strip()
    if flags != os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = flags


def enable_compilation_cache(path: str | os.PathLike | None = None, min_compile_time_secs: float = 0.0) -> str | None:
    """Keep XLA's compiled programs on disk (JAX's persistent compilation cache), so that a later process
    running the same programs loads them instead of compiling them again.

    The folder is ``path``, else ``$RESJAX_COMPILATION_CACHE``, else ``jax`` under ``$RESJAX_CACHE`` (the
    data cache, ``~/.cache/resjax``): ``~/.cache/resjax/jax``. ``RESJAX_COMPILATION_CACHE=0`` (or ``off``,
    ``false``, ``no``, ``none``) turns it off, and so does an empty value. A cache folder chosen for JAX already
    (``JAX_COMPILATION_CACHE_DIR`` or ``jax.config.update('jax_compilation_cache_dir', ...)``) is kept. Every
    program that took at least ``min_compile_time_secs`` to compile is written (JAX's own default is 1 s;
    0 keeps also the small ones that a start-up compiles many of). An entry is found again only for the same
    program, JAX and jaxlib versions, backend and ``XLA_FLAGS``; XLA:CPU refuses to load one compiled for a
    processor with other features. The folder grows with every new program; deleting it is always safe.
    The cache is trusted code: do not point it at a folder that others can write to.

    Call it before JAX compiles (the experiments' entry points call it first, after ``use_every_cpu_core``;
    the benchmarks do not, as they time compilation); programs compiled earlier in the process are not
    written. Imports JAX. Returns the folder in use, or ``None`` when the cache is off (also, with a warning,
    when its folder cannot be made or written).
    """
    env = os.environ.get("RESJAX_COMPILATION_CACHE")
    if path is None and env is not None and env.strip().lower() in OFF_VALUES + ("",):
        return None
    import jax

    current = jax.config.jax_compilation_cache_dir
    if current:
        return str(current)
    if path is None:
        base = os.environ.get("RESJAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "resjax"))
        path = env if env else os.path.join(base, "jax")
    path = os.fspath(path)
    try:  # an optional cache: a folder that cannot be made or written is a warning, not a failed run (#22)
        os.makedirs(path, mode=0o700, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise PermissionError(f"{path} is not writable")
    except OSError as err:
        import warnings

        warnings.warn(f"compilation cache: cannot use {path} ({err}); going on without it "
                      "(RESJAX_COMPILATION_CACHE=0 silences this)", stacklevel=2)
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_secs))
    return path
