"""Convolutional ResNets (resjax.nn.resnet): published parameter counts, shortcut and scaling semantics,
scan == unrolled, Fixup and learnable tau, Taki's 8x8 model, and errors naming the setting."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from resjax.nn.residual import stack_unrolled
from resjax.nn.resnet import (REPOSITORY_MODELS, ResNetBlock, cifar_resnet, imagenet_resnet, imagenet_tau,
                               taki_resnet)


@pytest.fixture(scope="module", autouse=True)
def _fast(fast_compiles):
    yield


def n_params(model, shape):
    variables = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros(shape)))
    return sum(x.size for x in jax.tree_util.tree_leaves(variables["params"]))


@pytest.mark.parametrize("depth,count", [(20, 269_722), (56, 853_018), (110, 1_727_962), (1202, 19_421_274)])
def test_cifar_parameter_counts_are_the_published_ones(depth, count):
    assert n_params(cifar_resnet(depth, scan=True), (1, 32, 32, 3)) == count


@pytest.mark.parametrize("depth,count", [(18, 11_689_512), (34, 21_797_672), (50, 25_557_032),
                                         (101, 44_549_160), (152, 60_192_808)])
def test_imagenet_parameter_counts_equal_torchvision(depth, count):
    assert n_params(imagenet_resnet(depth, scan=True), (1, 224, 224, 3)) == count


def test_wide_resnet_widths_and_projection():
    model = cifar_resnet(14, widen_factor=4, order="pre", shortcut="B")
    variables = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((2, 32, 32, 3))))
    first = variables["params"]["stage1_first"]
    assert first["shortcut_conv"]["kernel"].shape == (1, 1, 16, 64)  # 16 -> 16*4 needs a projection
    assert variables["params"]["stage3_first"]["conv_1"]["kernel"].shape == (3, 3, 256, 256)


def _as_scanned(collection, model):
    out = dict(collection)
    for s, size in enumerate(model.stage_sizes):
        if size > 1:
            out = stack_unrolled(out, size - 1, name=f"stage{s + 1}")
    return out


@pytest.mark.parametrize("kind_kwargs", [dict(), dict(order="pre", shortcut="B"), dict(norm="none", scaling="fixup")])
def test_scan_equals_unrolled(kind_kwargs):
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 16, 16, 3))
    unrolled = cifar_resnet(20, scan=False, **kind_kwargs)
    scanned = cifar_resnet(20, scan=True, **kind_kwargs)
    variables = unrolled.init(jax.random.PRNGKey(0), x)
    variables = {k: _as_scanned(v, unrolled) for k, v in variables.items()}  # the scanned layout
    if kind_kwargs.get("scaling") == "fixup":  # zero head and last convs: perturb so outputs are informative
        variables = jax.tree_util.tree_map(lambda a: a + 0.05, variables)
    with jax.default_matmul_precision("highest"):
        a, sa = unrolled.apply({k: _unstack(v, unrolled) for k, v in variables.items()}, x, train=True,
                               mutable=["batch_stats"])
        b, sb = scanned.apply(variables, x, train=True, mutable=["batch_stats"])
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    if "batch_stats" in sb:
        jax.tree_util.tree_map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-4, atol=1e-5),
                               _as_scanned(sa["batch_stats"], unrolled), sb["batch_stats"])


def _unstack(collection, model):
    from resjax.nn.residual import unstack_scanned

    out = dict(collection)
    for s, size in enumerate(model.stage_sizes):
        if size > 1:
            out = unstack_scanned(out, size - 1, name=f"stage{s + 1}")
    return out


def test_option_a_shortcut_is_subsample_plus_zero_channels():
    # SkipInit's alpha = 0 silences the branch, so the post block returns relu(shortcut(x))
    block = ResNetBlock(features=8, strides=2, shortcut="A", scaling="skipinit")
    x = jnp.abs(jax.random.normal(jax.random.PRNGKey(0), (2, 6, 6, 4)))
    variables = block.init(jax.random.PRNGKey(1), x)
    out = block.apply(variables, x, train=False)
    assert out.shape == (2, 3, 3, 8)
    np.testing.assert_array_equal(out[..., :4], x[:, ::2, ::2, :])
    np.testing.assert_array_equal(out[..., 4:], 0.0)
    assert "shortcut_conv" not in variables["params"]


def test_option_b_shortcut_is_a_strided_projection_with_norm():
    block = ResNetBlock(features=8, strides=2, shortcut="B", scaling="skipinit")
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 6, 6, 4))
    variables = block.init(jax.random.PRNGKey(1), x)
    assert variables["params"]["shortcut_conv"]["kernel"].shape == (1, 1, 4, 8)
    assert "shortcut_norm" in variables["params"]
    out, _ = block.apply(variables, x, train=True, mutable=["batch_stats"])
    # train-mode BN of the projection, then relu: per channel the pre-relu values have mean 0, var 1
    proj = jax.lax.conv_general_dilated(x, variables["params"]["shortcut_conv"]["kernel"], (2, 2), "VALID",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))
    normed = (proj - proj.mean((0, 1, 2))) / jnp.sqrt(proj.var((0, 1, 2)) + 1e-5)
    np.testing.assert_allclose(out, jax.nn.relu(normed), rtol=1e-4, atol=1e-5)


def test_option_a_norm_normalises_the_subsampled_input():
    # tau-ResNet's BN model: AvgPool2d(1, 2) -> BatchNorm2d(in) -> zero channels; silenced branch as above
    block = ResNetBlock(features=8, strides=2, shortcut="A", scaling="skipinit", option_a_norm=True)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 6, 6, 4))
    variables = block.init(jax.random.PRNGKey(1), x)
    assert variables["params"]["shortcut_norm"]["scale"].shape == (4,)
    out, _ = block.apply(variables, x, train=True, mutable=["batch_stats"])
    sub = x[:, ::2, ::2, :]
    normed = (sub - sub.mean((0, 1, 2))) / jnp.sqrt(sub.var((0, 1, 2)) + 1e-5)
    np.testing.assert_allclose(out[..., :4], jax.nn.relu(normed), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(out[..., 4:], 0.0)


def test_option_a_conv_input_subsamples_x_plus_the_first_scalar_bias():
    # Fixup's CIFAR code: downsample(x + bias1a); the Fixup branch is zero at init (last conv zero)
    x = jnp.abs(jax.random.normal(jax.random.PRNGKey(0), (2, 6, 6, 4)))
    for option, shift in (("conv_input", 0.5), ("x", 0.0)):
        block = ResNetBlock(features=8, strides=2, norm="none", scaling="fixup", option_a_input=option)
        variables = block.init(jax.random.PRNGKey(1), x)
        variables = {"params": {**variables["params"], "bias_in_0": jnp.asarray(0.5)}}
        out = block.apply(variables, x)
        np.testing.assert_allclose(out[..., :4], x[:, ::2, ::2, :] + shift, rtol=1e-6)
        np.testing.assert_array_equal(out[..., 4:], 0.0)


def test_repository_stems_and_network_biases():
    x = jnp.zeros((1, 32, 32, 3))
    fixup = cifar_resnet(20, **REPOSITORY_MODELS["fixup"]).init(jax.random.PRNGKey(0), x)["params"]
    stem = fixup["stem_conv"]["kernel"]  # PyTorch's default: U(+-1/sqrt(fan_in)), fan_in = 27
    assert float(jnp.abs(stem).max()) <= 1 / np.sqrt(27) and abs(float(stem.std()) * np.sqrt(3 * 27) - 1) < 0.15
    assert "stem_bias" in fixup and "head_bias" in fixup
    nobn = cifar_resnet(20, **REPOSITORY_MODELS["tau_resnet_nobn"]).init(jax.random.PRNGKey(0), x)["params"]
    assert "stem_bias" not in nobn and "head_bias" not in nobn and "bias_in_0" in nobn["stage1_first"]
    assert abs(float(nobn["stem_conv"]["kernel"].std()) / np.sqrt(2 / (9 * 16)) - 1) < 0.15  # He fan-out
    assert "bias" not in nobn["stem_conv"]


def test_option_a_cannot_reduce_channels():
    block = ResNetBlock(features=4, strides=1, shortcut="A")
    with pytest.raises(ValueError, match="shortcut"):
        block.init(jax.random.PRNGKey(0), jnp.zeros((1, 4, 4, 8)))


def test_pre_activation_block_adds_nothing_after_the_sum():
    block = ResNetBlock(features=4, order="pre", scaling="skipinit")
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 5, 4))
    variables = block.init(jax.random.PRNGKey(1), x)
    out, _ = block.apply(variables, x, train=True, mutable=["batch_stats"])
    np.testing.assert_array_equal(out, x)  # identity skip, silenced branch, no relu (x has negatives)


@pytest.mark.parametrize("kind", ["basic", "bottleneck"])
def test_fixup_starts_as_identity_with_the_published_gain(kind):
    features = 16 if kind == "basic" else 64
    depth_blocks = 50
    block = ResNetBlock(features=features, kind=kind, norm="none", scaling="fixup", num_blocks=depth_blocks)
    x = jnp.abs(jax.random.normal(jax.random.PRNGKey(0), (2, 8, 8, features)))
    variables = block.init(jax.random.PRNGKey(1), x)
    np.testing.assert_array_equal(block.apply(variables, x), x)  # relu(x + 0) with x >= 0
    params = variables["params"]
    m = 2 if kind == "basic" else 3
    assert float(jnp.abs(params[f"conv_{m - 1}"]["kernel"]).max()) == 0.0
    assert float(params["fixup_scale"]) == 1.0 and float(params["bias_out"]) == 0.0
    kernel = params["conv_0"]["kernel"]
    fan_out = kernel.shape[0] * kernel.shape[1] * kernel.shape[3]
    expected = np.sqrt(2.0 / fan_out) * depth_blocks ** (-1.0 / (2 * m - 2))
    assert abs(float(kernel.std()) / expected - 1) < 0.1


def test_fixup_network_outputs_zero_at_init():
    model = cifar_resnet(20, norm="none", scaling="fixup")
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 32, 32, 3))
    variables = model.init(jax.random.PRNGKey(1), x)
    np.testing.assert_array_equal(model.apply(variables, x), 0.0)
    assert "stem_bias" in variables["params"] and "head_bias" in variables["params"]


def test_tau_scales_the_branch_and_can_be_traced():
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 8, 16))
    block = ResNetBlock(features=16, order="pre", norm="none", scaling="tau", tau=0.5)
    plain = ResNetBlock(features=16, order="pre", norm="none")
    variables = plain.init(jax.random.PRNGKey(1), x)
    branch = plain.apply(variables, x) - x
    np.testing.assert_allclose(block.apply(variables, x) - x, 0.5 * branch, rtol=1e-5, atol=1e-6)
    taus = jnp.array([0.0, 0.25, 1.0])
    outs = jax.vmap(lambda t: block.apply(variables, x, False, t))(taus)
    for t, o in zip(taus, outs):
        np.testing.assert_allclose(o - x, t * branch, rtol=1e-5, atol=1e-6)


def test_learnable_tau_gradient_is_the_block_average():
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 8, 3))
    y = jnp.array([1, 3])
    kw = dict(norm="none", scaling="tau", tau="1/sqrt(L)", scalar_biases=True)
    learnable = cifar_resnet(14, learnable_tau=True, **kw)
    fixed = cifar_resnet(14, **kw)
    variables = jax.jit(learnable.init)(jax.random.PRNGKey(1), x)  # one program, not one per eager op
    assert abs(float(variables["params"]["tau"]) - 1 / np.sqrt(6)) < 1e-6

    def loss(model, params, tau=None):
        logits = model.apply({"params": params}, x, False, tau)
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(2), y])

    @jax.jit
    def both(params):  # the two models' losses and gradients in one program, not one program per eager op
        fixed_params = {k: v for k, v in params.items() if k != "tau"}
        l_learn, g_learn = jax.value_and_grad(lambda p: loss(learnable, p))(params)
        l_fixed, g_sum = jax.value_and_grad(lambda t: loss(fixed, fixed_params, t))(params["tau"])
        return l_learn, g_learn["tau"], l_fixed, g_sum

    l_learn, g_learn, l_fixed, g_sum = both(variables["params"])
    np.testing.assert_allclose(g_learn, g_sum / 6, rtol=1e-4)
    np.testing.assert_allclose(l_learn, l_fixed, rtol=1e-6)


def test_imagenet_tau_conventions():
    assert imagenet_tau((3, 4, 6, 3), "seed") == pytest.approx(1 / np.sqrt(4.0))
    assert imagenet_tau((3, 4, 6, 3), "official") == pytest.approx(2 / np.sqrt(6.0))
    with pytest.raises(ValueError, match="tau_convention"):
        imagenet_tau((3, 4, 6, 3), "mean")


def test_taki_model_init_variance_and_even_kernel_padding():
    model = taki_resnet(num_blocks=100)
    x = jnp.zeros((1, 32, 32, 3))
    variables = model.init(jax.random.PRNGKey(0), x)
    kernels = variables["params"]["blocks"]["block"]["conv"]["kernel"]
    assert kernels.shape == (100, 8, 8, 16, 16)
    assert abs(float(kernels.var()) * (8 * 8 * 16 * 100) - 1) < 0.02
    _, inter = model.apply(variables, x + 1.0, mutable=["intermediates"])
    assert inter["intermediates"]["blocks"]["block"]["block_out"][0].shape == (100, 1, 32, 32, 16)


def test_taki_scan_equals_unrolled_with_batchnorm():
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 8, 8, 3))
    scanned = taki_resnet(num_blocks=3, norm="batch", kernel_init="he_normal", scan=True)
    unrolled = taki_resnet(num_blocks=3, norm="batch", kernel_init="he_normal", scan=False)
    variables = unrolled.init(jax.random.PRNGKey(1), x)
    stacked = {k: stack_unrolled(v, 3) for k, v in variables.items()}
    with jax.default_matmul_precision("highest"):
        a, _ = unrolled.apply(variables, x, train=True, mutable=["batch_stats"])
        b, _ = scanned.apply(stacked, x, train=True, mutable=["batch_stats"])
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("make,setting", [
    (lambda: cifar_resnet(21), "depth"),
    (lambda: cifar_resnet(20, shortcut="C"), "shortcut"),
    (lambda: cifar_resnet(20, kind="wide"), "kind"),
    (lambda: cifar_resnet(20, norm="weird"), "norm"),
    (lambda: cifar_resnet(20, scaling="tau", tau="1/L^2"), "tau"),
    (lambda: cifar_resnet(20, learnable_tau=True), "learnable_tau"),
    (lambda: cifar_resnet(20, widen_factor=0), "widen_factor"),
    (lambda: imagenet_resnet(42), "depth"),
    (lambda: ResNetBlock(features=10, kind="bottleneck"), "features"),
    (lambda: taki_resnet(num_blocks=0), "num_blocks"),
    (lambda: cifar_resnet(20, option_a_input="y"), "option_a_input"),
    (lambda: cifar_resnet(20, option_a_norm="yes"), "option_a_norm"),
    (lambda: cifar_resnet(20, stem_head_biases="yes"), "stem_head_biases"),
    (lambda: cifar_resnet(20, stem_init="nope"), "stem_init"),
    (lambda: taki_resnet(kernel_init="nope"), "kernel_init"),
])
def test_bad_settings_name_the_setting(make, setting):
    with pytest.raises(ValueError, match=setting):
        make()
