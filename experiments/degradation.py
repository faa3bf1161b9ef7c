"""Degradation of deep plain MLPs on MNIST-1D, and depth-32 residual networks (lecture 000,
"Degradation" and "Training at depth 32").

Settings the lecture states: MNIST-1D (4,000 train / 1,000 test, length 40), width 64, SGD at learning
rate 0.005, 300 epochs, three seeds; plain networks with 2, 8 and 32 hidden 64-to-64 layers; a residual
network of 32 blocks whose branch is one 64-to-64 linear layer with BatchNorm at its start
(pre-activation: BN -> ReLU -> linear, added to the stream), and the same network without
normalisation. Configs: ``plain_d2``, ``plain_d8``, ``plain_d32``, ``residual_bn_d32``, ``residual_d32``.

Settings the lecture leaves open, and what is used:

- optimiser: plain SGD, no momentum, no weight decay ("SGD at learning rate 0.005");
- initialisation: He (Kaiming) uniform on the fan-in with zero biases, what the udlbook notebooks use
  (``nn.init.kaiming_uniform_`` with its defaults); the head is initialised the same way;
- stem and head: a linear stem 40 -> 64 (followed by ReLU in the plain networks, as in any plain MLP;
  without one in the pre-activation residual networks, whose branches begin with their own ReLU) and a
  linear head 64 -> 10; the residual networks have no final norm before the head (the udlbook's form);
- BatchNorm: PyTorch's defaults (epsilon 1e-5, running-estimate rate 0.1, i.e. flax momentum 0.9);
  training error is measured in evaluation mode (running estimates) on the whole training set after
  every epoch, as the lecture's "final training error" of a trained network;
- batches: each epoch is a fresh permutation; the last partial batch is dropped (fixed shapes);
- divergence: a run diverges at the first step whose loss or any gradient entry is not finite; it is
  recorded and frozen, never a crash;
- batch size. Selection rule, written before any run: sweep B in {16, 32, 64, 100, 128} for all five
  configs (three seeds each) and make the default the LARGEST B at which all five claims of the issue
  hold: (1) every ``plain_d32`` seed ends with a higher training error than every ``plain_d8`` seed;
  (2) ``plain_d8`` mean at or below 1%; (3) ``plain_d2`` mean worse than ``plain_d8`` mean;
  (4) ``residual_bn_d32`` mean at or below 3%; (5) ``residual_d32`` diverges in epoch 1 in every seed.
  If no B satisfies all five, the default is 100 (the udlbook's). Every cell is reported
  (``batch_sweep.*`` metrics and the report); ``batch_sweep.selected_batch_size`` re-applies the rule
  to the measured cells, so a change of outcome shows in the report rather than silently. The sweep's cells
  at batch sizes other than the main run's are evaluated after their last epoch only (their curves are not
  reported; the training is the same); its cells at the main run's batch size are the main run's (trained once).

Beyond the lecture (``--ablations true``, on by default): plain + BatchNorm at depth 32 (separates the
skip's contribution from BatchNorm's), the un-normalised residual network at learning rates 0.0005 and
0.001 (one vmapped program over learning rate and seed; separates too large a step from an unusable
forward pass), and depth-32 residual networks with the 1/sqrt(2) sum, tau = 1/sqrt(K), SkipInit and
Fixup instead of BatchNorm.

Metrics (lists over seeds): ``final_train_error_pct.<config>``, ``final_test_error_pct.<config>``,
``diverged_epoch.<config>`` (null where it never diverged), per-epoch ``curves.<config>.{train_error_pct,
test_error_pct,train_loss}`` (a list per seed), and the sweep cells
``batch_sweep.B<b>.{final_train_error_pct,diverged_epoch}.<config>`` with ``batch_sweep.B<b>.claims``
(1/0 per claim above) and ``batch_sweep.selected_batch_size``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import ml_collections
import numpy as np

from experiments import checkpoints, common
from resjax.data import load_dataset
from resjax.train import make_train, run_config, train_config

NAME = "degradation"
WIDTH = 64
SWEEP_BATCH_SIZES = (16, 32, 64, 100, 128)
FALLBACK_BATCH_SIZE = 100
DEFAULT_BATCH_SIZE = 64  # the selection rule of the docstring applied to the sweep (B=32 and 64 pass; 100 and 128 fail claims 1-2)

CONFIGS = {
    "plain_d2": dict(kind="plain_mlp", depth=2),
    "plain_d8": dict(kind="plain_mlp", depth=8),
    "plain_d32": dict(kind="plain_mlp", depth=32),
    "residual_bn_d32": dict(kind="residual_mlp", num_blocks=32, order="pre", norm="batch"),
    "residual_d32": dict(kind="residual_mlp", num_blocks=32, order="pre"),
}
ABLATIONS = {
    "plain_bn_d32": dict(kind="plain_mlp", depth=32, norm="batch"),
    "residual_rescale_d32": dict(kind="residual_mlp", num_blocks=32, order="pre", scaling="rescale"),
    "residual_tau_d32": dict(kind="residual_mlp", num_blocks=32, order="pre", scaling="tau", tau="1/sqrt(K)"),
    "residual_skipinit_d32": dict(kind="residual_mlp", num_blocks=32, order="pre", scaling="skipinit"),
    "residual_fixup_d32": dict(kind="residual_mlp", num_blocks=32, order="pre", scaling="fixup"),
}
ABLATION_LEARNING_RATES = {"residual_d32_lr5e-4": 0.0005, "residual_d32_lr1e-3": 0.001}

#: The kinds of network a cell (``--cells``, ``--ablation_cells``: ``KIND:DEPTH[:WIDTH]``) can be, each the model
#: fields it takes at a depth (hidden layers of a plain MLP, blocks of a residual one); ``CONFIGS`` and ``ABLATIONS``
#: are these kinds at the lecture's depths (``plain:2`` is ``plain_d2``, ``residual_bn:32`` is ``residual_bn_d32``).
CELL_KINDS = {
    "plain": lambda d: dict(kind="plain_mlp", depth=d),
    "plain_bn": lambda d: dict(kind="plain_mlp", depth=d, norm="batch"),
    "plain_ln": lambda d: dict(kind="plain_mlp", depth=d, norm="layer"),
    "residual": lambda d: dict(kind="residual_mlp", num_blocks=d, order="pre"),
    "residual_bn": lambda d: dict(kind="residual_mlp", num_blocks=d, order="pre", norm="batch"),
    "residual_ln": lambda d: dict(kind="residual_mlp", num_blocks=d, order="pre", norm="layer"),
    "residual_post": lambda d: dict(kind="residual_mlp", num_blocks=d, order="post"),
    "residual_post_bn": lambda d: dict(kind="residual_mlp", num_blocks=d, order="post", norm="batch"),
    "residual_rescale": lambda d: dict(kind="residual_mlp", num_blocks=d, order="pre", scaling="rescale"),
    "residual_tau": lambda d: dict(kind="residual_mlp", num_blocks=d, order="pre", scaling="tau", tau="1/sqrt(K)"),
    "residual_skipinit": lambda d: dict(kind="residual_mlp", num_blocks=d, order="pre", scaling="skipinit"),
    "residual_fixup": lambda d: dict(kind="residual_mlp", num_blocks=d, order="pre", scaling="fixup"),
}
#: ``CONFIGS`` and ``ABLATIONS`` as cells: the defaults of ``--cells`` and ``--ablation_cells``.
DEFAULT_CELLS = ("plain:2", "plain:8", "plain:32", "residual_bn:32", "residual:32")
DEFAULT_ABLATION_CELLS = ("plain_bn:32", "residual_rescale:32", "residual_tau:32", "residual_skipinit:32",
                          "residual_fixup:32")

HELP = {
    "cells": common.cells_help(CELL_KINDS, "the networks trained, each at every seed (and at every batch size of "
                                           "--sweep_batch_sizes); the selection rule and the claims need the "
                                           "default five"),
    "ablation_cells": common.cells_help(CELL_KINDS, "networks trained beyond the lecture when --ablations is true "
                                                    "(at --train.batch_size only)"),
    "ablations": "true/false: also train --ablation_cells and the un-normalised residual:32 at learning rates 0.0005 "
                 "and 0.001 (metrics residual_d32_lr5e-4, residual_d32_lr1e-3)",
    "sweep_batch_sizes": "batch sizes of the selection rule's sweep (every cell and seed at each; the docstring's "
                         "rule picks the default batch size from it), e.g. \"(16, 32, 64)\"; () = no sweep",
    "model.width": "hidden width of every cell (units per layer); a cell's :WIDTH replaces it",
    "pack_cells": "true/false/auto: the cells of one kind (and width) at several depths, e.g. plain:2, plain:8 and "
                  "plain:32, trained as one program at each batch size (resjax.train.packing: each run the network "
                  "of its depth, to float rounding); false: a program per cell; auto (the default): true on an "
                  "accelerator, false on CPUs (resjax.train.grid.auto_pack)",
    "model.scan": "true/false: the blocks as one nn.scan (traced and compiled once; --quick's choice) instead of "
                  "unrolled (the default: no such setting)",
    "train.batch_size": "minibatch size of the main run (training examples per SGD step; the last partial batch "
                        "of an epoch is dropped); the sweep's sizes are --sweep_batch_sizes",
}


def get_config(size: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.data = "mnist1d"
    c.model = ml_collections.ConfigDict({"width": WIDTH})  # shared by every cell; each cell adds its kind
    # checkpoint_every: a save every two chunks (a save costs ~0.4 s, a 300-epoch cell ~30 s; a stop signal saves anyway)
    c.train = train_config(learning_rate=0.005, momentum=0.0, epochs=300, batch_size=DEFAULT_BATCH_SIZE,
                           checkpoint_every=50)
    c.num_seeds = 3
    c.seed = 0
    c.sweep_batch_sizes = SWEEP_BATCH_SIZES
    c.cells = DEFAULT_CELLS
    c.ablations = True
    c.ablation_cells = DEFAULT_ABLATION_CELLS
    c.chunk_epochs = 25
    c.pack_cells = "auto"
    if size == "quick":
        c.train.epochs, c.num_seeds, c.sweep_batch_sizes, c.ablations, c.chunk_epochs = 2, 2, (), False, 2
        c.model.scan = True  # blocks traced and compiled once: 13 s from an empty cache, 18 s unrolled
    elif size == "full":
        c.num_seeds = 10
    return c


# ---- claims ------------------------------------------------------------------------------------------


def _final(m: dict, name: str, prefix: str = "") -> np.ndarray:
    return np.array([np.nan if v is None else v for v in m[f"{prefix}final_train_error_pct.{name}"]], float)


def _diverged(m: dict, name: str, prefix: str = "") -> list:
    return m[f"{prefix}diverged_epoch.{name}"]


def rule_claims(m: dict, prefix: str = "") -> list[bool]:
    """The five claims of the batch-size selection rule, evaluated on one batch size's cells."""
    d2, d8, d32, rbn = (_final(m, n, prefix) for n in ("plain_d2", "plain_d8", "plain_d32", "residual_bn_d32"))
    return [
        bool(np.nanmin(d32) > np.nanmax(d8)) if np.isfinite(d32).all() and np.isfinite(d8).all() else False,
        bool(np.mean(d8) <= 1.0),
        bool(np.mean(d2) > np.mean(d8)),
        bool(np.mean(rbn) <= 3.0),
        all(e == 1 for e in _diverged(m, "residual_d32", prefix)),
    ]


