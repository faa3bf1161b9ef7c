"""Results and claims: ``results.json``'s values, and the seed documents' claims checked against them.

``to_jsonable`` turns metrics and configs into JSON (NaN and infinities as ``null``), ``describe_results`` says in
one line what an existing ``results.json`` holds, :class:`Claim` is one claim of a seed document (every
experiment's ``CLAIMS``; ``experiments.reproduce`` checks them) and ``run_settings_note`` says where a run's
settings differ from those a claim states.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import time
from typing import Any, Callable

import ml_collections
import numpy as np

from experiments.settings import COUNT_SETTING, SIZES, flatten, show_value


@dataclasses.dataclass(frozen=True)
class Claim:
    """One claim of a seed document, checked against an experiment's metrics.

    ``measure(metrics)`` returns the measured value (a number or a short string) and ``holds(metrics)``
    whether the claim holds (``None`` for a number reported beside the seed's without a pass/fail
    test). ``seed_value`` is the document's number as text. ``probe_threshold``: the pass/fail threshold
    was set after a probe run of the experiment (its docstring says which run); the report marks such claims
    "threshold set after a probe". ``settings``: the config settings the claim's text states (``num_seeds`` for
    "mean of 3 seeds"); where a run's value differs from the seed's (the default size's), the report says so after
    the text, "(this run: 2 seeds)" (see :func:`run_settings_note`; default: the module's ``CLAIM_SETTINGS``, else
    every count, epochs and learning-rate setting that differs).
    """

    text: str
    source: str
    seed_value: str
    measure: Callable[[dict], Any]
    holds: Callable[[dict], bool | None]
    probe_threshold: bool = False
    settings: tuple[str, ...] = ()


#: How the report words a setting that a run changed ("(this run: 2 seeds, 2 epochs)"); others: "name value".
SETTING_WORDS = {"num_seeds": "{} seeds", "train.epochs": "{} epochs", "num_networks": "{} networks",
                 "num_draws": "{} draws", "num_inputs": "{} inputs", "plain_hidden_layers": "{} hidden layers",
                 "residual_blocks": "{} residual blocks", "num_blocks": "{} blocks", "depth": "depth {}",
                 "depths": "depths {}", "width": "width {}", "model.width": "width {}", "model.depth": "depth {}",
                 "train.learning_rate": "learning rate {}", "train.batch_size": "batch {}",
                 "train.momentum": "momentum {}", "num_runs": "{} runs", "num_batches": "{} batches",
                 "num_examples": "{} examples", "repeats": "{} repeats"}
#: Settings that change how a run is carried out, not what it measures: never named in a claim's note.
NEUTRAL_SETTINGS = ("chunk_epochs", "scan", "data_dir", "synthetic_examples", "train.eval_batch_size",
                    "train.checkpoint_every", "train.checkpoint_keep", "train.seed_axis", "checkpoint_dir")


def _words(name: str, value) -> str:
    template = SETTING_WORDS.get(name)
    if template is None:
        return f"{name} {show_value(value)}"
    if value == 1 and template.endswith("s"):
        template = template[:-1]
    return template.format(show_value(value))


def changed_settings(module, config: dict | None) -> dict[str, Any]:
    """``{setting: value}`` of a run's ``config`` (a results.json's) that differ from the seed's settings, the
    module's default size (only settings both have: an old run's reshaped config names nothing)."""
    if not config or not hasattr(module, "get_config"):
        return {}
    seed = flatten(ml_collections.ConfigDict(to_jsonable(module.get_config("default"))))
    ran = flatten(ml_collections.ConfigDict(to_jsonable(config)))
    return {k: v for k, v in ran.items() if k in seed and to_jsonable(v) != to_jsonable(seed[k])
            and k not in NEUTRAL_SETTINGS}


def run_settings_note(module, config: dict | None, claim: "Claim") -> str:
    """``' (this run: 2 seeds, 2 epochs)'``: the settings ``claim`` states (its ``settings``, else the module's
    ``CLAIM_SETTINGS``, else every count, epochs or learning-rate setting) where this run's differ from the seed's;
    ``''`` when none do."""
    changed = changed_settings(module, config)
    names = claim.settings or getattr(module, "CLAIM_SETTINGS", None)
    if names is None:
        names = [k for k in changed if COUNT_SETTING.match(k.rsplit(".", 1)[-1]) or k in SETTING_WORDS
                 or k.rsplit(".", 1)[-1] in ("learning_rate", "momentum", "batch_size")]
    shown = [_words(k, changed[k]) for k in names if k in changed]
    return f" (this run: {', '.join(shown)})" if shown else ""


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
    from resjax.paths import as_path

    path = as_path(path, "out")
    try:
        written = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(path.stat().st_mtime))
    except (OSError, AttributeError, NotImplementedError):  # a bucket object without a modification time
        written = "?"
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
