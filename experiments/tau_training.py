"""Training PlainNets and ResNets with tau in {1/L, 1/sqrt(L), 1/L^(1/4)} at depths 10, 100 and 1000
(Zhang et al., seed 003, Section 5.1 and Figure 3).

The seed's setting: the fully connected ResNet of its Section 2 (``resjax.nn.tau_resnet``, kind
``'tau'``: h_0 = relu(A x), h_l = relu(h_(l-1) + tau W_l h_(l-1)), y = B h_L, Gaussian A, W_l at variance
2/m, B at 1/d, no biases but the head's) and the PlainNet of the same shapes without the skip (kind
``'plain'``), width m = 128, depth L in {10, 100, 1000} (L blocks / hidden layers), tau in {1/L,
1/sqrt(L), 1/L^(1/4)}, SGD (no momentum, no weight decay) with minibatch 256 and learning rate 0.01 for
every network, no tuning. All three taus and all seeds of one depth are ONE compiled program
(``Trainer.sweep`` with tau as a traced hyper-parameter, vmapped with the seeds; the blocks are an
``nn.scan``); the PlainNets of one depth are a second program.

Data: MNIST-1D (4,000 training / 1,000 test sequences of length 40, 10 classes; generated offline), not
the seed's MNIST (60,000 28x28 images). MNIST through ``tfds`` is not available offline here, and
resjax ships no MNIST loader; MNIST-1D is the project's default. Differences that matter: the input
layer is 40 -> 128 instead of 784 -> 128; an epoch is 15 minibatches of 256 (the last partial batch is
dropped) instead of 234, so "epoch" on the x-axis means 16x fewer steps than the seed's; MNIST-1D is
harder for an MLP (it is built to separate architectures), so losses stay higher than MNIST's.

Epochs. The default is 8 epochs (120 SGD steps per network), chosen so the whole sweep (3 depths x
(9 + 3) networks, all compilation included) takes at most about 10 minutes on the shared 2-core CPU
this project is developed on (depth 1000 dominates: 12 networks x 1000 blocks per step). The seed's
Figure 3 runs much longer; ``--train.epochs 100`` (or more) on an accelerator gives its horizon. Which claims
hold can depend on the horizon; the report says what this run measured.

Evaluation (the whole training set in evaluation mode, for ``final_train_error_pct``) runs after the last epoch
only (``train.eval_every`` = epochs): at depth 1000 one evaluation of the 5,000 examples costs about as much as
half an epoch of training, and no other epoch's evaluation is reported.

Settings the seed leaves open: the number of seeds (3), the initialisation details (see
``resjax.nn.tau_resnet``: K = L blocks, A N(0, 2/m), B N(0, 1/d)), how the loss is reported (the mean
minibatch cross-entropy over each epoch, training mode, as ``resjax.train`` records it), and what
"explodes" means (below).

Metrics (<model> in ``plain``, ``tau=1/L``, ``tau=1/sqrt(L)``, ``tau=1/L^(1/4)``):
``final_train_loss.<model>.L<d>`` (list over seeds: the last epoch's mean training loss; null for a seed
that diverged), ``diverged_epoch.<model>.L<d>`` (list; null where the loss stayed finite; the 1-based
epoch of the first non-finite loss or gradient), ``max_train_loss.<model>.L<d>`` (largest finite epoch
loss per seed), ``final_train_error_pct.<model>.L<d>``, per-epoch curves
``curves.<model>.L<d>.train_loss`` (a list per seed), and ``seconds.L<d>`` / ``seconds_total``.

Claims (thresholds fixed before the first full run): tau = 1/L^(1/4) *explodes* at depths 100 and
1000: every seed diverges or reaches an epoch-mean loss above 10 (chance level is ln 10 = 2.3);
tau = 1/sqrt(L) ends with a lower mean training loss than tau = 1/L at every depth; its mean final
loss varies by at most 1.5x across depths; the PlainNet's mean final loss increases with depth (a
diverged PlainNet counts as worse than any finite loss).

``--quick`` (tests): width 16, depth 4, 2 seeds, 1 epoch, batch 128.
"""

from __future__ import annotations

import math
import time
import warnings

import jax
import ml_collections
import numpy as np

from experiments import checkpoints, common
from resjax.data import load_dataset
from resjax.nn.tau_mlp import tau_resnet_config, tau_value
from resjax.train import make_train, run_config, train_config

NAME = "tau_training"
TAUS = {"tau=1/L": "1/L", "tau=1/sqrt(L)": "1/sqrt(L)", "tau=1/L^(1/4)": "L^(-1/4)"}
MODELS = ("plain", *TAUS)
COLOURS = {"plain": "black", "tau=1/L": "tab:blue", "tau=1/sqrt(L)": "tab:green", "tau=1/L^(1/4)": "tab:orange"}
EXPLODED_LOSS = 10.0