def select_batch_size(m: dict, batch_sizes) -> int:
    """The selection rule of the docstring applied to measured cells."""
    passing = [b for b in batch_sizes if all(rule_claims(m, f"batch_sweep.B{b}."))]
    return max(passing) if passing else FALLBACK_BATCH_SIZE


def _mean_and_seeds(m: dict, name: str) -> str:
    return f"{np.mean(_final(m, name)):.2f} ({_fmt(_final(m, name))})"


def _mean_curve(m: dict, name: str) -> np.ndarray:
    return np.mean(np.array(m[f"curves.{name}.train_error_pct"], float), axis=0)


def _largest_swing(m: dict, name: str) -> float:
    runs = np.array(m[f"curves.{name}.train_error_pct"], float)
    return float(np.nanmax(np.abs(np.diff(runs, axis=1))))


def _leads_from(m: dict, leader: str, other: str) -> int | str:
    """The first epoch from which ``leader``'s mean training error stays below ``other``'s to the end."""
    behind = np.nonzero(~(_mean_curve(m, leader) < _mean_curve(m, other)))[0]
    if len(behind) == 0:
        return 1
    return int(behind[-1]) + 2 if behind[-1] + 1 < len(_mean_curve(m, leader)) else "never"


def _fmt(values) -> str:
    return ", ".join("n/a" if v is None or not np.isfinite(v) else f"{v:.1f}" for v in values)


