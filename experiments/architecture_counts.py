"""Weights in a bottleneck and width in a dense block, counted from resjax's own modules (lecture 000,
"Bottleneck blocks", "Weights in a bottleneck", "DenseNet", "Width in a dense block").

Every count is read from a parameter tree of ``resjax.nn.conv_blocks`` built by ``jax.eval_shape`` (the
shapes of ``module.init``, without computing any draw): conv kernels only, biases and norm
parameters excluded.

- Basic branch (two 3x3 convs, 256 -> 256) against bottleneck branch (256 -> 64 -> 64 -> 256): the
  lecture's 1,179,648 against 69,632 (about 1/17), 47% of the bottleneck in its two 1x1 layers, its
  3x3 layer 1/32 of the basic branch.
- A dense block of 12 layers, growth rate 32, from 64 channels (no 1x1 bottleneck), against a residual
  stage of constant width 64 (12 3x3 convolutions 64 -> 64): channels entering each layer (416 at layer
  12) and the weights of each layer's 3x3 convolution (119,808 against 36,864 at layer 12; level at
  layer 3).

Metrics: ``bottleneck.{basic_weights,bottleneck_weights,one_by_one_share,ratio,three_by_three_fraction}``,
``dense.{channels_in,conv_weights}`` and ``residual_stage.{channels_in,conv_weights}`` (lists over layers
1..L), ``dense.level_layer`` (first layer where the dense 3x3 conv costs at least the residual one).
Nothing is random and nothing is trained; the result is the same at every size.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from experiments import common
from resjax.nn.conv_blocks import (
    BasicBranch,
    BottleneckBranch,
    ConvResidualBlock,
    DenseBlock,
    conv_kernel_weights,
)
from resjax.nn.unet import UNet

NAME = "architecture_counts"


HELP = {
    "channels": "channels C of the basic and bottleneck blocks compared (the lecture's 256)",
    "bottleneck": "the bottleneck block's inner channels (the lecture's 64)",
    "dense_layers": "layers L of the dense block",
    "growth_rate": "the dense block's growth rate g (channels each layer adds)",
    "dense_channels_in": "channels entering the dense block",
    "residual_width": "width of the residual stage the dense block is compared with",
    "spatial": "image height and width of the traced shapes (counts do not depend on it)",
    "unet_input": "the U-Net's input image size (pixels per side)",
    "unet_features": "the U-Net's channels per level, e.g. \"(64, 128, 256, 512)\"",
}


def get_config(size: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.channels = 256
    c.bottleneck = 64
    c.dense_layers = 12
    c.growth_rate = 32
    c.dense_channels_in = 64
    c.residual_width = 64
    c.spatial = 8  # only shapes are traced, so the image size does not matter
    c.unet_input = 224
    c.unet_features = (64, 128, 256, 512)
    return c  # the same at every size: shapes only


class ResidualStage(nn.Module):
    """``num_blocks`` post-activation basic residual blocks at constant width (identity skips)."""

    width: int
    num_blocks: int

    @nn.compact
    def __call__(self, x, train: bool = False):
        for b in range(self.num_blocks):
            x = ConvResidualBlock(BasicBranch(self.width), name=f"block_{b}")(x, train)
        return x


def param_shapes(module, channels: int, spatial: int):
    """The ``params`` tree of ``module`` on an input ``(1, spatial, spatial, channels)``, as shapes."""
    x = jax.ShapeDtypeStruct((1, spatial, spatial, channels), jnp.float32)
    return jax.eval_shape(lambda k, x: module.init(k, x, False), jax.random.PRNGKey(0), x)["params"]


def check(config) -> None:
    """The preflight hook (``experiments.common.preflight``): every setting is a size, an integer >= 1 (or a
    tuple of them)."""
    for name, value in common.flatten(config).items():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if not common.is_int(v) or v < 1:
                raise ValueError(f"{name}: every size must be an integer >= 1, got {v!r}")


def run(config, out_dir) -> dict:
    check(config)
    basic = conv_kernel_weights(param_shapes(BasicBranch(config.channels), config.channels, config.spatial))
    bott = conv_kernel_weights(param_shapes(BottleneckBranch(config.channels, config.bottleneck),
                                            config.channels, config.spatial))
    basic_total, bott_total = sum(basic.values()), sum(bott.values())
    one_by_one = bott["conv1x1_reduce"] + bott["conv1x1_restore"]

    L, g, c0 = config.dense_layers, config.growth_rate, config.dense_channels_in
    dense = param_shapes(DenseBlock(L, g, bottleneck=False), c0, config.spatial)
    dense_in = [int(dense[f"layer_{k}"]["conv3x3"]["kernel"].shape[2]) for k in range(L)]
    dense_w = [conv_kernel_weights(dense[f"layer_{k}"])["conv3x3"] for k in range(L)]
    # the residual stage of constant width: L/2 basic residual blocks, L 3x3 convolutions width -> width
    w = config.residual_width
    stage = conv_kernel_weights(param_shapes(ResidualStage(w, -(-L // 2)), w, config.spatial))
    res_w = list(stage.values())[:L]
    res_in = [int(v // (9 * w)) for v in res_w]  # a 3x3 kernel (3, 3, C_in, w) holds 9 * C_in * w weights
    level = next((k + 1 for k in range(L) if dense_w[k] >= res_w[k]), None)

    out = {
        "bottleneck.basic_weights": basic_total,
        "bottleneck.bottleneck_weights": bott_total,
        "bottleneck.one_by_one_share": one_by_one / bott_total,
        "bottleneck.ratio": basic_total / bott_total,
        "bottleneck.three_by_three_fraction": bott["conv3x3"] / basic_total,
        "bottleneck.layers.basic": [basic["conv3x3_0"], basic["conv3x3_1"]],
        "bottleneck.layers.bottleneck": [bott["conv1x1_reduce"], bott["conv3x3"], bott["conv1x1_restore"]],
        "dense.channels_in": dense_in,
        "dense.conv_weights": dense_w,
        "dense.level_layer": level,
        "residual_stage.channels_in": res_in,
        "residual_stage.conv_weights": res_w,
    }
    out.update(unet_skips(config))
    plot(out, config, out_dir / f"{NAME}.png")
    return out


def unet_skips(config) -> dict:
    """The spatial sizes and widths of ``UNet``'s skips, read from its own sown intermediates (shapes only)."""
    unet = UNet(features=tuple(config.unet_features), out_channels=1)
    x = jnp.zeros((1, config.unet_input, config.unet_input, 3))

    def forward():
        return unet.apply(unet.init(jax.random.key(0), x, False), x, False, mutable=["intermediates"])

    out, state = jax.eval_shape(forward)
    skips = [state["intermediates"][f"skip_{i}"][0].shape for i in range(len(config.unet_features) - 1)]
    return {"unet.skip_sizes": [int(s[1]) for s in skips], "unet.skip_channels": [int(s[3]) for s in skips],
            "unet.bottleneck_size": config.unet_input // 2 ** (len(config.unet_features) - 1),
            "unet.output_size": int(out.shape[1])}


