"""Shattered gradients: autocorrelation of dy/dx along the input (lecture 000, "Shattered gradients",
"Gradients along the input", "Reading the autocorrelation").

Settings the lecture states: one input, one output, width 200, ReLU, weights and biases drawn at variance
1/fan-in (normal), at initialisation; a shallow network (one hidden layer), a 24-layer plain network, and
a 24-block residual network whose branches are scaled by 1/sqrt(24); the autocorrelation of dy/dx
against input distance averaged over 20 networks; the distance where it falls below one half (lecture:
0.46 shallow, 0.18 deep plain, 0.40 scaled residual); and the deep plain network with variance 1/200 in
its input layer (lecture: 0.31).

The lecture's source is the udlbook's Notebook 11.1 "Shattered gradients" (udlbook/udlbook,
``Notebooks/Chap11/11_1_Shattered_Gradients.ipynb``, read at the repository's newest snapshot, January
2026). What it does, and what is taken from it here:

- network: ``K`` hidden layers of ``D = 200`` ReLU units: weight matrices 1 -> D, (K - 1) x D -> D,
  D -> 1, each layer ``f = b + W h`` then ReLU, linear output. "24 hidden layers" is therefore K = 24:
  a 1 -> 200 stem and 23 200 -> 200 layers (``PlainMLP(depth=23)``; the ``plain_hidden_layers`` setting
  counts the stem's layer, as the notebook's K does); the shallow network is K = 1 (1 -> 200 -> 1);
- initialisation: the notebook draws EVERY weight and bias, the input layer's included, from
  N(0, 1/D) = N(0, 1/200) ("Glorot initialization"). The lecture's main setting is variance 1/fan-in
  (input layer: fan-in 1, variance 1), and it names the notebook's 1/200 input layer as the variant, so
  the variant ``deep_plain_input_var_1_over_width`` is the notebook's own network. Here the variant
  reuses the deep plain networks' draws with the input layer's weights and bias multiplied by
  sqrt(1/width), so the two differ only in the input layer's scale;
- grid: ``np.arange(-2, 2, 4/256)``: 256 points on [-2, 2), spacing 1/64 (kept: ``grid_points=256``);
- gradient: a hand-written backward pass (checked against a finite difference at one point); here
  ``jax.grad`` vmapped over the grid and over 20 networks;
- autocorrelation: left as a TODO ("use the numpy function correlate with the mode set to 'same'"),
  normalised by its value at lag 0 (``ac / ac[128]``) and plotted for lags 0..127 (distance 0 to 2).
  That is the uncentred SUM over overlapping pairs divided by the lag-0 sum: the ``notebook`` estimator
  here. The notebook shows ONE network per depth (seed 1) and K = 1 and 50; it has no residual network,
  no average over networks, no half-correlation distance and no 1/200 variant, and its author notes he
  does not find it a convincing replication of Balduzzi et al. (2017). The lecture's numbers therefore
  come from code beyond the notebook, which is not available.

Settings the lecture and the notebook leave open, and what is used:

- residual network: the udlbook's residual MLP form (Notebook 11.2, figure 11.5b: a linear stem, then
  blocks "ReLU + linear", then a linear head), i.e. ``ResidualMLP(order='pre')``:
  ``h_0 = A x + a``, ``h_k = h_(k-1) + (1/sqrt(24)) (W_k relu(h_(k-1)) + b_k)``, ``y = w . h_24 + c``;
  24 blocks of one 200 -> 200 layer each, every weight and bias at variance 1/fan-in (the branch scale
  multiplies the branch's bias too). ``--residual_order post`` gives ``relu(h + s (W h + b))`` instead;
- lags: 0 .. grid_points/2 (distance 0 to 2, as the notebook's plot); the curves are averaged over the
  networks first, then the half-correlation distance is read off the average by linear interpolation
  between grid lags (the lecture: "averaged over these 20 networks, correlation drops below one half at
  distance ..."); each network's own distance is reported as well (beyond the lecture);
- matmul precision 'highest' (the gradient is a product of 25 matrices; no TF32 on GPUs).

Default estimator, chosen BEFORE any number was measured: ``pearson``. The lecture defines the
autocorrelation at distance delta as "the correlation between dy/dx at x and at x + delta, over all x":
that is the Pearson correlation of the pairs (dy/dx(x), dy/dx(x + delta)) over the x where both exist,
which is what ``pearson`` computes at each lag. The alternatives measure something else: ``raw`` and
``notebook`` are uncentred, so a gradient with a non-zero mean level (a shallow ReLU network's dy/dx is
piecewise constant around a level set by its output weights) keeps them high however quickly its
fluctuations decorrelate, and ``notebook`` additionally falls by (n - l)/n from the shrinking overlap
alone (it reaches 0.5 at distance 2 for any signal); ``mean_subtracted`` is the textbook ACF estimator and
close to ``pearson`` at short lags, but it centres and scales with whole-signal statistics rather than
those of the pairs at each lag, so it is not the correlation the lecture names. Every estimator's numbers
are reported (``half_correlation_distance_by_estimator.*``, the report table) whichever agrees best.

Metrics: ``half_correlation_distance.<network>`` (default estimator) and
``half_correlation_distance_by_estimator.<estimator>.<network>`` for the networks ``shallow``,
``deep_plain``, ``residual_scaled``, ``deep_plain_input_var_1_over_width``; the averaged curves
``autocorrelation.<network>`` (default) and ``autocorrelation_by_estimator.<estimator>.<network>`` against
``autocorrelation_distance``; ``half_correlation_distance_per_network.<network>`` (default estimator, one
per network); ``undefined_networks.<network>`` (networks whose default-estimator curve is undefined, e.g. a
constant dy/dx, left out of the average); and the figure's single-network gradients ``dydx_example.*``.

Beyond the lecture: ``repeats`` (default 5) independent sets of ``num_networks`` networks, each averaged and
read off like the main one (``half_correlation_distance_repeats.<estimator>.<network>``, set 0 = the
result), to show how much a 20-network average moves from one draw of networks to the next; the claims
use set 0 only.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from experiments import common
from resjax.analysis import shattering
from resjax.nn import PlainMLP, ResidualMLP, get_initializer
from resjax.nn.init import get_bias_initializer

NAME = "shattered_gradients"
NETWORKS = ("shallow", "deep_plain", "residual_scaled", "deep_plain_input_var_1_over_width")
LECTURE = {"shallow": 0.46, "deep_plain": 0.18, "residual_scaled": 0.40, "deep_plain_input_var_1_over_width": 0.31}
TOLERANCE = 0.05
DEFAULT_ESTIMATOR = "pearson"


HELP = {
    "width": "hidden width D of every network (units per layer; the lecture's 200)",
    "plain_hidden_layers": "hidden layers K of the deep plain network, the stem's included (the notebook's K; the "
                           "lecture's 24); at least 2",
    "residual_blocks": "residual blocks of the scaled residual network (the lecture's 24)",
    "residual_order": "the residual block's form: 'pre' (h + s (W relu(h) + b), the udlbook's) or 'post' "
                      "(relu(h + s (W h + b)))",
    "branch_scale": "the residual branches' scale s: a number or a rule of K, the number of blocks, e.g. "
                    "'1/sqrt(K)' (the lecture's), '1', '0.5'",
    "num_networks": "random networks per kind; the autocorrelation is averaged over them (the lecture's 20)",
    "grid_points": "inputs x on the grid [grid_low, grid_high) where dy/dx is taken (the notebook's 256)",
    "grid_low": "the grid's first input x",
    "grid_high": "the grid's end (excluded): inputs x in [grid_low, grid_high)",
    "estimator": "the autocorrelation estimator of the claims and figure: 'pearson' (default), 'mean_subtracted', "
                 "'raw' or 'notebook' (every one is reported; see the docstring)",
    "repeats": "independent sets of num_networks networks (set 1 is the result; the others show its sampling spread)",
}


def get_config(size: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.width = 200
    c.plain_hidden_layers = 24  # hidden layers including the stem's (the notebook's K): PlainMLP depth K - 1
    c.residual_blocks = 24
    c.residual_order = "pre"
    c.branch_scale = "1/sqrt(K)"
    c.num_networks = 20
    c.grid_points = 256
    c.grid_low = -2.0
    c.grid_high = 2.0
    c.estimator = DEFAULT_ESTIMATOR
    c.seed = 0
    c.repeats = 5  # independent sets of num_networks networks; the first is the result, the rest its spread
    if size == "quick":
        c.num_networks, c.grid_points, c.plain_hidden_layers, c.residual_blocks, c.repeats = 3, 64, 6, 6, 2
    return c


# ---- networks ----------------------------------------------------------------------------------------


class OneHiddenLayer(nn.Module):
    """The shallow network: ``in -> width`` ReLU layer and a linear head (``PlainMLP`` has at least one
    width-to-width layer)."""

    width: int
    num_outputs: int = 1
    kernel_init: str = "fan_in"
    bias_init: str = "fan_in"

    @nn.compact
    def __call__(self, x, train: bool = False):
        k = get_initializer(self.kernel_init)
        h = nn.relu(nn.Dense(self.width, kernel_init=k, bias_init=get_bias_initializer(self.bias_init, x.shape[-1]),
                             name="stem")(x))
        return nn.Dense(self.num_outputs, kernel_init=k, bias_init=get_bias_initializer(self.bias_init, self.width),
                        name="head")(h)


def check(config) -> None:
    """Every bad setting raises ``ValueError`` naming it, before anything compiles."""
    for name in ("width", "plain_hidden_layers", "residual_blocks", "num_networks", "repeats"):
        v = config[name]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}: must be an integer >= 1, got {v!r}")
    if config.plain_hidden_layers < 2:
        raise ValueError(f"plain_hidden_layers: the deep plain network needs >= 2 hidden layers, got {config.plain_hidden_layers}")
    shattering.make_grid(config.grid_points, config.grid_low, config.grid_high)
    shattering.check_estimator(config.estimator)
    if config.residual_order not in ("pre", "post"):
        raise ValueError(f"residual_order: choose 'pre' or 'post', got {config.residual_order!r}")


def build_networks(config) -> dict:
    common_kw = dict(num_classes=1, kernel_init="fan_in", bias_init="fan_in")
    return {
        "shallow": OneHiddenLayer(config.width),
        "deep_plain": PlainMLP(width=config.width, depth=config.plain_hidden_layers - 1, **common_kw),
        "residual_scaled": ResidualMLP(width=config.width, num_blocks=config.residual_blocks,
                                       order=config.residual_order, scaling="tau", tau=config.branch_scale,
                                       **common_kw),
    }


def scale_input_layer(variables, variance: float):
    """The deep plain draws with the input layer's weights and bias (drawn at variance 1 = 1/fan-in for a
    scalar input) rescaled to ``variance``."""
    params = dict(variables["params"])
    params["stem"] = jax.tree_util.tree_map(lambda a: a * math.sqrt(variance), params["stem"])
    return {**variables, "params": params}


def measure_gradients(config) -> tuple[np.ndarray, dict]:
    """The grid and dy/dx of ``repeats`` sets of ``num_networks`` draws of each network:
    ``{network: (repeats, networks, points)}``. Set 0 is drawn from ``fold_in(key(seed), network index)``
    alone, so the result does not depend on ``repeats``; the other sets come from a separate key."""
    grid = shattering.make_grid(config.grid_points, config.grid_low, config.grid_high)
    key = jax.random.key(config.seed)
    n, r = config.num_networks, config.repeats
    grads = {}
    with jax.default_matmul_precision("highest"):
        for i, (name, module) in enumerate(build_networks(config).items()):
            variables = shattering.init_many(module, jax.random.fold_in(key, i), n)
            if r > 1:
                extra = shattering.init_many(module, jax.random.fold_in(jax.random.fold_in(key, i), 1_000_003), n * (r - 1))
                variables = jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a, b]), variables, extra)
            grads[name] = np.asarray(shattering.input_gradients_many(module, variables, grid)).reshape(r, n, -1)
            if name == "deep_plain":
                scaled = scale_input_layer(variables, 1.0 / config.width)
                grads["deep_plain_input_var_1_over_width"] = np.asarray(
                    shattering.input_gradients_many(module, scaled, grid)).reshape(r, n, -1)
    return np.asarray(grid), grads


# ---- claims ------------------------------------------------------------------------------------------


def _hcd(m: dict, net: str) -> float:
    v = m[f"half_correlation_distance.{net}"]
    return float("nan") if v is None else float(v)


def _ordering(m: dict) -> bool:
    s, r, v, d = (_hcd(m, n) for n in ("shallow", "residual_scaled", "deep_plain_input_var_1_over_width", "deep_plain"))
    return bool(s > r > v > d)


SRC = "000 lecture, Reading the autocorrelation"
_TEXTS = {
    "shallow": "half-correlation distance, shallow network (1 hidden layer), mean of 20 networks",
    "deep_plain": "half-correlation distance, 24-layer plain network, mean of 20 networks",
    "residual_scaled": "half-correlation distance, 24-block residual network, branches x 1/sqrt(24)",
    "deep_plain_input_var_1_over_width": "half-correlation distance, 24-layer plain network, input layer at variance 1/200",
}


def _claim(net: str) -> common.Claim:
    own = {"deep_plain": ("plain_hidden_layers",), "deep_plain_input_var_1_over_width": ("plain_hidden_layers",),
           "residual_scaled": ("residual_blocks", "branch_scale", "residual_order")}.get(net, ())
    return common.Claim(f"{_TEXTS[net]} (holds within {TOLERANCE})", SRC, f"{LECTURE[net]:.2f}",
                        lambda m: f"{_hcd(m, net):.3f}",
                        lambda m: bool(abs(_hcd(m, net) - LECTURE[net]) <= TOLERANCE),
                        settings=("width", *own, "num_networks", "grid_points", "estimator"))


CLAIMS = [_claim(n) for n in NETWORKS] + [
    common.Claim("ordering of half-correlation distances: shallow > residual > 1/200 variant > deep plain", SRC,
                 "0.46 > 0.40 > 0.31 > 0.18",
                 lambda m: " > ".join(f"{_hcd(m, n):.3f}" for n in
                                      ("shallow", "residual_scaled", "deep_plain_input_var_1_over_width", "deep_plain")),
                 _ordering),
]


#: The settings the claims' texts state ("24-layer", "mean of 20 networks"): the report names this run's where they differ.
CLAIM_SETTINGS = ("width", "plain_hidden_layers", "residual_blocks", "branch_scale", "residual_order", "num_networks",
                  "grid_points", "estimator")


def report_section(m: dict) -> str:
    """Every estimator's half-correlation distances beside the lecture's, and the spread over networks."""
    ests = [e for e in shattering.ESTIMATORS if f"half_correlation_distance_by_estimator.{e}.shallow" in m]
    default = next((e for e in ests if all(m[f"half_correlation_distance_by_estimator.{e}.{n}"] == m[f"half_correlation_distance.{n}"]
                                          for n in NETWORKS)), None)

    def fmt(v):
        return "n/a" if v is None or not np.isfinite(v) else f"{v:.3f}"

    lines = ["Half-correlation distance (input distance where the autocorrelation of dy/dx, averaged over the "
             "networks, first falls below 0.5), under every estimator (see the experiment's docstring).", "",
             "| estimator | " + " | ".join(NETWORKS) + " | lecture order holds |", "|---" * (len(NETWORKS) + 2) + "|",
             "| lecture | " + " | ".join(f"{LECTURE[n]:.2f}" for n in NETWORKS) + " | yes |"]
    for e in ests:
        vals = {n: m[f"half_correlation_distance_by_estimator.{e}.{n}"] for n in NETWORKS}
        vals = {n: float("nan") if v is None else float(v) for n, v in vals.items()}
        order = vals["shallow"] > vals["residual_scaled"] > vals["deep_plain_input_var_1_over_width"] > vals["deep_plain"]
        name = f"{e} (default)" if e == default else e
        lines.append(f"| {name} | " + " | ".join(fmt(vals[n]) for n in NETWORKS) + f" | {'yes' if order else 'no'} |")
    held = [n for n in NETWORKS if abs(_hcd(m, n) - LECTURE[n]) <= TOLERANCE]
    missed = [f"{n} {_hcd(m, n):.3f} vs {LECTURE[n]:.2f}" for n in NETWORKS if n not in held]
    lines += ["", f"Under the default estimator {len(held)} of the lecture's 4 numbers come out within {TOLERANCE}"
              + (f"; not reproduced: {', '.join(missed)}." if missed else ".")
              + f" The lecture's ordering {'holds' if _ordering(m) else 'does not hold'}."]
    per = [n for n in NETWORKS if f"half_correlation_distance_per_network.{n}" in m]
    if per:
        lines += ["", "Spread over networks (default estimator, each network's own curve): median [10th, 90th "
                  "percentile]: " + "; ".join(
                      f"{n} {np.nanmedian(_arr(m, n)):.3f} [{np.nanpercentile(_arr(m, n), 10):.3f}, "
                      f"{np.nanpercentile(_arr(m, n), 90):.3f}]" for n in per)]
    reps = {e: {n: _arr(m, n, f"half_correlation_distance_repeats.{e}") for n in NETWORKS} for e in ests
            if f"half_correlation_distance_repeats.{e}.shallow" in m}
    if reps and len(next(iter(reps.values()))["shallow"]) > 1:
        r = len(next(iter(reps.values()))["shallow"])
        lines += ["", f"Sampling spread of the network-averaged distance: {r} independent sets of networks (set 1 "
                  "is the result above), mean +- standard deviation over sets [min, max]:", "",
                  "| estimator | " + " | ".join(NETWORKS) + " |", "|---" * (len(NETWORKS) + 1) + "|"]
        for e, vals in reps.items():
            lines.append(f"| {e} | " + " | ".join(
                f"{np.nanmean(v):.3f} +- {_sd(v)} [{np.nanmin(v):.2f}, {np.nanmax(v):.2f}]"
                + (f" ({int(np.isnan(v).sum())} n/a)" if np.isnan(v).any() else "") for v in vals.values()) + " |")
    return "\n".join(lines)


def _sd(v) -> str:
    v = v[np.isfinite(v)]
    return f"{np.std(v, ddof=1):.3f}" if v.size > 1 else "n/a"


def _arr(m, n, prefix="half_correlation_distance_per_network"):
    return np.array([np.nan if v is None else v for v in m[f"{prefix}.{n}"]], float)


# ---- running -----------------------------------------------------------------------------------------


def run(config, out_dir) -> dict:
    check(config)
    grid, grads = measure_gradients(config)
    spacing = (config.grid_high - config.grid_low) / config.grid_points
    max_lag = config.grid_points // 2
    out: dict = {}
    for est in shattering.ESTIMATORS:
        for net in NETWORKS:
            out[f"half_correlation_distance_repeats.{est}.{net}"] = [
                shattering.shattering_statistics(g, spacing, max_lag, est)["half_distance"] for g in grads[net]]
            stats = shattering.shattering_statistics(grads[net][0], spacing, max_lag, est)
            out[f"half_correlation_distance_by_estimator.{est}.{net}"] = stats["half_distance"]
            out[f"autocorrelation_by_estimator.{est}.{net}"] = stats["mean_curve"]
            if est == config.estimator:
                out[f"half_correlation_distance.{net}"] = stats["half_distance"]
                out[f"autocorrelation.{net}"] = stats["mean_curve"]
                out[f"half_correlation_distance_per_network.{net}"] = stats["half_distance_per_network"]
                out[f"undefined_networks.{net}"] = stats["num_undefined"]
                out["autocorrelation_distance"] = stats["distances"]
    out["dydx_example.x"] = grid
    out["dydx_example.shallow"] = grads["shallow"][0, 0]
    out["dydx_example.deep_plain"] = grads["deep_plain"][0, 0]
    plot(out, config, out_dir / f"{NAME}.png")
    return out


# ---- figure ------------------------------------------------------------------------------------------

COLOURS = {"shallow": "tab:blue", "deep_plain": "tab:red", "residual_scaled": "tab:green",
           "deep_plain_input_var_1_over_width": "tab:orange"}


def labels(config) -> dict[str, str]:
    """Each network as this run built it (layer counts, branch scale, input variance from ``config``)."""
    k, b, scale = config.plain_hidden_layers, config.residual_blocks, str(config.branch_scale)
    scale = scale.replace("K", str(b)) if "K" in scale else scale
    order = "" if config.residual_order == "pre" else f" ({config.residual_order}-activation)"
    return {"shallow": "shallow (1 hidden layer)", "deep_plain": f"plain, {k} hidden layers",
            "residual_scaled": f"residual{order}, {b} blocks, branches x {scale}",
            "deep_plain_input_var_1_over_width": f"plain {k}, input layer variance 1/{config.width}"}


LECTURE_SETTINGS = {"shallow": "width 200", "deep_plain": "24 layers, width 200",
                    "residual_scaled": "24 blocks x 1/sqrt(24), width 200",
                    "deep_plain_input_var_1_over_width": "24 layers, 1/200"}


def at_lecture_settings(config, net: str) -> bool:
    """Whether this run's ``net`` is the network the lecture's number is about (width 200, 24 layers or blocks,
    branches x 1/sqrt(24), pre-activation)."""
    lecture = get_config("default")
    same = ["width"] + {"deep_plain": ["plain_hidden_layers"], "deep_plain_input_var_1_over_width": ["plain_hidden_layers"],
                        "residual_scaled": ["residual_blocks", "branch_scale", "residual_order"]}.get(net, [])
    return all(config[k] == lecture[k] for k in same)


def plot(m: dict, config, path) -> None:
    plt = common.pyplot()

    names = labels(config)
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.6))
    x = np.asarray(m["dydx_example.x"])
    for ax, net in zip(axes[:2], ("shallow", "deep_plain")):
        ax.plot(x, np.asarray(m[f"dydx_example.{net}"]), color=COLOURS[net], lw=1)
        ax.set_xlim(config.grid_low, config.grid_high)
        ax.set_xlabel("input x")
        ax.set_ylabel("dy/dx (own scale)")
        ax.set_title(f"dy/dx of one {names[net]} network", fontsize=10)
        ax.grid(alpha=0.3)
    ax = axes[2]
    d = np.asarray(m["autocorrelation_distance"])
    for net in NETWORKS:
        h = m[f"half_correlation_distance.{net}"]
        hs = "n/a" if h is None or not np.isfinite(h) else f"{h:.2f}"
        ls = "--" if net == "deep_plain_input_var_1_over_width" else "-"
        lecture = (f"lecture {LECTURE[net]:.2f}" if at_lecture_settings(config, net) else
                   f"lecture, {LECTURE_SETTINGS[net]}: {LECTURE[net]:.2f}")
        ax.plot(d, np.asarray(m[f"autocorrelation.{net}"]), color=COLOURS[net], ls=ls,
                label=f"{names[net]}: {hs} ({lecture})")
        if h is not None and np.isfinite(h):
            ax.plot([h], [0.5], "o", color=COLOURS[net], ms=4)
    ax.axhline(0.5, color="k", ls=":", lw=1)
    ax.set_xlim(0, d[-1])
    ax.set_xlabel("input distance delta")
    ax.set_ylabel(f"autocorrelation of dy/dx ({config.estimator})")
    ax.set_title(f"autocorrelation ({config.estimator}), mean of {config.num_networks} networks; dotted: 0.5",
                 fontsize=10)
    common.legend_outside(ax, ncol=1, title="half-correlation distance (dots)", title_fontsize=7)
    ax.grid(alpha=0.3)
    fig.suptitle(f"Shattered gradients (reproduces the lecture's figure 'Gradients along the input'): width "
                 f"{config.width}, weights and biases at variance 1/fan-in, {config.grid_points} inputs on "
                 f"[{config.grid_low:g}, {config.grid_high:g})", fontsize=10)
    common.save_figure(fig, path)


if __name__ == "__main__":
    common.main(__name__)
