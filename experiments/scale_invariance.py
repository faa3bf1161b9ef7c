"""Scale invariance of a weight layer followed by BatchNorm, and the effective learning rate (lecture 000,
"Scale invariance").

Part 1, the identities. For the hidden layers of ``PlainMLP(norm='batch')`` (linear -> BatchNorm -> ReLU;
each ``blocks_k/linear_0/kernel`` feeds BatchNorm directly) in training mode, on random MNIST-1D minibatches and
random He initialisations, ``resjax.analysis.scale_invariance.scale_identities`` measures the relative
deviations from: ``L(aW) = L(W)``; ``grad L(aW) = grad L(W) / a``; ``W . grad L = 0`` (|cosine|); and
``|W - alpha g|^2 - |W|^2 = alpha^2 |g|^2``, for every a in ``scales``, every hidden layer and every draw.
It does so twice: with BatchNorm's epsilon set to 0 (the lecture's "ignoring epsilon"; metrics
``identities.eps0.*``) and with the library's default epsilon 1e-5 (``identities.eps_default.*``: how far
the epsilon moves real networks off the identities, largest at small a). Matmuls at 'highest' precision.

Part 2, training. The same network kind (``model``: depth 4, width 64) trained on MNIST-1D with plain
SGD through ``resjax.train.make_train`` (``weight_decay`` a vmapped hyperparameter; a ``step_hook`` records each step's
geometry from inside the compiled run) at learning rate alpha, with weight decay lambda in ``weight_decays``, seeds and decays
vmapped in one program. After every step the hidden kernels' norm |W|, the angle turned by the step and
alpha / |W|^2 are recorded (``resjax.analysis.scale_invariance.step_geometry_from_update``).

Choices the lecture leaves open, made before running:

- weight decay is resjax.train's L2 penalty (``weight_decay_on='kernels'``: ``optax.add_decayed_weights`` before the SGD step), so
  the update is ``-alpha (g + lambda W)``. For plain SGD (no momentum) this is identical to decoupled
  decay ``W <- (1 - alpha lambda) W - alpha g``. It applies to every Dense kernel (stem, hidden, head),
  not to biases or BatchNorm's scale and offset;
- learning rate 0.1 (20x the lecture's 0.005: at 0.005 the squared norm grows by only
  alpha^2 |g|^2 per step and nothing visible happens within a few CPU minutes; BatchNorm networks train
  at 0.1), batch 100, 60 epochs (2,400 steps), depth 4, width 64, two seeds, weight decays
  0, 1e-3 and 1e-2;
- identities: width 32, depth 3, four draws (network and minibatch of 64), a in {0.1, 0.5, 2, 10},
  alpha = 0.1; "float32 tolerance" is a relative deviation below 1e-5 for the loss and the cosine and
  below 1e-4 for the gradient and the step (both divide by gradient-sized quantities);
- "the turning slows": the effective learning rate alpha/|W|^2 at the last step below its value at the
  first; the mean angle per step over the last epoch is also reported against the first epoch's (it
  also falls as the gradient at unit length shrinks while the loss falls);
- "|W| grows without weight decay": every hidden kernel of every seed ends longer than it started, and
  the fraction of steps whose squared-norm growth is >= -1e-6 |W|^2 (no step shortens W beyond float32
  rounding) is reported.

Metrics: ``identities.{eps0,eps_default}.{loss,grad,cosine,step}.max`` (largest relative deviation) and
``.by_scale`` (largest per a, in ``scales`` order); ``train.wd<name>.{norm,angle,eff_lr}`` per epoch
(mean over hidden layers, per seed, end-of-epoch norm, epoch-mean angle and eff lr),
``train.wd<name>.norm_ratio`` (final / initial |W|, mean over layers, per seed),
``train.wd<name>.eff_lr_ratio``, ``train.wd<name>.angle_ratio`` (last epoch / first epoch),
``train.wd<name>.unit_grad_ratio`` (last / first epoch of tan(angle) |W|^2 / alpha = |g| |W| / (1 - alpha
lambda), the gradient the weights would have at unit length: angle per step = effective learning rate x
this), ``train.wd<name>.nondecreasing_fraction``, ``train.wd<name>.angle_vs_prediction`` (largest relative
deviation of the measured angle from ``arctan(alpha |g| / (|W| (1 - alpha lambda)))``),
``train.wd<name>.final_train_error_pct``.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from experiments import checkpoints, common
from resjax.analysis import scale_invariance as si
from resjax.data import load_dataset
from resjax.nn import PlainMLP
from resjax.train import make_train, run_config, train_config

NAME = "scale_invariance"
IDENTITIES = ("loss", "grad", "cosine", "step")
TOL = {"loss": 1e-5, "cosine": 1e-5, "grad": 1e-4, "step": 1e-4}
SRC = "000 lecture, Scale invariance"


HELP = {
    "width": "part 1 (identities): hidden width of the BatchNorm MLP",
    "depth": "part 1 (identities): hidden layers of the BatchNorm MLP",
    "num_draws": "part 1: random networks and minibatches at which the identities are checked",
    "batch": "part 1: minibatch size of the identity checks (at least 2, as BatchNorm needs)",
    "scales": "part 1: the weight scales a of L(aW) = L(W) etc., e.g. \"(0.1, 0.5, 2.0, 10.0)\"",
    "alpha": "part 1: the step size alpha of the step identity |W - alpha g|^2 - |W|^2 = alpha^2 |g|^2",
    "model.kind": "part 2 (training): the network's kind ('plain_mlp')",
    "model.width": "part 2 (training): hidden width (units per layer)",
    "model.depth": "part 2 (training): hidden layers",
    "model.norm": "part 2 (training): normalisation after each hidden linear layer ('batch': the experiment's subject)",
    "weight_decays": "part 2: the weight decays lambda trained (one vmapped program), e.g. \"(0.0, 0.001)\"; must "
                     "include 0.0",
    "train.weight_decay": "not read: part 2's weight decays are --weight_decays",
}


def get_config(size: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.data = "mnist1d"
    c.seed = 0
    # part 1
    c.width = 32
    c.depth = 3
    c.num_draws = 4
    c.batch = 64
    c.scales = (0.1, 0.5, 2.0, 10.0)
    c.alpha = 0.1
    # part 2
    c.model = ml_collections.ConfigDict(dict(kind="plain_mlp", width=64, depth=4, norm="batch"))
    c.train = train_config(learning_rate=0.1, batch_size=100, epochs=60)  # weight decay: weight_decays
    c.weight_decays = (0.0, 1e-3, 1e-2)
    c.num_seeds = 2
    if size == "quick":
        c.num_draws, c.scales, c.width, c.depth = 1, (0.5, 2.0), 16, 2
        c.model.width, c.model.depth, c.train.epochs, c.weight_decays = 16, 2, 1, (0.0, 1e-2)
    elif size == "full":
        c.num_draws, c.train.epochs, c.num_seeds = 10, 200, 5
    return c


def check(config) -> None:
    """The preflight hook (``experiments.common.preflight``); also called by ``run``."""
    for a in config.scales:
        si.check_scale(a)
    si.check_learning_rate(config.alpha, "alpha")
    si.check_learning_rate(config.train.learning_rate, "learning_rate")
    for wd in config.weight_decays:
        si.check_weight_decay(wd)
    if 0.0 not in tuple(config.weight_decays):
        raise ValueError("weight_decays: must include 0.0 (the run without weight decay)")
    if config.model.get("kind") != "plain_mlp" or config.model.get("norm") != "batch":
        raise ValueError("model: part 2 measures the hidden kernels of a plain_mlp with norm='batch'")
    for name in ("num_draws", "batch", "num_seeds", "width", "depth"):
        if int(config[name]) < 1:
            raise ValueError(f"{name}: must be >= 1, got {config[name]}")
    if config.batch < 2:
        raise ValueError("batch: training-mode BatchNorm needs >= 2 examples")
    data = common.load_data(config)
    common.check_batch_sizes("batch", config.batch, len(data.y_train), minimum=2)
    common.check_train(config.train, len(data.y_train))
    common.build_models([config.model], data.num_classes)


def _wd_name(wd: float) -> str:
    """``wd0``, ``wd1e-03``: no dots, so metric names split cleanly."""
    return "wd0" if wd == 0 else f"wd{wd:.0e}".replace("+", "")


# ---- part 1: the identities --------------------------------------------------------------------------


@functools.cache
def _values_at(model, paths: tuple):
    """One compiled ``(variables, x, y, a) -> [(L(W), grad(W), L(aW), grad(aW)) per path]`` per model."""

    def values(variables, x, y, a):
        out = []
        for path in paths:
            vg = jax.value_and_grad(si.weight_loss_fn(model, variables, x, y, path, train=True))
            w = si.get_weight(variables, path)
            (l_w, g_w), (l_aw, g_aw) = vg(w), vg(a * w)
            out.append((l_w, g_w, l_aw, g_aw))
        return out

    return jax.jit(values)


def measure_identities(config, data) -> dict:
    out = {}
    models = {
        "eps0": PlainMLP(width=config.width, depth=config.depth, norm=functools.partial(
            nn.BatchNorm, use_running_average=False, epsilon=0.0, momentum=0.9)),
        "eps_default": PlainMLP(width=config.width, depth=config.depth, norm="batch"),
    }
    rng = np.random.default_rng(config.seed)
    with jax.default_matmul_precision("highest"):
        dev = {name: {i: np.zeros((len(config.scales),)) for i in IDENTITIES} for name in models}
        for d in range(config.num_draws):
            idx = rng.choice(len(data.y_train), config.batch, replace=False)
            x, y = jnp.asarray(data.x_train[idx]), jnp.asarray(data.y_train[idx])
            variables = models["eps_default"].init(jax.random.key(config.seed * 1000 + d), x)
            paths = tuple(f"blocks_{k}/linear_0/kernel" for k in range(config.depth))
            for name, model in models.items():
                for j, a in enumerate(config.scales):
                    per_path = _values_at(model, paths)(variables, x, y, jnp.float32(a))
                    for path, values in zip(paths, per_path):
                        r = si.identity_deviations(si.get_weight(variables, path), a, config.alpha, *values)
                        for i in IDENTITIES:
                            dev[name][i][j] = max(dev[name][i][j], r[i])
        for name in models:
            for i in IDENTITIES:
                out[f"identities.{name}.{i}.max"] = float(dev[name][i].max())
                out[f"identities.{name}.{i}.by_scale"] = dev[name][i]
    return out


# ---- part 2: training with and without weight decay --------------------------------------------------


GEOMETRY = ("norm_before", "angle", "effective_learning_rate", "growth", "predicted_angle")


def step_geometry_hook(depth: int):
    """A ``step_hook`` for ``make_train``: each hidden kernel's step geometry (``(layers,)`` per quantity)."""
    paths = [f"blocks_{k}" for k in range(depth)]

    def hook(before, after, hparams):
        geo = [si.step_geometry_from_update(before.state.params[p]["linear_0"]["kernel"],
                                            after.state.params[p]["linear_0"]["kernel"],
                                            hparams["learning_rate"], hparams["weight_decay"]) for p in paths]
        return {k: jnp.stack([g[k] for g in geo]) for k in GEOMETRY}

    return hook