SRC = "000 lecture, Degradation / Training at depth 32"
CLAIMS = [
    common.Claim("plain depth 8 final training error (%), mean of 3 seeds, at or below 1%", SRC, "0.2",
                 lambda m: _mean_and_seeds(m, "plain_d8"),
                 lambda m: rule_claims(m)[1]),
    common.Claim("plain depth 32 final training error (%), mean and seeds", SRC, "10.6 (5.4, 19.5, 7.0)",
                 lambda m: _mean_and_seeds(m, "plain_d32"),
                 lambda m: None),
    common.Claim("every depth-32 plain run ends worse than every depth-8 run", SRC, "yes",
                 lambda m: f"min d32 {np.nanmin(_final(m, 'plain_d32')):.2f} vs max d8 {np.nanmax(_final(m, 'plain_d8')):.2f}",
                 lambda m: rule_claims(m)[0]),
    common.Claim("plain depth 2 ends worse than depth 8", SRC, "worse, still falling",
                 lambda m: f"{np.mean(_final(m, 'plain_d2')):.2f} vs {np.mean(_final(m, 'plain_d8')):.2f}",
                 lambda m: rule_claims(m)[2]),
    common.Claim("plain depth 32 runs are erratic: largest swing of one run between consecutive epochs "
                 "(percentage points)", SRC, "up to 33 between checkpoints",
                 lambda m: f"{_largest_swing(m, 'plain_d32'):.1f}", lambda m: None),
    common.Claim("residual + BatchNorm depth 32 final training error (%), mean at or below 3%", SRC, "1.2",
                 lambda m: _mean_and_seeds(m, "residual_bn_d32"),
                 lambda m: rule_claims(m)[3]),
    common.Claim("residual without normalisation diverges in epoch 1 of every run (lr 0.005)", SRC, "epoch 1, 3/3",
                 lambda m: f"diverged epochs {_diverged(m, 'residual_d32')}",
                 lambda m: rule_claims(m)[4]),
    common.Claim("plain depth 8 leads residual + BN depth 32 (mean training error) for good only from epoch", SRC,
                 "260", lambda m: _leads_from(m, "plain_d8", "residual_bn_d32"), lambda m: None),
    common.Claim("degradation gap at depth 32 (points above plain depth 8): plain -> residual + BN", SRC,
                 "10.4 -> 1.0",
                 lambda m: (f"{np.mean(_final(m, 'plain_d32')) - np.mean(_final(m, 'plain_d8')):.1f} -> "
                            f"{np.mean(_final(m, 'residual_bn_d32')) - np.mean(_final(m, 'plain_d8')):.1f}"),
                 lambda m: bool(np.mean(_final(m, 'residual_bn_d32')) < np.mean(_final(m, 'plain_d32')))),
]


