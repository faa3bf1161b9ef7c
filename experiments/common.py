"""The experiment contract: config flags, ``results.json``, claims.

``main(module)`` parses ``[--quick | --full] [--out DIR] [--<setting> VALUE ...]`` where every leaf of
the module's ``get_config(size)`` (an ``ml_collections.ConfigDict``; nested leaves as ``--a.b``) is a
flag, preflights the run (``preflight``: finite floats, counts, the module's ``check(config)`` hook that
validates every cell it will run, the output folder; a refused value is an argparse error naming its flag,
exit status 2), runs the experiment, and writes ``DIR/results.json`` =
``{"experiment", "config", "metrics", "seconds"}`` (``DIR``: ``--out``, else ``runs/<name>``, or
``runs/<name>-quick`` with ``--quick``). Metrics are flat dotted names mapping to numbers
or (nested) lists of numbers; NaN and infinities are written as JSON ``null``.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import json
import math
import os
import pathlib
import re
import sys
import tempfile
import time
from typing import Any, Callable

import ml_collections
import numpy as np

from resjax.train.config import DICT_SETTINGS, is_int  # noqa: F401  (experiments use common.is_int)

SIZES = ("quick", "default", "full")


@dataclasses.dataclass(frozen=True)
class Claim:
    """One claim of a seed document, checked against an experiment's metrics.

    ``measure(metrics)`` returns the measured value (a number or a short string) and ``holds(metrics)``
    whether the claim holds (``None`` for a number reported beside the seed's without a pass/fail
    test). ``seed_value`` is the document's number as text. ``probe_threshold``: the pass/fail threshold
    was set after a probe run of the experiment (its docstring says which run); the report marks such claims
    "threshold set after a probe".
    """

    text: str
    source: str
    seed_value: str
    measure: Callable[[dict], Any]
    holds: Callable[[dict], bool | None]
    probe_threshold: bool = False


def flatten(config: ml_collections.ConfigDict, prefix: str = "") -> dict[str, Any]:
    """``{'train.learning_rate': 0.005, ...}``: every setting by its flag name; a dict setting (an optax
    function's arguments, ``train.optimizer_args``) is one setting, a dict."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, ml_collections.ConfigDict) and key in DICT_SETTINGS:
            out[name] = value.to_dict()
        elif isinstance(value, ml_collections.ConfigDict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _parse(text: str, default: Any) -> Any:
    """``text`` as a value of ``default``'s type; ``ValueError`` saying what was expected."""
    if isinstance(default, bool):
        if text.lower() in ("1", "true", "yes"):
            return True
        if text.lower() in ("0", "false", "no"):
            return False
        raise ValueError(f"expected true or false, got {text!r}")
    if isinstance(default, int):
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"expected an integer, got {text!r}") from None
    if isinstance(default, float):
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"expected a number, got {text!r}") from None
    if isinstance(default, str):
        return text
    if isinstance(default, dict):  # --train.optimizer_args "dict(b2=0.95)" or "{'b2': 0.95}"
        try:
            tree = ast.parse(text, mode="eval").body
            if isinstance(tree, ast.Call) and getattr(tree.func, "id", None) == "dict" and not tree.args:
                value = {k.arg: ast.literal_eval(k.value) for k in tree.keywords}
            else:
                value = ast.literal_eval(tree)
        except (ValueError, SyntaxError, TypeError):
            value = None
        if not isinstance(value, dict):
            raise ValueError(f"expected a dict such as \"dict(b2=0.95)\", got {text!r}")
        return value
    if isinstance(default, (tuple, list)):
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            parts = [v.strip() for v in text.split(",") if v.strip()]
            if (default and all(isinstance(v, str) for v in default)) or (  # --taus 1,L^-1/2
                    not default and parts and all(v.isidentifier() for v in parts)):  # --train.param_groups fixup
                return tuple(parts)
            example = f"({', '.join(repr(v) for v in default[:2])},)" if default else "(1, 2)"
            raise ValueError(f"expected a tuple such as {example!r}, got {text!r}") from None
        return tuple(value) if isinstance(value, (tuple, list)) else (value,)
    try:  # None-valued settings
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def set_path(config: ml_collections.ConfigDict, name: str, value: Any) -> None:
    *parents, leaf = name.split(".")
    node = config
    for p in parents:
        node = node[p]
    with node.unlocked():
        node[leaf] = tuple(value) if isinstance(value, list) else value


