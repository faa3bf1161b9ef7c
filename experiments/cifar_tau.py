"""Training CIFAR ResNets with tau = 1/sqrt(L): against 1/L and Fixup without BatchNorm, and on top of
BatchNorm (Zhang et al., seed 003, Sections 5.2-5.4, Figure 5 and Table 2).

What the seed claims:
- Without BN, ResNet-110 and ResNet-1202 (He et al.'s CIFAR ResNets, two 3x3 convs per block) train to
  good accuracy with tau = 1/sqrt(L); with tau = 1/L "the performance drops a lot".
- Without BN, tau = 1/sqrt(L) "achieves much better performance than the Fixup approach over all depths"
  (Table 2, depths 20-1202, five runs), and Fixup "fails to converge 2 out of 5 runs" at ResNet-1202.
- With BN, adding a fixed tau = 1/sqrt(L) before the residual addition is "much better than the baseline",
  the more so the deeper the network (CIFAR-10 and CIFAR-100, five runs); learnable tau gave no gain;
  ResNet-1202+BN needs a learning-rate warm-up while with tau "the same learning rate schedule" serves
  every depth.
The seed text carries no table values, so the report lists these as comparisons, each with its measured
numbers.

Models (``resjax.nn.resnet.cifar_resnet``, post-activation, option-A shortcuts, He fan-out init), by variant;
each is the repository model the seed's numbers come from, built with ``resjax.nn.resnet.REPOSITORY_MODELS``
(same functions and parameter counts; ``tests/test_interop.py`` checks them against the repositories' code):
- ``tau_sqrt`` / ``tau_inv``: no normalisation; ``REPOSITORY_MODELS['tau_resnet_nobn']``, the tau-ResNet
  repository's model without BN (``resnet_cifar_nobn.py``): Fixup's scalar biases around every conv (none
  at the stem or the head), one learnable tau shared by all blocks, initialised at 1/sqrt(L) / 1/L (L = the
  number of blocks, 3n), its gradient averaged over the blocks. The seed's Table 2 describes the same model
  ("the same model as Fixup with tau = 1/sqrt(L) and the Kaiming initialization").
- ``fixup``: no normalisation, ``REPOSITORY_MODELS['fixup']``, the Fixup repository's model
  (``fixup_resnet_cifar.py``: zero last conv, other conv x L^(-1/2), scalar biases and multiplier, zero
  classifier, the shortcut fed ``x + bias1a``, the stem at PyTorch's default initialisation).
- ``bn``: the ResNet with BatchNorm as the tau-ResNet repository builds it (``resnet_cifar.py`` with tau = 1,
  its baseline): ``REPOSITORY_MODELS['tau_resnet_bn']`` less tau, i.e. a BatchNorm on each option-A shortcut
  (``option_a_norm``; 96 parameters more than He et al.'s ResNet at every depth); at depth >=
  ``config.bn_warmup_depth`` (110, as He et al. warm up ResNet-110 and -1202) the learning rate warms up
  linearly over ``config.bn_warmup_epochs`` = 1 epoch (He et al. use 0.01 for about 400 iterations, i.e.
  about one epoch, then 0.1).
- ``bn_nowarmup``: the same at ``config.extra_depth`` with no warm-up. ``bn_tau``: BN + fixed tau =
  1/sqrt(L), no warm-up at any depth (``REPOSITORY_MODELS['tau_resnet_bn']``). ``bn_tau_learnable``: BN + a
  learnable tau (at ``extra_depth``; the repository's BN model keeps tau fixed, so this one has no peer).

Training (``config.train``, ``resjax.train.image_train_config``): the tau-ResNet / Fixup repositories'
recipe: SGD with momentum 0.9, batch 128, learning rate 0.1 divided by 10 at epochs 100 and 150 of 200,
weight decay 1e-4 on every parameter, scalar biases / multipliers / tau at a tenth of the learning rate,
random crops (padding 4) and flips. Differences from the seed's runs: Fixup's repository also trains
with mixup (alpha = 1), which resjax does not implement; inputs are normalised by CIFAR's true pixel
std, not the repositories' (0.2023, 0.1994, 0.2010) (see ``resjax.data.tfds``).

Seeds: ``config.num_seeds`` = 5 per cell (the seed's "five runs"), trained together in one vmapped program
per cell. A run has *failed* when it diverged (a non-finite loss) or its final test accuracy is below twice
chance (20% on CIFAR-10, 2% on CIFAR-100); this rule was fixed before any run. Errors are final (epoch
200) test error in percent, mean over the seeds that did not fail; ``best`` errors are recorded too.

Data: CIFAR-10 / CIFAR-100 from TFDS (``python -m experiments.cifar_tau`` needs them prepared; the error
says how). ``--quick``: ResNet-8, two seeds, 2 epochs on 128 synthetic CIFAR-shaped images, batch 32 (a pipeline
check, not a measurement). Every cell checkpoints into ``<out>/checkpoints`` and a rerun resumes there.

Claims (fixed before any run; "error" = mean final test error over non-failed seeds, a cell whose seeds
all failed counts as worse than any finite error): (1) tau_sqrt < tau_inv at 110 and 1202 without BN;
(2) tau_sqrt < fixup at every depth; (3) Fixup's failures at 1202 (reported beside the seed's 2 of 5);
(4) tau_sqrt fails no run at any depth; (5) bn_tau < bn at every depth, on each data set; (6) the gap
bn - bn_tau is larger at the deepest than at the shallowest depth, on each data set; (7) bn_tau at the
extra depth without warm-up fails no run; (8) bn_nowarmup's failures and (9) learnable vs fixed tau with BN
(reported).
"""