#: The settings the claims' texts state ("mean of 3 seeds", "lr 0.005"): the report names this run's where they differ.
CLAIM_SETTINGS = ("num_seeds", "train.epochs", "train.batch_size", "train.learning_rate", "train.momentum", "model.width",
                  "cells")


def report_section(m: dict) -> str:
    """The batch-size sweep, every cell: final training error per seed, divergence, which claims hold."""
    sizes = sorted({int(k.split(".")[1][1:]) for k in m if k.startswith("batch_sweep.B") and ".final_train_error_pct." in k})
    if not sizes:
        return "\n".join(["No batch-size sweep in this run (`--sweep_batch_sizes ()`)."] + _ablation_table(m))
    first = f"batch_sweep.B{sizes[0]}.final_train_error_pct."
    names = [k[len(first):] for k in m if k.startswith(first)]  # the cells of the run (--cells), in its order
    rule = f"batch_sweep.B{sizes[0]}.claims" in m  # the selection rule needs the five default cells
    lines = ["Batch-size sweep (final training error %, mean [seeds]; a cell that diverged: its diverged epochs). "
             + ("Claims 1-5 are the selection rule's (see the experiment's docstring)." if rule else
                "The selection rule needs the five default cells, which this run did not train."), "",
             "| B | " + " | ".join(names) + (" | claims 1-5 hold |" if rule else " |"),
             "|---" * (len(names) + 1 + rule) + "|"]
    for b in sizes:
        p = f"batch_sweep.B{b}."
        cells = []
        for n in names:
            if n == "residual_d32" or any(e is not None for e in _diverged(m, n, p)):
                cells.append(f"diverged {_diverged(m, n, p)}")
            else:
                v = _final(m, n, p)
                cells.append(f"{np.mean(v):.2f} [{_fmt(v)}]")
        claims = " | " + "".join("Y" if c else "n" for c in m[f"{p}claims"]) if rule else ""
        lines.append(f"| {b} | " + " | ".join(cells) + f"{claims} |")
    if rule:
        lines += ["", f"Selection rule applied to these cells: batch size {m['batch_sweep.selected_batch_size']} "
                  f"(the experiment's default is {DEFAULT_BATCH_SIZE})."]
    return "\n".join(lines + _ablation_table(m))


def _ablation_table(m: dict) -> list[str]:
    """Every config run at the default batch size: final errors per seed and divergence."""
    names = [k.split(".", 1)[1] for k in m if k.startswith("final_train_error_pct.")]  # every cell, in run order
    lines = ["", "All configs at the run's batch size (final training / test error %, per seed; divergence):", "",
             "| config | training error | test error | diverged (epoch, step) |", "|---|---|---|---|"]
    for n in names:
        test = [np.nan if v is None else v for v in m[f"final_test_error_pct.{n}"]]
        steps = m.get(f"diverged_step.{n}", [None] * len(test))
        div = [f"{e}, {s}" for e, s in zip(m[f"diverged_epoch.{n}"], steps) if e is not None]
        lines.append(f"| {n} | {_fmt(_final(m, n))} | {_fmt(test)} | {'; '.join(div) or 'never'} |")
    return lines


# ---- running -----------------------------------------------------------------------------------------


def check(config) -> None:
    """The preflight hook (``experiments.common.preflight``): every cell before any training: the train config at
    every batch size (the library's checks), every batch size within the training examples, every model
    config built."""
    pack_cells(config)
    data = common.load_data(config)
    n = len(data.y_train)
    common.check_train(config.train, n)
    common.check_batch_sizes("sweep_batch_sizes", config.sweep_batch_sizes, n)
    for setting, chosen in (("cells", cells(config)), ("ablation_cells", ablation_cells(config))):
        common.build_models([{**config.model, **c.model} for c in chosen], data.num_classes, prefix=setting)