def train_part(config, data) -> dict:
    depth = config.model.depth
    trainer = make_train(run_config(config.model, config.train, config.data), data, step_hook=step_geometry_hook(depth))
    wds = np.asarray(config.weight_decays, np.float32)
    s = config.num_seeds
    keys = jnp.concatenate([jax.random.split(jax.random.key(config.seed), s)] * len(wds))
    lrs = jnp.full((len(keys),), config.train.learning_rate, jnp.float32)
    wd_all = jnp.asarray(np.repeat(wds, s))
    run, m = checkpoints.sweep(trainer, keys, {"learning_rate": lrs, "weight_decay": wd_all}, cell="weight_decay sweep")
    rec, losses, err, div = m["step_records"], m["train_loss"], m["train_error"][:, -1], m["diverged_epoch"]
    final_norm = jax.device_get(jax.jit(jax.vmap(lambda p: jnp.stack(
        [jnp.linalg.norm(p[f"blocks_{k}"]["linear_0"]["kernel"]) for k in range(depth)])))(run.state.params))  # (runs, layers)
    out = {"train.weight_decays": [float(w) for w in config.weight_decays]}
    for i, wd in enumerate(config.weight_decays):
        sl = slice(i * s, (i + 1) * s)
        r = {k: np.asarray(v[sl], np.float64) for k, v in rec.items()}  # (S, epochs, steps, layers)
        S, E, T, L = r["norm_before"].shape
        norm = r["norm_before"].reshape(S, E * T, L)
        angle = r["angle"].reshape(S, E * T, L)
        eff = r["effective_learning_rate"].reshape(S, E * T, L)
        growth = r["growth"].reshape(S, E * T, L)
        pred = r["predicted_angle"].reshape(S, E * T, L)
        fn = np.asarray(final_norm[sl], np.float64)  # (S, L)
        p = f"train.{_wd_name(wd)}."
        # (S, E + 1): at the start of every epoch, then the final norm
        out[p + "norm"] = np.concatenate([r["norm_before"][:, :, 0].mean(-1), fn.mean(-1)[:, None]], axis=1)
        out[p + "angle"] = r["angle"].mean(axis=(2, 3))
        out[p + "eff_lr"] = r["effective_learning_rate"].mean(axis=(2, 3))
        out[p + "norm_ratio"] = (fn / norm[:, 0]).mean(-1)
        out[p + "norm_grew_every_layer"] = [int(v) for v in (fn > norm[:, 0]).all(-1)]
        out[p + "eff_lr_ratio"] = (config.train.learning_rate / fn ** 2 / eff[:, 0]).mean(-1)
        out[p + "angle_ratio"] = (r["angle"][:, -1].mean(axis=(1, 2)) / r["angle"][:, 0].mean(axis=(1, 2)))
        unit_grad = np.tan(r["angle"]) / r["effective_learning_rate"]  # = |g| |W| (1 - alpha lambda)^-1: gradient at |W| = 1
        out[p + "unit_grad_ratio"] = unit_grad[:, -1].mean(axis=(1, 2)) / unit_grad[:, 0].mean(axis=(1, 2))
        out[p + "nondecreasing_fraction"] = (growth >= -1e-6 * norm ** 2).mean(axis=(1, 2))
        out[p + "angle_vs_prediction"] = (np.abs(angle - pred) / np.maximum(pred, 1e-30)).max(axis=(1, 2))
        out[p + "final_train_error_pct"] = 100 * np.asarray(err[sl], np.float64)
        out[p + "train_loss"] = np.asarray(losses[sl], np.float64)
        out[p + "diverged_epoch"] = [None if e < 0 else int(e) for e in div[sl]]
    return out


