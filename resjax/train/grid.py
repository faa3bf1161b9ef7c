"""Grids of runs: seeds x traced hyperparameters in one program, with results labelled by the grid.

::

    g = grid(seeds=[0, 1, 2, 3], learning_rate=[0.1, 0.03, 0.01])     # 12 runs, seeds vary fastest
    result = fit_grid(trainer, g, epochs=10)                            # either feeder: one program
    result.frame().query("learning_rate == 0.1")                        # one row per run and epoch (pandas)
    result.summary()                                                    # one row per run
    result.select(seed=2, learning_rate=0.03)                           # that run's RunState

A grid is every combination of its axes' values (``seed`` and any of ``resjax.train.core.HPARAMS``: the
values that do not change shapes, so all runs share one compiled program); run ``r`` is seed ``seed[r]``
with the hyperparameters ``hparams[k][r]``, trained exactly as that seed alone with those settings (the seed
integer gives the PRNG key and the data order). The feeders take the grid's ``seeds`` and ``hparams`` as they
take any list of seeds and per-run ``hparams``; ``fit_grid`` is that call plus the labels.

Diverged runs: the trainers freeze a run whose loss or gradient became non-finite and record its epoch
(``diverged_epoch``, 1-based; -1 for none), and its later epochs' metrics are NaN. ``summary()`` reports, per
run, the ``final_*`` (last epoch), ``best_*`` (lowest over the finite epochs only) and ``last_finite_*``
(the last finite epoch's value) metrics, and ``diverged_epoch`` (None when the run did not diverge).
``frame()`` keeps every epoch as trained (NaN after divergence) with ``diverged`` per row.

pandas is needed for ``frame`` and ``summary`` only (``pip install pandas``, or resjax's ``grid`` extra).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Sequence

import numpy as np

from resjax.train.core import HPARAMS, METRICS
from resjax.train.state import RunState

__all__ = ["Grid", "GridResult", "fit_grid", "grid"]


@dataclasses.dataclass(frozen=True)
class Grid:
    """Runs as a table: ``axes`` (name -> values, ``'seed'`` first) and, per run, ``seeds`` and ``hparams`` (the
    values as given, float64; the trainers compute in float32)."""

    axes: dict
    seeds: list
    hparams: dict

    @property
    def num_runs(self) -> int:
        """The number of runs (the product of the axes' lengths)."""
        return len(self.seeds)

    def labels(self) -> list[dict]:
        """One dict per run: ``{'run': r, 'seed': s, <hparam>: value, ...}``."""
        return [{"run": r, "seed": s, **{k: float(v[r]) for k, v in self.hparams.items()}}
                for r, s in enumerate(self.seeds)]

    def index(self, **settings: Any) -> int:
        """The run number of the run with ``settings`` (every axis named, e.g. ``seed=1, learning_rate=0.1``)."""
        if set(settings) != set(self.axes):
            raise ValueError(f"index: name every axis of the grid {sorted(self.axes)}, got {sorted(settings)}")
        for label in self.labels():
            if all(np.isclose(label[k], v, rtol=1e-6, atol=0) if k != "seed" else label[k] == v
                   for k, v in settings.items()):
                return label["run"]
        raise ValueError(f"index: no run of the grid has {settings}; its axes are {self.axes}")


def grid(seeds: int | Sequence[int] = 1, **axes: Sequence[float]) -> Grid:
    """The grid of every combination of ``seeds`` (seed integers, or a count: ``0 .. seeds - 1``) and the
    values of each hyperparameter axis (``learning_rate=[...]``, ``weight_decay=[...]``, ``tau=[...]``); the
    seed varies fastest, then the axes in the order given. Bad names or values are a ``ValueError`` naming
    the axis (the trainer checks the values' ranges when it runs the grid)."""
    if isinstance(seeds, (int, np.integer)) and not isinstance(seeds, bool):
        if seeds < 1:
            raise ValueError(f"seeds: want a positive count or a list of seed integers, got {seeds!r}")
        seeds = list(range(int(seeds)))
    seeds = list(seeds)
    if not seeds or any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) for s in seeds):
        raise ValueError(f"seeds: want a non-empty list of seed integers, got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds: each seed once, got {seeds}")
    values = {}
    for name, vals in axes.items():
        if name not in HPARAMS:
            raise ValueError(f"{name}: not a hyperparameter a grid can vary in one program; choose from {HPARAMS}")
        vals = [float(v) for v in np.atleast_1d(np.asarray(vals, dtype=np.float64))]
        if not vals or len(set(vals)) != len(vals):
            raise ValueError(f"{name}: want distinct values, got {vals}")
        values[name] = vals
    runs = list(itertools.product(*values.values(), seeds)) if values else [(s,) for s in seeds]
    names = list(values)
    return Grid(axes={"seed": [int(s) for s in seeds], **values}, seeds=[int(r[-1]) for r in runs],
                hparams={n: np.asarray([r[i] for r in runs], np.float64) for i, n in enumerate(names)})


