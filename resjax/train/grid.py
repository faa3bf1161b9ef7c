"""Grids of runs over any setting: seeds x settings, each traced inside a program or splitting the grid into
programs that run side by side, with results labelled by the grid.

::

    g = grid(seeds=[0, 1, 2, 3], learning_rate=[0.1, 0.03, 0.01])     # 12 runs, seeds vary fastest
    result = fit_grid(trainer, g, epochs=10)                            # either feeder: one program
    result.frame().query("learning_rate == 0.1")                        # one row per run and epoch (pandas)
    result.summary()                                                    # one row per run
    result.select(seed=2, learning_rate=0.03)                           # that run's RunState

    g = grid(3, {"model.num_blocks": [2, 8, 16, 32], "model.width": [32, 64]})  # 24 runs of a residual MLP:
    result = fit_grid(trainer, g, pack=True)                            # one program (depth and width packed)

    g = grid(1, zipped(optimizer=["sgd", "adam"], learning_rate=[0.1, 1e-3]))   # exactly these two settings
    g = grid(1, optimizer={"sgd": dict(learning_rate=[0.1, 0.03], momentum=[0.0, 0.9]),
                           "adam": dict(learning_rate=[1e-3])})                  # 5 settings: a conditional axis

    g = grid(2, **{"train.batch_size": [16, 32], "train.momentum": [0.0, 0.9]})  # 8 runs in 2 programs
    result = fit_grid(trainer, g, checkpoint_dir="grid")                # batch 16 and batch 32 side by side
    result.select(seed=1, batch_size=32, momentum=0.9)                  # an axis by its last name, too

A grid is every combination of its axes' values; the seed varies fastest, then the axes in reverse order of
their giving (the first axis slowest). An axis is named by a dotted config path (``'train.batch_size'``,
``'model.width'``, ``'train.optimizer'``, ``'train.optimizer_args.b2'``) or a bare name: one of
``resjax.train.core.HPARAMS`` (``learning_rate``, ``weight_decay``, ``tau``, ``momentum``, ``adam_b1``,
``adam_b2``) or any other setting of ``config.train`` (``batch_size`` means ``train.batch_size``). ``fit_grid``
resolves every axis against the trainer's config before anything is built or trained: one that is not a
setting is a ``ValueError`` naming it, as is a ``model.*`` axis of a trainer given its model as a module
object (it cannot be rebuilt; build the model from ``config.model``).

Traced axes and programs. The hyperparameters (``HPARAMS``) that the trainer's program can hold per run are
traced: run ``r`` gets ``hparams[name][r]`` inside one vmapped program (the learning rate and weight decay
always; ``tau`` for a model with ``scaling='tau'``; ``momentum`` for the SGD family and ``adam_b1`` /
``adam_b2`` for the built-in 'adam', injected into the optimiser state only when a grid varies them:
``Core.with_traced``). Every other axis (batch size, optimiser, schedule, model kind; depth and width where they
do not pack, below) changes the program: the grid splits into one program per
combination of those axes' values (``trainer.with_config(config)``: the trainer rebuilt with the same data,
model factory, optimiser pieces and hooks), each with the traced axes inside. The programs run side by side,
one device each (``resjax.train.side_by_side``, on-device ``Trainer``: ``Trainer.sweep``), or one after
another (the host feeder's ``ImageTrainer``, whose ``fit`` uses every device it is given; and one device or
several processes). Each run is trained exactly as that seed alone with those settings (the seed integer
gives the PRNG key and the data order): its program's config is the trainer's with the program's values
set, its traced values are its ``hparams``.

Depth and width packed. A ``model.num_blocks`` (``plain_mlp``: ``model.depth``) or ``model.width`` axis of an MLP
built by name does not split the grid: its program's model is built at the largest depth and width of its runs,
and each run trains its own network inside it (``resjax.train.packing``: the blocks past a run's depth are the
identity and never move, a narrower run's units past its width are zero and stay zero, each run's initial draws
are its own network's): equal to that network trained alone to float rounding. Where a program cannot pack
(``packing.packable``: a rematerialised stack, a tau rule of K, an optimiser of your own; for the width, a norm
that mixes the units, Fixup's scalar biases) the axis splits as any other. ``fit_grid(..., pack=False)`` splits
always; ``pack='depth'`` or ``'width'`` packs that axis only; the default, ``pack='auto'``, packs on an
accelerator, and on a CPU where ``packing_pays`` predicts the compilations it saves to cost more than the
arithmetic it adds (every packed run computes as its program's largest network; on the 2-core CPU a grid of 24 runs
was 3.2x faster packed at 2 epochs, 1.65x at 10, 0.94x at 30: ``docs/benchmarks.md``). The packed program scans its
stack of blocks even where the config unrolls it (one block to compile, not one per depth; ``packing.scanned``).
``select`` gives a packed run as its own network holds it: the config's layout, the run's depth and width
(``packing.own_run``), so the network built from the config at those settings applies to it.

Axes that say what the researcher means. ``zipped(a=[...], b=[...])`` (positional, in ``grid(seeds, ...)``) varies
its axes together: exactly the listed tuples. An axis given a dict is conditional, each value with the axes that
apply to it (``optimizer={'sgd': dict(learning_rate=[...], momentum=[...]), 'adam': dict(learning_rate=[...])}``):
a run's label is None for an axis that does not apply to it, and its setting is the config's. An axis value that
has no effect on some runs (``momentum`` or ``adam_b1`` under an optimiser without it, ``tau`` on a model without
``scaling='tau'``, a learning rate for your own ``GradientTransformation``) would train identical runs: it is a
``ValueError`` before anything trains, naming the runs, their settings and the setting. A ``model.*`` axis may
name a field of the model that the config leaves to its default. The columns of ``frame()`` and ``summary()``
are the names ``select`` and ``index`` take: an axis's last part (``batch_size`` for ``'train.batch_size'``),
its full name only where two axes share a last part. ``fit_grid`` says, before anything trains, how many runs
and programs it makes (``describe``).

Checkpoints: ``fit_grid(..., checkpoint_dir=D)`` with one program checkpoints into ``D`` itself (as
``trainer.fit`` does); with several, program ``p`` checkpoints into ``D/<p.name>`` (its settings, e.g.
``train.batch_size=16``; ``D/grid.json`` lists them). Run again with the same grid and ``D``, each program
resumes from its own newest checkpoint: a finished program is read back, not trained; an unfinished one
continues, so the whole grid equals the uninterrupted grid bit for bit. A SIGTERM or SIGINT during a grid
lets the running programs save (``side_by_side``) and raises ``Preempted``; the programs not yet started start
on the rerun.

Results (``GridResult``): ``history`` holds, per metric (the trainer's history entries with an epoch axis,
whatever the objective's metrics are), ``(runs, epochs)`` in the grid's run order; ``frame()`` has one row per
run and epoch, labelled by ``run``, ``seed`` and every axis (values as given: numbers, names, tuples);
``summary()`` one row per run; ``select(**settings)`` a run's ``RunState`` (the axes that apply to it named);
``programs`` each program's settings, runs, trainer and results.

Diverged runs: the trainers freeze a run whose loss or gradient became non-finite and record its epoch
(``diverged_epoch``, 1-based; -1 for none), and its later epochs' metrics are NaN. ``summary()`` reports, per
run, the ``final_*`` (last epoch), ``best_*`` (lowest over the finite epochs only; the highest for the metrics
named in ``summary(maximize=...)``, e.g. an accuracy) and ``last_finite_*``
(the last finite epoch's value) metrics, and ``diverged_epoch`` (None when the run did not diverge).
``frame()`` keeps every epoch as trained (NaN after divergence) with ``diverged`` per row.

pandas is needed for ``frame`` and ``summary`` only (``pip install pandas``, or resjax's ``grid`` extra).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import math
import os
import re
import sys
import types
from typing import Any, Sequence

import ml_collections
import numpy as np

from resjax.train.core import HPARAM_SETTINGS, HPARAMS
from resjax.train.preemption import Preempted, _say
from resjax.train.state import RunState

__all__ = ["CPU_PROGRAM_SECONDS", "CPU_UNIT_SECONDS", "Grid", "GridResult", "Program", "Zipped", "auto_pack",
           "describe", "fit_grid", "grid", "packing_pays", "programs", "zipped"]

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
#: The dict-valued settings whose keys a grid may add (an optax function's arguments).
_OPEN = ("train.optimizer_args", "train.schedule_args")


def _hparam(name: str) -> str | None:
    """The ``HPARAMS`` name an axis name stands for (``'momentum'``, ``'train.momentum'``), or None."""
    if name in HPARAMS:
        return name
    return next((h for h, path in HPARAM_SETTINGS.items() if path == name), None)


def _plain(v: Any) -> Any:
    """A value as plain Python (numpy scalars as numbers, lists as tuples), for configs, labels and JSON."""
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, (list, tuple, np.ndarray)):
        return tuple(_plain(x) for x in (v.tolist() if isinstance(v, np.ndarray) else v))
    return v


def _same(a: Any, b: Any) -> bool:
    """Whether two axis values are equal: floats to a relative 1e-6 (float32 labels), others exactly."""
    if all(isinstance(x, (float, int)) and not isinstance(x, bool) for x in (a, b)):
        return bool(np.isclose(a, b, rtol=1e-6, atol=0))
    return a == b and type(a) is type(b)


@dataclasses.dataclass(frozen=True)
class Grid:
    """Runs as a table: ``axes`` (name -> values, ``'seed'`` first) and, per run, ``seeds`` and ``values`` (axis
    name -> the run's value; ``HPARAMS`` axes as float64 numbers, the trainers compute in float32)."""

    axes: dict
    seeds: list
    values: dict

    @property
    def num_runs(self) -> int:
        """The number of runs (the product of the axes' lengths)."""
        return len(self.seeds)

    @property
    def hparams(self) -> dict:
        """The ``HPARAMS`` axes as per-run float64 arrays, by hyperparameter name (``{'learning_rate': ...}``; NaN
        where a conditional axis does not apply to a run)."""
        return {_hparam(k): np.asarray([np.nan if x is None else x for x in v], np.float64)
                for k, v in self.values.items() if _hparam(k)}

    def column(self, axis: str) -> str:
        """The name of ``axis``'s column in ``labels``, ``frame`` and ``summary``: the name ``select`` and ``index``
        take, its last part (``batch_size`` for ``'train.batch_size'``) unless another axis shares that last part
        (then the name as given)."""
        short = axis.split(".")[-1]
        clash = [a for a in self.axes if a != "seed" and a.split(".")[-1] == short]
        return short if len(clash) == 1 and short not in ("run", "seed", "epoch") else axis

    def labels(self) -> list[dict]:
        """One dict per run: ``{'run': r, 'seed': s, <axis column>: value, ...}`` (None where a conditional axis
        does not apply to the run)."""
        cols = {k: self.column(k) for k in self.values}
        return [{"run": r, "seed": s, **{cols[k]: v[r] for k, v in self.values.items()}}
                for r, s in enumerate(self.seeds)]

    def axis(self, name: str) -> str:
        """The axis ``name`` names: its name as given, its config path's last part (``batch_size`` for
        ``'train.batch_size'``) or, for a bare name, ``train.<name>`` (``ValueError`` when none or several)."""
        if name in self.axes:
            return name
        short = name.split(".")[-1]
        found = [a for a in self.axes if a != "seed" and (a == short if "." in name else a.split(".")[-1] == name)]
        if len(found) != 1:
            raise ValueError(f"{name}: {'names several axes' if found else 'not an axis'} of the grid "
                             f"{list(self.axes)}")
        return found[0]

    def index(self, **settings: Any) -> int:
        """The run number of the run with ``settings`` (every axis that applies to it named, as given or by its
        last name, e.g. ``seed=1, learning_rate=0.1`` or ``seed=0, batch_size=32``). A label of ``labels()`` names
        its run as it is (``index(**label)``): an axis given as None is one that does not apply to the run (a
        conditional axis), ``run`` is checked against the rest, and ``seed`` may be left out of a grid of one seed.
        Float values match to a relative 1e-6 (``learning_rate=0.030000001`` is the 0.03 run)."""
        named, run_no = {}, settings.pop("run", None)
        for k, v in settings.items():
            named[self.axis(k)] = _plain(v)
        if "seed" not in named and len(set(self.seeds)) == 1:
            named["seed"] = self.seeds[0]
        if "seed" not in named or not set(named) <= set(self.axes):
            raise ValueError(f"index: name every axis of the grid {list(self.axes)}, got {sorted(settings)}")
        given = {k: v for k, v in named.items() if v is not None}
        for r, s in enumerate(self.seeds):
            if s != given["seed"]:
                continue
            run = {k: v[r] for k, v in self.values.items() if v[r] is not None}
            if set(run) == set(given) - {"seed"} and all(_same(run[k], given[k]) for k in run):
                if run_no is not None and run_no != r:
                    raise ValueError(f"index: run={run_no} is not the run with {settings} (that is run {r})")
                return r
        if set(named) != set(self.axes) and all(None not in v for v in self.values.values()):
            raise ValueError(f"index: name every axis of the grid {list(self.axes)}, got {sorted(settings)}")
        raise ValueError(f"index: no run of the grid has {settings}; its axes are {self.axes}")


@dataclasses.dataclass(frozen=True)
class Zipped:
    """Axes that vary together (``zipped(optimizer=['sgd', 'adam'], learning_rate=[0.1, 0.001])``): the i-th values of
    every axis form one setting, so the grid runs exactly the listed pairs (tuples), not their product."""

    axes: dict


def zipped(axes: dict | None = None, **more: Sequence[Any]) -> Zipped:
    """Axes that vary together, for ``grid(...)``: ``zipped(optimizer=['sgd', 'adam'], learning_rate=[0.1, 1e-3])``
    is two settings, (sgd, 0.1) and (adam, 0.001). Every list must have the same length (``ValueError`` naming
    the axes), the settings distinct; a dotted name goes in ``axes`` (``zipped({'train.batch_size': [...]}, ...)``)."""
    given = {**(axes or {}), **more}
    if len(given) < 1:
        raise ValueError("zipped: want at least one axis")
    lists = {n: _axis_values(n, v, distinct=False) for n, v in given.items()}
    lengths = {n: len(v) for n, v in lists.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"zipped: the axes {sorted(lists)} must have as many values each, got {lengths}")
    rows = list(zip(*lists.values()))
    if any(all(_same(x, y) for x, y in zip(a, b)) for a, b in itertools.combinations(rows, 2)):
        raise ValueError(f"zipped: want distinct settings of {list(lists)}, got {rows}")
    return Zipped(lists)


def _axis_values(name: Any, vals: Any, distinct: bool = True) -> list:
    """An axis's values, checked (``ValueError`` naming the axis): numbers for ``HPARAMS``, any plain values
    otherwise; distinct unless ``distinct=False``."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"{name!r}: an axis is a setting's name or dotted config path ('train.batch_size')")
    if name in ("seed", "train.seed"):
        raise ValueError(f"{name}: the seeds are the grid's seeds= argument, not an axis")
    if _hparam(name):
        vals = np.atleast_1d(np.asarray(vals, dtype=object))
        try:
            vals = [float(v) for v in vals]
        except (TypeError, ValueError):
            raise ValueError(f"{name}: want numbers, got {list(vals)}") from None
        if any(not math.isfinite(v) for v in vals):
            raise ValueError(f"{name}: want finite numbers, got {vals}")
    else:
        if isinstance(vals, (str, bytes)) or not isinstance(vals, (Sequence, np.ndarray)):
            raise ValueError(f"{name}: want a list of values, got {vals!r}")
        vals = [_plain(v) for v in vals]
    if not vals or (distinct and any(_same(a, b) for a, b in itertools.combinations(vals, 2))):
        raise ValueError(f"{name}: want distinct values, got {vals}")
    return vals


def _settings(parts: list) -> list[dict]:
    """Every combination of ``parts`` (each a ``Zipped``, or a dict of axis name -> values or, for a conditional
    axis, value -> its own axes), as dicts of axis name -> value, the first part slowest."""
    factors = []
    for part in parts:
        if isinstance(part, Zipped):
            factors.append([dict(zip(part.axes, row)) for row in zip(*part.axes.values())])
            continue
        for name, vals in part.items():
            if isinstance(vals, Zipped):
                raise ValueError(f"{name}: pass zipped(...) as its own argument of grid(...), not as an axis's values")
            if isinstance(vals, dict):  # a conditional axis: each value with the axes that apply to it
                values = _axis_values(name, list(vals))
                factor = []
                for v, sub in zip(values, vals.values()):
                    subparts = [sub] if isinstance(sub, (dict, Zipped)) else list(sub or ())
                    if not all(isinstance(p, (dict, Zipped)) for p in subparts):
                        raise ValueError(f"{name}={v!r}: want the axes that apply to it as a dict (or zipped(...)), "
                                         f"got {sub!r}")
                    for s in _settings(subparts):
                        if name in s:
                            raise ValueError(f"{name}: an axis inside its own conditional value {v!r}")
                        factor.append({name: v, **s})
                factors.append(factor)
            else:
                factors.append([{name: v} for v in _axis_values(name, vals)])
    out = []
    for combo in itertools.product(*factors):
        merged = {}
        for d in combo:
            twice = set(merged) & set(d)
            if twice:
                raise ValueError(f"{sorted(twice)[0]}: an axis given twice in grid(...)")
            merged.update(d)
        out.append(merged)
    return out


def grid(seeds: int | Sequence[int] = 1, axes: dict | Zipped | None = None, *groups: dict | Zipped,
         **more: Sequence[Any] | dict) -> Grid:
    """The grid of every combination of ``seeds`` (seed integers, or a count: ``range(seeds)``) and the
    values of each axis: ``axes`` (a dict, for dotted names: ``{'train.batch_size': [64, 128]}``), keywords
    (``learning_rate=[...]``, ``momentum=[...]``, ``batch_size=[...]``) and, positionally, ``zipped(...)`` axes
    (their values in lockstep: exactly the listed tuples). An axis given a dict is conditional: each of its values
    with the axes that apply to it (``optimizer={'sgd': dict(learning_rate=[0.1, 0.03], momentum=[0.0, 0.9]),
    'adam': dict(learning_rate=[1e-3])}``: 4 SGD settings and one Adam setting; a run's label is None for an axis
    that does not apply to it, and its value is the config's). The seed varies fastest, then the axes in reverse
    order of their giving. Bad names or values are a ``ValueError`` naming the axis; whether a name is a setting
    (and whether each value has an effect on its runs) is checked against the trainer's config by ``fit_grid``,
    before training."""
    if isinstance(seeds, (int, np.integer)) and not isinstance(seeds, bool):
        if seeds < 1:
            raise ValueError(f"seeds: want a positive count or a list of seed integers, got {seeds!r}")
        seeds = list(range(int(seeds)))
    seeds = list(seeds)
    if not seeds or any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) for s in seeds):
        raise ValueError(f"seeds: want a non-empty list of seed integers, got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds: each seed once, got {seeds}")
    parts = [p for p in (axes, *groups) if p is not None]
    for p in parts:
        if not isinstance(p, (dict, Zipped)):
            raise ValueError(f"grid: the positional arguments after seeds are dicts of axes or zipped(...), got {p!r}")
    parts.append(more)
    settings = _settings(parts)
    names = list(dict.fromkeys(n for s in settings for n in s))
    values = {n: [s.get(n) for s in settings for _ in seeds] for n in names}
    distinct = {}
    for n in names:
        distinct[n] = []
        for s in settings:
            if n in s and not any(_same(s[n], v) for v in distinct[n]):
                distinct[n].append(s[n])
    return Grid(axes={"seed": [int(s) for s in seeds], **distinct}, seeds=[int(s) for _ in settings for s in seeds],
                values=values)


@dataclasses.dataclass(frozen=True)
class Program:
    """One program of a grid: ``settings`` (its program axes' values, by axis name), ``runs`` (the grid's run
    numbers it trains, in order), ``trainer`` (rebuilt for its settings, tracing its traced axes), ``hparams``
    (the traced values per run), ``name`` (its checkpoint folder's name) and, once trained, ``run`` and
    ``history`` (its own, a leading axis over ``runs``)."""

    settings: dict
    runs: list
    trainer: Any
    hparams: dict
    name: str
    run: RunState | None = None
    history: dict | None = None


@dataclasses.dataclass(frozen=True)
class GridResult:
    """A trained grid: ``run`` (the state, a leading run axis; None when the grid ran as several programs,
    whose states have other shapes: ``select``), ``history`` (``(runs, epochs)`` per metric, in the grid's run
    order), ``grid`` and ``programs`` (``Program``, trained)."""

    grid: Grid
    run: RunState | None
    history: dict
    programs: tuple = ()

    def select(self, **settings: Any) -> RunState:
        """The ``RunState`` of one run, named by its settings (``seed=1, learning_rate=0.1``; an axis by its
        name as given or its last part: ``batch_size=32``)."""
        r = self.grid.index(**settings)
        program = next((p for p in self.programs if r in p.runs), None)
        if program is None:  # a result made without its programs
            return self.run.select(r)
        run = program.run.select(program.runs.index(r))
        t = program.trainer
        if getattr(t, "packed_depths", ()) or getattr(t, "packed_widths", ()):  # the run's own network's state
            from resjax.train.packing import own_run

            h = {k: np.asarray(v).reshape(-1) for k, v in (program.hparams or {}).items()}
            i = program.runs.index(r)
            pick = lambda name: int(h[name][i if h[name].size > 1 else 0]) if name in h else None  # noqa: E731
            run = own_run(t, run, pick("active_depth"), pick("active_width"))
        return run

    def metric_names(self) -> list[str]:
        """The history's per-epoch metrics (its entries with a run and an epoch axis), in its order."""
        return [k for k, v in self.history.items()
                if isinstance(v, np.ndarray) and v.ndim == 2 and v.shape[0] == self.grid.num_runs
                and v.dtype.kind == "f"]

    def frame(self) -> Any:
        """A pandas DataFrame with one row per run and epoch: the grid's labels (``run``, ``seed``, each axis),
        ``epoch`` (1-based), each metric of the history, ``diverged`` and ``diverged_epoch`` (None when the run
        did not diverge)."""
        import pandas as pd

        rows, diverged = [], np.asarray(self.history["diverged_epoch"]).reshape(-1)
        names = self.metric_names()
        epochs = max((self.history[m].shape[1] for m in names), default=0)
        for label in self.grid.labels():
            r = label["run"]
            d = int(diverged[r])
            for e in range(epochs):
                rows.append({**label, "epoch": e + 1, **{m: float(self.history[m][r, e]) for m in names},
                             "diverged": d >= 0 and e + 1 >= d, "diverged_epoch": d if d >= 0 else None})
        return _none_kept(pd.DataFrame(rows), self.grid)

    def summary(self, maximize: str | Sequence[str] = ()) -> Any:
        """A pandas DataFrame with one row per run: the labels, ``final_<m>``, ``best_<m>`` (over finite epochs)
        and ``last_finite_<m>`` of each metric but ``lr``, and ``diverged_epoch``. ``best_<m>`` is the lowest
        value, as for losses and errors, or the highest for the metrics named in ``maximize``: a metric's name as
        the trainer's ``metrics=`` gave it (``summary(maximize="accuracy")``: its ``batch_``, ``train_`` and
        ``test_`` entries) or a history entry's (``"test_accuracy"``). A name that is no metric of the history
        is a ``ValueError`` naming it."""
        import pandas as pd

        names = [m for m in self.metric_names() if m != "lr"]
        wanted = [maximize] if isinstance(maximize, str) else maximize
        if not isinstance(wanted, (Sequence, set, frozenset)) or not all(isinstance(w, str) for w in wanted):
            raise ValueError(f"summary(maximize=...): want a metric's name or a list of them, got {maximize!r}")
        highest, unknown = set(), []
        for want in wanted:
            hits = {m for m in names if m == want or m in (f"batch_{want}", f"train_{want}", f"test_{want}")}
            highest |= hits
            unknown += [want] if not hits else []
        if unknown:
            raise ValueError(f"summary(maximize=...): {', '.join(map(repr, unknown))} names no metric of the "
                             f"history (its metrics: {', '.join(names)})")
        rows, diverged = [], np.asarray(self.history["diverged_epoch"]).reshape(-1)
        for label in self.grid.labels():
            r, row = label["run"], dict(label)
            for m in names:
                v = np.asarray(self.history[m][r], np.float64)
                finite = np.flatnonzero(np.isfinite(v))
                best = np.max if m in highest else np.min
                row[f"final_{m}"] = float(v[-1]) if len(v) else np.nan
                row[f"best_{m}"] = float(best(v[finite])) if len(finite) else np.nan
                row[f"last_finite_{m}"] = float(v[finite[-1]]) if len(finite) else np.nan
            row["diverged_epoch"] = int(diverged[r]) if diverged[r] >= 0 else None
            rows.append(row)
        return _none_kept(pd.DataFrame(rows), self.grid)


def _none_kept(frame: Any, g: Grid) -> Any:
    """``frame`` with None, not NaN, where a conditional axis does not apply to a run (pandas turns a None among
    numbers into NaN): those axis columns as objects, as ``labels()`` and ``select`` have them."""
    for axis, values in g.values.items():
        col = g.column(axis)
        if col in frame and any(v is None for v in values):
            frame[col] = frame[col].astype(object).where(frame[col].notna(), None)
    return frame


# ---- resolving axes against a trainer ---------------------------------------------------------------------------


def _lookup(config: Any, path: str) -> bool:
    """Whether ``path`` is a setting of ``config`` (a key of one of the open dict settings counts)."""
    node, parts = config, path.split(".")
    for i, part in enumerate(parts):
        if not hasattr(node, "keys"):
            return False
        if part not in node:
            return ".".join(parts[:i]) in _OPEN and i == len(parts) - 1
        node = node[part]
    return not hasattr(node, "keys")  # a setting, not a block of them


def _model_fields(config: Any) -> set | None:
    """The fields of the model ``config.model`` builds (by its ``kind``), or None when it names no kind it knows."""
    if "model" not in config or "kind" not in config.model:
        return None
    import inspect

    from resjax.nn import _families

    kind = config.model.kind
    if kind == "tau_resnet":
        from resjax.nn import tau_resnet as made
    else:
        made = _families().get(kind)
    if made is None:
        return None
    if dataclasses.is_dataclass(made):
        names = {f.name for f in dataclasses.fields(made)} - {"parent", "name"}
    else:
        names = {n for n, p in inspect.signature(made).parameters.items()
                 if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return (names | set(config.model.keys())) - {"kind"}


def _model_field(config: Any, path: str) -> bool:
    """Whether ``path`` (``'model.depth'``) is a field of the model ``config.model`` builds (by its ``kind``), named
    in the config or not (then the model's default is the axis's base value)."""
    parts = path.split(".")
    if len(parts) != 2 or parts[0] != "model":
        return False
    return parts[1] in (_model_fields(config) or ())


def _resolve(trainer: Any, name: str) -> str:
    """The config path of the axis ``name`` (``ValueError`` naming it when it is no setting of the trainer)."""
    h = _hparam(name)
    if h == "tau" and name == "tau" and trainer.uses_tau:
        return "tau"  # the model call's tau (the model may be a module object)
    config = trainer.config
    path = HPARAM_SETTINGS[h] if h else name
    if "." not in path:
        if "train" in config and path in config.train:
            path = f"train.{path}"
        elif path in config and not hasattr(config[path], "keys"):
            return path
    if not _lookup(config, path) and not _model_field(config, path):
        fields = _model_fields(config)
        if path.startswith("model.") and fields is not None:  # the model's own fields, the closest first
            import difflib

            close = difflib.get_close_matches(path.split(".", 1)[1], sorted(fields), n=1, cutoff=0.7)
            raise ValueError(f"{name}: a {config.model.kind!r} model has no field {path.split('.', 1)[1]!r}"
                             + (f" (did you mean 'model.{close[0]}'?)" if close else "")
                             + f"; its fields: {', '.join(sorted(fields))}")
        known = sorted(config.train.keys()) if "train" in config else []
        raise ValueError(f"{name}: not a setting of the trainer's config (a dotted path such as 'train.batch_size' "
                         f"or 'model.width', or a setting of config.train: {known})")
    if path.startswith("model.") and trainer.make_args.get("model") is not None:
        raise ValueError(f"{name}: the trainer's model was given as a module object, which a grid cannot rebuild "
                         "for another model setting; build the model from config.model (no model=) to vary it")
    if path == "train.seed":
        raise ValueError(f"{name}: the seeds are the grid's seeds= argument, not an axis")
    return path


def _set(config: ml_collections.ConfigDict, path: str, value: Any, axis: str) -> None:
    node, parts = config, path.split(".")
    for part in parts[:-1]:
        node = node[part]
    try:
        node[parts[-1]] = value
    except (TypeError, ValueError) as e:
        raise ValueError(f"{axis}: cannot set {path} to {value!r} ({e})") from None


def _folder(settings: dict) -> str:
    """A readable, stable folder name for a program's settings (its resolved paths and values)."""
    def text(v):
        if isinstance(v, float):
            return repr(v)
        if isinstance(v, tuple):
            return "(" + ",".join(text(x) for x in v) + ")"
        return str(v)

    name = ",".join(f"{path}={text(v)}" for path, v in settings.items()) or "all"
    safe = re.sub(r"[^A-Za-z0-9._=,()+-]", "_", name)
    if safe != name or len(safe) > 120:  # characters replaced, or too long: a digest keeps it unique
        safe = safe[:100] + "-" + hashlib.sha256(name.encode()).hexdigest()[:12]
    return safe


def _no_effect(t: Any, h: str) -> str:
    """Why the hyperparameter ``h`` cannot vary in trainer ``t``'s program (it has no effect there)."""
    if h == "tau":
        return "the model has no scaling='tau'"
    if h == "learning_rate":
        return "the optimiser given as a GradientTransformation holds its own learning rate"
    if h == "label_smoothing":
        return "the objective has no label smoothing"
    return f"optimizer {t.config.train.get('optimizer', 'sgd')!r} has no {h}"


def _remedy(h: str) -> str:
    """How to give the hyperparameter ``h`` an axis where ``_no_effect`` says it has none."""
    if h == "learning_rate":  # the rate is the transformation's own: a factory of the rate lets resjax set it
        return ("To vary the learning rate, pass your optimiser as a factory of the rate: "
                "make_train(..., optimizer=lambda learning_rate: optax.adamw(learning_rate))")
    return "Give it only where it applies, with a conditional axis: " + (
        "grid(..., {'model.scaling': {'tau': dict(tau=[0.5, 1.0]), 'none': {}}})" if h == "tau" else
        "grid(..., optimizer={'sgd': dict(momentum=[0.0, 0.9]), 'adam': dict(adam_b1=[0.8, 0.9])})")


def _base(t: Any, h: str) -> float:
    """The value of hyperparameter ``h`` in trainer ``t``'s config (a run that a conditional axis gives none)."""
    if h == "tau":
        from resjax.nn.residual import resolve_tau

        return resolve_tau(getattr(t.model, "tau", 1.0), getattr(t.model, "num_blocks", None))
    try:
        return float(t.setting(HPARAM_SETTINGS[h]))
    except KeyError:
        return float(np.asarray(t.default_hparams().get(h, 0.0)))


def _packed_axes(trainer: Any, paths: dict) -> dict:
    """The grid's axes over the depth and the width of the trainer's model (``model.num_blocks`` and
    ``model.width`` of a residual MLP), if any: ``{'active_depth': axis, 'active_width': axis}``."""
    from resjax.train.packing import KINDS

    if trainer.make_args.get("model") is not None or "model" not in trainer.config:
        return {}
    field = KINDS.get(trainer.config.model.get("kind"))
    if field is None:
        return {}
    out = {}
    for name, path in (("active_depth", f"model.{field}"), ("active_width", "model.width")):
        axis = next((a for a, p in paths.items() if p == path), None)
        if axis is not None:
            out[name] = axis
    return out


def _build(trainer: Any, g: Grid, paths: dict, split: list) -> list[tuple]:
    """``(combo, runs, trainer)`` per combination of the ``split`` axes' values (the trainer rebuilt for it)."""
    combos = {}
    for r in range(g.num_runs):
        combos.setdefault(tuple(_plain(g.values[a][r]) for a in split), []).append(r)
    built = []
    for combo, runs in combos.items():
        if not any(v is not None for v in combo):
            t = trainer
        else:
            config = ml_collections.ConfigDict(trainer.config.to_dict())
            for a, v in zip(split, combo):
                if v is not None:
                    _set(config, paths[a], v, a)
            t = trainer.with_config(config)
        built.append((combo, runs, t))
    return built


def programs(trainer: Any, g: Grid, pack: bool | str = "auto") -> list[Program]:
    """The grid's programs on ``trainer`` (see the module docstring), every axis resolved and every program's
    trainer built before any training (``ValueError`` naming a bad axis or setting, or an axis value that has no
    effect on some runs, naming them). ``pack``: a depth or width axis of a model whose depth or width packs
    (``resjax.train.packing``) runs inside its programs (``hparams['active_depth']``, ``['active_width']``);
    ``'depth'`` or ``'width'``: that axis only; ``False``: one program per depth and width; ``'auto'``:
    ``auto_pack(None, trainer, g)``, as ``fit_grid`` on JAX's devices."""
    if pack == "auto":
        pack = auto_pack(None, trainer, g)
    from resjax.train.packing import KINDS, packable, packable_width

    paths = {a: _resolve(trainer, a) for a in g.values}
    traced = [a for a in g.values if _hparam(a)]
    packs = _packed_axes(trainer, paths) if pack else {}
    if isinstance(pack, str):  # 'depth' or 'width': that axis only
        packs = {n: a for n, a in packs.items() if n == f"active_{pack}"}
    checks = {"active_depth": packable, "active_width": packable_width}
    while True:
        split = [a for a in g.values if a not in traced and a not in packs.values()]
        built = _build(trainer, g, paths, split)
        cannot = [n for n in packs if any(checks[n](t.config, t.optim) is not None for _, _, t in built)]
        if not cannot:
            break
        for n in cannot:  # some program cannot pack it: a program per value
            del packs[n]
    packed = []
    for combo, runs, t in built:
        values = {}
        for name, axis in packs.items():
            field = KINDS[t.config.model.kind] if name == "active_depth" else "width"
            base = t.config.model.get(field, getattr(t.model, field, None))
            values[name] = [base if g.values[axis][r] is None else g.values[axis][r] for r in runs]
        if values:
            t = t._packed(values.get("active_depth", ()), values.get("active_width", ()))
        packed.append((combo, runs, t, values))
    built = [(combo, runs, t) for combo, runs, t, _ in packed]
    for a in traced:  # a value where the setting has no effect would train identical runs: refused, naming them
        h = _hparam(a)
        idle = [(combo, [r for r in runs if g.values[a][r] is not None], t) for combo, runs, t in built
                if not t.traceable(h)]
        idle = [(combo, runs, t) for combo, runs, t in idle if runs]
        if idle:
            combo, runs, t = idle[0]
            where = ", ".join(f"{g.column(s)}={v!r}" for s, v in zip(split, combo) if v is not None)
            more = sum(len(r) for _, r, _ in idle) - len(runs)
            raise ValueError(
                f"{a}: has no effect on runs {runs}{f' and {more} more' if more else ''} of the grid"
                f"{f' ({where})' if where else ''}: {_no_effect(t, h)}; its values would train identical runs. "
                + _remedy(h))
    out = []
    for combo, runs, t, values in packed:
        mine = [a for a in traced if any(g.values[a][r] is not None for r in runs)]
        t = t.with_traced([_hparam(a) for a in mine])
        hparams = {_hparam(a): np.asarray([_base(t, _hparam(a)) if g.values[a][r] is None else g.values[a][r]
                                           for r in runs], np.float64) for a in mine}
        hparams.update({name: np.asarray(v, np.float64) for name, v in values.items()})
        t.check_hparams(hparams, len(runs))  # every program's values checked before any program trains
        settings = {a: v for a, v in zip(split, combo) if v is not None}
        out.append(Program(settings=settings, runs=runs, trainer=t, hparams=hparams,
                           name=_folder({paths[a]: v for a, v in settings.items()})))
    names = [p.name for p in out]
    if len(set(names)) != len(names):
        raise ValueError(f"grid: two programs would share the checkpoint folder {names}")
    return out


def _merge(g: Grid, trained: list[Program]) -> dict:
    """The programs' histories as one, in the grid's run order: per-run entries stacked (an epoch axis padded
    with NaN to the longest), scalars (``epochs``) the largest."""
    out = {}
    for p in trained:
        for k, v in p.history.items():
            if not isinstance(v, np.ndarray) or v.ndim == 0:
                if np.ndim(v) == 0 and not isinstance(v, dict):
                    out[k] = max(out.get(k, v), v)
                continue
            if v.shape[0] != len(p.runs):
                continue
            if k not in out:
                fill = np.nan if v.dtype.kind in "fc" else -1
                out[k] = np.full((g.num_runs, *v.shape[1:]), fill, v.dtype)
            if v.shape[1:] != out[k].shape[1:]:  # another number of epochs (a train.epochs axis): pad
                widths = [max(a, b) for a, b in zip(out[k].shape[1:], v.shape[1:])]
                fill = np.nan if v.dtype.kind in "fc" else -1
                grown = np.full((g.num_runs, *widths), fill, out[k].dtype)
                grown[(slice(None), *(slice(0, n) for n in out[k].shape[1:]))] = out[k]
                out[k] = grown
            out[k][(np.asarray(p.runs), *(slice(0, n) for n in v.shape[1:]))] = v
    return out


def _block_work(progs: Sequence[Program]) -> tuple[float, float]:
    """The blocks' arithmetic per example of the packed programs' runs, ``(alone, packed)``: depth x width^2 summed
    over the runs, as their own networks and as their program's largest one (0, 0 when nothing is packed)."""
    from resjax.train.packing import KINDS

    alone = packed = 0.0
    for p in progs:
        depths, widths = p.hparams.get("active_depth"), p.hparams.get("active_width")
        if depths is None and widths is None:
            continue
        n, model = len(p.runs), p.trainer.config.model
        d = np.full(n, float(model[KINDS[model.kind]])) if depths is None else np.asarray(depths, float)
        w = np.full(n, float(model.get("width", 1))) if widths is None else np.asarray(widths, float)
        alone += float(np.sum(d * w ** 2))
        packed += n * float(d.max() * w.max() ** 2)
    return alone, packed


def _packed_work(progs: Sequence[Program]) -> float | None:
    """The blocks' arithmetic of the packed programs over that of their runs alone (depth x width^2 per run), or
    None when nothing is packed."""
    alone, packed = _block_work(progs)
    return packed / alone if alone else None


def describe(progs: Sequence[Program], g: Grid) -> str:
    """What a grid's programs will train, said before they run: ``'grid: 24 runs in 1 program (depth packed:
    2, 8, 32; traced: learning_rate)'``, one line, and a line per program when there are several."""
    traced = sorted({k for p in progs for k in p.hparams if k not in ("active_depth", "active_width")})
    notes = []
    for name in ("depth", "width"):
        values = sorted({int(d) for p in progs for d in p.hparams.get(f"active_{name}", ())})
        notes += [f"{name} packed: {', '.join(map(str, values))}"] if values else []
    notes += [f"traced: {', '.join(traced)}"] if traced else []
    factor = _packed_work(progs)
    if factor is not None and factor > 1.0:
        notes.append(f"packed runs compute as their program's largest network: {factor:.1f}x the block "
                     "arithmetic of the runs alone")
    head = (f"grid: {g.num_runs} runs in {len(progs)} program{'s' if len(progs) != 1 else ''}"
            + (f" ({'; '.join(notes)})" if notes else ""))
    if len(progs) == 1:
        return head
    return "\n".join([head] + [f"  {p.name}: {len(p.runs)} runs" for p in progs])


#: ``packing_pays``' price of one more program on the 2-core CPU, in seconds: its compilation, less what packing
#: costs to compile (``docs/benchmarks.md``, section 5: ``python -m benchmarks.grid_packing`` at 2, 10 and 30 epochs
#: in one sitting; the unpacked grid's 8 programs took 30 s more than the packed one, whatever the epochs).
CPU_PROGRAM_SECONDS = 4.4
#: ``packing_pays``' price of one unit of a block's arithmetic (depth x width^2) for one training example of an epoch
#: on the 2-core CPU, in seconds, evaluation included (the same sitting: 1.2 s more an epoch for the packed grid's
#: 2.25 million units more per example, 3,968 examples).
CPU_UNIT_SECONDS = 1.3e-10


def packing_pays(trainer: Any, g: Grid) -> bool:
    """Whether packing ``g``'s depth and width axes on ``trainer`` is predicted faster on the CPU than a program per
    depth and width: the compilations it saves (``CPU_PROGRAM_SECONDS`` each) against the block arithmetic its
    packed runs add (every run computes as its program's largest network: ``CPU_UNIT_SECONDS`` per unit, example
    and epoch). Both rates were measured on the 2-core CPU; with them the prediction put the crossover of the
    benchmark's grid (24 runs, 3.5x the arithmetic, MNIST-1D) at 26 epochs, where the sitting measured 1.65x faster
    packed at 10 epochs and 0.94x at 30. A larger network reaches it in fewer epochs. (Measured with the on-device
    feeder; the host feeder's packed programs use the same prediction, unmeasured.)"""
    if not _packed_axes(trainer, {a: _resolve(trainer, a) for a in g.values}):
        return False  # no depth or width axis: nothing to pack
    packed, unpacked = programs(trainer, g, True), programs(trainer, g, False)
    saved = len(unpacked) - len(packed)
    if saved <= 0:
        return False
    return _extra_seconds(packed, trainer) < saved * CPU_PROGRAM_SECONDS


def _extra_seconds(packed: Sequence[Program], trainer: Any) -> float:
    """The seconds the packed runs' extra block arithmetic is predicted to take on the 2-core CPU (``packing_pays``):
    the training examples of every epoch (or period) at ``CPU_UNIT_SECONDS`` per unit."""
    alone, work = _block_work(packed)
    examples = trainer.steps_per_epoch * trainer.config.train.batch_size * trainer.num_epochs
    return (work - alone) * examples * CPU_UNIT_SECONDS


def auto_pack(devices: Sequence[Any] | None = None, trainer: Any = None, g: Grid | None = None) -> bool:
    """What ``fit_grid(..., pack='auto')`` does on ``devices`` (default: JAX's): pack on an accelerator, where a
    small MLP's program leaves the chip nearly idle and more vmapped runs cost almost nothing (the issue's H200
    measurement: 8 seeds vmapped 8.6x faster than one after another; not measured here). On CPUs, pack where
    ``packing_pays(trainer, g)`` predicts it faster (without a trainer and a grid: not at all), since there every
    packed run's extra arithmetic costs time: on the 2-core CPU the benchmark's grid was 3.2x faster packed at 2
    epochs, 1.65x at 10 and 0.94x at 30 (``docs/benchmarks.md``)."""
    from resjax.train import planning

    platform = list(devices)[0].platform if devices else planning.backend()
    if platform != "cpu":
        return True
    return trainer is not None and g is not None and packing_pays(trainer, g)


def fit_grid(trainer: Any, grid: Grid, *, pack: bool | str = "auto", **fit_kwargs: Any) -> GridResult:
    """Train every run of ``grid`` on ``trainer`` (either feeder: ``Trainer`` or ``ImageTrainer``) and label
    the results (see the module docstring).

    One program (every axis traced): ``trainer.fit(grid.seeds, hparams=..., **fit_kwargs)``. Several: each
    program's ``sweep`` side by side (``Trainer``; ``devices=`` chooses the devices) or ``fit`` one after another
    (``ImageTrainer``), with ``fit_kwargs`` (``epochs``, ``checkpoint_dir``, ``resume``, ``progress``,
    ``callback``, ``log``, ``chunk_epochs``) passed to each; ``checkpoint_dir`` and a ``log`` folder get a
    subfolder per program, a ``progress`` label the program's name. ``callback`` is called from the program's
    thread.

    ``pack``: ``True``: the depth and width axes of an MLP run inside one program (``resjax.train.packing``);
    ``'depth'`` or ``'width'``: that axis only; ``False``: a program per depth and width; ``'auto'`` (default):
    ``True`` on an accelerator, and on a CPU where ``packing_pays`` predicts it faster (``auto_pack``). A packed
    run computes as the largest network of its program: packing saves compilations and fills a device, at the cost
    of that extra arithmetic (``describe`` says how much; measured in ``docs/benchmarks.md``). Before anything
    trains the grid says how many runs and programs it makes (``describe``), on standard output, unless
    ``progress=False``."""
    if "hparams" in fit_kwargs:
        raise ValueError("hparams: a grid sets them; vary them as axes of grid(...)")
    if not isinstance(pack, bool) and pack not in ("depth", "width", "auto"):
        raise ValueError(f"pack: must be True, False, 'depth', 'width' or 'auto', got {pack!r}")
    devices = fit_kwargs.pop("devices", None)
    chosen = auto_pack(devices, trainer, grid) if pack == "auto" else pack
    progs = programs(trainer, grid, chosen)
    if fit_kwargs.get("progress", None) is not False:
        said = describe(progs, grid)
        if pack == "auto" and not chosen and _packed_axes(trainer, {a: _resolve(trainer, a) for a in grid.values}):
            said += ("\n  (depth and width not packed: on the CPU, the arithmetic packing adds is predicted to cost "
                     "more than the compilations it saves, resjax.train.grid.packing_pays; pack=True packs)")
        said = "\n".join([said, *_resume_lines(progs, fit_kwargs.get("checkpoint_dir"), len(progs) == 1)])
        print(said, flush=True)
    if len(progs) == 1:
        p = progs[0]
        run, history = p.trainer.fit(grid.seeds, hparams=p.hparams or None, **fit_kwargs)
        return GridResult(grid, run, history, (dataclasses.replace(p, run=run, history=history),))
    root = fit_kwargs.pop("checkpoint_dir", None)
    log = fit_kwargs.pop("log", None)
    progress = fit_kwargs.pop("progress", None)
    if root is not None:
        _write_manifest(root, grid, progs)

    def kwargs(p: Program) -> dict:
        kw = dict(fit_kwargs)
        if root is not None:
            kw["checkpoint_dir"] = _join(root, p.name)
        if log is not None:
            kw["log"] = _join(log, p.name) if isinstance(log, (str, os.PathLike)) else log
        if progress is not None:
            kw["progress"] = f"{progress} {p.name}" if isinstance(progress, str) else progress
        return kw

    seeds = [[grid.seeds[r] for r in p.runs] for p in progs]
    if all(hasattr(p.trainer, "sweep") for p in progs):  # the on-device feeder: side by side, a device each
        from resjax.train.side_by_side import side_by_side

        jobs = [functools.partial(p.trainer.sweep, s, p.hparams or None, **kwargs(p)) for p, s in zip(progs, seeds)]
        results = side_by_side(jobs, devices)
    else:
        results = []
        for i, (p, s) in enumerate(zip(progs, seeds)):
            try:
                results.append(p.trainer.fit(s, hparams=p.hparams or None, **kwargs(p)))
            except Preempted:
                if i:  # the line the program printed speaks for it alone: say what the programs before it kept
                    where = (f"saved in {_join(root, '')}<program>" if root is not None
                             else "not saved (no checkpoint_dir): lost when this process ends")
                    _say(f"resjax: the grid stopped in its program {i + 1} of {len(progs)} ({p.name}); its programs "
                         f"{', '.join(q.name for q in progs[:i])} had finished and are {where}"
                         + (": run the same command again to go on" if root is not None else ""))
                raise
    trained = [dataclasses.replace(p, run=run, history=history) for p, (run, history) in zip(progs, results)]
    return GridResult(grid, None, _merge(grid, trained), tuple(trained))


def _resume_lines(progs: list, root: Any, single: bool) -> list[str]:
    """What a grid with checkpoints in ``root`` reads back (each program's folder and its newest step) and what
    it starts afresh; folders of ``root`` that are no program of this grid (a changed setting names another
    folder) are named as left alone. Nothing when nothing was saved before (a fresh grid)."""
    if root is None:
        return []
    from resjax.paths import as_path
    from resjax.train import checkpoint

    lines, resumed = [], False
    for p in progs:
        folder = os.fspath(root) if single else _join(root, p.name)
        step = checkpoint.latest(folder)
        resumed |= step is not None
        lines.append(f"  {p.name}: " + (f"resumes from its step {step} in {folder}" if step is not None
                                       else "starts afresh (nothing saved yet)"))
    base = as_path(os.fspath(root), "checkpoint_dir")
    others = ([] if single or not base.is_dir() else
              sorted(q.name for q in base.iterdir() if q.is_dir() and q.name not in {p.name for p in progs}))
    if others:
        lines.append(f"  left as they are, no program of this grid (another setting): {', '.join(others)}")
    return ["grid: resuming from " + os.fspath(root), *lines] if resumed or others else []


def _join(folder: str | os.PathLike, name: str) -> str:
    """``folder/name``: ``os.path.join`` for a local folder, a ``/`` for a bucket URL."""
    from resjax.paths import is_url

    return f"{os.fspath(folder).rstrip('/')}/{name}" if is_url(folder) else os.path.join(folder, name)


def _write_manifest(root: Any, g: Grid, progs: list[Program]) -> None:
    """``root/grid.json``: the grid's axes and each program's folder, settings and runs (for people; resuming
    reads each program's own checkpoints)."""
    from resjax.train.distributed import is_main_process

    if not is_main_process():
        return
    from resjax.paths import as_path, write_atomically

    folder = as_path(root, "checkpoint_dir")  # a local folder or a bucket URL
    folder.mkdir(parents=True, exist_ok=True)
    doc = {"axes": {k: list(v) for k, v in g.axes.items()},
           "programs": [{"folder": p.name, "settings": p.settings, "runs": p.runs} for p in progs]}
    write_atomically(folder / "grid.json", lambda path: path.write_text(json.dumps(doc, indent=1, default=str)),
                     ".grid.json.tmp")


class _GridModule(types.ModuleType):
    """This module, callable as its function :func:`grid` (``resjax.train.grid(3, {...})``): the package exports
    the module under that name, so that ``resjax.train.grid.fit_grid`` and ``help(resjax.train.grid)`` reach the
    module while ``grid(...)`` still builds a grid."""

    def __call__(self, *args: Any, **kwargs: Any) -> Grid:
        return grid(*args, **kwargs)


sys.modules[__name__].__class__ = _GridModule
