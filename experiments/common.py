"""The experiment contract: config flags, ``results.json``, claims.

``main(module)`` parses ``[--quick | --full] [--out DIR] [--<setting> VALUE ...]`` where every leaf of
the module's ``get_config(size)`` (an ``ml_collections.ConfigDict``; nested leaves as ``--a.b``) is a
flag, preflights the run (``preflight``: finite floats, counts, the module's ``check(config)`` hook that
validates every cell it will run, the output folder; a refused value is an argparse error naming its flag,
exit status 2), runs the experiment, and writes ``DIR/results.json`` =
``{"experiment", "config", "metrics", "seconds"}`` (``DIR``: ``--out``, else ``runs/<name>``, or
``runs/<name>-quick`` with ``--quick``). Metrics are flat dotted names mapping to numbers
or (nested) lists of numbers; NaN and infinities are written as JSON ``null``. Every training cell
checkpoints into ``--checkpoint_dir`` (default ``DIR/checkpoints``; ``none``: off) and the same command
resumes; ``--fresh`` starts every cell over; SIGTERM/SIGINT exit 143/130 cleanly (``experiments.checkpoints``).
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
import threading
import time
from typing import Any, Callable

import ml_collections
import numpy as np

from experiments import checkpoints
from resjax.train.config import DICT_SETTINGS, is_int  # noqa: F401  (experiments use common.is_int)

SIZES = ("quick", "default", "full")


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
                 "train.learning_rate": "learning rate {}", "train.batch_size": "batch {}", "train.momentum": "momentum {}",
                 "num_runs": "{} runs", "num_batches": "{} batches", "num_examples": "{} examples", "repeats": "{} repeats"}
#: Settings that change how a run is carried out, not what it measures: never named in a claim's note.
NEUTRAL_SETTINGS = ("chunk_epochs", "scan", "data_dir", "synthetic_examples", "train.eval_batch_size",
                    "train.checkpoint_every", "train.checkpoint_keep", "train.seed_axis", "checkpoint_dir")


def _words(name: str, value) -> str:
    template = SETTING_WORDS.get(name)
    if template is None:
        return f"{name} {_show(value)}"
    if value == 1 and template.endswith("s"):
        template = template[:-1]
    return template.format(_show(value))


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


# ---- help: every flag's meaning, units and allowed values ----------------------------------------------

#: Help for the settings of ``resjax.train.train_config`` (``--train.<setting>``), shared by every experiment
#: that trains; an experiment's own ``HELP`` entry replaces one of these where the experiment reads it otherwise.
TRAIN_HELP = {
    "train.optimizer": "optimiser: 'sgd' (heavy ball when train.momentum > 0), 'momentum', 'nesterov', 'adam' "
                       "(PyTorch's rules) or any optax optimiser by name ('adamw', 'lamb', 'lars', 'lion', 'rmsprop', ...)",
    "train.optimizer_args": "an optax optimiser's other arguments, a dict such as \"dict(b2=0.95)\"; empty: none",
    "train.learning_rate": "base learning rate (step size), a number >= 0",
    "train.momentum": "SGD momentum in [0, 1): buf = momentum * buf + g (PyTorch's, no dampening); 0 = plain SGD",
    "train.nesterov": "true/false: Nesterov momentum for 'sgd' with train.momentum > 0",
    "train.adam_b1": "Adam's first-moment decay rate beta1 (optimizer 'adam')",
    "train.adam_b2": "Adam's second-moment decay rate beta2 (optimizer 'adam')",
    "train.adam_eps": "Adam's epsilon, added to the root of the second moment (optimizer 'adam')",
    "train.weight_decay": "coupled L2 weight decay: the step uses g + weight_decay * w (PyTorch's weight_decay); 0 = off",
    "train.weight_decay_on": "which parameters weight decay applies to: 'all' (every parameter, PyTorch's default) or "
                             "'kernels' (Dense/Conv kernels only)",
    "train.scalar_lr_factor": "learning-rate factor for 0-d parameters (Fixup's and SkipInit's scalars, a learnable tau)",
    "train.param_groups": "parameter-group rules or preset names ('tau_resnet', 'fixup'), comma-separated: per-group "
                          "learning-rate and weight-decay factors (resjax.train.optim); empty: one group",
    "train.grad_clip_norm": "clip gradients to this global L2 norm; 0 = no clipping",
    "train.schedule": "learning-rate schedule: 'constant', 'step' (times train.decay_factor at each of "
                      "train.milestones), 'cosine', or an optax schedule's name with train.schedule_args",
    "train.schedule_args": "an optax schedule's other arguments, a dict such as \"dict(decay_rate=0.5)\"",
    "train.milestones": "epochs at which a 'step' schedule multiplies the learning rate by train.decay_factor, "
                        "e.g. \"(100, 150)\"",
    "train.decay_factor": "factor applied to the learning rate at each milestone of a 'step' schedule",
    "train.warmup_epochs": "epochs of linear learning-rate warm-up from 0 (fractions allowed); 0 = none",
    "train.batch_size": "minibatch size: training examples per SGD step (the last partial batch of an epoch is dropped)",
    "train.eval_batch_size": "examples per evaluation batch (host-fed image runs; does not change any result)",
    "train.epochs": "training epochs (passes over the training set)",
    "train.eval_every": "evaluate the training and test sets after every k-th epoch and after the last (1: every "
                        "epoch); the other epochs' evaluation entries are NaN, the training is the same",
    "train.augment": "true/false: random crops and flips of the training images (host-fed image runs)",
    "train.shuffle": "true/false: a fresh order of the training set every epoch (host-fed image runs)",
    "train.checkpoint_every": "epochs between checkpoints (on-device runs: rounded to whole chunks); 0 = only at the end",
    "train.checkpoint_keep": "how many checkpoints to keep (the newest)",
    "train.seed": "the first training seed when seeds are counted from it (an integer in [0, 2**31))",
    "train.seed_axis": "how the host feeder steps several seeds: 'auto', 'vmap', 'unroll' or 'loop' (same results; "
                       "on-device runs always vmap)",
}

#: Help for settings that several experiments share under one name and meaning; an experiment's own ``HELP`` entry
#: replaces one of these.
COMMON_HELP = {
    "seed": "random seed of the experiment, an integer in [0, 2**31): every weight draw, input and data order of the "
            "run derives from it",
    "num_seeds": "independent runs (seeds) per cell; metrics are lists over seeds",
    "data": "data set: 'mnist1d' (MNIST-1D, 4,000 training / 1,000 test sequences of length 40, generated offline)",
    "chunk_epochs": "epochs per compiled chunk of the on-device training loop: progress lines (and checkpoints) come "
                    "once per chunk; does not change any result",
    "data_dir": "TFDS data folder; empty: TFDS's default (~/tensorflow_datasets or $TFDS_DATA_DIR)",
    "synthetic_examples": "CIFAR-shaped random images in the synthetic stand-in data set (data 'synthetic')",
    "width": "hidden width (units per layer)",
    "model.width": "hidden width of every network (units per layer)",
    "checkpoint_dir": "folder for training checkpoints; a rerun with the same settings resumes there",
}


def help_for(module, name: str, config: ml_collections.ConfigDict | None = None) -> str | None:
    """The help line of ``--<name>`` for ``module``: its ``HELP`` entry, else the shared one (``COMMON_HELP``,
    ``TRAIN_HELP``); ``None`` when there is none. ``--train.seed`` of an experiment that has its own ``--seed``
    says that it is not read (the experiment's runs derive their seeds from ``--seed``)."""
    own = getattr(module, "HELP", {})
    if name in own:
        return own[name]
    if name == "train.seed" and config is not None and "seed" in config:
        return "not read by this experiment: its runs' seeds derive from --seed (every train config has this setting)"
    if name == "seed" and config is not None and "train" in config and "seed" in config.train:
        return COMMON_HELP["seed"] + "; --train.seed is not read by this experiment"
    return COMMON_HELP.get(name, TRAIN_HELP.get(name))


def flags_without_help(module) -> list[str]:
    """Every setting of ``module`` (at any size) that has no help line (a test keeps this empty)."""
    names: dict[str, ml_collections.ConfigDict] = {}
    for size in SIZES:
        config = module.get_config(size)
        for name in flatten(config):
            names.setdefault(name, config)
    return [name for name, config in names.items() if not help_for(module, name, config)]


def size_changes(module, size: str) -> list[str]:
    """What ``--<size>`` changes against the default size: ``['train.epochs 300 -> 2', ...]`` (from the configs)."""
    base, other = flatten(module.get_config("default")), flatten(module.get_config(size))
    changes = [f"{k} {_show(base[k])} -> {_show(other[k])}" for k in other if k in base and base[k] != other[k]]
    return changes + [f"{k} = {_show(other[k])} (added)" for k in other if k not in base]


def _show(value) -> str:
    """A setting's value as a flag takes it: ``(4, 8)``, ``false``, ``sgd``."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return value or "''"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_show(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    return repr(value)


def size_help(module, size: str) -> str:
    """The help line of ``--quick`` / ``--full``: what the size is for and every setting it changes."""
    what = {"quick": "small, fast sizes (seconds to a minute; what the tests run): a pipeline check, NOT expected to "
                     "reproduce the seed documents' numbers",
            "full": "paper-scale sizes (more seeds, draws or epochs; meant for an accelerator)"}[size]
    changes = size_changes(module, size)
    if not changes:
        return f"the same settings as the default size in this experiment ({size} changes nothing)"
    return f"{what}. Changes: {'; '.join(changes)}"


def _describe_flags(parser: argparse.ArgumentParser, argv_flag: str) -> str:
    """The unknown ``argv_flag``'s error: the closest known flag names (``difflib``)."""
    import difflib

    known = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
    close = difflib.get_close_matches(argv_flag, known, n=3, cutoff=0.6)
    if not close:  # a misspelt part of a dotted name: match the last part too (--train.learn -> --train.learning_rate)
        leaf = argv_flag.rsplit(".", 1)[-1]
        close = [o for o in known if leaf and o.rsplit(".", 1)[-1].startswith(leaf.lstrip("-"))][:3]
    hint = f"; did you mean {' or '.join(close)}?" if close else "; --help lists every flag"
    cells = [o for o in known if o.endswith("cells")]
    if cells and re.search(r"depth|blocks|layers|kind|norm|order|model\.", argv_flag):
        hint += f" (the networks, their kinds and depths, are {' and '.join(cells)})"
    return f"unrecognized argument {argv_flag}{hint}"


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` that refuses abbreviated flags (``allow_abbrev=False``: ``--train.learn 0.01`` is
    an error, not ``--train.learning_rate``) and names the closest known flags for an unknown one."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            flags = [e for e in extras if e.startswith("-")]
            self.error(_describe_flags(self, flags[0].split("=", 1)[0]) if flags
                       else f"unrecognized arguments: {' '.join(extras)}")
        return parsed


# ---- cells: an experiment's networks as a setting ------------------------------------------------------

CELL_SYNTAX = "KIND:DEPTH[:WIDTH]"


@dataclasses.dataclass(frozen=True)
class Cell:
    """One network of an experiment's cell list, written ``KIND:DEPTH[:WIDTH]`` on the command line
    (``residual_bn:16``). ``name`` is its name in the metrics, ``<kind>_d<depth>`` (``_w<width>`` added when a
    width is given); ``model`` the model fields its kind makes for that depth (and width)."""

    kind: str
    depth: int
    width: int | None
    name: str
    model: dict


def parse_cell(spec: str, kinds: dict[str, Callable[[int], dict]], setting: str = "cells") -> Cell:
    """``'residual_bn:16'`` as a :class:`Cell` of one of ``kinds`` (``{kind: depth -> model fields}``);
    ``ValueError`` naming ``setting`` for an unknown kind or a depth or width that is not an integer >= 1."""
    known = ", ".join(kinds)
    parts = [p.strip() for p in str(spec).split(":")]
    if len(parts) not in (2, 3) or not parts[0]:
        raise ValueError(f"{setting}: {spec!r} is not a cell; write {CELL_SYNTAX}, e.g. {next(iter(kinds))}:8 "
                         f"(kinds: {known})")
    kind = parts[0]
    if kind not in kinds:
        raise ValueError(f"{setting}: unknown cell kind {kind!r} in {spec!r}; known kinds: {known}")
    numbers = []
    for what, text in zip(("depth", "width"), parts[1:]):
        if not re.fullmatch(r"\d+", text) or int(text) < 1 or int(text) > 2**31 - 1:
            raise ValueError(f"{setting}: the {what} in {spec!r} must be an integer >= 1, got {text!r}")
        numbers.append(int(text))
    depth, width = numbers[0], (numbers[1] if len(numbers) > 1 else None)
    model = dict(kinds[kind](depth))
    if width is not None:
        model["width"] = width
    return Cell(kind, depth, width, f"{kind}_d{depth}" + (f"_w{width}" if width is not None else ""), model)


def parse_cells(specs, kinds: dict[str, Callable[[int], dict]], setting: str = "cells",
                taken: tuple[str, ...] = ()) -> list[Cell]:
    """Every cell of ``specs`` (a tuple of ``KIND:DEPTH[:WIDTH]`` strings, or one comma-separated string);
    ``ValueError`` naming ``setting`` for a bad cell or one whose name repeats (also a name in ``taken``)."""
    if isinstance(specs, str):
        specs = [s for s in specs.split(",") if s.strip()]
    cells, seen = [], set(taken)
    for spec in specs:
        cell = parse_cell(spec, kinds, setting)
        if cell.name in seen:
            raise ValueError(f"{setting}: the cell {cell.name} ({spec!r}) is given twice")
        seen.add(cell.name)
        cells.append(cell)
    return cells


def cells_help(kinds: dict[str, Callable[[int], dict]], what: str) -> str:
    """A cell list's help line: what it holds, the syntax and every kind with the model it builds."""
    def show(kind):
        fields = {k: v for k, v in kinds[kind](1).items() if k not in ("depth", "num_blocks")}
        return f"{kind} ({', '.join(f'{k}={v}' for k, v in fields.items())})"
    return (f"{what}: comma-separated {CELL_SYNTAX} (DEPTH: hidden layers or residual blocks; WIDTH: default "
            f"model.width), e.g. \"plain:8,residual_bn:16\"; a leading + adds to the default list "
            f"(\"+residual_bn:16\"); metric names are <kind>_d<depth>. Kinds: {'; '.join(show(k) for k in kinds)}")


# ---- figures built from the run's own settings ---------------------------------------------------------


def describe_optimizer(train) -> str:
    """``'SGD lr 0.005'``, ``'SGD momentum 0.9 lr 0.1, weight decay 0.0001, step schedule'``: the optimiser a
    train config runs, for figure titles (built from the settings, never a fixed string)."""
    name = str(train.optimizer)
    momentum = float(train.get("momentum", 0.0) or 0.0)
    if name == "sgd" and momentum > 0:
        text = f"SGD {'Nesterov ' if train.get('nesterov') else ''}momentum {momentum:g}"
    elif name in ("sgd", "adam"):
        text = name.upper() if name == "sgd" else "Adam"
    elif name in ("momentum", "nesterov"):
        text = f"SGD {name} {momentum:g}"
    else:
        text = name
    text += f" lr {float(train.learning_rate):g}"
    extras = []
    if float(train.get("weight_decay", 0.0) or 0.0) > 0:
        extras.append(f"weight decay {float(train.weight_decay):g}")
    if train.get("schedule", "constant") != "constant":
        extras.append(f"{train.schedule} schedule")
    if float(train.get("warmup_epochs", 0.0) or 0.0) > 0:
        extras.append(f"{float(train.warmup_epochs):g} warm-up epochs")
    return text + (", " + ", ".join(extras) if extras else "")


def integer_ticks(ax, axis: str = "x") -> None:
    """Integer ticks only on ``axis`` of ``ax`` (epochs, blocks): no 0.5 epoch. Call after the data is drawn."""
    from matplotlib.ticker import MaxNLocator

    lo, hi = ax.get_xlim() if axis == "x" else ax.get_ylim()
    whole = list(range(math.ceil(lo), math.floor(hi) + 1))
    if len(whole) <= 8:  # a few epochs: each one ticked (one epoch: a single tick, not 0.96 ... 1.04)
        (ax.set_xticks if axis == "x" else ax.set_yticks)(whole)
    else:
        # steps 1, 2, 5, 10: round ticks (0, 20, ..., 100 epochs, not 0, 15, ..., 105)
        (ax.xaxis if axis == "x" else ax.yaxis).set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))


def plural(count: int, word: str) -> str:
    """``'1 epoch'``, ``'2 epochs'``."""
    return f"{count} {word}{'' if count == 1 else 's'}"


def diverged_marks(runs, diverged_epochs, colour, label=None) -> list[tuple]:
    """Where each diverged run of ``runs`` (seeds x epochs, NaN after divergence) ends: ``(epoch, last finite value
    before it or None, colour, label)`` per run whose ``diverged_epochs`` entry (1-based) is not None; the label on
    the first only. Drawn by :func:`mark_diverged`."""
    marks = []
    for r, e in zip(np.asarray(runs, float), diverged_epochs):
        if e is not None:
            finite = r[:e][np.isfinite(r[:e])]
            marks.append((int(e), float(finite[-1]) if finite.size else None, colour, label))
            label = None
    return marks


def mark_diverged(ax, marks, log: bool = False) -> None:
    """Mark diverged runs with an x where their line would be (``diverged_marks``): at the divergence epoch, on
    the run's last finite value, or, for a run with none (diverged in its first epoch), just above the data (the
    panel's range stays the data's). Call after every line of the panel is drawn."""
    if not marks:
        return
    lo, hi = ax.get_ylim() if ax.has_data() else ((1.0, 10.0) if log else (0.0, 1.0))
    if log:
        top, new_hi = hi * (hi / lo) ** 0.05, hi * (hi / lo) ** 0.1
    else:
        top, new_hi = hi + 0.04 * (hi - lo), hi + 0.08 * (hi - lo)
    ax.set_ylim(lo, new_hi)
    for epoch, value, colour, label in marks:
        ax.plot([epoch], [top if value is None else value], "x", color=colour, ms=9, mew=2, label=label)


def legend_outside(ax, where: str = "below", fontsize: int = 7, ncol: int | None = None, **kwargs) -> None:
    """The legend of ``ax`` outside its plotting area (``'below'`` or ``'right'``), so that it covers no data;
    nothing when nothing is labelled."""
    handles, labels = ax.get_legend_handles_labels()
    if not handles:
        return
    if where == "right":
        ax.legend(fontsize=fontsize, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, **kwargs)
    else:
        ncol = ncol or (1 if max(len(label) for label in labels) > 45 else 2)
        ax.legend(fontsize=fontsize, loc="upper center", bbox_to_anchor=(0.5, -0.17), ncol=ncol, borderaxespad=0.0,
                  **kwargs)


def _build_parser(module, argv):
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    size = pre.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true")
    size.add_argument("--full", action="store_true")
    known, _ = pre.parse_known_args(argv)
    size_name = "quick" if known.quick else "full" if known.full else "default"
    config = module.get_config(size_name)
    epilog = ("Values: numbers, true/false, text; tuples as \"(16, 32)\" or 16,32, and a leading + adds to a tuple's "
              "default (--sweep_batch_sizes +256). Every setting is checked before any work (exit status 2 naming "
              "the flag). Results: OUT/results.json = {experiment, config, metrics, seconds} and OUT/"
              f"{module.NAME}.png; compare runs with python -m experiments.compare RUN_A RUN_B.")
    parser = ArgumentParser(prog=f"python -m experiments.{module.NAME}",
                            usage="%(prog)s [--quick | --full] [--out DIR] [--<setting> VALUE ...]",
                            description=(module.__doc__ or "").split("\n\n")[0], epilog=epilog)
    sizes = parser.add_mutually_exclusive_group()
    for name in ("quick", "full"):
        sizes.add_argument(f"--{name}", action="store_true", help=size_help(module, name))
    parser.add_argument("--out", default=None, metavar="DIR",
                        help=f"output folder (default: {default_out(module.NAME, 'default')}; with --quick "
                             f"{default_out(module.NAME, 'quick')}, so a quick check never replaces a real run)")
    parser.add_argument("--checkpoint_dir", default=None, metavar="DIR",
                        help="where each training cell checkpoints, so that the same command run again resumes: "
                             f"finished cells load, the interrupted one goes on (default: OUT/checkpoints; 'none': "
                             "no checkpoints)")
    parser.add_argument("--fresh", action="store_true",
                        help="train every cell from its start, ignoring (and replacing) its checkpoints")
    for name, default in flatten(config).items():
        text = help_for(module, name, config) or "(no help yet)"
        parser.add_argument(f"--{name}", dest=name, default=None, metavar="VALUE",
                            help=f"{text} (default: {_show(default)})".replace("%", "%%"))
    return parser, config, size_name


def parse_args(module, argv=None, check: bool = False,
               options: dict | None = None) -> tuple[ml_collections.ConfigDict, pathlib.Path]:
    """``(config, out_dir)`` from the command line. A value that does not parse is an argparse error (exit
    status 2, naming the flag). With ``check``, the run is also preflighted (:func:`preflight`: every cell,
    every setting, the output folder, the checkpoint folder) and a refused setting is an argparse error naming
    its flag. ``options``, a dict, receives ``checkpoint_dir`` (the ``--checkpoint_dir`` text, None when not
    given) and ``fresh``."""
    parser, config, size_name = _build_parser(module, argv)
    args = vars(parser.parse_args(argv))
    leaves = flatten(config)
    for name, default in leaves.items():
        if args.get(name) is not None:
            try:
                text = args[name]
                if isinstance(default, (tuple, list)) and text.startswith("+"):  # --cells +residual_bn:16
                    value = tuple(default) + tuple(_parse(text[1:], default))
                else:
                    value = _parse(text, default)
            except ValueError as err:
                parser.error(f"argument --{name}: {err}")
            set_path(config, name, value)
    out_dir = pathlib.Path(args["out"]) if args["out"] else default_out(module.NAME, size_name)
    if options is not None:
        options.update(checkpoint_dir=args["checkpoint_dir"], fresh=args["fresh"])
    if check:
        from resjax.data import DataNotPreparedError

        try:
            checkpoints.check_root(checkpoints.resolve(args["checkpoint_dir"], out_dir))
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
    from resjax.train.checkpoint import check_free_space

    check_free_space(path, OUT_ROOM, "out", "a run's results, figures and metrics.jsonl")  # a warning (#22)


#: Free space an output folder should have (a warning below it): results.json, figures and metrics.jsonl of a
#: default-size run are up to about 12 MB (degradation); checkpoints are checked per cell as they are opened.
OUT_ROOM = 16 * 2**20


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
    if setting in ("out", "checkpoint_dir"):  # flags of the command line, not settings of the config
        return setting
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


def run_experiment(module, config: ml_collections.ConfigDict, out_dir: pathlib.Path, checkpoint_dir=None,
                   fresh: bool = False) -> dict:
    """Run ``module`` with ``config``, write ``results.json`` into ``out_dir`` and return its content.

    An existing ``results.json`` there is replaced, and what it held is printed (``describe_results``).
    With several processes every process runs the experiment and returns the results; process 0 alone
    writes them (and the figures, ``save_figure``). Every training cell checkpoints into ``checkpoint_dir``
    (default ``out_dir/checkpoints``; ``'none'``: nowhere) and the same call again resumes from there;
    ``fresh`` trains every cell from its start (``experiments.checkpoints``)."""
    from resjax.train.lock import DirectoryLock

    root = checkpoints.resolve(checkpoint_dir, out_dir)
    with DirectoryLock(out_dir, "out"):  # a second run into this folder is refused while this one runs (#22)
        with checkpoints.session(root, module.NAME, to_jsonable(config), fresh) as cells:
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
                tensorboard=os.environ.get("RESJAX_TENSORBOARD", "0") not in ("", "0")), _deferred_figures() as figures:
        metrics = module.run(config, out_dir)
    with checkpoints.signals_deferred():  # a stop signal now waits for the results and figures to be written
        return _write_results(module, config, out_dir, metrics, start, figures)


def _write_results(module, config, out_dir: pathlib.Path, metrics: dict, start: float, figures: list) -> dict:
    main = is_main()
    path = out_dir / "results.json"
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
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")  # this process's, this thread's
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


def main(module, argv=None) -> dict:
    """The command line of ``module`` (a module or its name, e.g. ``__name__``)."""
    start()
    if isinstance(module, str):
        module = sys.modules[module]
    options: dict = {}
    config, out_dir = parse_args(module, argv, check=True, options=options)
    with unusable_checkpoints_end_the_run(module.NAME), checkpoints.stop_signals(module.NAME):  # 143/130 (#22)
        results = run_experiment(module, config, out_dir, options["checkpoint_dir"], options["fresh"])
    if is_main():
        print(f"{module.NAME}: wrote {out_dir / 'results.json'} and {out_dir / (module.NAME + '.png')} "
          f"in {results['seconds']:.1f} s")
    return results
