"""Normalisation axes: which values share one mean and variance in BatchNorm, LayerNorm, GroupNorm
and InstanceNorm (lecture 000, "Normalisation choices", "Limits of batch statistics", "Normalisation
schemes", "Normalisation axes").

The lecture's table, for activations (B, C, H, W): BatchNorm over the batch and spatial positions,
per channel; LayerNorm over the channels and positions of each example; GroupNorm over a group of
channels and the positions of each example; InstanceNorm over the positions of each channel of each
example.

Layout: flax (and so resjax) is channels-last, so the lecture's (B, C, H, W) is flax's (B, H, W, C):
NCHW axes (0, 1, 2, 3) are NHWC axes (0, 3, 1, 2). Inputs here are drawn in the lecture's NCHW and
moved with ``np.moveaxis(x, 1, -1)`` (``resjax.analysis.batchnorm.nchw_to_nhwc``); axes are reported
in both numberings.

The layers are resjax's own (``make_norm(kind)``, flax underneath) with their defaults, except:

- LayerNorm: ``make_norm('layer')`` keeps flax's default ``reduction_axes=-1``, the channels only: on a
  4-d activation that normalises each example *at each position* separately (the Transformer
  convention, one token at a time; on an MLP's (B, D) it is the lecture's LayerNorm). The lecture's
  LayerNorm over channels and positions is ``make_norm('layer', reduction_axes=(1, 2, 3))``. Both are
  measured: ``layer`` (the lecture's) and ``layer_default`` (resjax's default);
- GroupNorm: ``num_groups`` is set to fit the channels (2 groups in the figure's 6 channels, 4 in
  the check's 16; ``make_norm``'s default, 32, needs 32 | C);
- BatchNorm runs in training mode (batch statistics); all at epsilon 1e-5, scale 1, offset 0.

The figure is generated from what the layers do, not from the table: two values share one mean and
variance exactly when the layer's output at one depends on its input at the other, so each layer's
groups are the connected components of its Jacobian (``groups_from_layer``) on a (4, 6, 3, 3) NCHW
activation; one group (the one holding example 1, channel 1, position (1, 1), counting from 0) is shaded.

Metrics, per layer ``batch, layer, layer_default, group, instance``: ``axes_nchw.*`` and
``axes_nhwc.*`` (the reduced axes, ``reduction_axes``; GroupNorm also reduces within its group of
channels), ``same_groups.*`` (1 if the Jacobian's groups equal the documented ones, figure shape),
``num_groups.*`` and ``group_size.*`` (how many means, over how many values each),
``max_abs_diff.*`` (the layer's output against the numpy (float64) standardisation over the
documented groups, on an (8, 16, 5, 5) activation with a different offset and scale per channel and
example; ``--quick`` checks on the figure's activation), and ``max_abs_diff.batch_stats_{mean,var}`` (BatchNorm's stored statistics at rho = 1
against numpy's mean and population variance over (B, H, W)). Seed 0, ``jax.random.key``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from experiments import common
from resjax.analysis import batchnorm as bn

NAME = "normalisation_axes"
LAYERS = {  # name -> (kind, layer_axes)
    "batch": ("batch", "position"),
    "layer": ("layer", "example"),
    "layer_default": ("layer", "position"),
    "group": ("group", "position"),
    "instance": ("instance", "position"),
}
TITLES = {"batch": "BatchNorm", "layer": "LayerNorm (lecture: reduction_axes=(1, 2, 3))",
          "layer_default": "LayerNorm (resjax/flax default: channels only)", "group": "GroupNorm",
          "instance": "InstanceNorm"}


HELP = {
    "figure_shape": "the figure's activation shape (B, C, H, W), in the lecture's NCHW order",
    "figure_groups": "GroupNorm's groups in the figure (must divide C of figure_shape)",
    "check_shape": "the numeric check's activation shape (B, C, H, W)",
    "check_groups": "GroupNorm's groups in the numeric check (must divide C of check_shape)",
    "epsilon": "every layer's epsilon, added to the variance",
}


def get_config(size: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.figure_shape = (4, 6, 3, 3)  # (B, C, H, W)
    c.figure_groups = 2
    c.check_shape = (8, 16, 5, 5)
    c.check_groups = 4
    c.epsilon = 1e-5
    c.seed = 0
    if size == "quick":  # the figure's activation only: one compiled layer each
        c.check_shape = c.figure_shape
        c.check_groups = c.figure_groups
    return c


@functools.lru_cache(maxsize=None)
def _layer_fn(name, groups, epsilon):
    kind, layer_axes = LAYERS[name]
    overrides = {**bn.layer_overrides(kind, layer_axes, groups), "epsilon": epsilon}
    return jax.jit(lambda x: bn.apply_norm(kind, x, train=True, **overrides)[0])


def _labels(name, shape_nhwc, groups):
    kind, layer_axes = LAYERS[name]
    return bn.statistic_groups(kind, shape_nhwc, num_groups=groups, layer_axes=layer_axes)


def _draw(key, shape_nchw):
    k1, k2, k3 = jax.random.split(key, 3)
    B, C = shape_nchw[:2]
    offset = 3 * jax.random.normal(k1, (B, C, 1, 1))
    scale = jnp.exp(jax.random.normal(k2, (B, C, 1, 1)))
    return np.asarray(offset + scale * jax.random.normal(k3, shape_nchw), np.float32)


def check(config) -> None:
    """The preflight hook (``experiments.common.preflight``): (B, C, H, W) shapes and group counts that divide the channels."""
    for setting in ("figure_shape", "check_shape"):
        shape = tuple(config[setting])
        if len(shape) != 4 or min(shape) < 1:
            raise ValueError(f"{setting}: a (B, C, H, W) shape of positive sizes, got {shape}")
    for setting, shape in (("figure_groups", config.figure_shape), ("check_groups", config.check_shape)):
        g = config[setting]
        if g < 1 or shape[1] % g:
            raise ValueError(f"{setting}: num_groups {g} must divide the {shape[1]} channels")


def run(config, out_dir) -> dict:
    check(config)
    key_fig, key_check = jax.random.split(jax.random.key(config.seed))
    out: dict = {}
    x_fig = bn.nchw_to_nhwc(_draw(key_fig, tuple(config.figure_shape)))
    x_chk = bn.nchw_to_nhwc(_draw(key_check, tuple(config.check_shape)))
    figure_groups = {}
    for name, (kind, layer_axes) in LAYERS.items():
        out[f"axes_nchw.{name}"] = list(bn.reduction_axes(kind, "NCHW", layer_axes))
        out[f"axes_nhwc.{name}"] = list(bn.reduction_axes(kind, "NHWC", layer_axes))
        found = bn.groups_from_layer(_layer_fn(name, config.figure_groups, config.epsilon), x_fig)
        documented = _labels(name, x_fig.shape, config.figure_groups)
        figure_groups[name] = found
        out[f"same_groups.{name}"] = int(bn.same_partition(found, documented))
        labels = _labels(name, x_chk.shape, config.check_groups)
        y = np.asarray(_layer_fn(name, config.check_groups, config.epsilon)(x_chk))
        ref, _, _ = bn.normalise_by_groups(x_chk, labels, config.epsilon)
        out[f"max_abs_diff.{name}"] = float(np.max(np.abs(y - ref)))
        out[f"num_groups.{name}"] = int(labels.max() + 1)
        out[f"group_size.{name}"] = int(labels.size // (labels.max() + 1))
    _, stats = jax.jit(lambda x: bn.apply_norm("batch", x, train=True, rho=1.0, epsilon=config.epsilon))(x_chk)
    x64 = x_chk.astype(np.float64)
    out["max_abs_diff.batch_stats_mean"] = float(np.max(np.abs(np.asarray(stats["mean"]) - x64.mean((0, 1, 2)))))
    out["max_abs_diff.batch_stats_var"] = float(np.max(np.abs(np.asarray(stats["var"]) - x64.var((0, 1, 2)))))
    plot(figure_groups, config, out_dir / f"{NAME}.png")
    return out


# ---- claims ------------------------------------------------------------------------------------------

SRC = "000 lecture, Normalisation schemes"
STATEMENT = {
    "batch": "BatchNorm: batch and spatial positions, separately per channel",
    "layer": "LayerNorm: channels and spatial positions within each example",
    "group": "GroupNorm: groups of channels and spatial positions within each example",
    "instance": "InstanceNorm: spatial positions within each channel and example",
}


def _claim(name):
    return common.Claim(
        f"{STATEMENT[name]} (resjax's layer: statistics equal numpy's over those axes, and the layer's own "
        "Jacobian groups the values that way)", SRC, STATEMENT[name].split(": ")[1],
        lambda m: f"axes NCHW {tuple(m[f'axes_nchw.{name}'])}; max |layer - numpy| = "
                  f"{m[f'max_abs_diff.{name}']:.2g}; groups match: {bool(m[f'same_groups.{name}'])}",
        lambda m: bool(m[f"max_abs_diff.{name}"] <= 1e-4 and m[f"same_groups.{name}"] == 1))


CLAIMS = [_claim(n) for n in STATEMENT] + [
    common.Claim("resjax's default LayerNorm (flax's reduction_axes=-1) on a 4-d activation normalises each "
                 "position of each example over its channels only, not the lecture's whole example",
                 "flax.linen.LayerNorm documentation", "channels only",
                 lambda m: f"axes NCHW {tuple(m['axes_nchw.layer_default'])}; {m['num_groups.layer_default']} means of "
                           f"{m['group_size.layer_default']} values; max |layer - numpy| = "
                           f"{m['max_abs_diff.layer_default']:.2g}",
                 lambda m: bool(m["max_abs_diff.layer_default"] <= 1e-4 and m["same_groups.layer_default"] == 1)),
]


def report_section(m: dict) -> str:
    lines = ["Lecture layout (B, C, H, W) = flax's (B, H, W, C), NCHW axis i -> NHWC axis (0, 3, 1, 2)[i].", "",
             "| layer | axes (NCHW) | axes (NHWC) | means x values each | max abs diff vs numpy | Jacobian groups match |",
             "|---|---|---|---|---|---|"]
    for name in LAYERS:
        lines.append(f"| {TITLES[name]} | {tuple(m[f'axes_nchw.{name}'])} | {tuple(m[f'axes_nhwc.{name}'])} | "
                     f"{m[f'num_groups.{name}']} x {m[f'group_size.{name}']} | {m[f'max_abs_diff.{name}']:.2g} | "
                     f"{bool(m[f'same_groups.{name}'])} |")
    lines += ["", "GroupNorm also reduces over the channels of one group only. BatchNorm's stored statistics "
                  f"(rho = 1): max |mean - numpy| = {m['max_abs_diff.batch_stats_mean']:.2g}, "
                  f"|var - numpy| = {m['max_abs_diff.batch_stats_var']:.2g}. The larger float32 differences (InstanceNorm's "
                  "25-value groups) come from flax's single-pass variance E[x^2] - E[x]^2 "
                  "(``use_fast_variance=True``), which loses digits when a group's mean is large against its spread."]
    return "\n".join(lines)


# ---- figure ------------------------------------------------------------------------------------------


def plot(groups: dict, config, path) -> None:
    plt = common.pyplot()

    B, C, H, W = config.figure_shape
    ref = (min(1, B - 1), min(1, H - 1), min(1, W - 1), min(1, C - 1))  # NHWC index of the reference value
    P = H * W
    fig = plt.figure(figsize=(4.4 * len(groups), 5.4))
    for i, (name, lab) in enumerate(groups.items()):
        ax = fig.add_subplot(1, len(groups), i + 1, projection="3d")
        shaded = lab == lab[ref]  # (B, H, W, C)
        # voxel grid indexed [channel, example, position]: the cube of Wu & He's GroupNorm figure
        s = shaded.reshape(B, P, C).transpose(2, 0, 1)
        ax.voxels(s, facecolors=(0.17, 0.45, 0.75, 0.9), edgecolors=(0.05, 0.15, 0.35, 0.8), linewidth=0.4)
        faint = dict(color="grey", lw=0.5, alpha=0.6)
        for c in range(C + 1):  # one faint line per channel, on the top, front and bottom faces
            ax.plot([c, c], [0, B], [P, P], **faint)
            ax.plot([c, c], [0, 0], [0, P], **faint)
            ax.plot([c, c], [0, B], [0, 0], **faint)
        for b in range(B + 1):  # one per example, on the top, side and bottom faces
            ax.plot([0, C], [b, b], [P, P], **faint)
            ax.plot([C, C], [b, b], [0, P], **faint)
            ax.plot([0, C], [b, b], [0, 0], **faint)
        for z in range(P + 1):  # and one per position, on the front and side faces
            ax.plot([0, C], [0, 0], [z, z], color="grey", lw=0.3, alpha=0.35)
            ax.plot([C, C], [0, B], [z, z], color="grey", lw=0.3, alpha=0.35)
        ax.set_xlim(0, C)
        ax.set_ylim(0, B)
        ax.set_zlim(0, P)
        ax.set_box_aspect((C, B * 1.2, P * 0.8))
        ax.set_xlabel("channel c", fontsize=8)
        ax.set_ylabel("example b", fontsize=8)
        ax.set_zlabel(f"position (h, w), {H} x {W}", fontsize=8)
        ax.set_xticks(np.arange(C) + 0.5, range(C), fontsize=6)
        ax.set_yticks(np.arange(B) + 0.5, range(B), fontsize=6)
        ax.set_zticks(np.arange(P) + 0.5, range(P), fontsize=6)
        ax.view_init(elev=20, azim=-58)
        ax.grid(False)
        kind, layer_axes = LAYERS[name]
        axes = bn.reduction_axes(kind, "NCHW", layer_axes)
        extra = (f" (+ the {C // config.figure_groups} channels of a group, {config.figure_groups} groups)"
                 if kind == "group" else "")
        ax.set_title(f"{TITLES[name]}\nreduces over NCHW axes {axes}{extra}\n"
                     f"shaded: {int(shaded.sum())} values share one mean and variance", fontsize=8)
    fig.suptitle("Normalisation axes (lecture, seed 000, fig. 'Normalisation axes'), generated from each resjax "
                 f"layer's own Jacobian. Activation (B, C, H, W) = {tuple(config.figure_shape)}; flax holds it as "
                 f"(B, H, W, C). Shaded: the values whose one mean and variance normalise example {ref[0]}, channel "
                 f"{ref[3]}, position ({ref[1]}, {ref[2]}) (counting from 0).",
                 fontsize=9, y=0.98)
    fig.subplots_adjust(left=0.01, right=0.98, top=0.86, bottom=0.02, wspace=0.08)
    common.save_figure(fig, path, tight=False)


if __name__ == "__main__":
    common.main(__name__)