def run(config, out_dir) -> dict:
    check(config)
    data = load_dataset(config.data)
    out = measure_identities(config, data)
    out.update(train_part(config, data))
    plot(out, config, out_dir / f"{NAME}.png")
    return out


# ---- claims ------------------------------------------------------------------------------------------


def _ident(i):
    return common.Claim(
        {"loss": "loss unchanged when W -> aW, a > 0 (largest relative deviation; epsilon 0 / default 1e-5)",
         "grad": "gradient at aW equals gradient at W divided by a (largest relative deviation)",
         "cosine": "gradient perpendicular to W (largest |cosine|)",
         "step": "a step lengthens W: |W - alpha g|^2 - |W|^2 = alpha^2 |g|^2 (largest relative deviation)"}[i],
        SRC, {"loss": "L(aW) = L(W)", "grad": "grad L(aW) = grad L(W) / a", "cosine": "W . grad L = 0",
              "step": "exact"}[i],
        lambda m: f"{m[f'identities.eps0.{i}.max']:.1e} / {m[f'identities.eps_default.{i}.max']:.1e}",
        lambda m: bool(m[f"identities.eps0.{i}.max"] < TOL[i]))


def _wds(m):
    return sorted(m["train.weight_decays"])


def _mean(m, key):
    return float(np.mean(np.asarray(m[key], float)))