def default_out(name: str, size: str) -> pathlib.Path:
    """Where a run writes without ``--out``: ``runs/<name>``, or ``runs/<name>-quick`` for ``--quick`` (so a
    quick check never replaces the results of a real run)."""
    return pathlib.Path("runs") / (f"{name}-quick" if size == "quick" else name)


def _build_parser(module, argv):
    pre = argparse.ArgumentParser(add_help=False)
    size = pre.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true")
    size.add_argument("--full", action="store_true")
    known, _ = pre.parse_known_args(argv)
    size_name = "quick" if known.quick else "full" if known.full else "default"
    config = module.get_config(size_name)
    parser = argparse.ArgumentParser(prog=f"python -m experiments.{module.NAME}",
                                     usage="%(prog)s [--quick | --full] [--out DIR] [--<setting> VALUE ...]",
                                     description=(module.__doc__ or "").split("\n\n")[0], parents=[pre])
    parser.add_argument("--out", default=None,
                        help=f"output folder (default: {default_out(module.NAME, size_name)})")
    for name, default in flatten(config).items():
        parser.add_argument(f"--{name}", dest=name, default=None, metavar="VALUE", help=f"default: {default!r}")
    return parser, config, size_name


def parse_args(module, argv=None, check: bool = False) -> tuple[ml_collections.ConfigDict, pathlib.Path]:
    """``(config, out_dir)`` from the command line. A value that does not parse is an argparse error (exit
    status 2, naming the flag). With ``check``, the run is also preflighted (:func:`preflight`: every cell,
    every setting, the output folder) and a refused setting is an argparse error naming its flag."""
    parser, config, size_name = _build_parser(module, argv)
    args = vars(parser.parse_args(argv))
    leaves = flatten(config)
    for name, default in leaves.items():
        if args.get(name) is not None:
            try:
                value = _parse(args[name], default)
            except ValueError as err:
                parser.error(f"argument --{name}: {err}")
            set_path(config, name, value)
    out_dir = pathlib.Path(args["out"]) if args["out"] else default_out(module.NAME, size_name)
    if check:
        from resjax.data import DataNotPreparedError

        try:
            preflight(module, config, out_dir)
        except ValueError as err:
            parser.error(flag_message(err, leaves))
        except DataNotPreparedError as err:
            parser.exit(2, f"{parser.prog}: error: {err}\n")
    return config, out_dir


# ---- preflight -----------------------------------------------------------------------------------------

# Settings (outside ``train``, whose checks are the library's) that count something: integers >= 1.
COUNT_SETTING = re.compile(r"^(num_\w+|(\w+_)?(depths?|widths?|blocks|batch|batch_sizes?|epochs|examples|layers|"
                           r"draws|networks|repeats|samples|points|inputs|seeds|steps|runs))$")


def check_finite(config: ml_collections.ConfigDict) -> None:
    """Every float setting (and every float inside a tuple setting) is finite: NaN and infinities refused."""
    for name, value in flatten(config).items():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, (float, np.floating)) and not math.isfinite(v):
                raise ValueError(f"{name}: must be a finite number, got {v!r}")


