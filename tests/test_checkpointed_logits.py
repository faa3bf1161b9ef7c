"""``fixup_one_step.checkpointed_logits``: the model's own logits and gradient, bit for bit, with the blocks
rematerialised in segments (what keeps the experiment's depth-1000 full-batch step at 1.5 GB instead of 8 GB)."""
import jax
import numpy as np
import optax
import pytest

from experiments import fixup_one_step
from resjax.nn.tau_mlp import tau_resnet

X = jax.random.normal(jax.random.key(0), (32, 12))
Y = jax.random.randint(jax.random.key(1), (32,), 0, 10)


@pytest.mark.parametrize("kind", ["tau", "fixup"])
@pytest.mark.parametrize("segment", [None, 3, 7, 20])  # sqrt(K); K = 2 x 3 + 1 (a remainder); one segment; > K
def test_logits_and_gradient_equal_the_models_bit_for_bit(kind, segment):
    model = tau_resnet(kind, 8, 7, 10, tau="1/sqrt(L)")
    params = model.init(jax.random.key(2), X[:2])["params"]
    if kind == "fixup":  # W_l = 0 at init: take the step's parameters, where the blocks do something
        params = jax.tree_util.tree_map(lambda p: p + 0.1 * jax.random.normal(jax.random.key(3), p.shape), params)

    def loss(logits_fn):
        return jax.jit(jax.value_and_grad(lambda p: optax.softmax_cross_entropy_with_integer_labels(
            logits_fn(p), Y).mean()))(params)

    (l0, g0), (l1, g1) = loss(lambda p: model.apply({"params": p}, X)), \
        loss(lambda p: fixup_one_step.checkpointed_logits(model, p, X, segment))
    assert np.array_equal(l0, l1)
    for a, b in zip(jax.tree_util.tree_leaves(g0), jax.tree_util.tree_leaves(g1), strict=True):
        assert np.array_equal(a, b)


def test_other_models_are_refused():
    model = tau_resnet("bn", 8, 3, 10)
    params = model.init(jax.random.key(0), X[:2])["params"]
    with pytest.raises(ValueError, match="model:"):
        fixup_one_step.checkpointed_logits(model, params, X)