def cells(config) -> list[common.Cell]:
    """The networks of ``config.cells`` (``KIND:DEPTH[:WIDTH]``; ``ValueError`` naming ``cells`` for a bad one)."""
    main = common.parse_cells(config.cells, CELL_KINDS, "cells", taken=tuple(ABLATION_LEARNING_RATES))
    if not main:
        raise ValueError("cells: needs at least one cell, e.g. plain:8")
    return main


def ablation_cells(config) -> list[common.Cell]:
    """The networks of ``config.ablation_cells`` when ``config.ablations`` is on (none otherwise)."""
    if not config.ablations:
        return []
    taken = tuple(c.name for c in cells(config)) + tuple(ABLATION_LEARNING_RATES)
    return common.parse_cells(config.ablation_cells, CELL_KINDS, "ablation_cells", taken=taken)


def cell_job(config, model: dict, batch_size: int, data, learning_rates, name: str | None = None,
             curves: bool = True) -> Callable[[], dict]:
    """One model at one batch size, every seed (x learning rate) in one vmapped program, as a job of
    ``checkpoints.sweeps`` (``name``: the cell's name in progress lines and ``metrics.jsonl``). ``curves=False``:
    only the final epoch is evaluated (``train.eval_every``; the training is the same), for a cell whose curves
    are not reported."""
    train = ml_collections.ConfigDict(config.train.to_dict())
    train.batch_size, train.learning_rate = batch_size, float(learning_rates[0])
    if not curves:
        train.eval_every = train.epochs
    label = f"B={batch_size} {name or model['kind']}"  # checkpointed as this cell (experiments.checkpoints)

    def job() -> dict:
        trainer = make_train(run_config({**config.model, **model}, train, config.data), data)
        seeds = jax.random.split(jax.random.key(config.seed), config.num_seeds)
        keys = jax.numpy.concatenate([seeds] * len(learning_rates))
        lrs = np.repeat(np.asarray(learning_rates, np.float32), config.num_seeds)
        return dict(trainer=trainer, keys=keys, hparams={"learning_rate": lrs}, cell=label,
                    chunk_epochs=config.chunk_epochs, progress=label)

    # a cell's work, roughly (what orders the jobs, longest first): steps x layers x runs
    job.cost = len(data.y_train) // batch_size * (model.get("depth") or model.get("num_blocks") or 1) * len(
        learning_rates)
    return job


def pack_cells(config) -> bool:
    """``config.pack_cells`` as a bool (``'auto'``: ``resjax.train.grid.auto_pack``); ``ValueError`` naming it."""
    from resjax.train.grid import auto_pack

    value = config.pack_cells
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "auto"):
        value = {"true": True, "false": False, "auto": "auto"}[value.strip().lower()]
    if value == "auto":
        return auto_pack()
    if not isinstance(value, bool):
        raise ValueError(f"pack_cells: must be true, false or auto, got {config.pack_cells!r}")
    return value


def packed_groups(config, chosen: list) -> list[list]:
    """``chosen`` cells in groups trained as one program each: with ``config.pack_cells``, the cells of one kind and
    width at several depths whose depth packs (``resjax.train.packing.packable``), deepest last; every other cell
    alone. In the order of each group's first cell."""
    from resjax.train.packing import packable

    groups: dict = {}
    for c in chosen:
        together = pack_cells(config) and packable(run_config({**config.model, **c.model}, config.train)) is None
        groups.setdefault((c.kind, c.width) if together else c.name, []).append(c)
    return [sorted(g, key=lambda c: c.depth) for g in groups.values()]


def packed_job(config, group: list, batch_size: int, data, learning_rates, curves: bool = True) -> Callable[[], dict]:
    """``cell_job`` for a group of cells that differ only in depth (``packed_groups``): one vmapped program of every
    seed at every depth, the model built at the deepest (``Trainer.with_packed_depths``); its runs are the depths'
    seeds in turn (``runs_of`` splits them)."""
    if len(group) == 1:
        return cell_job(config, group[0].model, batch_size, data, learning_rates, group[0].name, curves)
    deepest = group[-1]
    job = cell_job(config, deepest.model, batch_size, data, learning_rates, "+".join(c.name for c in group), curves)
    depths = [c.depth for c in group]

    def packed() -> dict:
        args = job()
        count = len(args["keys"])
        args["trainer"] = args["trainer"].with_packed_depths(depths)
        args["keys"] = jax.numpy.concatenate([args["keys"]] * len(depths))
        args["hparams"] = {"learning_rate": np.tile(args["hparams"]["learning_rate"], len(depths)),
                           "active_depth": np.repeat(np.asarray(depths, np.float32), count)}
        return args

    packed.cost = job.cost * len(depths)
    return packed