# ---- claims ------------------------------------------------------------------------------------------

SRC_B = "000 lecture, Counting the bottleneck's weights"
SRC_D = "000 lecture, Width in a dense block / Reading the dense block"

CLAIMS = [
    common.Claim("basic branch (two 3x3 convs at 256 channels) holds 2*9*256^2 weights", SRC_B, "1,179,648",
                 lambda m: f"{m['bottleneck.basic_weights']:,}",
                 lambda m: m["bottleneck.basic_weights"] == 1_179_648),
    common.Claim("bottleneck branch 256 -> 64 -> 64 -> 256 holds 256*64 + 9*64^2 + 64*256 weights", SRC_B, "69,632",
                 lambda m: f"{m['bottleneck.bottleneck_weights']:,}",
                 lambda m: m["bottleneck.bottleneck_weights"] == 69_632),
    common.Claim("the bottleneck branch has about 1/17 of the basic branch's weights", SRC_B, "1/17",
                 lambda m: f"1/{m['bottleneck.ratio']:.2f}",
                 lambda m: round(m["bottleneck.ratio"]) == 17),
    common.Claim("the bottleneck's 3x3 layer costs 1/32 of the basic branch", SRC_B, "1/32",
                 lambda m: f"1/{1 / m['bottleneck.three_by_three_fraction']:.2f}",
                 lambda m: abs(m["bottleneck.three_by_three_fraction"] - 1 / 32) < 1e-12),
    common.Claim("the two 1x1 layers hold 47% of the bottleneck's weights", SRC_B, "47%",
                 lambda m: f"{100 * m['bottleneck.one_by_one_share']:.1f}%",
                 lambda m: round(100 * m["bottleneck.one_by_one_share"]) == 47),
    common.Claim("C_0 = 64, g = 32: 416 channels enter layer 12 of the dense block (64 for the residual stage)",
                 SRC_D, "416 vs 64",
                 lambda m: f"{m['dense.channels_in'][11]} vs {m['residual_stage.channels_in'][11]}",
                 lambda m: m["dense.channels_in"][11] == 416 and m["residual_stage.channels_in"][11] == 64),
    common.Claim("weights in layer 12's 3x3 convolution: dense 119,808 against residual 36,864", SRC_D,
                 "119,808 vs 36,864",
                 lambda m: f"{m['dense.conv_weights'][11]:,} vs {m['residual_stage.conv_weights'][11]:,}",
                 lambda m: m["dense.conv_weights"][11] == 119_808 and m["residual_stage.conv_weights"][11] == 36_864),
    common.Claim("dense layers start cheaper than the residual ones and draw level at layer 3", SRC_D, "layer 3",
                 lambda m: f"layer {m['dense.level_layer']}",
                 lambda m: m["dense.level_layer"] == 3
                 and m["dense.conv_weights"][2] == m["residual_stage.conv_weights"][2]),
    common.Claim("U-Net on a 224 x 224 input: encoder features concatenated into the decoder at matching "
                 "scales, among them 112 x 112 and 56 x 56 (read from the module's sown skips)",
                 "000 lecture, U-Net skips", "112, 56",
                 lambda m: f"skips at {m['unet.skip_sizes']} with {m['unet.skip_channels']} channels; "
                           f"output {m['unet.output_size']}",
                 lambda m: {112, 56} <= set(m["unet.skip_sizes"]) and m["unet.output_size"] == 224),
]