CLAIMS = [
    *[_ident(i) for i in IDENTITIES],
    common.Claim("without weight decay |W| grows (final / initial |W|, mean over hidden layers and seeds)", SRC,
                 "grows step by step",
                 lambda m: f"{_mean(m, 'train.wd0.norm_ratio'):.3f}; steps not shortening W: "
                           f"{_mean(m, 'train.wd0.nondecreasing_fraction'):.4f}",
                 lambda m: bool(all(m["train.wd0.norm_grew_every_layer"]))),
    common.Claim("without weight decay the turning slows: alpha/|W|^2 final / initial "
                 "(and angle per step, last / first epoch)", SRC, "falls like alpha/|W|^2",
                 lambda m: (f"{_mean(m, 'train.wd0.eff_lr_ratio'):.3f} ({_mean(m, 'train.wd0.angle_ratio'):.3f}; "
                            f"gradient at unit length x{_mean(m, 'train.wd0.unit_grad_ratio'):.3f})"),
                 lambda m: bool(_mean(m, "train.wd0.eff_lr_ratio") < 1)),
    common.Claim("weight decay shrinks |W| (final / initial |W| at the largest weight decay vs none)", SRC,
                 "shrinks it again",
                 lambda m: f"{_mean(m, f'train.{_wd_name(max(_wds(m)))}.norm_ratio'):.3f} vs {_mean(m, 'train.wd0.norm_ratio'):.3f}",
                 lambda m: bool(_mean(m, f"train.{_wd_name(max(_wds(m)))}.norm_ratio") < _mean(m, "train.wd0.norm_ratio"))),
]


