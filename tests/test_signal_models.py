"""1-D residual networks (``resjax.nn.signal``) and the MNIST-1D reference models (``resjax.nn.reference``)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from resjax.nn import (CLASSIFIERS, ReferenceCNN, ResidualBlock, ResNet, ResNet1D, ResNetBlock, build_model,
                       small_resnet1d)


def _params(model, x, **kw):
    return model.init(jax.random.key(0), x, train=False, **kw)


def _count(variables):
    return sum(a.size for a in jax.tree_util.tree_leaves(variables["params"]))


@pytest.mark.parametrize("order", ["post", "pre"])
@pytest.mark.parametrize("kind, shortcut", [("basic", "A"), ("basic", "B"), ("bottleneck", "B")])
def test_resnet1d_shapes_through_its_stages(order, kind, shortcut):
    """Every block's output is (batch, ceil(length / stride), width): stride 2 halves the length per stage."""
    model = ResNet1D(stage_sizes=(2, 1, 1), stage_widths=(8, 16, 32), stem_width=8, num_classes=3, kind=kind,
                     shortcut=shortcut, order=order)
    x = jax.random.normal(jax.random.key(1), (5, 41, 2))
    variables = _params(model, x)
    logits, state = model.apply(variables, x, train=True, mutable=["batch_stats", "intermediates"])
    assert logits.shape == (5, 3)
    sown = state["intermediates"]
    shapes = {name: sown[name]["block_out"][0].shape for name in ("stage1_first", "stage1_0", "stage2_first",
                                                                   "stage3_first")}
    assert shapes == {"stage1_first": (5, 41, 8), "stage1_0": (5, 41, 8), "stage2_first": (5, 21, 16),
                      "stage3_first": (5, 11, 32)}
    # every kernel is 1-D: (length, in, out)
    kernels = [a for p, a in jax.tree_util.tree_leaves_with_path(variables["params"]) if "kernel" in str(p[-1])
               and "head" not in str(p)]
    assert kernels and all(k.ndim == 3 for k in kernels)
    # (batch, length) is one channel
    one = ResNet1D(stage_sizes=(1,), stage_widths=(4,), stem_width=4, num_classes=3)
    v = _params(one, jnp.ones((2, 12)))
    np.testing.assert_array_equal(one.apply(v, jnp.ones((2, 12)), train=False),
                                  one.apply(v, jnp.ones((2, 12, 1)), train=False))


def test_option_a_on_a_signal_subsamples_the_length_and_appends_zero_channels():
    block = ResNetBlock(6, strides=2, shortcut="A", norm="none")
    x = jax.random.normal(jax.random.key(2), (2, 9, 4))
    variables = block.init(jax.random.key(0), x, train=False)
    skip = block.apply(variables, x, x, False, method=block._shortcut)
    assert skip.shape == (2, 5, 6)
    np.testing.assert_array_equal(skip[..., :4], x[:, ::2, :])
    np.testing.assert_array_equal(skip[..., 4:], 0.0)


def test_a_pair_of_strides_on_a_signal_names_the_setting():
    block = ResNetBlock(4, strides=(2, 2), norm="none")
    with pytest.raises(ValueError, match="strides"):
        block.init(jax.random.key(0), jnp.ones((2, 8, 4)), train=False)


class _WrongLength(nn.Module):
    """A branch that drops a position: its output cannot be added to the skip."""

    features: int

    @nn.compact
    def __call__(self, x, train=None):
        return nn.Conv(self.features, (3,), padding="VALID")(x)


def test_the_residual_addition_on_a_signal_is_shape_checked():
    """A 1-D branch of another length is refused by residual_add (chex), never broadcast."""
    block = ResidualBlock(4, branch=_WrongLength(4))
    with pytest.raises(ValueError, match=r"residual_add: skip shape \(2, 8, 4\) and branch shape \(2, 6, 4\)"):
        block.init(jax.random.key(0), jnp.ones((2, 8, 4)))


def test_resnet1d_is_resnet_on_signals_and_refuses_images():
    """ResNet takes (batch, length, channels) itself; ResNet1D is that, and refuses an image by name."""
    kw = dict(stage_sizes=(1, 1), stage_widths=(4, 8), stem_width=4, num_classes=3)
    x = jax.random.normal(jax.random.key(3), (2, 10, 3))
    variables = _params(ResNet(**kw), x)
    np.testing.assert_array_equal(ResNet(**kw).apply(variables, x, train=False),
                                  ResNet1D(**kw).apply(variables, x, train=False))
    with pytest.raises(ValueError, match="signals"):
        ResNet1D(**kw).init(jax.random.key(0), jnp.ones((2, 6, 6, 3)), train=False)


def test_small_resnet1d_is_the_reference_cnns_size():
    x = jnp.ones((2, 40))
    assert _count(_params(small_resnet1d(), x)) == 5225
    assert _count(_params(small_resnet1d(width=8), x)) == 6738
    assert abs(5225 - 5210) / 5210 < 0.003
    with pytest.raises(ValueError, match="width"):
        small_resnet1d(width=0)