HELP = {
    "models": "the networks trained at every depth, comma-separated: plain (the PlainNet) and tau=RULE (the ResNet "
              "with branch scale tau: a rule of L, 1/L, 1/sqrt(L), 1/L^(1/4), L^(-1/4), L^(-1/2), or a number, "
              "e.g. tau=0.3); a leading + adds models (+tau=0.3); metric names are the models'",
    "depths": "depths L trained (blocks / hidden layers), e.g. \"(10, 100, 1000)\"; a leading + adds depths (+30)",
    "model.width": "width m of every network (units per block; the seed's 128)",
}


def get_config(size: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.data = "mnist1d"
    c.model = ml_collections.ConfigDict({"width": 128})  # every depth and tau; tau_resnet_config adds the rest
    c.depths = (10, 100, 1000)
    c.models = MODELS
    c.num_seeds = 3
    c.train = train_config(batch_size=256, learning_rate=0.01, momentum=0.0, epochs=8)
    c.chunk_epochs = 4
    c.seed = 0
    if size == "quick":
        c.model.width, c.depths, c.num_seeds, c.chunk_epochs = 16, (4,), 2, 1
        c.train.epochs, c.train.batch_size = 1, 128
    elif size == "full":
        c.train.epochs, c.num_seeds, c.chunk_epochs = 100, 5, 10
    c.train.eval_every = c.train.epochs  # only the final training error is reported: evaluate after the last epoch
    return c


def tau_models(config) -> dict[str, str]:
    """``{name: tau rule}`` of the ResNets in ``config.models`` (``tau=1/L``, ``tau=0.3``, ...), in their order;
    ``ValueError`` naming ``models`` for a model that is neither ``plain`` nor ``tau=RULE`` with a known rule."""
    out = {}
    for name in config.models:
        if name == "plain":
            continue
        rule = TAUS.get(name, name[4:] if name.startswith("tau=") else None)
        try:
            if rule is None:
                raise ValueError("not plain or tau=RULE")
            tau_value(rule, 10)
        except ValueError as err:
            raise ValueError(f"models: unknown model {name!r} ({err}); write plain or tau=RULE, e.g. tau=1/sqrt(L) "
                             "or tau=0.3") from None
        if name in out:
            raise ValueError(f"models: {name!r} is given twice")
        out[name] = rule
    if not out and "plain" not in config.models:
        raise ValueError("models: needs at least one model, e.g. plain,tau=1/sqrt(L)")
    return out


def _train_config(config, model: dict) -> ml_collections.ConfigDict:
    return run_config(model, config.train, config.data)


def _record(m: dict, name: str, depth: int, metrics: dict, seeds: slice) -> None:
    loss = np.asarray(metrics["train_loss"][seeds], np.float64)
    err = np.asarray(metrics["train_error"][seeds], np.float64)
    div = np.asarray(metrics["diverged_epoch"][seeds])
    p = f".{name}.L{depth}"
    m["final_train_loss" + p] = loss[:, -1]
    m["final_train_error_pct" + p] = 100.0 * err[:, -1]
    m["diverged_epoch" + p] = [None if e < 0 else int(e) for e in div]
    m["max_train_loss" + p] = [float(np.nanmax(r)) if np.isfinite(r).any() else None for r in loss]
    m["curves" + p + ".train_loss"] = loss


def check(config) -> None:
    """The preflight hook (``experiments.common.preflight``): every depth and the seed count, the train config with its batch size within the training examples, every model built."""
    for d in config.depths:
        if not isinstance(d, int) or d < 1:
            raise ValueError(f"depths: every depth must be an integer >= 1, got {d!r}")
    if not isinstance(config.num_seeds, int) or config.num_seeds < 1:
        raise ValueError(f"num_seeds: must be an integer >= 1, got {config.num_seeds!r}")
    data = common.load_data(config)
    common.check_train(config.train, len(data.y_train))
    taus = tau_models(config)
    models = [tau_resnet_config("plain", config.model.width, d, scan=True) for d in config.depths
              if "plain" in config.models]
    models += [tau_resnet_config("tau", config.model.width, d, tau=t) for d in config.depths for t in taus.values()]
    common.build_models(models, data.num_classes)


def run(config, out_dir) -> dict:
    check(config)
    data = load_dataset(config.data)
    m: dict = {}
    start_all = time.time()
    s = config.num_seeds
    chosen = tau_models(config)  # --models: the ResNets, by name, and their tau rules
    for i, depth in enumerate(config.depths):
        start = time.time()
        key = jax.random.fold_in(jax.random.key(config.seed), i)
        seed_keys = jax.random.split(key, s)
        if chosen:  # all taus x all seeds: one program; tau is a traced hyper-parameter
            res = make_train(_train_config(config, tau_resnet_config("tau", config.model.width, depth, tau="1/sqrt(L)",
                                                                     scan=True)), data)
            taus = np.repeat([tau_value(rule, depth) for rule in chosen.values()], s).astype(np.float32)
            keys = jax.numpy.concatenate([seed_keys] * len(chosen))  # the same initial draws for every tau
            _, metrics = checkpoints.sweep(res, keys, {"tau": taus}, cell=f"L={depth} tau", chunk_epochs=config.chunk_epochs)
            for j, name in enumerate(chosen):
                _record(m, name, depth, metrics, slice(j * s, (j + 1) * s))
                m[f"tau.{name}.L{depth}"] = float(taus[j * s])
        if "plain" in config.models:
            plain = make_train(_train_config(config, tau_resnet_config("plain", config.model.width, depth, scan=True)),
                               data)
            _, metrics = checkpoints.sweep(plain, seed_keys, cell=f"L={depth} plain", chunk_epochs=config.chunk_epochs)
            _record(m, "plain", depth, metrics, slice(0, s))
        m[f"seconds.L{depth}"] = round(time.time() - start, 1)
        print(f"{NAME}: depth {depth} done in {m[f'seconds.L{depth}']} s", flush=True)
    m["seconds_total"] = round(time.time() - start_all, 1)
    plot(m, config, out_dir / f"{NAME}.png")
    return m


# ---- claims ----------------------------------------------------------------------------------------


def _depths(m: dict) -> list[int]:
    return sorted({int(k.rsplit(".L", 1)[1]) for k in m if k.startswith("final_train_loss.")})


def _models(m: dict) -> list[str]:
    """The models of a run (``--models``), in the seed's order first, then any added ones."""
    found = list(dict.fromkeys(k[len("final_train_loss."):].rsplit(".L", 1)[0] for k in m
                               if k.startswith("final_train_loss.")))
    return [n for n in MODELS if n in found] + [n for n in found if n not in MODELS]


def _losses(m: dict, name: str, depth: int) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in m[f"final_train_loss.{name}.L{depth}"]], float)