def report_section(m: dict) -> str:
    lines = ["| weight decay | final/initial abs(W) | eff. lr final/initial | angle/step last/first epoch | "
             "gradient at unit length last/first epoch | angle vs arctan prediction (max rel. dev.) | final train error % |",
             "|---|---|---|---|---|---|---|"]
    for wd in _wds(m):
        p = f"train.{_wd_name(wd)}."
        lines.append(f"| {wd:g} | {_mean(m, p + 'norm_ratio'):.3f} | {_mean(m, p + 'eff_lr_ratio'):.3f} | "
                     f"{_mean(m, p + 'angle_ratio'):.3f} | {_mean(m, p + 'unit_grad_ratio'):.3f} | {np.max(m[p + 'angle_vs_prediction']):.1e} | "
                     f"{_mean(m, p + 'final_train_error_pct'):.2f} |")
    return "\n".join(lines)


# ---- figure ------------------------------------------------------------------------------------------


def plot(m: dict, config, path) -> None:
    plt = common.pyplot()

    fig, axes = plt.subplots(2, 2, figsize=(13, 10))
    colours = plt.cm.viridis(np.linspace(0, 0.85, len(config.weight_decays)))
    steps_per_epoch = len(load_dataset(config.data).y_train) // config.train.batch_size
    for wd, col in zip(config.weight_decays, colours):
        p = f"train.{_wd_name(wd)}."
        norm, angle, eff = (np.asarray(m[p + k], float) for k in ("norm", "angle", "eff_lr"))
        e_norm = np.arange(norm.shape[1])
        e = np.arange(1, angle.shape[1] + 1)
        dots = dict(marker="o", ms=4) if len(e) < 8 else {}  # a few epochs: each one visible (one epoch: a point)
        for s in range(norm.shape[0]):
            lab = f"weight decay {wd:g}" if s == 0 else None
            axes[0, 1].plot(e_norm, norm[s], color=col, label=lab, **dots)
            axes[1, 0].plot(e, np.degrees(angle[s]), color=col, label=lab, **dots)
            axes[1, 1].plot(e, eff[s], color=col, label=lab, **dots)
    seeds = common.plural(config.num_seeds, "seed")
    axes[0, 1].set(xlabel="epoch (0 = initialisation; end of each epoch)",
                   ylabel="|W| (Frobenius norm; mean over hidden kernels)",
                   title=f"Weight norm during training (one line per seed, {seeds})")
    axes[1, 0].set(xlabel=f"epoch ({steps_per_epoch} SGD steps each)",
                   ylabel="angle turned per SGD step (degrees; epoch mean)", yscale="log",
                   title="Turning rate of the hidden kernels")
    axes[1, 1].set(xlabel=f"epoch ({steps_per_epoch} SGD steps each)",
                   ylabel="alpha / |W|^2 (epoch mean, mean over layers)", yscale="log",
                   title=f"Effective learning rate alpha / |W|^2 (alpha = {config.train.learning_rate:g})")
    ax = axes[0, 0]
    x = np.arange(len(config.scales))
    for name, ls in (("eps0", "-"), ("eps_default", "--")):
        for i, mk in zip(IDENTITIES, "osD^"):
            v = np.maximum(np.asarray(m[f"identities.{name}.{i}.by_scale"], float), 1e-12)
            ax.plot(x, v, ls, marker=mk, label=f"{i} ({'epsilon 0' if name == 'eps0' else 'epsilon 1e-5'})")
    ax.set_xticks(x, [f"{a:g}" for a in config.scales])
    ax.set_xlim(-0.5, len(x) - 0.5)
    ax.set(xlabel="scale factor a (weights aW)", ylabel="largest relative deviation (exact 0 drawn at 1e-12)",
           yscale="log")
    ax.set_title(f"The four identities: {common.plural(config.num_draws, 'draw')} x {common.plural(config.depth, 'layer')}, "
                 f"width {config.width}, batch {config.batch}\n(loss: |L(aW)-L(W)|/L; grad: |g(aW)-g(W)/a|/|g(W)/a|;\n"
                 f"cosine: |W.g|/|W||g|; step at alpha {config.alpha:g})", fontsize=10)
    for a in axes.flat:
        a.grid(alpha=0.3, which="both")
    for a in (axes[0, 1], axes[1, 0], axes[1, 1]):
        common.integer_ticks(a)
    for a in axes.flat:
        common.legend_outside(a, ncol=2 if a is axes[0, 0] else 3)
    on = "kernels" if config.train.get("weight_decay_on", "kernels") == "kernels" else "every parameter"
    fig.suptitle(f"Lecture (seed 000), 'Scale invariance' (top left: identities, training mode, random init)\n"
                 f"Training: MNIST-1D, PlainMLP + BatchNorm depth {config.model.depth} width {config.model.width}, "
                 f"{common.describe_optimizer(config.train)}, batch {config.train.batch_size} ({steps_per_epoch} steps/epoch),\n"
                 f"{common.plural(config.train.epochs, 'epoch')}, L2 weight decay "
                 f"{', '.join(f'{wd:g}' for wd in config.weight_decays)} on {on}, {seeds}")
    common.save_figure(fig, path, dpi=100)


if __name__ == "__main__":
    common.main(__name__)