@dataclasses.dataclass(frozen=True)
class GridResult:
    """A trained grid: ``run`` (the state, a leading run axis), ``history`` (the trainer's, ``(runs, epochs)``
    per metric) and ``grid``."""

    grid: Grid
    run: RunState
    history: dict

    def select(self, **settings: Any) -> RunState:
        """The ``RunState`` of one run, named by its settings (``seed=1, learning_rate=0.1``)."""
        return self.run.select(self.grid.index(**settings))

    def frame(self) -> Any:
        """A pandas DataFrame with one row per run and epoch: the grid's labels (``run``, ``seed``, each
        hyperparameter), ``epoch`` (1-based), each metric of ``METRICS``, ``diverged`` and ``diverged_epoch``
        (None when the run did not diverge)."""
        import pandas as pd

        rows, diverged = [], np.asarray(self.history["diverged_epoch"]).reshape(-1)
        epochs = int(self.history["epochs"])
        for label in self.grid.labels():
            r = label["run"]
            d = int(diverged[r])
            for e in range(epochs):
                rows.append({**label, "epoch": e + 1,
                             **{m: float(self.history[m][r, e]) for m in METRICS if m in self.history},
                             "diverged": d >= 0 and e + 1 >= d, "diverged_epoch": d if d >= 0 else None})
        return pd.DataFrame(rows)

    def summary(self) -> Any:
        """A pandas DataFrame with one row per run: the labels, ``final_<m>``, ``best_<m>`` (over finite epochs;
        lowest for losses and errors) and ``last_finite_<m>`` of each metric, and ``diverged_epoch``."""
        import pandas as pd

        rows, diverged = [], np.asarray(self.history["diverged_epoch"]).reshape(-1)
        for label in self.grid.labels():
            r, row = label["run"], dict(label)
            for m in METRICS:
                if m not in self.history or m == "lr":
                    continue
                v = np.asarray(self.history[m][r], np.float64)
                finite = np.flatnonzero(np.isfinite(v))
                row[f"final_{m}"] = float(v[-1]) if len(v) else np.nan
                row[f"best_{m}"] = float(np.min(v[finite])) if len(finite) else np.nan
                row[f"last_finite_{m}"] = float(v[finite[-1]]) if len(finite) else np.nan
            row["diverged_epoch"] = int(diverged[r]) if diverged[r] >= 0 else None
            rows.append(row)
        return pd.DataFrame(rows)


def fit_grid(trainer: Any, grid: Grid, **fit_kwargs: Any) -> GridResult:
    """Train every run of ``grid`` with ``trainer.fit(grid.seeds, hparams=grid.hparams, **fit_kwargs)`` (either
    feeder: ``Trainer`` or ``ImageTrainer``; ``epochs``, ``checkpoint_dir``, ``progress``, ``callback`` pass
    through) and label the results."""
    if "hparams" in fit_kwargs:
        raise ValueError("hparams: a grid sets them; vary them as axes of grid(...)")
    run, history = trainer.fit(grid.seeds, hparams=grid.hparams or None, **fit_kwargs)
    return GridResult(grid, run, history)