def check_counts(config: ml_collections.ConfigDict) -> None:
    """Every setting that counts something (``num_*``, depths, widths, blocks, batch sizes, epochs, ...,
    by the name's last part; not under ``train``) is an integer >= 1, or a tuple of them."""
    for name, value in flatten(config).items():
        leaf = name.rsplit(".", 1)[-1]
        if name.startswith("train.") or "warmup" in leaf or not COUNT_SETTING.match(leaf):
            continue
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if is_int(v) and v > 2**31 - 1:  # --depths 100000000000: an OverflowError deep inside, once
                raise ValueError(f"{name}: {v} is more than any array size here can be (2**31 - 1)")
            if not is_int(v) or v < 1:
                what = "every entry must be an integer >= 1" if isinstance(value, (tuple, list)) else \
                    "must be an integer >= 1"
                raise ValueError(f"{name}: {what}, got {v!r}")


def check_seeds(config: ml_collections.ConfigDict) -> None:
    """Every setting named ``seed`` (an experiment's, ``train.seed``, ...) is an integer in ``[0, 2**31)``, the
    range of ``jax.random.key`` seeds that resjax accepts (``--seed -1`` used to run)."""
    for name, value in flatten(config).items():
        if name.rsplit(".", 1)[-1] == "seed" and (not is_int(value) or not 0 <= value < 2**31):
            raise ValueError(f"{name}: must be an integer in [0, 2**31), got {value!r}")


def check_out_dir(out_dir) -> None:
    """Create ``out_dir`` and write (then remove) a temporary file in it; ``ValueError`` naming ``out`` else."""
    path = pathlib.Path(out_dir)
    if not is_main():  # process 0 writes every file of a multi-process run
        return
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".preflight-"):
            pass
    except OSError as err:
        raise ValueError(f"out: cannot write into the output folder {path} ({err.strerror or err})") from None


@contextlib.contextmanager
def setting_prefix(prefix: str):
    """Re-raise a ``ValueError`` whose message starts ``name: ...`` as ``prefix.name: ...`` (library checks
    name a setting of the config they see, e.g. ``batch_size`` of ``config.train``)."""
    try:
        yield
    except ValueError as err:
        text = str(err)
        m = re.match(r"([A-Za-z_][\w.]*)\s*:", text)
        if m and m.group(1) != prefix and not m.group(1).startswith(prefix + "."):
            raise ValueError(f"{prefix}.{text}") from None
        raise


def check_train(train, num_examples: int | None = None, prefix: str = "train") -> None:
    """The library's checks of a train config (``resjax.train.config.check_train_config``, errors named
    ``prefix.<setting>``) and its batch size within ``num_examples`` training examples."""
    from resjax.train.config import check_train_config

    with setting_prefix(prefix):
        check_train_config(train)
    if num_examples is not None:
        check_batch_sizes(f"{prefix}.batch_size", train.batch_size, num_examples)
        from resjax.train.config import check_step_count

        with setting_prefix(prefix):
            check_step_count(train.epochs, num_examples // train.batch_size)


def check_batch_sizes(name: str, sizes, num_examples: int, minimum: int = 1) -> None:
    """Every batch size in ``sizes`` (setting ``name``) is an integer in ``[minimum, num_examples]``."""
    for b in sizes if isinstance(sizes, (tuple, list)) else (sizes,):
        if not is_int(b) or not minimum <= b <= num_examples:
            raise ValueError(f"{name}: batch sizes must be integers from {minimum} to {num_examples} (the training "
                             f"examples), got {b!r}")


def load_data(config):
    """The on-device data set ``config.data`` (``resjax.data.load_dataset``: cached, and every value checked
    finite); errors name ``data``."""
    from resjax.data import load_dataset

    with setting_prefix("data"):
        return load_dataset(config.data)


def build_models(models, num_classes: int, prefix: str = "model") -> None:
    """Build every model config in ``models`` (``resjax.nn.build_model`` checks each field as the module is
    constructed; nothing is initialised); errors name ``prefix.<field>``."""
    from resjax.nn import build_model

    for model in models:
        with setting_prefix(prefix):
            build_model(model, num_classes=num_classes)


def preflight(module, config: ml_collections.ConfigDict, out_dir=None) -> None:
    """Validate a run before any training: the generic checks (finite floats, counts), the module's own
    ``check(config)`` (every cell it will run: batch sizes against the data, models built, the library's
    train config checks) and the output folder. Raises ``ValueError`` naming the first bad setting."""
    check_finite(config)
    check_counts(config)
    check_seeds(config)
    if hasattr(module, "check"):
        module.check(config)
    if out_dir is not None:
        check_out_dir(out_dir)


def _flag(setting: str, leaves) -> str | None:
    """The flag of a setting named in an error: itself, the nearest enclosing setting, or the one setting whose
    name ends with it (library checks name ``batch_size`` for ``train.batch_size``)."""
    if setting == "out":
        return "out"
    parts = setting.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in leaves:
            return ".".join(parts[:i])
    ends = [name for name in leaves if name.endswith("." + setting)]
    return ends[0] if len(ends) == 1 else None


def flag_message(err: Exception, leaves) -> str:
    """``argument --a.b: <the rest>`` for an error ``a.b: <the rest>`` (``ValueError`` of a preflight), on one
    line; the message as it is when it names no setting."""
    text = " ".join(str(err).split())
    m = re.match(r"([A-Za-z_][\w.]*)\s*:\s*(.*)", text)
    if m:
        flag = _flag(m.group(1), leaves)
        if flag is not None:
            return f"argument --{flag}: {m.group(2)}"
    return text


def to_jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return to_jsonable(value.tolist())
    if isinstance(value, (np.floating, float)):
        v = float(value)
        return v if math.isfinite(v) else None
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.bool_,)):
        return bool(value)
    if isinstance(value, ml_collections.ConfigDict):
        return to_jsonable(value.to_dict())
    return value


