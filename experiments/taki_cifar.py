"""Taki's 100-block convolutional ResNets on CIFAR-10: He's initialisation, Taki's and He's with BatchNorm
(seed 004, Section 4, Figures 2 and 3).

What the seed claims: with He's initialisation the BN-free ResNet "is trapped on a plateau from the
beginning and converge is hampered" and is "very unstable" (Fig. 3: nine runs); with Taki's
initialisation (weights N(0, 1/(8*8*16*100))) it is "more stable": "the mean and variance of the
validation accuracy after the first epoch are 0.434 and 0.017"; it shows "a comparable performance with
ResNet with batch normalization", which is "slightly better" and more stable over the 20 epochs shown.

Model (``resjax.nn.resnet.taki_resnet``): a 3x3 stem to 16 channels, 100 blocks ``x + conv8x8(relu(N(x)))``
(16 channels, no bias; N = BatchNorm for the BN model, the identity otherwise; the even kernel padded
3 before / 4 after), global average pool, a dense classifier. Variants: ``he`` (N = identity, He normal
fan-in: variance 2/(8*8*16)), ``taki`` (N = identity, variance 1/(8*8*16*100)), ``bn`` (BatchNorm, He).

Settings the seed does not state, chosen before any run and not tuned: SGD with momentum 0.9 at a constant
learning rate 0.01, batch 128, no weight decay, the standard CIFAR crops and flips; 20 epochs (the seed's
horizon); ``config.num_seeds`` = 9 runs per variant (the seed's Fig. 3 shows nine). "Validation accuracy"
is the CIFAR-10 test split's accuracy after each epoch (evaluation mode; running BN statistics). The
variance is the unbiased sample variance over the runs (a diverged run counts as accuracy 0.1, chance,
and is also counted separately).

Claims (fixed before any run): (1) Taki's mean first-epoch validation accuracy and (2) its variance,
reported beside 0.434 and 0.017; (3) Taki's mean first-epoch accuracy is higher than He's; (4) He's
first-epoch accuracy varies more across runs than Taki's (variance); (5) BN's mean accuracy at epoch 20 is
at least Taki's ("slightly better") and (6) within 10 points of it ("comparable").

``--quick``: 3 blocks, 2 runs, 2 epochs on 128 synthetic CIFAR-shaped images (a pipeline check).
"""

from __future__ import annotations

import ml_collections
import numpy as np

from experiments import common, image_runs
from resjax.nn.resnet import taki_resnet
from resjax.train import image_train_config

NAME = "taki_cifar"
VARIANTS = {
    "he": {"norm": "none", "kernel_init": "he_normal"},
    "taki": {"norm": "none", "kernel_init": "taki"},
    "bn": {"norm": "batch", "kernel_init": "he_normal"},
}
LABELS = {"he": "He init, no BN", "taki": "Taki init c/(nL), no BN", "bn": "He init + BatchNorm"}
COLOURS = {"he": "tab:gray", "taki": "goldenrod", "bn": "tab:blue"}
CHANCE = 0.1


HELP = {
    "data": "'real' (CIFAR-10 from TFDS, prepared beforehand) or 'synthetic' (random CIFAR-shaped images: a "
            "pipeline check that measures nothing)",
    "dataset": "the TFDS data set: 'cifar10' or 'cifar100'",
    "num_blocks": "residual blocks of every network (the seed's 100)",
    "variants": "the networks, comma-separated: he (He init, no BN), taki (Taki's c/(nL), no BN), bn (He + BatchNorm)",
    "scan": "'auto' (nn.scan over the blocks on accelerators, unrolled on the CPU), 'yes' or 'no'; same numbers",
    "num_seeds": "independent runs per variant (the seed's nine)",
}