def train_cell(*args, **kwargs) -> dict:
    """``cell_job``'s cell trained on its own (its seeds over every device): its metrics."""
    return checkpoints.sweeps([cell_job(*args, **kwargs)])[0][1]


def runs_of(metrics: dict, num_seeds: int) -> list[dict]:
    """A sweep's metrics over ``len(learning_rates) * num_seeds`` runs (``train_cell``) split into one dict per
    learning rate; entries without a run axis (the sweep's scalars) are passed to each as they are."""
    count = len(metrics["train_error"]) // num_seeds
    return [{k: v[i * num_seeds:(i + 1) * num_seeds] if np.ndim(v) else v for k, v in metrics.items()}
            for i in range(count)]


def _record(out: dict, prefix: str, name: str, metrics: dict, curves: bool) -> None:
    out[f"{prefix}final_train_error_pct.{name}"] = 100 * metrics["train_error"][:, -1]
    out[f"{prefix}final_test_error_pct.{name}"] = 100 * metrics["test_error"][:, -1]
    for key in ("diverged_epoch", "diverged_step"):
        out[f"{prefix}{key}.{name}"] = [None if e < 0 else int(e) for e in metrics[key]]
    if curves:
        out[f"curves.{name}.train_error_pct"] = 100 * metrics["train_error"]
        out[f"curves.{name}.test_error_pct"] = 100 * metrics["test_error"]
        out[f"curves.{name}.train_loss"] = metrics["train_loss"]


def has_rule_cells(config) -> bool:
    """Whether the run trains the five cells the selection rule and the lecture's claims are about."""
    return set(CONFIGS) <= {c.name for c in cells(config)}


def run(config, out_dir) -> dict:
    check(config)
    data = load_dataset(config.data)
    lr = [config.train.learning_rate]
    batch_sizes = sorted(set(config.sweep_batch_sizes) | {config.train.batch_size})
    # Every cell of the run is an independent sweep: all of them side by side, each whole on one device
    # (checkpoints.sweeps), the longest first; recorded below in the order of the report.
    groups = packed_groups(config, cells(config))  # plain:2, plain:8, plain:32: one program (pack_cells)
    jobs = {(b, tuple(c.name for c in g)): packed_job(config, g, b, data, lr, curves=b == config.train.batch_size)
            for b in batch_sizes for g in groups}
    if config.ablations:
        for c in ablation_cells(config):
            jobs[(None, c.name)] = cell_job(config, c.model, config.train.batch_size, data, lr, c.name)
        lrs = list(ABLATION_LEARNING_RATES.values())
        jobs[(None, "lr")] = cell_job(config, CONFIGS["residual_d32"], config.train.batch_size, data, lrs,
                                      "residual_d32 at " + ", ".join(f"lr {v:g}" for v in lrs))
    order = sorted(jobs, key=lambda k: -jobs[k].cost)
    start = time.time()
    done = dict(zip(order, (metrics for _, metrics in checkpoints.sweeps([jobs[k] for k in order]))))
    for b in batch_sizes:  # a packed group's runs: each depth's seeds in turn
        for g in groups:
            for c, metrics in zip(g, runs_of(done.pop((b, tuple(c.name for c in g))), config.num_seeds)):
                done[(b, c.name)] = metrics
    out: dict = {"seconds": time.time() - start}
    print(f"degradation: {len(jobs)} cells done in {out['seconds']:.0f} s", flush=True)
    for b in batch_sizes:
        for c in cells(config):
            if b in config.sweep_batch_sizes:
                _record(out, f"batch_sweep.B{b}.", c.name, done[(b, c.name)], curves=False)
            if b == config.train.batch_size:
                _record(out, "", c.name, done[(b, c.name)], curves=True)
        if b in config.sweep_batch_sizes and has_rule_cells(config):  # the rule needs the five default cells
            out[f"batch_sweep.B{b}.claims"] = [int(c) for c in rule_claims(out, f"batch_sweep.B{b}.")]
    if config.sweep_batch_sizes and has_rule_cells(config):
        out["batch_sweep.selected_batch_size"] = select_batch_size(out, config.sweep_batch_sizes)
    if config.ablations:
        for c in ablation_cells(config):
            _record(out, "", c.name, done[(None, c.name)], True)
        for name, metrics in zip(ABLATION_LEARNING_RATES, runs_of(done[(None, "lr")], config.num_seeds)):
            _record(out, "", name, metrics, True)
    plot(out, config, out_dir / f"{NAME}.png")
    return out


# ---- figure ------------------------------------------------------------------------------------------