def describe_results(path, module=None) -> str:
    """One line on an existing ``results.json``: its experiment, its size (the ``get_config`` size its config
    equals, else 'custom' and the settings that differ from the default size) and when it was written."""
    path = pathlib.Path(path)
    written = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(path.stat().st_mtime))
    try:
        old = json.loads(path.read_text())
        name, config = old.get("experiment", "?"), old.get("config")
    except (OSError, ValueError, AttributeError) as err:
        return f"{path} (unreadable: {type(err).__name__}: {err}; written {written})"
    size = "unknown size"
    if module is not None and name == module.NAME and isinstance(config, dict):
        sizes = [s for s in SIZES if to_jsonable(module.get_config(s)) == config]
        if sizes:
            size = f"size {sizes[0]}"
        else:
            base = flatten(ml_collections.ConfigDict(to_jsonable(module.get_config("default"))))
            now = flatten(ml_collections.ConfigDict(config))
            diff = [f"{k}={now[k]!r}" for k in now if base.get(k) != now[k]]
            size = "custom config: " + (", ".join(diff[:6]) + (" ..." if len(diff) > 6 else "") or "?")
    seconds = old.get("seconds")
    ran = f", ran {seconds:.0f} s" if isinstance(seconds, (int, float)) else ""
    return f"{path} (experiment {name}, {size}{ran}, written {written})"


def run_experiment(module, config: ml_collections.ConfigDict, out_dir: pathlib.Path) -> dict:
    """Run ``module`` with ``config``, write ``results.json`` into ``out_dir`` and return its content.

    An existing ``results.json`` there is replaced, and what it held is printed (``describe_results``).
    With several processes every process runs the experiment and returns the results; process 0 alone
    writes them (and the figures, ``save_figure``)."""
    from resjax.train.lock import DirectoryLock

    with DirectoryLock(out_dir, "out"):  # a second run into this folder is refused while this one runs (#22)
        return _run_experiment(module, config, out_dir)