def get_config(size: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.data = "real"
    c.data_dir = ""
    c.synthetic_examples = 256
    c.dataset = "cifar10"
    c.num_blocks = 100
    c.variants = tuple(VARIANTS)
    c.num_seeds = 9
    c.scan = "auto"
    c.train = image_train_config()
    c.train.epochs = 20
    c.train.learning_rate = 0.01
    c.train.schedule = "constant"
    c.train.weight_decay = 0.0
    c.train.checkpoint_every = 5
    if size == "quick":
        c.data = "synthetic"
        c.num_blocks = 3
        c.synthetic_examples = 128
        c.num_seeds = 2
        c.train.epochs = 2
        c.train.batch_size = 64
        c.train.eval_batch_size = 64
        c.train.checkpoint_every = 0
    return c


def required_data(config) -> list[str]:
    return [config.dataset]


def check(config) -> None:
    """The preflight hook (``experiments.common.preflight``): the data mode and variants, the scan mode, the train config with its batch size within the training examples, every model built."""
    image_runs.check_data_mode(config)
    for v in config.variants:
        if v not in VARIANTS:
            raise ValueError(f"variants: unknown variant {v!r}; choose from {tuple(VARIANTS)}")
    image_runs.check_cells(config, [config.dataset])
    for v in config.variants:
        taki_resnet(config.num_blocks, scan=False, **VARIANTS[v])


def run(config, out_dir) -> dict:
    check(config)
    metrics: dict = {}
    if config.data == "synthetic":
        metrics[image_runs.STAND_IN] = 1
    train, test = image_runs.sources(config.dataset, config)
    seeds = list(range(config.train.seed, config.train.seed + config.num_seeds))
    for v in config.variants:
        model = taki_resnet(config.num_blocks, scan=image_runs.use_scan(config), **VARIANTS[v])
        history, seconds = image_runs.train_cell(model, config.train, train, test, seeds, out_dir, v)
        acc = 1.0 - np.asarray(history["test_error"], np.float64)
        diverged = np.asarray(history["diverged_epoch"])
        acc = np.where(np.isfinite(acc), acc, CHANCE)  # a diverged run predicts no better than chance
        if acc.shape[1] < config.train.epochs:  # every seed diverged: fit stopped early
            acc = np.pad(acc, ((0, 0), (0, config.train.epochs - acc.shape[1])), constant_values=CHANCE)
        first, last = acc[:, 0], acc[:, -1]
        metrics[f"first_epoch_acc.{v}"] = first.tolist()
        metrics[f"first_epoch_acc_mean.{v}"] = float(first.mean())
        metrics[f"first_epoch_acc_var.{v}"] = float(first.var(ddof=1)) if len(first) > 1 else 0.0
        metrics[f"final_acc.{v}"] = last.tolist()
        metrics[f"final_acc_mean.{v}"] = float(last.mean())
        metrics[f"diverged_runs.{v}"] = int((diverged >= 0).sum())
        metrics[f"curves.{v}.test_acc"] = acc.tolist()
        metrics[f"curves.{v}.train_loss"] = np.asarray(history["train_loss"]).tolist()
        metrics[f"seconds.{v}"] = seconds
    _plot(config, metrics, out_dir)
    return metrics


def _runs(values) -> np.ndarray:
    """Seeds x epochs, ``None`` (a non-finite value in results.json) as NaN."""
    return np.array([[np.nan if v is None else v for v in row] for row in values], float)


def _plot(config, metrics, out_dir) -> None:
    plt = common.pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 5.4))
    marks1, marks2 = [], []
    for v in config.variants:
        acc = _runs(metrics[f"curves.{v}.test_acc"])
        loss = _runs(metrics[f"curves.{v}.train_loss"])
        # A diverged run's loss turns non-finite (its accuracy is then counted as chance): marked where it does.
        diverged = [int(np.argmax(~np.isfinite(row))) + 1 if (~np.isfinite(row)).any() else None for row in loss]
        n = sum(e is not None for e in diverged)
        label = LABELS[v] + (f": {n} of {len(loss)} runs diverged (x)" if n else "")
        few = acc.shape[1] < 8  # a few epochs: each one a visible point
        for i, row in enumerate(acc):
            a1.plot(np.arange(1, len(row) + 1), row, marker="o", ms=4 if few else 2, color=COLOURS[v], alpha=0.6,
                    lw=1, label=label if i == 0 else None)
        for i, row in enumerate(loss):
            a2.plot(np.arange(1, len(row) + 1), row, marker="o", ms=4 if few else 2, color=COLOURS[v], alpha=0.6,
                    lw=1, label=label if i == 0 else None)
        marks1 += common.diverged_marks(acc, diverged, COLOURS[v])
        marks2 += common.diverged_marks(loss, diverged, COLOURS[v])
    a1.axhline(0.434, color="goldenrod", ls=":", lw=1, label="seed: Taki, epoch-1 mean 0.434")
    a1.set_xlabel("epoch")
    a1.set_ylabel(f"validation accuracy (fraction; diverged = {CHANCE:g})")
    a1.set_title("validation accuracy (seed 004 Fig. 2a, Fig. 3), one line per run", fontsize=10)
    a2.set_xlabel("epoch")
    a2.set_ylabel("training loss (cross-entropy, epoch mean)")
    a2.set_yscale("log")
    a2.set_title("training loss (seed 004 Fig. 2b), one line per run", fontsize=10)
    common.mark_diverged(a1, marks1)
    common.mark_diverged(a2, marks2, log=True)
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
        common.integer_ticks(ax)
        common.legend_outside(ax)
    stand_in = "\nSYNTHETIC STAND-IN DATA, not a measurement" if metrics.get(image_runs.STAND_IN) else ""
    fig.suptitle(f"Taki (seed 004): {config.num_blocks}-block 8x8-conv ResNets on {config.dataset.upper().replace('CIFAR', 'CIFAR-')}, "
                 f"{common.describe_optimizer(config.train)}, batch {config.train.batch_size},\n"
                 f"{common.plural(config.train.epochs, 'epoch')}, {common.plural(config.num_seeds, 'run')} each"
                 f"{stand_in}", fontsize=10)
    common.save_figure(fig, out_dir / f"{NAME}.png")


