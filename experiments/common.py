"""The experiment contract: config flags, ``results.json``, claims.

``main(module)`` parses ``[--quick | --full] [--out DIR] [--<setting> VALUE ...]`` where every leaf of
the module's ``get_config(size)`` (an ``ml_collections.ConfigDict``; nested leaves as ``--a.b``) is a
flag, runs the experiment, and writes ``DIR/results.json`` =
``{"experiment", "config", "metrics", "seconds"}``. Metrics are flat dotted names mapping to numbers
or (nested) lists of numbers; NaN and infinities are written as JSON ``null``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import math
import pathlib
import time
from typing import Any, Callable

import ml_collections
import numpy as np

SIZES = ("quick", "default", "full")


@dataclasses.dataclass(frozen=True)
class Claim:
    """One claim of a seed document, checked against an experiment's metrics.

    ``measure(metrics)`` returns the measured value (a number or a short string) and ``holds(metrics)``
    whether the claim holds (``None`` for a number reported beside the seed's without a pass/fail
    test). ``seed_value`` is the document's number as text.
    """

    text: str
    source: str
    seed_value: str
    measure: Callable[[dict], Any]
    holds: Callable[[dict], bool | None]


def flatten(config: ml_collections.ConfigDict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, ml_collections.ConfigDict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _parse(text: str, default: Any) -> Any:
    if isinstance(default, bool):
        if text.lower() in ("1", "true", "yes"):
            return True
        if text.lower() in ("0", "false", "no"):
            return False
        raise ValueError(f"expected true or false, got {text!r}")
    if isinstance(default, int):
        return int(text)
    if isinstance(default, float):
        return float(text)
    if isinstance(default, str):
        return text
    try:  # tuples, lists, None-valued settings
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


def parse_args(module, argv=None) -> tuple[ml_collections.ConfigDict, pathlib.Path]:
    pre = argparse.ArgumentParser(add_help=False)
    size = pre.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true")
    size.add_argument("--full", action="store_true")
    known, _ = pre.parse_known_args(argv)
    size_name = "quick" if known.quick else "full" if known.full else "default"
    config = module.get_config(size_name)

    parser = argparse.ArgumentParser(prog=f"python -m experiments.{module.NAME}",
                                     description=(module.__doc__ or "").split("\n\n")[0], parents=[pre])
    parser.add_argument("--out", default=f"runs/{module.NAME}", help="output folder (default: %(default)s)")
    leaves = flatten(config)
    for name, default in leaves.items():
        parser.add_argument(f"--{name}", dest=name, default=None, metavar="VALUE",
                            help=f"default: {default!r}")
    args = vars(parser.parse_args(argv))
    for name, default in leaves.items():
        if args.get(name) is not None:
            try:
                value = _parse(args[name], default)
            except ValueError as err:
                raise SystemExit(f"--{name}: {err}") from None
            set_path(config, name, value)
    return config, pathlib.Path(args["out"])


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


def run_experiment(module, config: ml_collections.ConfigDict, out_dir: pathlib.Path) -> dict:
    """Run ``module`` with ``config``, write ``results.json`` into ``out_dir`` and return its content."""
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.time()
    metrics = module.run(config, out_dir)
    results = {
        "experiment": module.NAME,
        "config": to_jsonable(config),
        "metrics": to_jsonable(metrics),
        "seconds": round(time.time() - start, 2),
    }
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    return results


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend (experiments never open windows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path, dpi: int = 110, tight: bool = True) -> None:
    """Lay out (``tight_layout`` unless ``tight=False``), write and close ``fig``."""
    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def start() -> None:
    """What an entry point does before JAX's first computation: every CPU core a device
    (``resjax.use_every_cpu_core``, so seed sweeps shard across cores) and, when the environment asks for
    several processes, ``jax.distributed.initialize()`` (``resjax.train.distributed.initialize_if_needed``)."""
    import resjax

    resjax.use_every_cpu_core()
    from resjax.train.distributed import initialize_if_needed

    initialize_if_needed()


def main(module, argv=None) -> dict:
    """The command line of ``module`` (a module or its name, e.g. ``__name__``)."""
    start()
    if isinstance(module, str):
        import sys

        module = sys.modules[module]
    config, out_dir = parse_args(module, argv)
    results = run_experiment(module, config, out_dir)
    print(f"{module.NAME}: wrote {out_dir / 'results.json'} and {out_dir / (module.NAME + '.png')} "
          f"in {results['seconds']:.1f} s")
    return results