#: Each cell kind's colour family: a cell is drawn in its kind's colour, lighter for the shallower cells of that kind
#: in the run and darker for the deeper ones (``cell_colours``), so that plain_d4 and plain_d8 are two reds and the
#: kinds stay apart. The lecture's cells: plain (red shades: the depths of 'Training error against depth'),
#: residual + BN (green) and residual without normalisation (grey).
FAMILY_COLOURS = {"plain": "tab:red", "plain_bn": "tab:orange", "plain_ln": "tab:pink", "residual": "tab:gray",
                  "residual_bn": "tab:green", "residual_ln": "tab:olive", "residual_post": "tab:brown",
                  "residual_post_bn": "tab:cyan", "residual_rescale": "tab:blue", "residual_tau": "tab:purple",
                  "residual_skipinit": "goldenrod", "residual_fixup": "darkmagenta"}
#: The learning-rate ablations: the un-normalised residual network at depth 32 (its family's colour, lighter at the
#: smaller rate), told apart from the cells by line style.
ABLATION_STYLES = {"residual_d32_lr5e-4": "--", "residual_d32_lr1e-3": ":"}
LECTURE_PLAIN_DEPTHS = (2, 8, 32)  # the lecture's 'Training error against depth'
LECTURE_DEPTH_32 = ("plain_d8", "plain_d32", "residual_bn_d32", "residual_d32")  # the lecture's 'Training at depth 32'


def shade(colour, t: float) -> tuple:
    """``colour`` lightened towards white (``t`` < 0) or darkened towards black (``t`` > 0) by ``|t|``; its hue kept."""
    from matplotlib.colors import to_rgb

    rgb = np.asarray(to_rgb(colour))
    return tuple(float(x) for x in (rgb + (1 - rgb) * -t if t < 0 else rgb * (1 - t)))


def cell_colours(chosen: list) -> dict:
    """``{cell name: colour}`` for ``chosen`` cells (``common.Cell``): the kind's ``FAMILY_COLOURS`` entry, shaded by
    the cell's rank in depth (then width) among the run's cells of its kind: from light (the shallowest) to dark
    (the deepest); a kind's only cell gets the family colour itself."""
    colours = {}
    for kind in dict.fromkeys(c.kind for c in chosen):
        family = [c for c in chosen if c.kind == kind]
        ranked = sorted({(c.depth, c.width or 0) for c in family})
        steps = np.linspace(-0.5, 0.45, len(ranked)) if len(ranked) > 1 else [0.0]
        base = FAMILY_COLOURS.get(kind, "black")
        for c in family:
            colours[c.name] = shade(base, float(steps[ranked.index((c.depth, c.width or 0))]))
    return colours


def legend_order(chosen: list) -> list[str]:
    """The cells' names as legends list them: the kinds in the order the run first gives them, each kind's cells in
    depth (then width) order (plain_d4, plain_d8, residual_bn_d16)."""
    kinds = list(dict.fromkeys(c.kind for c in chosen))
    return [c.name for c in sorted(chosen, key=lambda c: (kinds.index(c.kind), c.depth, c.width or 0))]


def _runs(m: dict, k: str) -> np.ndarray:
    return np.array([[np.nan if v is None else v for v in r] for r in m[k]], float)


def _curves(ax, m, names, colours, key="train_error_pct", faint=True, gap=False) -> tuple[list, list]:
    """Each cell's mean curve over seeds (``gap``: test minus training error), faint single seeds; a diverged seed
    is marked x at its divergence epoch, on its last finite value or, without one, at the top of the panel.
    Returns the legend's ``(handles, labels)`` in the order of ``names`` (a cell with no finite value is labelled
    on its x mark, drawn last)."""
    marks, labelled = [], {}
    for name in names:
        k = f"curves.{name}.{key}"
        if k not in m:
            continue
        runs = _runs(m, k) if not gap else _runs(m, f"curves.{name}.test_error_pct") - _runs(m, k)
        epochs = np.arange(1, runs.shape[1] + 1)
        colour, style = colours[name], ABLATION_STYLES.get(name, "-")
        if faint:
            for r in runs:
                ax.plot(epochs, r, color=colour, alpha=0.25, lw=0.7, ls=style)
        div = m.get(f"diverged_epoch.{name}", [None] * len(runs))
        diverged = [e for e in div if e is not None]
        label = name + (f": diverged (x) in epoch {', '.join(map(str, sorted(set(diverged))))}, {len(diverged)} of "
                        f"{len(div)} seeds" if diverged else "")
        if np.isfinite(runs).any():
            with np.errstate(all="ignore"):
                mean = np.mean(runs, axis=0)
            labelled[name] = ax.plot(epochs, mean, color=colour, lw=1.6, ls=style, label=label,
                                     marker="o" if len(epochs) < 4 else None, ms=3)[0]
            label = None
        marks += common.diverged_marks(runs, div, colour, label)
    common.mark_diverged(ax, marks)
    handles = dict(zip(*reversed(ax.get_legend_handles_labels())))  # label -> handle, the x marks' too
    ordered = [(h, label) for name in names for label, h in handles.items()
               if label == name or label.startswith(name + ":")]
    return [h for h, _ in ordered], [label for _, label in ordered]