from __future__ import annotations

import math

import ml_collections
import numpy as np

from experiments import common, image_runs
from resjax.nn.resnet import REPOSITORY_MODELS, cifar_resnet
from resjax.train import image_train_config

NAME = "cifar_tau"
VARIANTS = {
    "tau_sqrt": {**REPOSITORY_MODELS["tau_resnet_nobn"], "tau": "1/sqrt(L)"},
    "tau_inv": {**REPOSITORY_MODELS["tau_resnet_nobn"], "tau": "1/L"},
    "fixup": dict(REPOSITORY_MODELS["fixup"]),
    "bn": {"norm": "batch", "option_a_norm": True},
    "bn_nowarmup": {"norm": "batch", "option_a_norm": True},
    "bn_tau": {**REPOSITORY_MODELS["tau_resnet_bn"], "tau": "1/sqrt(L)"},
    "bn_tau_learnable": {**REPOSITORY_MODELS["tau_resnet_bn"], "tau": "1/sqrt(L)", "learnable_tau": True},
}
NUM_CLASSES = {"cifar10": 10, "cifar100": 100}


HELP = {
    "data": "'real' (the TFDS data sets, prepared beforehand) or 'synthetic' (random CIFAR-shaped images: a "
            "pipeline check that measures nothing)",
    "nobn_dataset": "data set of the runs without BatchNorm: 'cifar10' or 'cifar100'",
    "nobn_depths": "CIFAR ResNet depths (6n+2) of tau = 1/sqrt(L) and Fixup without BatchNorm, e.g. \"(20, 110)\"",
    "tau_inv_depths": "depths of tau = 1/L without BatchNorm",
    "bn_datasets": "data sets of the BatchNorm runs, comma-separated: cifar10, cifar100",
    "bn_depths": "depths of the BatchNorm runs (bn, bn_tau)",
    "extra_depth": "depth of the extra cells (bn_nowarmup, bn_tau_learnable)",
    "bn_warmup_depth": "from this depth on, the BatchNorm baseline warms its learning rate up",
    "bn_warmup_epochs": "epochs of that warm-up (linear from 0)",
    "scan": "'auto' (nn.scan over the blocks on accelerators, unrolled on the CPU), 'yes' or 'no'; same numbers",
    "num_seeds": "independent runs per cell (the seed's five)",
}