def _run_experiment(module, config: ml_collections.ConfigDict, out_dir: pathlib.Path) -> dict:
    main = is_main()
    if main:
        out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.json"
    if path.exists() and main:
        print(f"{module.NAME}: {path} exists and will be replaced when this run ends: "
              f"{describe_results(path, module)}", flush=True)
    start = time.time()
    from resjax.train.monitor import log_to

    # metrics.jsonl (and with RESJAX_TENSORBOARD=1 TensorBoard files) in out_dir as training goes; progress lines
    with log_to(out_dir, name=module.NAME, progress=True, fresh=True,
                tensorboard=os.environ.get("RESJAX_TENSORBOARD", "0") not in ("", "0")), _deferred_figures() as figures:
        metrics = module.run(config, out_dir)
    results = {
        "experiment": module.NAME,
        "config": to_jsonable(config),
        "metrics": to_jsonable(metrics),
        "seconds": round(time.time() - start, 2),
    }
    if not main:
        return results
    if path.exists():
        print(f"{module.NAME}: replacing {describe_results(path, module)}", flush=True)
    _write_atomically(path, lambda tmp: tmp.write_text(json.dumps(results, indent=1)))
    for fig, figure_path, dpi in figures:  # after the results: a figure that cannot be written loses nothing else
        try:
            _write_figure(fig, figure_path, dpi)
        except OSError as err:
            print(f"{module.NAME}: could not write the figure {figure_path} ({err}); {path} was written",
                  file=sys.stderr, flush=True)
        finally:
            pyplot().close(fig)
    return results


def _write_atomically(path: pathlib.Path, write: Callable[[pathlib.Path], Any]) -> None:
    """``write(tmp)`` then ``tmp`` renamed to ``path``: ``path`` is the old file or the whole new one, never a
    part; a failed write leaves no temporary file behind."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


_FIGURES: list[list] = []  # figures held back by run_experiment until its results are written


@contextlib.contextmanager
def _deferred_figures():
    """Inside the block ``save_figure`` keeps its figures (yielded as ``[(fig, path, dpi)]``) instead of writing
    them, so that ``run_experiment`` writes ``results.json`` first."""
    held: list = []
    _FIGURES.append(held)
    try:
        yield held
    finally:
        _FIGURES.remove(held)


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend (experiments never open windows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path, dpi: int = 110, tight: bool = True) -> None:
    """Lay out (``tight_layout`` unless ``tight=False``), write and close ``fig`` (written by process 0 only).
    Inside ``run_experiment`` the figure is written, atomically, after ``results.json``."""
    if is_main():
        if tight:
            fig.tight_layout()
        if _FIGURES:
            _FIGURES[-1].append((fig, path, dpi))
            return
        _write_figure(fig, path, dpi)
    pyplot().close(fig)


def _write_figure(fig, path, dpi: int) -> None:
    path = pathlib.Path(path)
    _write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format=path.suffix.lstrip(".") or "png"))


def is_main() -> bool:
    """Whether this process writes files: always with one process, process 0 of several."""
    from resjax.train.distributed import is_main_process

    return is_main_process()


def start() -> None:
    """What an entry point does before JAX's first computation: every CPU core a device
    (``resjax.use_every_cpu_core``, so seed sweeps shard across cores), compiled programs kept on disk for
    the next run (``resjax.enable_compilation_cache``: ``~/.cache/resjax/jax``; ``RESJAX_COMPILATION_CACHE=0``
    turns it off) and, when the environment asks for several processes, ``jax.distributed.initialize()``
    (``resjax.train.distributed.initialize_if_needed``)."""
    import resjax

    resjax.use_every_cpu_core()
    resjax.enable_compilation_cache()
    from resjax.train.distributed import initialize_if_needed

    initialize_if_needed()


def main(module, argv=None) -> dict:
    """The command line of ``module`` (a module or its name, e.g. ``__name__``)."""
    start()
    if isinstance(module, str):
        module = sys.modules[module]
    config, out_dir = parse_args(module, argv, check=True)
    results = run_experiment(module, config, out_dir)
    if is_main():
        print(f"{module.NAME}: wrote {out_dir / 'results.json'} and {out_dir / (module.NAME + '.png')} "
          f"in {results['seconds']:.1f} s")
    return results
