"""U-Net and hourglass modules: shapes, skip scales, forward/backward under jit, validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from resjax.nn.hourglass import Hourglass, StackedHourglass
from resjax.nn.residual import concat_merge
from resjax.nn.unet import UNet


def _skip_sizes(inter, n):
    return [inter[f"skip_{i}"][0].shape[1] for i in range(n)]


def _init(model, x):
    return model.init(jax.random.PRNGKey(0), x, False)


def _init_and_apply(model, x):
    """``(variables, (output, state))``: init, then apply with the intermediates sown (evaluation mode), in one
    jitted program (not one program per eager op)."""
    def run(x):
        variables = _init(model, x)
        return variables, model.apply(variables, x, False, mutable=["intermediates"])

    return jax.jit(run)(x)


def test_unet_shapes_and_skip_scales():
    model = UNet(features=(4, 8, 8, 8), out_channels=2)
    x = jnp.ones((1, 32, 32, 3))
    _, (y, state) = _init_and_apply(model, x)
    assert y.shape == (1, 32, 32, 2)
    assert _skip_sizes(state["intermediates"], 3) == [32, 16, 8]


def test_unet_224_skips_at_lecture_scales():
    """Default widths (64, 128, 256, 512) on 224x224: skips at 224, 112, 56 (shapes only, via eval_shape)."""
    model = UNet(out_channels=1)
    x = jax.ShapeDtypeStruct((1, 224, 224, 3), jnp.float32)
    variables = jax.eval_shape(lambda x: _init(model, x), x)
    y, state = jax.eval_shape(lambda v, x: model.apply(v, x, False, mutable=["intermediates"]), variables, x)
    assert y.shape == (1, 224, 224, 1)
    inter = state["intermediates"]
    assert [inter[f"skip_{i}"][0].shape for i in range(3)] == [(1, 224, 224, 64), (1, 112, 112, 128), (1, 56, 56, 256)]


def _train_grad(model, x, loss_of, variables=None):
    """Loss and gradient in training mode under jit: finite, and some gradient nonzero (numpy checks)."""
    variables = jax.jit(_init, static_argnums=0)(model, x) if variables is None else variables

    @jax.jit
    def loss(params):
        out, _ = model.apply({**variables, "params": params}, x, True, mutable=["batch_stats"])
        return loss_of(out)

    value, grads = jax.tree_util.tree_map(np.asarray, jax.jit(jax.value_and_grad(loss))(variables["params"]))
    assert np.isfinite(value)
    assert all(np.all(np.isfinite(g)) for g in jax.tree_util.tree_leaves(grads))
    assert any(np.abs(g).sum() > 0 for g in jax.tree_util.tree_leaves(grads))


def test_unet_forward_backward_jit():
    x = jax.random.normal(jax.random.PRNGKey(1), (1, 16, 16, 3))
    _train_grad(UNet(features=(4, 8), out_channels=1), x, lambda y: jnp.mean(y ** 2))


def test_hourglass_forward_backward_jit_and_skips():
    x = jax.random.normal(jax.random.PRNGKey(1), (1, 16, 16, 4))
    model = Hourglass(depth=2, features=4)
    variables, (y, state) = _init_and_apply(model, x)
    assert y.shape == (1, 16, 16, 4)
    inter = state["intermediates"]
    assert inter["skip"][0].shape[1] == 16 and inter["inner"]["skip"][0].shape[1] == 8
    _train_grad(model, x, lambda y: jnp.mean(y ** 2), variables)


def test_stacked_hourglass_heatmaps():
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 16, 16, 3))
    model = StackedHourglass(num_stacks=2, depth=2, features=4, num_heatmaps=5)
    variables, (heat, _) = _init_and_apply(model, x)
    assert isinstance(heat, list) and len(heat) == 2
    assert all(h.shape == (2, 16, 16, 5) for h in heat)
    _train_grad(model, x, lambda hs: sum(jnp.mean(h ** 2) for h in hs), variables)


@pytest.mark.parametrize("make, shape, setting", [
    (lambda: UNet(features=(4, 8, 8, 8)), (1, 15, 15, 3), "input"),
    (lambda: UNet(features=(4, 8, 8, 8)), (1, 36, 36, 3), "input"),
    (lambda: Hourglass(depth=2, features=4), (1, 18, 18, 3), "input"),
    (lambda: StackedHourglass(1, 3, 4, 2), (1, 12, 12, 3), "input"),
])
def test_bad_input_size_raises(make, shape, setting):
    with pytest.raises(ValueError, match=setting):
        _init(make(), jnp.ones(shape))


def test_mismatched_skip_raises():
    """The merge the decoder uses refuses skips whose spatial size differs (e.g. 15 -> pool 7 -> up 14)."""
    with pytest.raises(ValueError, match="concat_merge"):
        concat_merge(jnp.ones((1, 14, 14, 4)), jnp.ones((1, 15, 15, 4)))


@pytest.mark.parametrize("make, setting", [
    (lambda: UNet(features=()), "features"),
    (lambda: UNet(features=(4, 0)), "features"),
    (lambda: UNet(features=(4,), out_channels=0), "out_channels"),
    (lambda: UNet(norm="bogus"), "norm"),
    (lambda: Hourglass(depth=0, features=4), "depth"),
    (lambda: StackedHourglass(0, 2, 4, 3), "num_stacks"),
    (lambda: StackedHourglass(1, 2, 4, 0), "num_heatmaps"),
])
def test_bad_settings_raise(make, setting):
    with pytest.raises(ValueError, match=setting):
        make()
