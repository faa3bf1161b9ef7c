"""Run control: ``main(module)``, the command line of every experiment, and ``run_experiment``, one run.

``main`` parses and preflights the command line (``experiments.flags``), runs the experiment and writes
``DIR/results.json`` = ``{"experiment", "config", "metrics", "seconds"}``, then its figures (``experiments.figures``);
``seconds`` is the run's wall time over every session of it, a stopped run and the sessions that resumed it
(``experiments.checkpoints``).
Checkpoints and stop signals are ``experiments.checkpoints``'; a folder another run holds, unusable checkpoints
and stop signals end the process with one message and a status (1, 1, 143/130), never a traceback. ``start`` is
what an entry point does before JAX's first computation, ``release_memory`` what ``reproduce`` does between
experiments.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import sys
import time

import ml_collections

from experiments import checkpoints, files
from experiments.figures import deferred_figures, pyplot, write_figure
from experiments.files import FolderInUseError, is_main
from experiments.flags import parse_args
from experiments.results import describe_results, to_jsonable


def run_experiment(module, config: ml_collections.ConfigDict, out_dir: pathlib.Path, checkpoint_dir=None,
                   fresh: bool = False) -> dict:
    """Run ``module`` with ``config``, write ``results.json`` into ``out_dir`` and return its content.

    An existing ``results.json`` there is replaced, and what it held is printed (``describe_results``).
    With several processes every process runs the experiment and returns the results; process 0 alone
    writes them (and the figures, ``save_figure``). Every training cell checkpoints into ``checkpoint_dir``
    (default ``out_dir/checkpoints``; ``'none'``: nowhere) and the same call again resumes from there;
    ``fresh`` trains every cell from its start (``experiments.checkpoints``). A folder another running process
    holds (this output folder, the checkpoint root, a cell's folder that ``fresh`` would empty) is refused with
    ``experiments.files.FolderInUseError`` naming that process, before anything there is changed."""
    root = checkpoints.resolve(checkpoint_dir, out_dir)
    # Every folder this run writes or deletes in is locked before anything there changes (#22, #32): the output
    # folder here, the checkpoint root by the session, a cell's folder before --fresh empties it. Another run's
    # folder is refused (files.FolderInUseError, naming its process), with nothing deleted.
    with files.lock_folder(out_dir, "out"):
        with checkpoints.session(root, module.NAME, to_jsonable(config), fresh, locked=out_dir) as cells:
            return _run_experiment(module, config, out_dir, cells)


def _run_experiment(module, config: ml_collections.ConfigDict, out_dir: pathlib.Path, cells=None) -> dict:
    main = is_main()
    if main:
        out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.json"
    if path.exists() and main:
        print(f"{module.NAME}: {path} exists and will be replaced when this run ends: "
              f"{describe_results(path, module)}", flush=True)
    resuming = cells is not None and cells.resuming
    if resuming and main:
        print(f"{module.NAME}: resuming the run of this config from its checkpoints in {cells.root} (finished cells "
              "load without training; --fresh starts over)", flush=True)
    start = time.time()
    from resjax.train.monitor import log_to

    # metrics.jsonl (and with RESJAX_TENSORBOARD=1 TensorBoard files) in out_dir as training goes; progress lines.
    # A resumed run keeps its file (each cell drops its lines past its checkpoint and adds those it lacks).
    with log_to(out_dir, name=module.NAME, progress=True, fresh=not resuming,
                tensorboard=os.environ.get("RESJAX_TENSORBOARD", "0") not in ("", "0")), deferred_figures() as figures:
        metrics = module.run(config, out_dir)
    earlier = cells.earlier if cells is not None else 0.0  # the seconds of the earlier sessions of a resumed run
    with checkpoints.signals_deferred():  # a stop signal now waits for the results and figures to be written
        return _write_results(module, config, out_dir, metrics, start, figures, earlier)


def _write_results(module, config, out_dir: pathlib.Path, metrics: dict, start: float, figures: list,
                   earlier: float = 0.0) -> dict:
    """``results.json`` and the figures; ``seconds``: the wall time of the run, this session's (since ``start``)
    and that of the ``earlier`` sessions it resumed (``experiments.checkpoints``)."""
    main = is_main()
    path = out_dir / "results.json"
    session = time.time() - start
    results = {
        "experiment": module.NAME,
        "config": to_jsonable(config),
        "metrics": to_jsonable(metrics),
        "seconds": round(earlier + session, 2),
    }
    if not main:
        return results
    if earlier:
        print(f"{module.NAME}: {session:.1f} s in this session and {earlier:.1f} s in the earlier ones it resumed: "
              f"results.json's seconds are the {results['seconds']:.1f} s of the whole run", flush=True)
    if path.exists():
        print(f"{module.NAME}: replacing {describe_results(path, module)}", flush=True)
    files.write_atomically(path, lambda tmp: tmp.write_text(json.dumps(results, indent=1)))
    for fig, figure_path, dpi in figures:  # after the results: a figure that cannot be written loses nothing else
        try:
            write_figure(fig, figure_path, dpi)
        except OSError as err:
            print(f"{module.NAME}: could not write the figure {figure_path} ({err}); {path} was written",
                  file=sys.stderr, flush=True)
        finally:
            pyplot().close(fig)
    return results


def release_memory() -> None:
    """Give the memory a finished experiment held back to the system before the next one starts (``reproduce``
    runs every experiment in one process): collect Python's garbage, drop JAX's compiled programs
    (``jax.clear_caches``; a later use compiles again or loads from the compilation cache) and return the C heap's
    free pages (glibc's ``malloc_trim``). Without it the freed heap of each experiment stays resident and
    fragmented: a default reproduce (degradation left out) reached 5.7 GB at tau_stability, whose own process
    peaks at 3.0 GB; a finished experiment's process holds 1.5 GB of which 0.3 GB stays after the trim. Changes
    no result."""
    import ctypes
    import gc

    import jax

    gc.collect()
    jax.clear_caches()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS): nothing to trim
        pass


def start(argv=None) -> None:
    """What an entry point does before JAX's first computation: every CPU core a device
    (``resjax.use_every_cpu_core``, so seed sweeps shard across cores), with fast compiles when the command line
    (``argv``, default ``sys.argv[1:]``) asks for ``--quick`` sizes, whose programs take longer to compile than to
    run (``use_every_cpu_core(fast_compile=True)``: XLA's optimisation passes off; ``RESJAX_FAST_COMPILE`` set to
    ``0`` or ``1`` decides instead), compiled programs kept on disk for
    the next run (``resjax.enable_compilation_cache``: ``~/.cache/resjax/jax``; ``RESJAX_COMPILATION_CACHE=0``
    turns it off) and, when the environment asks for several processes, ``jax.distributed.initialize()``
    (``resjax.train.distributed.initialize_if_needed``)."""
    import resjax

    quick = "--quick" in (sys.argv[1:] if argv is None else argv)
    resjax.use_every_cpu_core(fast_compile=None if "RESJAX_FAST_COMPILE" in os.environ else quick)
    resjax.enable_compilation_cache()
    from resjax.train.distributed import initialize_if_needed

    initialize_if_needed()


@contextlib.contextmanager
def unusable_checkpoints_end_the_run(name: str):
    """An entry point's ``CheckpointError`` (a cell's checkpoints that cannot be used: every step damaged, say)
    as resjax's message and how to go on, exit status 1, without a Python traceback."""
    from resjax.train.checkpoint import CheckpointError

    try:
        yield
    except CheckpointError as err:
        print(f"{name}: {err}\n{name}: nothing of that cell was trained in this run. To train it again, remove "
              f"{err.directory} (the other cells keep their checkpoints) and run the same command, or add --fresh "
              "to train every cell from its start.", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


#: The exit status of a run refused because another run holds its folder (``os.EX_TEMPFAIL``): a restart loop
#: tries again later (``docs/howto/buckets.md``); every other refusal exits with 1 or 2.
IN_USE_STATUS = 75


@contextlib.contextmanager
def folder_in_use_ends_the_run(name: str):
    """An entry point's unusable folder as one line, without a Python traceback: a ``FolderInUseError`` (its output
    or checkpoint folder held by another running process: ``experiments.files``; nothing in that folder was
    changed) exits with :data:`IN_USE_STATUS`, 75 (``EX_TEMPFAIL``: try again later, as a restart loop does when a
    lost VM's lease has not yet run out); a ``resjax.train.storage.StorageError`` (a full disk, a read-only file
    system, no permission, while locking, saving a checkpoint or writing results: the line names the folder, what
    to free or change and which checkpoint is intact) exits with status 1."""
    from resjax.train.storage import StorageError

    try:
        yield
    except (FolderInUseError, StorageError) as err:
        print(f"{name}: {err}", file=sys.stderr, flush=True)
        raise SystemExit(IN_USE_STATUS if isinstance(err, FolderInUseError) else 1) from None


def main(module, argv=None) -> dict:
    """The command line of ``module`` (a module or its name, e.g. ``__name__``)."""
    start(argv)
    if isinstance(module, str):
        module = sys.modules[module]
    options: dict = {}
    config, out_dir = parse_args(module, argv, check=True, options=options)
    with folder_in_use_ends_the_run(module.NAME), unusable_checkpoints_end_the_run(module.NAME), \
            checkpoints.stop_signals(module.NAME):  # 143/130 (#22)
        results = run_experiment(module, config, out_dir, options["checkpoint_dir"], options["fresh"])
    if is_main():
        print(f"{module.NAME}: wrote {out_dir / 'results.json'} and {out_dir / (module.NAME + '.png')} "
              f"in {results['seconds']:.1f} s")
    return results