def _listed(names) -> str:
    names = list(names)
    return ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else "".join(names)


def panel_titles(main: list, ablated: list[str], ablated_depths: list[int]) -> dict:
    """The panels' titles from the cells that ran (``main``: ``common.Cell``s with curves; ``ablated``: names):
    ``{'depth' | 'depth32' | 'gap' | 'ablations': title}``, only the panels there is something to draw for. A
    title names the lecture's figure only where the panel shows that figure's cells, and says which are missing."""
    names = [c.name for c in main]
    titles = {}
    plain = sorted({(c.depth, c.width or 0) for c in main if c.kind == "plain"})
    if plain:
        depths = "plain MLPs of depth " + _listed(f"{d}" + (f" (width {w})" if w else "") for d, w in plain)
        at_lecture = [d for d, w in plain if not w] == list(LECTURE_PLAIN_DEPTHS) and len(plain) == 3
        titles["depth"] = (f"Training error against depth (lecture fig. 'Training error against depth')\n{depths}; "
                           if at_lecture else
                           f"Training error against depth: {depths}\n(the lecture's fig. 'Training error against "
                           f"depth' has depths {_listed(map(str, LECTURE_PLAIN_DEPTHS))})\n") \
            + "faint: single seeds, solid: mean"
    lecture = [n for n in LECTURE_DEPTH_32 if n in names]
    added = [n for n in names if n not in CONFIGS]
    if any(n.endswith("_d32") for n in lecture):  # the lecture's depth-32 figure is there, in part or whole
        missing = [n for n in LECTURE_DEPTH_32 if n not in names]
        title = ("Training at depth 32 (lecture fig. 'Training at depth 32'"
                 + (f"; without {_listed(missing)}" if missing else "") + ")")
        if added:
            title += "\nand the cells added by --cells"
        titles["depth32"] = title + ", means over seeds"
    elif names:
        titles["depth32"] = "Training error of every cell of this run (--cells), means over seeds"
    titles["gap"] = ("Train-test gap (test error - training error), means over seeds\n"
                     "(lecture 'Revision': degradation vs overfitting)")
    if ablated:
        at = sorted(set(ablated_depths))
        titles["ablations"] = (f"Beyond the lecture: ablations at depth{'s' if len(at) > 1 else ''} "
                               f"{_listed(map(str, at))}, means over seeds")
    return titles


def plot(m: dict, config, path) -> None:
    plt = common.pyplot()

    main = [c for c in cells(config) if f"curves.{c.name}.train_error_pct" in m]
    names = legend_order(main)
    extra = [c for c in ablation_cells(config) if f"curves.{c.name}.train_error_pct" in m]
    lr_runs = [n for n in ABLATION_LEARNING_RATES if f"curves.{n}.train_error_pct" in m]
    ablated = legend_order(extra) + lr_runs
    colours = cell_colours(main + extra)
    for n, t in zip(ABLATION_LEARNING_RATES, (-0.35, 0.35)):  # the un-normalised residual network at depth 32
        colours[n] = shade(FAMILY_COLOURS["residual"], t)  # in its family's colour, lighter at the smaller rate
    titles = panel_titles(main, ablated, [c.depth for c in extra] + [32] * len(lr_runs))
    panels = []  # (title, names, faint, gap): only panels with something to draw
    if "depth" in titles:
        panels.append((titles["depth"], [n for n in names if n in {c.name for c in main if c.kind == "plain"}], True,
                       False))
    if "depth32" in titles:
        lecture = [n for n in LECTURE_DEPTH_32 if n in names]
        shown = lecture + [n for n in names if n not in CONFIGS] if lecture and any(
            n.endswith("_d32") for n in lecture) else names
        panels.append((titles["depth32"], [n for n in names if n in shown], False, False))
    panels.append((titles["gap"], names, False, True))
    if ablated:
        panels.append((titles["ablations"], ablated + [n for n in ["residual_bn_d32"] if n in names], False, False))
    ncols = 2 if len(panels) == 4 else len(panels)
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.4 * ncols, 5.6 * nrows), squeeze=False)
    for ax, (title, shown, faint, gap) in zip(axes.flat, panels):
        handles, labels = _curves(ax, m, shown, colours, faint=faint, gap=gap)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("gap (percentage points)" if gap else "training error (%)")
        ax.set_xlabel("epoch")
        common.integer_ticks(ax)
        ax.grid(alpha=0.3)
        common.legend_outside(ax, handles=handles, labels=labels)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_axis_off()
    fig.suptitle(f"MNIST-1D degradation: width {config.model.width}, {common.describe_optimizer(config.train)}, "
                 f"batch {config.train.batch_size}, {common.plural(config.train.epochs, 'epoch')}, "
                 f"{common.plural(config.num_seeds, 'seed')}")
    common.save_figure(fig, path)


if __name__ == "__main__":
    common.main(__name__)