def mean_final(m: dict, name: str, depth: int) -> float:
    """Mean final training loss over seeds; ``inf`` if any seed diverged (a diverged run is worse than any loss)."""
    losses = _losses(m, name, depth)
    return float(np.mean(losses)) if np.isfinite(losses).all() else math.inf


def exploded(m: dict, name: str, depth: int) -> bool:
    div = m[f"diverged_epoch.{name}.L{depth}"]
    peak = m[f"max_train_loss.{name}.L{depth}"]
    return all(d is not None or (p is not None and p > EXPLODED_LOSS) for d, p in zip(div, peak))


def _fmt(m: dict, name: str) -> str:
    out = []
    for d in _depths(m):
        div = [e for e in m[f"diverged_epoch.{name}.L{d}"] if e is not None]
        v = mean_final(m, name, d)
        out.append(f"L={d}: {v:.3f}" if math.isfinite(v) else f"L={d}: diverged (epochs {div})")
    return ", ".join(out)


def _deep(m: dict) -> list[int]:
    return [d for d in _depths(m) if d >= 100]


SRC = "003 Zhang et al., Section 5.1 / Figure 3 (MNIST; here MNIST-1D)"
CLAIMS = [
    common.Claim("tau = 1/L^(1/4): the training loss explodes at depths 100 and 1000 (every seed diverges or "
                 f"has an epoch-mean loss above {EXPLODED_LOSS:g})", SRC, "explodes at L = 100, 1000",
                 lambda m: "; ".join(f"L={d}: diverged epochs {m[f'diverged_epoch.tau=1/L^(1/4).L{d}']}, max loss "
                                     f"{[None if p is None else round(p, 3) for p in m[f'max_train_loss.tau=1/L^(1/4).L{d}']]}"
                                     for d in _deep(m)) or "no depth >= 100 in this run",
                 lambda m: all(exploded(m, "tau=1/L^(1/4)", d) for d in _deep(m)) if _deep(m) else None),
    common.Claim("tau = 1/sqrt(L) reaches a lower training loss than tau = 1/L (mean final loss, every depth)", SRC,
                 "lower",
                 lambda m: f"1/sqrt(L): {_fmt(m, 'tau=1/sqrt(L)')} | 1/L: {_fmt(m, 'tau=1/L')}",
                 lambda m: all(mean_final(m, "tau=1/sqrt(L)", d) < mean_final(m, "tau=1/L", d) for d in _depths(m))),
    common.Claim("tau = 1/sqrt(L): convergence hardly depends on depth (mean final loss within 1.5x across depths)",
                 SRC, "does not depend on the depth",
                 lambda m: _fmt(m, "tau=1/sqrt(L)"),
                 lambda m: (max(mean_final(m, "tau=1/sqrt(L)", d) for d in _depths(m))
                            <= 1.5 * min(mean_final(m, "tau=1/sqrt(L)", d) for d in _depths(m)))),
    common.Claim("PlainNet: training becomes harder as depth increases (mean final loss increases with depth)", SRC,
                 "harder with depth",
                 lambda m: _fmt(m, "plain"),
                 lambda m: all(mean_final(m, "plain", a) < mean_final(m, "plain", b)
                               for a, b in zip(_depths(m), _depths(m)[1:]))),
]