CLAIMS = [
    common.Claim("Taki init: mean validation accuracy after the first epoch", "seed 004 Sec. 4", "0.434",
                 lambda m: m["first_epoch_acc_mean.taki"], lambda m: None),
    common.Claim("Taki init: variance of that accuracy over runs", "seed 004 Sec. 4", "0.017",
                 lambda m: m["first_epoch_acc_var.taki"], lambda m: None),
    common.Claim("first-epoch accuracy, mean: Taki's init above He's (Taki / He)", "seed 004 Figs. 2, 3",
                 "He trapped on a plateau",
                 lambda m: f"{m['first_epoch_acc_mean.taki']:.3f} / {m['first_epoch_acc_mean.he']:.3f}",
                 lambda m: m["first_epoch_acc_mean.taki"] > m["first_epoch_acc_mean.he"]),
    common.Claim("first-epoch accuracy varies more with He's init than Taki's (variance He / Taki)",
                 "seed 004 Fig. 3", "He 'very unstable'",
                 lambda m: f"{m['first_epoch_acc_var.he']:.4f} / {m['first_epoch_acc_var.taki']:.4f}",
                 lambda m: m["first_epoch_acc_var.he"] > m["first_epoch_acc_var.taki"]),
    common.Claim("epoch-20 accuracy: BN at least Taki's (BN / Taki)", "seed 004 Fig. 2", "BN slightly better",
                 lambda m: f"{m['final_acc_mean.bn']:.3f} / {m['final_acc_mean.taki']:.3f}",
                 lambda m: m["final_acc_mean.bn"] >= m["final_acc_mean.taki"]),
    common.Claim("epoch-20 accuracy: Taki within 0.10 of BN", "seed 004 Fig. 2", "comparable",
                 lambda m: round(m["final_acc_mean.bn"] - m["final_acc_mean.taki"], 4),
                 lambda m: abs(m["final_acc_mean.bn"] - m["final_acc_mean.taki"]) <= 0.10),
]


if __name__ == "__main__":
    common.main(__name__)