def report_section(m: dict) -> str:
    lines = ["| branch | layers (weights) | total |", "|---|---|---|",
             f"| basic 3x3, 3x3 | {', '.join(f'{v:,}' for v in m['bottleneck.layers.basic'])} | "
             f"{m['bottleneck.basic_weights']:,} |",
             f"| bottleneck 1x1, 3x3, 1x1 | {', '.join(f'{v:,}' for v in m['bottleneck.layers.bottleneck'])} | "
             f"{m['bottleneck.bottleneck_weights']:,} |",
             "", "| layer | dense channels in | dense 3x3 weights | residual 3x3 weights |", "|---|---|---|---|"]
    for k, (c, d, r) in enumerate(zip(m["dense.channels_in"], m["dense.conv_weights"],
                                      m["residual_stage.conv_weights"])):
        lines.append(f"| {k + 1} | {c} | {d:,} | {r:,} |")
    return "\n".join(lines)


# ---- figure ------------------------------------------------------------------------------------------


def plot(m: dict, config, path) -> None:
    plt = common.pyplot()
    from matplotlib.ticker import StrMethodFormatter
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.6), gridspec_kw={"width_ratios": [1, 1.3, 1.3, 1.3]})

    ax = axes[0]
    layers = [("basic", m["bottleneck.layers.basic"], ["3x3", "3x3"], ["tab:blue", "tab:cyan"]),
              ("bottleneck", m["bottleneck.layers.bottleneck"], ["1x1", "3x3", "1x1"],
               ["tab:orange", "tab:red", "tab:orange"])]
    for i, (name, vals, labels, colours) in enumerate(layers):
        bottom = 0
        for v, lab, col in zip(vals, labels, colours):
            ax.bar(i, v, bottom=bottom, color=col, edgecolor="k", lw=0.5)
            if v > 0.1 * m["bottleneck.basic_weights"]:
                ax.text(i, bottom + v / 2, f"{lab}\n{v:,}", ha="center", va="center", fontsize=8)
            bottom += v
        total = ax.text(i, bottom, f"{bottom:,}", ha="center", va="bottom", fontsize=9)
        if name == "bottleneck":  # its layers are too thin to label inside: listed above its total
            lab = "\n".join(f"{lab} {v:,}" for lab, v in zip(labels, vals))
            ax.annotate(lab, (0.5, 1.0), xycoords=total, xytext=(0, 4), textcoords="offset points",
                        ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, 1.15 * m["bottleneck.basic_weights"])
    ax.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))  # weights as whole numbers, no 1e6 offset
    ax.set_xticks([0, 1], [f"basic\n{config.channels}->{config.channels}->{config.channels}",
                           f"bottleneck\n{config.channels}->{config.bottleneck}->{config.bottleneck}->{config.channels}"])
    ax.set_ylabel("conv weights in the branch, biases excluded")
    ax.set_title(f"Weights in a bottleneck (lecture, seed 000, fig.)\n1/{m['bottleneck.ratio']:.1f} of the weights; "
                 f"1x1 layers {100 * m['bottleneck.one_by_one_share']:.0f}%", fontsize=9)

    k = np.arange(1, len(m["dense.channels_in"]) + 1)
    width = 0.4
    ax = axes[1]
    ax.bar(k - width / 2, m["dense.channels_in"], width, label=f"dense block (g = {config.growth_rate})",
           color="tab:green")
    ax.bar(k + width / 2, m["residual_stage.channels_in"], width,
           label=f"residual stage (width {config.residual_width})", color="tab:blue")
    ax.set_xticks(k)
    ax.set_xlabel("layer")
    ax.set_ylabel("channels entering the layer")
    ax.set_title(f"Width in a dense block (lecture, seed 000, fig.), left: channels in\n"
                 f"layer {k[-1]}: {m['dense.channels_in'][-1]} vs {m['residual_stage.channels_in'][-1]}", fontsize=9)
    ax.legend(fontsize=8)

    ax = axes[2]
    ax.bar(k - width / 2, m["dense.conv_weights"], width, label=f"dense layer 3x3 (C_in -> {config.growth_rate})", color="tab:green")
    ax.bar(k + width / 2, m["residual_stage.conv_weights"], width, label=f"residual 3x3 ({config.residual_width} -> {config.residual_width})", color="tab:blue")
    ax.axvline(m["dense.level_layer"], color="grey", ls="--", lw=0.8)
    ax.text(m["dense.level_layer"] + 0.1, max(m["dense.conv_weights"]) * 0.55, f"level at layer {m['dense.level_layer']}",
            fontsize=8)
    ax.set_xticks(k)
    ax.set_xlabel("layer")
    ax.set_ylabel("weights in the layer's 3x3 convolution")
    ax.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
    ax.set_title(f"Width in a dense block (lecture, seed 000, fig.), right: 3x3 weights\n"
                 f"layer {k[-1]}: {m['dense.conv_weights'][-1]:,} vs {m['residual_stage.conv_weights'][-1]:,}",
                 fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    for ax in axes[:3]:
        ax.grid(alpha=0.3, axis="y")
    _plot_unet(axes[3], m)
    common.save_figure(fig, path)


def _plot_unet(ax, m: dict) -> None:
    """Encoder and decoder stages as boxes (height: spatial size, width: channels), skips as arrows."""
    sizes, chans = m["unet.skip_sizes"], m["unet.skip_channels"]
    scale = 0.6 / max(chans)
    for i, (h, c) in enumerate(zip(sizes, chans)):
        for x0, colour in ((i, "tab:blue"), (2 * len(sizes) - i, "tab:green")):
            w = c * scale * (2 if colour == "tab:green" else 1)  # decoder: skip + upsampled channels
            ax.add_patch(plt_rect(x0 - w / 2, -h / 2, w, h, colour))
        ax.annotate("", xy=(2 * len(sizes) - i - 0.4, h / 2 + 8), xytext=(i + 0.4, h / 2 + 8),
                    arrowprops=dict(arrowstyle="->", color="grey", lw=0.8))
        ax.text(len(sizes), h / 2 + 12, f"skip {h} x {h}, {c} ch (concat)", ha="center", fontsize=7)
    b = m["unet.bottleneck_size"]
    ax.add_patch(plt_rect(len(sizes) - 0.3, -b / 2, 0.6, b, "tab:purple"))
    ax.set_xlim(-1, 2 * len(sizes) + 1)
    ax.set_ylim(-max(sizes) / 2 - 10, max(sizes) / 2 + 30)
    ax.set_xticks([])
    ax.set_ylabel("spatial size (pixels; box height); box width: channels")
    ax.set_title("U-Net skips (lecture, seed 000, fig.),\nfrom the module's own shapes: blue encoder,\ngreen decoder "
                 "after concat, purple bottleneck", fontsize=9)


def plt_rect(x, y, w, h, colour):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), w, h, facecolor=colour, edgecolor="k", lw=0.5, alpha=0.8)


if __name__ == "__main__":
    common.main(__name__)
