"""resjax's models under ``flax.nnx.bridge.ToNNX`` (README 'Flax NNX'), tuple ``strides`` and the width
message a block gives for an input of another width after init (#24 item 6).

The README's recipe itself (a vmapped NNX run against ``make_train``) runs in ``tests/test_doc_examples.py``; here
one eager training step is compared bit for bit, and the block checks are tested one by one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from flax.nnx import bridge

from resjax.nn import ResidualBlock, ResidualMLP, ResNetBlock, TakiBlock


def _linen_variables(model: nnx.Module) -> dict:
    return {"params": nnx.to_pure_dict(nnx.state(model, nnx.Param)),
            "batch_stats": nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))}


def _equal(a, b) -> bool:
    return jax.tree.structure(a) == jax.tree.structure(b) and jax.tree.all(jax.tree.map(jnp.array_equal, a, b))


def test_one_nnx_step_with_batchnorm_equals_linen_bit_for_bit():
    linen = ResidualMLP(width=8, num_blocks=2, norm="batch", num_classes=3)
    x = jax.random.normal(jax.random.key(1), (16, 5))
    y = jax.random.randint(jax.random.key(2), (16,), 0, 3)
    init_key = jax.random.key(0)
    variables = linen.init({"params": init_key}, jnp.zeros((2, 5)), train=False)
    model = bridge.ToNNX(linen).lazy_init(jnp.zeros((2, 5)), train=False, rngs=init_key)
    assert _equal(_linen_variables(model), variables)

    tx = optax.sgd(0.1, momentum=0.9)

    def linen_loss(params, batch_stats):
        logits, updates = linen.apply({"params": params, "batch_stats": batch_stats}, x, train=True,
                                      mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), updates["batch_stats"]

    grads, batch_stats = jax.grad(linen_loss, has_aux=True)(variables["params"], variables["batch_stats"])
    updates, _ = tx.update(grads, tx.init(variables["params"]), variables["params"])
    expected = {"params": optax.apply_updates(variables["params"], updates), "batch_stats": batch_stats}

    def nnx_loss(model):
        logits = model(x, train=True, mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    optimizer.update(model, nnx.grad(nnx_loss)(model))
    assert _equal(_linen_variables(model), expected)
    assert not _equal(_linen_variables(model), variables)  # the step moved both parameters and statistics


@pytest.mark.parametrize("strides", [(2, 2), [2, 2]])
@pytest.mark.parametrize("kind,shortcut", [("basic", "A"), ("basic", "B"), ("bottleneck", "B")])
def test_a_pair_of_equal_strides_is_the_integer(strides, kind, shortcut):
    x = jax.random.normal(jax.random.key(3), (2, 8, 8, 8))
    as_int = ResNetBlock(16, strides=2, kind=kind, shortcut=shortcut)
    as_pair = ResNetBlock(16, strides=strides, kind=kind, shortcut=shortcut)
    v = as_int.init(jax.random.key(0), x)
    assert _equal(jax.tree.map(jnp.shape, as_pair.init(jax.random.key(0), x)), jax.tree.map(jnp.shape, v))
    assert _equal(as_pair.init(jax.random.key(0), x), v)
    out = as_pair.apply(v, x, False)
    assert out.shape == (2, 4, 4, 16)
    assert jnp.array_equal(out, as_int.apply(v, x, False))


@pytest.mark.parametrize("shortcut", ["A", "B"])
def test_unequal_strides_subsample_each_axis(shortcut):
    x = jax.random.normal(jax.random.key(3), (2, 8, 6, 4))
    block = ResNetBlock(8, strides=(2, 1), shortcut=shortcut, norm="none")
    v = block.init(jax.random.key(0), x)
    assert block.apply(v, x, False).shape == (2, 4, 6, 8)
    assert v["params"]["conv_0"]["kernel"].shape == (3, 3, 4, 8)


@pytest.mark.parametrize("bad", [0, -1, (2,), (2, 0), (2, 2, 2), "2", True, (2.0, 2), None])
def test_bad_strides_name_strides(bad):
    with pytest.raises(ValueError, match=r"^strides: must be an integer >= 1 or a pair"):
        ResNetBlock(16, strides=bad)


@pytest.mark.parametrize("order", ["pre", "post"])
def test_residual_block_refuses_another_width_where_it_enters(order):
    block = ResidualBlock(16, order=order, norm="batch")
    v = block.init(jax.random.key(0), jnp.ones((4, 16)))
    with pytest.raises(ValueError, match=r"^inputs: ResidualBlock takes inputs of width 16 .*got width 32"):
        block.apply(v, jnp.ones((4, 32)), train=False)
    with pytest.raises(ValueError, match=r"^inputs: ResidualBlock takes inputs of width 16"):
        block.init(jax.random.key(0), jnp.ones((4, 32)))


@pytest.mark.parametrize("order", ["pre", "post"])
def test_resnet_block_refuses_another_width_after_init(order):
    block = ResNetBlock(16, order=order)
    v = block.init(jax.random.key(0), jnp.ones((2, 8, 8, 8)))  # 8 -> 16 channels (option A) is allowed
    assert block.apply(v, jnp.ones((2, 8, 8, 8)), False).shape == (2, 8, 8, 16)
    with pytest.raises(ValueError, match=r"^inputs: ResNetBlock takes inputs of width 8 \(the channels its "
                                         r"parameters were initialised for\), got width 12"):
        block.apply(v, jnp.ones((2, 8, 8, 12)), True, mutable=["batch_stats"])


def test_taki_block_and_the_bridge_give_the_width_message():
    block = TakiBlock(features=4, kernel_size=3, norm="batch")
    v = block.init(jax.random.key(0), jnp.ones((2, 6, 6, 4)), train=False)
    with pytest.raises(ValueError, match=r"^inputs: TakiBlock takes inputs of width 4"):
        block.apply(v, jnp.ones((2, 6, 6, 8)), train=True, mutable=["batch_stats"])
    model = bridge.ToNNX(ResidualBlock(16, order="pre", norm="batch")).lazy_init(jnp.ones((4, 16)), train=False,
                                                                                   rngs=jax.random.key(0))
    with pytest.raises(ValueError, match=r"takes inputs of width 16 .*got width 32"):
        model(jnp.ones((4, 32)), train=True, mutable=["batch_stats"])