@pytest.mark.parametrize("kind, kwargs, count", [("logistic", {}, 410), ("reference_mlp", {}, 15210),
                                                 ("reference_cnn", {}, 5210), ("reference_gru", {}, 5134),
                                                 ("reference_gru", {"cell": "flax"}, 5110)])
def test_reference_models_shapes_and_parameter_counts(kind, kwargs, count):
    """The counts of the mnist1d repository's models (the GRU's with flax's cell, ``cell='flax'``: 24 fewer, no
    hidden-side reset and update biases; see ``resjax.nn.reference``'s docstring)."""
    model = build_model(kind, num_classes=10, **kwargs)
    assert kind in CLASSIFIERS
    x = jax.random.normal(jax.random.key(4), (3, 40))
    variables = _params(model, x)
    assert _count(variables) == count
    assert set(variables) == {"params"}
    out = model.apply(variables, x, train=True)
    assert out.shape == (3, 10) and np.all(np.isfinite(np.asarray(out)))
    np.testing.assert_array_equal(out, model.apply(variables, x[..., None], train=True))  # (batch, length, 1)
    with pytest.raises(ValueError, match="signals"):
        model.apply(variables, jnp.ones((3, 40, 1, 1)))


def test_reference_mlp_is_h_plus_relu_w_h():
    model = build_model("reference_mlp", width=7, num_classes=3)
    x = jax.random.normal(jax.random.key(5), (4, 40))
    p = _params(model, x)["params"]
    dense = lambda q, h: h @ q["kernel"] + q["bias"]  # noqa: E731
    h = jax.nn.relu(dense(p["stem"], x))
    h = h + jax.nn.relu(dense(p["blocks_0"]["branch"]["linear"], h))
    np.testing.assert_allclose(model.apply({"params": p}, x), dense(p["head"], h), rtol=1e-6, atol=1e-6)


def test_reference_cnn_lengths_and_torch_initialisation():
    """40 -> 19 -> 10 -> 5 positions (kernel 5 then 3, stride 2, padding 1), 125 features into the head; every
    weight inside +-1/sqrt(fan_in) (PyTorch's default)."""
    model = ReferenceCNN()
    x = jax.random.normal(jax.random.key(6), (2, 40))
    p = _params(model, x)["params"]
    assert p["conv_0"]["kernel"].shape == (5, 1, 25) and p["head"]["kernel"].shape == (125, 10)
    for name, fan_in in (("conv_0", 5), ("conv_1", 75), ("conv_2", 75), ("head", 125)):
        for leaf in p[name].values():
            assert float(jnp.max(jnp.abs(leaf))) <= 1 / np.sqrt(fan_in)
    # the first layer, by hand
    h = jax.lax.conv_general_dilated(x[..., None], p["conv_0"]["kernel"], (2,), [(1, 1)],
                                     dimension_numbers=("NWC", "WIO", "NWC"))
    assert h.shape == (2, 19, 25)


def test_reference_gru_backward_direction_reads_the_future_only():
    """Bidirectional: the first half of position t's features depends on x[:t+1], the second on x[t:]."""
    model = build_model("reference_gru", num_classes=10)
    x = jax.random.normal(jax.random.key(7), (1, 40))
    variables = _params(model, x)

    def features(x):  # the bidirectional GRU's outputs, (batch, length, 2 hidden), captured on the way to the head
        _, state = model.apply(variables, x, capture_intermediates=lambda m, _: isinstance(m, nn.Bidirectional),
                               mutable=["intermediates"])
        return state["intermediates"]["gru"]["__call__"][0]

    out = features(x)
    jac = jax.jacfwd(features)(x)  # (1, 40, 12, 1, 40)
    assert out.shape == (1, 40, 12)
    dep = np.abs(np.asarray(jac))[0, :, :, 0, :]  # (position t, feature, input position s)
    t, s = np.meshgrid(np.arange(40), np.arange(40), indexing="ij")
    assert np.all(dep[:, :6, :][np.broadcast_to((s > t)[:, None, :], dep[:, :6, :].shape)] == 0)  # forward: past
    assert np.all(dep[:, 6:, :][np.broadcast_to((s < t)[:, None, :], dep[:, 6:, :].shape)] == 0)  # backward: future
    assert np.any(dep[:, 6:, :][np.broadcast_to((s > t)[:, None, :], dep[:, 6:, :].shape)] != 0)


def test_bad_settings_name_the_setting():
    for kind, kw, setting in (("reference_cnn", dict(channels=0), "channels"), ("reference_gru", dict(hidden=0),
                              "hidden"), ("reference_mlp", dict(width=0), "width"),
                              ("logistic", dict(num_classes=0), "num_classes"),
                              ("resnet1d", dict(stage_sizes=(1,), stage_widths=(0,)), "stage_widths")):
        with pytest.raises(ValueError, match=setting):
            build_model(kind, **kw)