def get_config(size: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.data = "real"
    c.data_dir = ""
    c.synthetic_examples = 256
    c.nobn_dataset = "cifar10"
    c.nobn_depths = (20, 32, 44, 56, 110, 1202)
    c.tau_inv_depths = (110, 1202)
    c.bn_datasets = ("cifar10", "cifar100")
    c.bn_depths = (20, 32, 44, 56, 110, 1202)
    c.extra_depth = 1202
    c.bn_warmup_depth = 110
    c.bn_warmup_epochs = 1.0
    c.num_seeds = 5
    c.scan = "auto"
    c.train = image_train_config()
    c.train.scalar_lr_factor = 0.1
    c.train.checkpoint_every = 5
    if size == "quick":
        c.data = "synthetic"
        c.nobn_depths = (8,)
        c.tau_inv_depths = (8,)
        c.bn_datasets = ("cifar10",)
        c.bn_depths = (8,)
        c.extra_depth = 8
        c.bn_warmup_depth = 8
        c.num_seeds = 2
        c.train.epochs = 2
        c.train.milestones = (1,)
        c.synthetic_examples = 128
        c.train.batch_size = 32
        c.train.eval_batch_size = 128
        c.train.checkpoint_every = 0
    return c


def required_data(config) -> list[str]:
    return sorted({config.nobn_dataset, *config.bn_datasets})


def cells(config) -> list[tuple[str, str, int]]:
    """(data set, variant, depth) of every training cell, in run order."""
    out = [(config.nobn_dataset, v, d) for d in config.nobn_depths for v in ("tau_sqrt", "fixup")]
    out += [(config.nobn_dataset, "tau_inv", d) for d in config.tau_inv_depths]
    out += [(ds, v, d) for ds in config.bn_datasets for d in config.bn_depths for v in ("bn", "bn_tau")]
    out += [(ds, v, config.extra_depth) for ds in config.bn_datasets for v in ("bn_nowarmup", "bn_tau_learnable")]
    return list(dict.fromkeys(out))


def _train_config(config, variant: str, depth: int):
    train = ml_collections.ConfigDict(config.train.to_dict())
    if variant == "bn" and depth >= config.bn_warmup_depth:
        train.warmup_epochs = config.bn_warmup_epochs
    return train


def key(dataset: str, variant: str, depth: int) -> str:
    return f"{dataset}.{variant}.L{depth}"


def check(config) -> None:
    """The preflight hook (``experiments.common.preflight``): the data mode, the scan mode, every data set, the train config of every cell with its batch size within the training examples, every model built."""
    image_runs.check_data_mode(config)
    for dataset in required_data(config):
        if dataset not in NUM_CLASSES:
            setting = "nobn_dataset" if dataset == config.nobn_dataset else "bn_datasets"
            raise ValueError(f"{setting}: unknown data set {dataset!r}; choose one of {tuple(NUM_CLASSES)}")
    for setting in ("nobn_depths", "tau_inv_depths", "bn_depths", "extra_depth"):
        value = config[setting]
        for depth in value if isinstance(value, (tuple, list)) else (value,):
            if not common.is_int(depth) or depth < 8 or (depth - 2) % 6:
                raise ValueError(f"{setting}: every CIFAR ResNet depth must be 6n+2 with n >= 1 (20, 32, 44, 56, 110, "
                                 f"1202), got {depth!r}")
    image_runs.check_cells(config, required_data(config), [_train_config(config, v, d) for _, v, d in cells(config)])
    for dataset, variant, depth in cells(config):
        with common.setting_prefix("model"):
            cifar_resnet(depth, num_classes=NUM_CLASSES[dataset], scan=False, **VARIANTS[variant])


def run(config, out_dir) -> dict:
    check(config)
    metrics: dict = {}
    if config.data == "synthetic":
        metrics[image_runs.STAND_IN] = 1
    seeds = list(range(config.train.seed, config.train.seed + config.num_seeds))
    for dataset, variant, depth in cells(config):
        train, test = image_runs.sources(dataset, config)
        model = cifar_resnet(depth, num_classes=NUM_CLASSES[dataset], scan=image_runs.use_scan(config), **VARIANTS[variant])
        k = key(dataset, variant, depth)
        history, seconds = image_runs.train_cell(model, _train_config(config, variant, depth), train, test, seeds,
                                                 out_dir, k.replace(".", "_"))
        final = 1.0 - np.asarray(history["final_test_error"])  # accuracy
        chance = 1.0 / NUM_CLASSES[dataset]
        failed = (np.asarray(history["diverged_epoch"]) >= 0) | ~(np.nan_to_num(final, nan=0.0) >= 2 * chance)
        metrics[f"final_test_error_pct.{k}"] = image_runs.error_pct(history["final_test_error"])
        metrics[f"best_test_error_pct.{k}"] = image_runs.error_pct(history["best_test_error"])
        metrics[f"failed.{k}"] = int(failed.sum())
        metrics[f"mean_error_pct.{k}"] = (float(np.mean(100 * np.asarray(history["final_test_error"])[~failed]))
                                          if (~failed).any() else math.inf)
        metrics[f"diverged_epoch.{k}"] = np.asarray(history["diverged_epoch"]).tolist()
        metrics[f"curves.{k}.test_acc"] = (1.0 - np.asarray(history["test_error"])).tolist()
        metrics[f"curves.{k}.train_loss"] = np.asarray(history["train_loss"]).tolist()
        metrics[f"seconds.{k}"] = seconds
    _plot(config, metrics, out_dir)
    return metrics


def _err(m, dataset, variant, depth) -> float:
    v = m.get(f"mean_error_pct.{key(dataset, variant, depth)}")
    return math.inf if v is None else float(v)


#: Curve labels and colours of the figure; the extra cells (one depth) are points beside the BatchNorm curves.
PLOT_LABELS = {"tau_sqrt": "tau = 1/sqrt(L)", "tau_inv": "tau = 1/L", "fixup": "Fixup", "bn": "BN",
               "bn_tau": "BN + tau = 1/sqrt(L)", "bn_nowarmup": "BN, no warm-up",
               "bn_tau_learnable": "BN + learnable tau"}
PLOT_COLOURS = {"tau_sqrt": "tab:blue", "tau_inv": "tab:orange", "fixup": "tab:green", "bn": "tab:purple",
                "bn_tau": "tab:blue", "bn_nowarmup": "tab:red", "bn_tau_learnable": "tab:cyan"}


def _plot(config, metrics, out_dir) -> None:
    plt = common.pyplot()
    panels = [("without BN, " + config.nobn_dataset, config.nobn_dataset,
               [("tau_sqrt", config.nobn_depths), ("tau_inv", config.tau_inv_depths), ("fixup", config.nobn_depths)])]
    panels += [(f"with BN, {ds}", ds, [("bn", config.bn_depths), ("bn_tau", config.bn_depths),
                                       ("bn_nowarmup", (config.extra_depth,)),
                                       ("bn_tau_learnable", (config.extra_depth,))]) for ds in config.bn_datasets]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 5.6), squeeze=False)
    for ax, (title, ds, series) in zip(axes[0], panels):
        ran, marks = set(), []
        drawn = [(v, depths) for v, depths in series
                 if any(f"final_test_error_pct.{key(ds, v, d)}" in metrics for d in depths)]
        for i, (v, depths) in enumerate(drawn):
            dodge = 1 + 0.025 * (i - (len(drawn) - 1) / 2)  # side by side at a shared depth (log axis: a factor)
            xs, ys, lo, hi, diverged, failed, runs = [], [], [], [], [], 0, 0
            for d in sorted(set(depths)):
                k = key(ds, v, d)
                errs = metrics.get(f"final_test_error_pct.{k}")
                if errs is None:
                    continue
                ran.add(d)
                errs = np.array([np.nan if e is None else e for e in errs], float)
                failed, runs = failed + int(metrics.get(f"failed.{k}", 0)), runs + errs.size
                finite = errs[np.isfinite(errs)]
                if finite.size:
                    xs.append(d * dodge)
                    ys.append(finite.mean())
                    lo.append(finite.mean() - finite.min())
                    hi.append(finite.max() - finite.mean())
                if finite.size < errs.size:
                    diverged.append(d * dodge)
            label = PLOT_LABELS[v] + (f" ({failed} of {runs} runs failed)" if failed else "")
            if xs:
                ax.errorbar(xs, ys, yerr=[lo, hi], marker="D" if v in ("bn_nowarmup", "bn_tau_learnable") else "o",
                            capsize=3, ls="-" if len(xs) > 1 else "none", color=PLOT_COLOURS[v], label=label)
                label = None
            marks += [(d, None, PLOT_COLOURS[v], (label or PLOT_LABELS[v]) + ": diverged (x)" if j == 0 else None)
                      for j, d in enumerate(diverged)]
        ran = sorted(ran)
        if len(ran) > 1:
            ax.set_xscale("log")
        elif ran:  # one depth: a linear axis around it
            ax.set_xlim(ran[0] * 0.9, ran[0] * 1.1)
        common.mark_diverged(ax, marks)
        ax.set_xticks(ran, [str(d) for d in ran])  # the depths that ran, as integers
        ax.minorticks_off()
        ax.set_xlabel("depth L (layers, 6n+2)")
        ax.set_ylabel("final test error (%), mean and range over\nthe seeds that did not diverge")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        common.legend_outside(ax)
    stand_in = "\nSYNTHETIC STAND-IN DATA, not a measurement" if metrics.get(image_runs.STAND_IN) else ""
    warmup = (f"; BN from depth {config.bn_warmup_depth}: {config.bn_warmup_epochs:g} warm-up "
              f"epoch{'' if config.bn_warmup_epochs == 1 else 's'}"
              if config.bn_datasets else "")
    fig.suptitle(f"Zhang et al. (seed 003) Figure 5 / Table 2: CIFAR ResNets with tau, "
                 f"{common.describe_optimizer(config.train)}, batch {config.train.batch_size},\n"
                 f"{common.plural(config.train.epochs, 'epoch')}, {common.plural(config.num_seeds, 'seed')} per cell"
                 f"{warmup}; failed: diverged or accuracy below twice chance{stand_in}", fontsize=10)
    common.save_figure(fig, out_dir / f"{NAME}.png")


