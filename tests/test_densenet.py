"""DenseNet (resjax.nn.densenet): exact DenseNet-121 parameter count, a tiny model's forward + backward
under jit with batch statistics updating, and settings checks."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from resjax.nn.densenet import DenseNet, densenet121, densenet_bc_cifar


def _param_count(model, shape):
    variables = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros(shape), False))
    return sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(variables["params"]))


def test_densenet121_param_count_matches_torchvision():
    assert _param_count(densenet121(), (1, 224, 224, 3)) == 7_978_856


def test_densenet_bc_100_cifar_param_count():
    assert _param_count(densenet_bc_cifar(100, 12), (1, 32, 32, 3)) == 769_162  # the paper's "0.8M"


def test_tiny_densenet_forward_backward_under_jit():
    """One training step and an evaluation under jit (init jitted too: one program each, not one per eager op);
    the test-side arithmetic is numpy."""
    model = DenseNet(block_layers=(2, 2), growth_rate=4, init_features=8, num_classes=3, stem="cifar")
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 32, 32, 3))
    y = jnp.array([0, 1, 2, 0])
    variables = jax.jit(lambda key: model.init(key, x, False))(jax.random.PRNGKey(0))
    params, stats = variables["params"], variables["batch_stats"]

    @jax.jit
    def step(params, stats):
        def loss_fn(p):
            logits, updates = model.apply({"params": p, "batch_stats": stats}, x, True, mutable=["batch_stats"])
            onehot = jax.nn.one_hot(y, 3)
            return -jnp.mean(jnp.sum(onehot * jax.nn.log_softmax(logits), -1)), (logits, updates["batch_stats"])
        (loss, (logits, new_stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        eval_logits = model.apply({"params": params, "batch_stats": new_stats}, x, False)
        return loss, logits, new_stats, grads, eval_logits

    loss, logits, new_stats, grads, eval_logits = jax.tree_util.tree_map(np.asarray, step(params, stats))
    assert logits.shape == (4, 3)
    assert np.isfinite(float(loss))
    gnorms = [float(np.linalg.norm(g)) for g in jax.tree_util.tree_leaves(grads)]
    assert all(np.isfinite(gnorms)) and sum(gnorms) > 0
    changed = jax.tree_util.tree_map(lambda a, b: bool(np.any(np.asarray(a) != b)), stats, new_stats)
    assert all(jax.tree_util.tree_leaves(changed))
    # 2 blocks of 2 layers, 1 transition: 8 + 2*4 = 16 -> 8 -> 8 + 2*4 = 16 channels at the head
    assert params["classifier"]["kernel"].shape == (16, 3)
    assert eval_logits.shape == (4, 3)


@pytest.mark.parametrize("kwargs, setting", [
    ({"block_layers": ()}, "block_layers"),
    ({"block_layers": (2, 0)}, "block_layers"),
    ({"growth_rate": 0}, "growth_rate"),
    ({"init_features": -1}, "init_features"),
    ({"compression": 0.0}, "compression"),
    ({"compression": 1.5}, "compression"),
    ({"num_classes": 0}, "num_classes"),
    ({"stem": "resnet"}, "stem"),
    ({"norm": "bogus"}, "norm"),
])
def test_bad_settings_raise(kwargs, setting):
    with pytest.raises(ValueError, match=setting):
        DenseNet(**kwargs)


@pytest.mark.parametrize("depth", [99, 4, 0])
def test_bad_cifar_depth_raises(depth):
    with pytest.raises(ValueError, match="depth"):
        densenet_bc_cifar(depth)