#: The settings the claims' texts state (depths 100 and 1000, the seed's training): the report names this run's where they
#: differ.
CLAIM_SETTINGS = ("depths", "num_seeds", "train.epochs", "train.batch_size", "train.learning_rate", "train.momentum",
                  "model.width", "models")


def report_section(m: dict) -> str:
    depths = _depths(m)
    lines = ["Mean final training loss over seeds (diverged: the epochs at which seeds diverged); "
             "final training error % in brackets:", "",
             "| model | " + " | ".join(f"L={d}" for d in depths) + " |", "|---" * (len(depths) + 1) + "|"]
    for name in _models(m):
        cells = []
        for d in depths:
            v = mean_final(m, name, d)
            err = np.nanmean(np.array([np.nan if e is None else e for e in m[f"final_train_error_pct.{name}.L{d}"]], float)) \
                if any(e is not None for e in m[f"final_train_error_pct.{name}.L{d}"]) else float("nan")
            div = [e for e in m[f"diverged_epoch.{name}.L{d}"] if e is not None]
            cells.append((f"{v:.3f} [{err:.1f}]" if math.isfinite(v) else "diverged") + (f" (div. {div})" if div else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Wall time per depth (s): " + ", ".join(f"L={d}: {m[f'seconds.L{d}']}" for d in depths)
              + f"; total {m['seconds_total']} s"]
    return "\n".join(lines)


def plot(m: dict, config, path) -> None:
    plt = common.pyplot()

    depths, models = _depths(m), _models(m)
    extra = iter(("navy", "darkgoldenrod", "crimson", "teal", "limegreen", "indigo", "sienna", "slategray") * 4)
    colours = {name: COLOURS.get(name) or next(extra) for name in models}
    fig, axes = plt.subplots(1, len(depths), figsize=(max(5.8 * len(depths), 8), 6.2), squeeze=False)
    for ax, d in zip(axes[0], depths):
        marks = []
        for name in models:
            runs = np.array([[np.nan if v is None else v for v in r] for r in m[f"curves.{name}.L{d}.train_loss"]], float)
            epochs = np.arange(1, runs.shape[1] + 1)
            for r in runs:
                ax.plot(epochs, r, color=colours[name], alpha=0.3, lw=0.8, marker="." if len(epochs) < 4 else None)
            div = m[f"diverged_epoch.{name}.L{d}"]
            diverged = [e for e in div if e is not None]
            label = name if name == "plain" or _is_number(name[4:]) else f"{name} = {m[f'tau.{name}.L{d}']:.3g}"
            label += f": diverged (x) in epoch {', '.join(map(str, sorted(set(diverged))))}, {len(diverged)} of " \
                     f"{len(div)} seeds" if diverged else ""
            with warnings.catch_warnings():  # an epoch where every seed has diverged has no mean
                warnings.simplefilter("ignore", RuntimeWarning)
                mean = np.nanmean(runs, axis=0)
            if np.isfinite(mean).any():
                ax.plot(epochs, mean, color=colours[name], lw=2, label=label, marker="o" if len(epochs) < 4 else None)
                label = None
            marks += common.diverged_marks(runs, div, colours[name], label)
        ax.axhline(np.log(10), color="gray", ls=":", lw=1, label="chance (ln 10)")
        ax.set_yscale("log")
        common.mark_diverged(ax, marks, log=True)
        common.integer_ticks(ax)
        ax.set_xlabel(f"epoch ({len_epoch(config)} SGD steps of {config.train.batch_size})")
        ax.set_ylabel("training loss (cross-entropy, epoch mean)")
        ax.set_title(f"depth L = {d}")
        ax.grid(alpha=0.3, which="both")
        common.legend_outside(ax)
    fig.suptitle(f"Zhang et al. (seed 003) Sec. 5.1 / Fig. 3 on MNIST-1D: width {config.model.width}, "
                 f"{common.describe_optimizer(config.train)}, batch {config.train.batch_size},\n"
                 f"{common.plural(config.train.epochs, 'epoch')}, {common.plural(config.num_seeds, 'seed')} (faint) "
                 "and their mean (solid)", fontsize=11)
    common.save_figure(fig, path, dpi=100)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def len_epoch(config) -> int:
    return len(load_dataset(config.data).y_train) // config.train.batch_size


if __name__ == "__main__":
    common.main(__name__)