def _deepest_shallowest_gap(m, ds, depths):
    gaps = [_err(m, ds, "bn", d) - _err(m, ds, "bn_tau", d) for d in (min(depths), max(depths))]
    return gaps


def _claims():
    cfg = get_config()

    def nobn_tau_vs_inv(m):
        return all(_err(m, cfg.nobn_dataset, "tau_sqrt", d) < _err(m, cfg.nobn_dataset, "tau_inv", d)
                   for d in cfg.tau_inv_depths)

    def tau_vs_fixup(m):
        return all(_err(m, cfg.nobn_dataset, "tau_sqrt", d) < _err(m, cfg.nobn_dataset, "fixup", d)
                   for d in cfg.nobn_depths)

    def table(m, a, b, ds, depths):
        return "; ".join(f"L{d}: {_err(m, ds, a, d):.2f} vs {_err(m, ds, b, d):.2f}" for d in depths)

    ds10 = cfg.nobn_dataset
    return [
        common.Claim("without BN, tau = 1/sqrt(L) beats tau = 1/L at ResNet-110 and -1202 (final test error %)",
                     "seed 003 Sec. 5.2, Fig. 5", "1/L 'drops a lot'",
                     lambda m: table(m, "tau_sqrt", "tau_inv", ds10, cfg.tau_inv_depths), nobn_tau_vs_inv),
        common.Claim("without BN, tau = 1/sqrt(L) beats Fixup at every depth 20-1202 (error %, tau vs Fixup)",
                     "seed 003 Sec. 5.3, Table 2", "tau better at all depths",
                     lambda m: table(m, "tau_sqrt", "fixup", ds10, cfg.nobn_depths), tau_vs_fixup),
        common.Claim("Fixup runs that fail at ResNet-1202 (of 5)", "seed 003 Sec. 5.3", "2 of 5",
                     lambda m: m[f"failed.{key(ds10, 'fixup', 1202)}"], lambda m: None),
        common.Claim("tau = 1/sqrt(L) without BN fails no run at any depth", "seed 003 Table 2", "none failed",
                     lambda m: sum(m[f"failed.{key(ds10, 'tau_sqrt', d)}"] for d in cfg.nobn_depths),
                     lambda m: sum(m[f"failed.{key(ds10, 'tau_sqrt', d)}"] for d in cfg.nobn_depths) == 0),
        *[common.Claim(f"{ds}: BN + tau = 1/sqrt(L) beats BN at every depth (error %, BN vs BN + tau)",
                       "seed 003 Sec. 5.4, Fig. 5", "tau better",
                       lambda m, ds=ds: table(m, "bn", "bn_tau", ds, cfg.bn_depths),
                       lambda m, ds=ds: all(_err(m, ds, "bn_tau", d) < _err(m, ds, "bn", d) for d in cfg.bn_depths))
          for ds in cfg.bn_datasets],
        *[common.Claim(f"{ds}: tau's gain over BN is larger at 1202 than at 20 (error points, shallow / deep)",
                       "seed 003 Sec. 5.4", "gain grows with depth",
                       lambda m, ds=ds: " / ".join(f"{g:.2f}" for g in _deepest_shallowest_gap(m, ds, cfg.bn_depths)),
                       lambda m, ds=ds: (lambda g: g[1] > g[0])(_deepest_shallowest_gap(m, ds, cfg.bn_depths)))
          for ds in cfg.bn_datasets],
        common.Claim("BN + tau trains ResNet-1202 with no warm-up: failed runs", "seed 003 Sec. 5.4",
                     "same schedule at all depths",
                     lambda m: sum(m[f"failed.{key(ds, 'bn_tau', cfg.extra_depth)}"] for ds in cfg.bn_datasets),
                     lambda m: sum(m[f"failed.{key(ds, 'bn_tau', cfg.extra_depth)}"] for ds in cfg.bn_datasets) == 0),
        common.Claim("ResNet-1202 + BN without warm-up: failed runs (CIFAR-10)", "seed 003 Sec. 5.4",
                     "needs warm-up", lambda m: m[f"failed.{key(ds10, 'bn_nowarmup', cfg.extra_depth)}"],
                     lambda m: None),
        common.Claim("BN + learnable tau vs fixed tau at 1202 (CIFAR-10 error %)", "seed 003 Sec. 5.4", "no gain",
                     lambda m: f"{_err(m, ds10, 'bn_tau_learnable', cfg.extra_depth):.2f} vs "
                               f"{_err(m, ds10, 'bn_tau', cfg.extra_depth):.2f}", lambda m: None),
    ]


CLAIMS = _claims()


if __name__ == "__main__":
    common.main(__name__)
