"""BatchNorm and the loss surface on MNIST-1D: Santurkar et al.'s measurements as the lecture describes them
(lecture 000, "BatchNorm and the loss surface").

Claims (the lecture, after Santurkar et al. 2018): BatchNorm makes the loss vary more smoothly along
optimisation directions, makes gradients change more gradually, makes larger learning rates practical;
noise injected after each BatchNorm layer (covariate shift) trains about as well as standard BatchNorm.

What is run (every choice the lecture leaves open, written before running):

- networks: ``PlainMLP`` depth 8 (eight hidden 64-to-64 layers), width 64, He-uniform kernels, zero
  biases, without normalisation (``plain``) and with BatchNorm after each hidden linear layer
  (``batchnorm``, linear -> BN -> ReLU, PyTorch defaults epsilon 1e-5, rate 0.1); MNIST-1D (4,000 /
  1,000), batch 100, plain SGD without momentum or weight decay; three seeds vmapped in one program;
- the training path: both networks trained at the same learning rate 0.05 (ten times the lecture's
  0.005, so that 30 epochs go somewhere; Santurkar et al. also compare at one shared learning rate) for
  30 epochs; checkpoints at epochs 0, 3, ..., 30;
- at each checkpoint (``resjax.analysis.loss_surface.probe_gradient_direction``): one fixed minibatch
  of 100 training examples (drawn once, the same for every checkpoint and network), training-mode
  BatchNorm (batch statistics, as during training), the gradient g of the whole parameter tree, and the
  points ``theta - eta g`` for eta = c x 0.05, c in {0.5, 1, 1.5, ..., 4} (eight step sizes, half to four
  times the training learning rate, in Santurkar et al.'s spirit). Reported: the loss range (max - min
  of the loss over the eight points), the gradient change (max over the points of the l2 distance
  between the gradient there and g) and the effective beta-smoothness (max of gradient change / distance
  moved). A network's summary is the mean over checkpoints and seeds;
- the largest learning rate that trains: a grid 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, every
  (learning rate, seed) pair one vmapped program (``Trainer.sweep`` with a ``learning_rate`` array), 20
  epochs. Criterion: a learning rate trains when every seed never diverges (no non-finite loss or
  gradient) and ends with a last-epoch mean training loss below 1.0 (chance is ln 10 = 2.30); the
  largest such rate of the grid is reported (``resjax.analysis.loss_surface.largest_trainable_learning_rate``).
  Neither reads an evaluation, so these runs are evaluated after their last epoch only (``train.eval_every``);
- noisy BatchNorm: ``resjax.analysis.loss_surface.NoisyBNMLP``, the ``batchnorm`` network with, after
  every BatchNorm and in training mode only, ``z' = s_tj z + mu_tj + 0.25 e_tij`` where, at every step t
  and for every unit j, mu_tj ~ U(-0.5, 0.5) and s_tj ~ U(0.5, 1.5), and e_tij ~ N(0, 1) per example i
  (a per-unit mean and spread that change every step: injected covariate shift; our reading of
  Santurkar et al., not their exact distributions). Evaluation mode adds no noise. Trained exactly as
  the path runs (learning rate 0.05, 30 epochs, same seeds). "About as well": its final test error
  (evaluation mode, mean over seeds) within 3 percentage points of standard BatchNorm's; the training
  loss (training mode, noise included) and the training error (evaluation mode) are reported beside it.

Metrics: ``path.<net>.{loss_range,grad_change,beta_smoothness,loss0,grad_norm}`` (per seed, per
checkpoint), ``path.<net>.{loss_range,grad_change,beta_smoothness}_mean``, ``path.epochs``;
``curves.<net>.{train_loss,train_error_pct,test_error_pct}`` (per seed per epoch, nets ``plain``,
``batchnorm``, ``noisy_bn``), ``final_{train,test}_error_pct.<net>``;
``lr_sweep.learning_rates``, ``lr_sweep.<net>.{final_train_loss,diverged_epoch}`` (per learning rate, per
seed), ``lr_sweep.<net>.trains`` (1/0 per learning rate), ``lr_sweep.<net>.largest``.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from experiments import checkpoints, common
from resjax.analysis import loss_surface as ls
from resjax.data import load_dataset
from resjax.train import make_train, run_config, train_config

NAME = "batchnorm_loss_surface"
NETS = ("plain", "batchnorm")
SRC = "000 lecture, BatchNorm and the loss surface (Santurkar et al.)"


HELP = {
    "model.kind": "the networks' kind ('plain_mlp'; trained without normalisation, with BatchNorm and with noisy "
                  "BatchNorm)",
    "model.width": "hidden width of the networks (units per layer)",
    "model.depth": "hidden layers of the networks",
    "probe_every": "epochs between loss-surface probes along the training path (must divide train.epochs)",
    "step_multipliers": "probe step sizes as multiples c of train.learning_rate, e.g. \"(0.5, 1.0, 2.0)\"",
    "sweep_learning_rates": "learning rates of the largest-trainable-rate sweep, e.g. \"(0.01, 0.1, 1.0)\"",
    "sweep_epochs": "training epochs of each run of the learning-rate sweep",
    "train_loss_threshold": "a learning rate trains when every seed ends below this training loss (chance: "
                            "ln 10 = 2.30)",
    "noise_shift": "noisy BatchNorm: the per-step, per-unit shift mu is drawn from U(-noise_shift, noise_shift)",
    "noise_scale_low": "noisy BatchNorm: the per-step, per-unit scale s is drawn from U(noise_scale_low, "
                       "noise_scale_high)",
    "noise_scale_high": "noisy BatchNorm: upper end of the scale s's range",
    "noise_sigma": "noisy BatchNorm: standard deviation of the per-example noise added after each BatchNorm",
    "noisy_tolerance_pct": "'about as well': noisy BatchNorm's final test error within this many percentage points "
                           "of BatchNorm's",
    "train.eval_every": "the training-path runs are evaluated after every k-th epoch and after the last (their error "
                        "curves are per epoch: 1); the learning-rate sweep's runs after their last epoch only",
}


def get_config(size: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.data = "mnist1d"
    c.seed = 0
    c.model = ml_collections.ConfigDict(dict(kind="plain_mlp", width=64, depth=8))  # norm: per network
    c.train = train_config(batch_size=100, learning_rate=0.05, epochs=30)
    c.num_seeds = 3
    c.probe_every = 3
    c.step_multipliers = (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0)
    c.sweep_learning_rates = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
    c.sweep_epochs = 20
    c.train_loss_threshold = 1.0
    c.noise_shift = 0.5
    c.noise_scale_low = 0.5
    c.noise_scale_high = 1.5
    c.noise_sigma = 0.25
    c.noisy_tolerance_pct = 3.0
    if size == "quick":
        c.model.width, c.model.depth, c.num_seeds, c.train.epochs, c.probe_every = 8, 1, 2, 1, 1
        c.step_multipliers, c.sweep_learning_rates, c.sweep_epochs = (1.0, 2.0), (0.01, 1.0), 1
    elif size == "full":
        # probe_every must divide the epochs (3 did not divide 100: the full run failed at once)
        c.num_seeds, c.train.epochs, c.sweep_epochs, c.probe_every = 5, 100, 50, 5
    return c


def check(config) -> None:
    """The preflight hook (``experiments.common.preflight``); also called by ``run``."""
    for name in ("num_seeds", "probe_every", "sweep_epochs"):
        if int(config[name]) < 1:
            raise ValueError(f"{name}: must be >= 1, got {config[name]}")
    if config.train.epochs % config.probe_every:
        raise ValueError(f"probe_every: must divide train.epochs ({config.train.epochs}), got {config.probe_every}")
    if config.train.learning_rate <= 0:
        raise ValueError(f"learning_rate: must be > 0, got {config.train.learning_rate}")
    if any(lr < 0 for lr in config.sweep_learning_rates) or not config.sweep_learning_rates:
        raise ValueError(f"sweep_learning_rates: need >= 1 rates, all >= 0, got {config.sweep_learning_rates}")
    ls.check_step_sizes(np.asarray(config.step_multipliers) * config.train.learning_rate)
    ls.check_noise(config.noise_shift, config.noise_scale_low, config.noise_scale_high, config.noise_sigma)
    if not config.train_loss_threshold > 0:
        raise ValueError(f"train_loss_threshold: must be > 0, got {config.train_loss_threshold}")
    data = common.load_data(config)
    common.check_train(config.train, len(data.y_train))
    common.build_models([{**config.model, "norm": norm} for norm in ("none", "batch")], data.num_classes)


def _trainer(config, data, norm: str, epochs: int, model=None, epoch_hook=None, eval_every: int | None = None):
    train = ml_collections.ConfigDict(config.train.to_dict())
    train.epochs = epochs
    if eval_every is not None:
        train.eval_every = eval_every
    return make_train(run_config({**config.model, "norm": norm}, train, config.data), data, model=model,
                      epoch_hook=epoch_hook)


def _noisy_model(config, data):
    return ls.NoisyBNMLP(width=config.model.width, depth=config.model.depth, num_classes=data.num_classes,
                         shift=config.noise_shift, scale_low=config.noise_scale_low,
                         scale_high=config.noise_scale_high, sigma=config.noise_sigma)


def _probe(config, x, y, model_of):
    """An ``epoch_hook``: the loss and gradient along the gradient direction on the fixed batch ``(x, y)``."""
    etas = jnp.asarray(np.asarray(config.step_multipliers) * config.train.learning_rate, jnp.float32)

    def probe(run, hparams=None):
        state = run.state
        loss_fn = ls.params_loss_fn(model_of(), state.variables(), x, y, train=True)
        r = ls.probe_gradient_direction(loss_fn, state.params, etas)
        return {k: r[k] for k in ("loss_range", "grad_change", "beta_smoothness", "loss0", "grad_norm")}

    return probe


def train_path(config, data, norm: str, x, y, probe: bool, model=None) -> dict:
    """Train every seed (vmapped); with ``probe``, the gradient direction is probed after every epoch from
    inside the compiled run (an ``epoch_hook``) and at initialisation, and kept every ``probe_every`` epochs."""
    holder = {}
    hook = _probe(config, x, y, lambda: holder["trainer"].model) if probe else None
    trainer = holder["trainer"] = _trainer(config, data, norm, config.train.epochs, model=model, epoch_hook=hook)
    s = config.num_seeds
    keys = jax.random.split(jax.random.key(config.seed), s)
    hp = {"learning_rate": jnp.full((s,), config.train.learning_rate, jnp.float32)}
    run, out = checkpoints.sweep(trainer, keys, hp, cell=f"train norm={norm}", chunk_epochs=config.probe_every)
    if probe:
        at_init = jax.device_get(jax.jit(jax.vmap(lambda k, h: hook(trainer.init(k, h))))(keys, hp))
        every = config.probe_every
        out["probes"] = {k: np.concatenate([at_init[k][:, None], v[:, every - 1::every]], axis=1)
                         for k, v in out.pop("epoch_records").items()}  # (S, checkpoints)
    return out


def lr_sweep(config, data, norm: str) -> dict:
    # Only the last epoch's training loss and the divergence are read (both from the training steps, not from an
    # evaluation): the runs are evaluated after their last epoch only; the training is the same.
    trainer = _trainer(config, data, norm, config.sweep_epochs, eval_every=config.sweep_epochs)
    lrs = np.asarray(config.sweep_learning_rates, np.float32)
    s = config.num_seeds
    keys = jnp.concatenate([jax.random.split(jax.random.key(config.seed), s)] * len(lrs))
    _, m = checkpoints.sweep(trainer, keys, {"learning_rate": np.repeat(lrs, s)}, cell=f"lr_sweep norm={norm}")
    final = m["train_loss"][:, -1].reshape(len(lrs), s)
    diverged = (m["diverged_epoch"] >= 0).reshape(len(lrs), s)
    ok = ls.trains(final, diverged, config.train_loss_threshold)
    return {"final_train_loss": final, "diverged_epoch": [[None if e < 0 else int(e) for e in row]
                                                          for row in m["diverged_epoch"].reshape(len(lrs), s)],
            "trains": [int(v) for v in ok.all(axis=1)],
            "largest": ls.largest_trainable_learning_rate(lrs, ok)}


def run(config, out_dir) -> dict:
    check(config)
    data = load_dataset(config.data)
    idx = np.random.default_rng(config.seed).choice(len(data.y_train), config.train.batch_size, replace=False)
    x, y = jnp.asarray(data.x_train[idx]), jnp.asarray(data.y_train[idx])
    out: dict = {"path.epochs": list(range(0, config.train.epochs + 1, config.probe_every))}
    nets = {"plain": ("none", None), "batchnorm": ("batch", None), "noisy_bn": ("batch", _noisy_model(config, data))}
    for net, (norm, model) in nets.items():
        r = train_path(config, data, norm, x, y, probe=net in NETS, model=model)
        out[f"curves.{net}.train_loss"] = r["train_loss"]
        out[f"curves.{net}.train_error_pct"] = 100 * r["train_error"]
        out[f"curves.{net}.test_error_pct"] = 100 * r["test_error"]
        out[f"final_train_error_pct.{net}"] = 100 * r["train_error"][:, -1]
        out[f"final_test_error_pct.{net}"] = 100 * r["test_error"][:, -1]
        out[f"diverged_epoch.{net}"] = [None if e < 0 else int(e) for e in r["diverged_epoch"]]
        if "probes" in r:
            for k, v in r["probes"].items():
                out[f"path.{net}.{k}"] = v
            for k in ("loss_range", "grad_change", "beta_smoothness"):
                out[f"path.{net}.{k}_mean"] = float(np.nanmean(r["probes"][k]))
    out["lr_sweep.learning_rates"] = list(config.sweep_learning_rates)
    for net, norm in (("plain", "none"), ("batchnorm", "batch")):
        for k, v in lr_sweep(config, data, norm).items():
            out[f"lr_sweep.{net}.{k}"] = v
    plot(out, config, out_dir / f"{NAME}.png")
    return out


# ---- claims ------------------------------------------------------------------------------------------


def _m(m, k):
    return float(np.mean(np.asarray(m[k], float)))


def _largest(m, net) -> float:
    v = m[f"lr_sweep.{net}.largest"]
    return float("nan") if v is None else float(v)


def _noisy_gap(m):
    return _m(m, "final_test_error_pct.noisy_bn") - _m(m, "final_test_error_pct.batchnorm")


CLAIMS = [
    common.Claim("loss varies more smoothly along the gradient with BatchNorm: loss range over step sizes "
                 "(mean over checkpoints and seeds), plain vs BN", SRC, "smaller with BN",
                 lambda m: f"{m['path.plain.loss_range_mean']:.3g} vs {m['path.batchnorm.loss_range_mean']:.3g}",
                 lambda m: bool(m["path.batchnorm.loss_range_mean"] < m["path.plain.loss_range_mean"])),
    common.Claim("gradients change more gradually with BatchNorm: l2 gradient change along the gradient, plain vs BN "
                 "(beta-smoothness in brackets)", SRC, "smaller with BN",
                 lambda m: (f"{m['path.plain.grad_change_mean']:.3g} vs {m['path.batchnorm.grad_change_mean']:.3g} "
                            f"({m['path.plain.beta_smoothness_mean']:.3g} vs {m['path.batchnorm.beta_smoothness_mean']:.3g})"),
                 lambda m: bool(m["path.batchnorm.grad_change_mean"] < m["path.plain.grad_change_mean"])),
    common.Claim("larger learning rates practical with BatchNorm: largest learning rate of the grid that trains, "
                 "plain vs BN", SRC, "larger with BN",
                 lambda m: f"{_largest(m, 'plain'):g} vs {_largest(m, 'batchnorm'):g} (nan: none trains)",
                 lambda m: bool(np.nan_to_num(_largest(m, "batchnorm"), nan=-1)
                                > np.nan_to_num(_largest(m, "plain"), nan=-1))),
    common.Claim("noise after each BatchNorm trains about as well as standard BatchNorm: final test error % "
                 "(train error %), standard vs noisy, within 3 points", SRC, "about as well",
                 lambda m: (f"{_m(m, 'final_test_error_pct.batchnorm'):.2f} ({_m(m, 'final_train_error_pct.batchnorm'):.2f}) vs "
                            f"{_m(m, 'final_test_error_pct.noisy_bn'):.2f} ({_m(m, 'final_train_error_pct.noisy_bn'):.2f})"),
                 lambda m: bool(abs(_noisy_gap(m)) <= 3.0)),
    common.Claim("beyond the pre-stated criterion: noisy BN's final training error % (evaluation mode) within 3 points "
                 "of standard BN's; last-epoch training loss (training mode) in brackets", SRC, "about as well",
                 lambda m: (f"{_m(m, 'final_train_error_pct.batchnorm'):.2f} ({np.mean(np.asarray(m['curves.batchnorm.train_loss'], float)[:, -1]):.3f}) vs "
                            f"{_m(m, 'final_train_error_pct.noisy_bn'):.2f} ({np.mean(np.asarray(m['curves.noisy_bn.train_loss'], float)[:, -1]):.3f})"),
                 lambda m: bool(abs(_m(m, "final_train_error_pct.noisy_bn") - _m(m, "final_train_error_pct.batchnorm")) <= 3.0)),
]


def report_section(m: dict) -> str:
    lrs = m["lr_sweep.learning_rates"]
    lines = ["Learning-rate sweep: last-epoch training loss, mean over seeds (D: a seed diverged); "
             "trains = every seed finite and below the threshold.", "",
             "| network | " + " | ".join(f"{lr:g}" for lr in lrs) + " | largest that trains |",
             "|---" * (len(lrs) + 2) + "|"]
    for net in NETS:
        cells = []
        for i, _ in enumerate(lrs):
            div = any(e is not None for e in m[f"lr_sweep.{net}.diverged_epoch"][i])
            v = np.asarray(m[f"lr_sweep.{net}.final_train_loss"][i], float)
            cells.append("D" if div else f"{np.nanmean(v):.3f}" + ("" if m[f"lr_sweep.{net}.trains"][i] else " (no)"))
        lines.append(f"| {net} | " + " | ".join(cells) + f" | {_largest(m, net):g} |")
    return "\n".join(lines)


# ---- figure ------------------------------------------------------------------------------------------

COLOURS = {"plain": "tab:red", "batchnorm": "tab:blue", "noisy_bn": "tab:green"}


def _arr(v):
    return np.array([[np.nan if e is None else e for e in row] for row in v], float)


def plot(m: dict, config, path) -> None:
    plt = common.pyplot()

    fig, axes = plt.subplots(2, 2, figsize=(13, 10))
    ep = np.asarray(m["path.epochs"])
    for ax, key, label in ((axes[0, 0], "loss_range", "loss range over step sizes (max - min, nats)"),
                           (axes[0, 1], "grad_change", "max l2 change of the gradient along the gradient")):
        for net in NETS:
            v = _arr(m[f"path.{net}.{key}"])
            for s, row in enumerate(v):
                ax.plot(ep, row, "o-", ms=3, color=COLOURS[net], alpha=0.8, label=net if s == 0 else None)
        ax.set(xlabel=f"epoch of the training path (checkpoint every {common.plural(config.probe_every, 'epoch')})",
               ylabel=label, yscale="log")
    seeds = common.plural(config.num_seeds, "seed")
    axes[0, 0].set_title(f"Loss variation along the gradient direction\n(steps eta = c x {config.train.learning_rate:g}, "
                         f"c in {', '.join(f'{c:g}' for c in config.step_multipliers)}; one line per seed)", fontsize=10)
    axes[0, 1].set_title("Gradient predictiveness: |grad L(theta - eta g) - g|,\nmax over the same eta (one line per seed)",
                         fontsize=10)
    ax = axes[1, 0]
    lrs = np.asarray(m["lr_sweep.learning_rates"], float)
    marks, finals = [], [config.train_loss_threshold]
    for net in NETS:
        v = _arr(m[f"lr_sweep.{net}.final_train_loss"])
        with np.errstate(all="ignore"):
            mean = np.array([np.nanmean(r) if np.isfinite(r).any() else np.nan for r in v])
        largest = _largest(m, net)
        finals += [v for v in mean if np.isfinite(v) and v > 0]
        ax.plot(lrs, mean, "o-", color=COLOURS[net],
                label=f"{net} (largest that trains: {largest:g})" if np.isfinite(largest) else f"{net} (none trains)")
        diverged = [lr for lr, row in zip(lrs, m[f"lr_sweep.{net}.diverged_epoch"]) if any(e is not None for e in row)]
        for i, lr in enumerate(diverged):  # above the data at that learning rate
            marks.append((lr, None, COLOURS[net], f"{net}: a seed diverged (x)" if i == 0 else None))
    ax.axhline(config.train_loss_threshold, color="k", ls=":", label=f"threshold {config.train_loss_threshold:g} "
                                                                        "(trains below)")
    ax.set_xscale("log")
    wide = max(finals) / min(finals) > 20  # a loss that exploded without diverging: log axis, the rest still visible
    if wide:
        ax.set_yscale("log")
    common.mark_diverged(ax, marks, log=wide)
    ax.set_xticks(lrs, [f"{lr:g}" for lr in lrs], minor=False)
    ax.set(xlabel="learning rate", ylabel=f"training loss (cross-entropy, nats), last of "
           f"{common.plural(config.sweep_epochs, 'epoch')}\n(mean over seeds that did not diverge)",
           title=f"Largest learning rate that trains ({common.plural(config.sweep_epochs, 'epoch')}, {seeds})")
    ax = axes[1, 1]
    drawn = []
    for net in ("plain", "batchnorm", "noisy_bn"):
        te = np.asarray(m[f"curves.{net}.test_error_pct"], float)
        tr = np.asarray(m[f"curves.{net}.train_error_pct"], float)
        e = np.arange(1, te.shape[1] + 1)
        few = len(e) < 8  # a few epochs: each one visible (one epoch: a point), test and training told apart
        ax.plot(e, np.nanmean(te, 0), color=COLOURS[net], label=f"{net}: test error", **(dict(marker="o", ms=5) if few else {}))
        ax.plot(e, np.nanmean(tr, 0), "--", color=COLOURS[net], label=f"{net}: training error",
                **(dict(marker="s", ms=6, mfc="none") if few else {}))
        drawn += [np.nanmean(te, 0), np.nanmean(tr, 0)]
    drawn = np.concatenate(drawn)
    drawn = drawn[np.isfinite(drawn) & (drawn > 0)]
    wide = drawn.size and drawn.max() / drawn.min() > 3  # a log axis only where the errors span a wide range
    ax.set(xlabel="epoch", ylabel="error (%, evaluation mode, mean over seeds)", yscale="log" if wide else "linear")
    ax.set_title(f"Noisy BatchNorm vs standard (after each BN: s z + mu + sigma e)\n"
                 f"s~U({config.noise_scale_low:g}, {config.noise_scale_high:g}), mu~U(+-{config.noise_shift:g}), "
                 f"sigma {config.noise_sigma:g}; lr {config.train.learning_rate:g}", fontsize=10)
    for a in axes.flat:
        a.grid(alpha=0.3, which="major" if a is axes[1, 0] else "both")
    for a in (axes[0, 0], axes[0, 1], axes[1, 1]):
        common.integer_ticks(a)
    for a in axes.flat:
        common.legend_outside(a, ncol=3 if a is axes[1, 1] else 2)
    fig.suptitle(f"Lecture (seed 000), 'BatchNorm and the loss surface': MNIST-1D, PlainMLP depth {config.model.depth} "
                 f"width {config.model.width}, {common.describe_optimizer(config.train)}, batch {config.train.batch_size},\n"
                 f"{common.plural(config.train.epochs, 'epoch')} (learning-rate sweep: "
                 f"{common.plural(config.sweep_epochs, 'epoch')}), {seeds}")
    common.save_figure(fig, path, dpi=100)


if __name__ == "__main__":
    common.main(__name__)
