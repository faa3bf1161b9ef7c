"""Figures: matplotlib on the file-only backend, written after the results, drawn from the run's own settings.

``pyplot()`` is ``matplotlib.pyplot`` on Agg (experiments never open windows); ``save_figure`` lays a figure out
and writes it atomically (process 0 only; inside ``run_experiment`` held back until ``results.json`` is written,
so a figure that cannot be written loses nothing else). Helpers for the panels: ``describe_optimizer`` (a title
built from the train config, never a fixed string), ``integer_ticks``, ``plural``, ``diverged_marks`` with
``mark_diverged``, and ``legend_outside``.
"""

from __future__ import annotations

import contextlib
import math
import pathlib

import numpy as np

from experiments import files
from experiments.files import is_main

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


_FIGURES: list[list] = []  # figures held back by run_experiment until its results are written


@contextlib.contextmanager
def deferred_figures():
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
        write_figure(fig, path, dpi)
    pyplot().close(fig)


def write_figure(fig, path, dpi: int) -> None:
    """Write ``fig`` to ``path`` atomically (its format from the suffix; png without one)."""
    from resjax.paths import as_path, is_url

    path = as_path(path, "out")
    kind = path.suffix.lstrip(".") or "png"
    if is_url(path):  # matplotlib writes local files: the figure's bytes, then one object
        import io

        buffer = io.BytesIO()
        fig.savefig(buffer, dpi=dpi, format=kind)
        files.write_atomically(path, lambda target: target.write_bytes(buffer.getvalue()))
        return
    files.write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format=kind))
