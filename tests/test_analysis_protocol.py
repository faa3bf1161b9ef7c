"""The analyses on models that are not resjax's (issue #24 item 4): a user's own Flax residual MLP that follows
only the written protocol (``resjax.analysis``'s docstring, the README's "Analysing a model of your own"), a
plain ``apply_fn``, an NNX model through ``flax.nnx.bridge``, and NNX objects refused with a useful message."""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.nnx import bridge

from resjax.analysis import (
    branch_stack, branch_variance_ratio, from_nnx, init_many, input_gradients, input_gradients_many, path_expansion,
    stream_activations, variance_through_depth,
)
from resjax.analysis.paths import stream_input

WIDTH, K = 6, 3


# ---- a user's own Linen residual MLP: no resjax class, no `train` ------------------------------------


class Branch(nn.Module):
    width: int

    @nn.compact
    def __call__(self, h):
        return nn.Dense(self.width)(nn.tanh(nn.Dense(self.width)(h)))


class Block(nn.Module):
    width: int

    @nn.compact
    def __call__(self, h):
        h = h + Branch(self.width, name="branch")(h)
        self.sow("intermediates", "block_out", h)
        return h


class MyResMLP(nn.Module):
    width: int = WIDTH
    num_blocks: int = K

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(self.width, name="stem")(x)
        self.sow("intermediates", "stem_out", h)
        for k in range(self.num_blocks):
            h = Block(self.width, name=f"block_{k}")(h)
        return nn.Dense(1, name="head")(h)


def _by_hand(v, x):
    """The stream h_0 ... h_K of MyResMLP, from its parameters."""
    p = v["params"]
    h = x @ p["stem"]["kernel"] + p["stem"]["bias"]
    out = [h]
    for k in range(K):
        h = h + Branch(WIDTH).apply({"params": p[f"block_{k}"]["branch"]}, h)
        out.append(h)
    return jnp.stack(out)


@pytest.fixture(scope="module")
def user_model():
    model = MyResMLP()
    x = jax.random.normal(jax.random.key(1), (16, 1))
    return model, model.init(jax.random.key(0), x), x


def test_variance_through_depth_of_a_users_module_without_train(user_model):
    model, v, x = user_model
    stream = _by_hand(v, x)
    for callee in (model, model.apply, lambda variables, inputs, **kw: model.apply(variables, inputs, **kw)):
        out = variance_through_depth(callee, v, x)
        np.testing.assert_allclose(out["variance"], jnp.var(stream.reshape(K + 1, -1), axis=1), rtol=1e-5)
        assert out["per_unit_variance"].shape == (K + 1,)
    np.testing.assert_allclose(stream_activations(model, v, x), stream, rtol=1e-5, atol=1e-6)
    ratio = branch_variance_ratio(model, v, x)
    added = stream[1:] - stream[:-1]
    np.testing.assert_allclose(ratio, jnp.var(added.reshape(K, -1), 1) / jnp.var(stream[:-1].reshape(K, -1), 1),
                               rtol=1e-4)
    with pytest.raises(ValueError, match="train: MyResMLP takes no 'train'"):
        variance_through_depth(model, v, x, train=True)


def test_a_module_that_sows_nothing_is_told_the_sow():
    dense = nn.Dense(3)
    x = jnp.ones((4, 3))
    with pytest.raises(ValueError, match=r"self.sow\('intermediates', 'block_out', h\)"):
        variance_through_depth(dense, dense.init(jax.random.key(0), x), x)


def test_shattering_of_a_users_module_and_of_a_plain_function(user_model):
    model, v, _ = user_model
    grid = jnp.linspace(-2.0, 2.0, 9)
    direct = jax.vmap(jax.grad(lambda t: model.apply(v, t.reshape(1, 1))[0, 0]))(grid)
    np.testing.assert_allclose(input_gradients(model, v, grid), direct, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(input_gradients(model.apply, v, grid), direct, rtol=1e-5, atol=1e-6)
    cubic = lambda variables, x: variables["a"] * x ** 3  # noqa: E731  any JAX function
    np.testing.assert_allclose(input_gradients(cubic, {"a": 2.0}, grid), 6 * grid ** 2, rtol=1e-6, atol=1e-6)
    many = init_many(model, jax.random.key(3), 2)
    g = input_gradients_many(model, many, grid)
    assert g.shape == (2, 9)
    one = jax.tree_util.tree_map(lambda a: a[1], many)
    np.testing.assert_allclose(g[1], input_gradients(model, one, grid), rtol=1e-5, atol=1e-6)


def _branch_fn(p, x):
    return Branch(WIDTH).apply({"params": p}, x)


def test_path_expansion_of_a_users_stack_sums_to_its_jacobian(user_model):
    model, v, _ = user_model
    x = jax.random.normal(jax.random.key(2), (3, 1))
    p = v["params"]
    same = [(_branch_fn, p[f"block_{k}"]["branch"]) for k in range(K)]  # one function: stacked parameters
    mixed = [((lambda q, h: _branch_fn(q, h)), p[f"block_{k}"]["branch"]) for k in range(K)]  # K functions
    x0 = stream_input(model, v, x)
    np.testing.assert_allclose(x0, _by_hand(v, x)[0], rtol=1e-6)
    for stack in (branch_stack(same), same, mixed):
        pe = path_expansion(stack, x0)
        assert pe.terms.shape == (3, K + 1, WIDTH, WIDTH)
        np.testing.assert_allclose(pe.stream[:, -1], _by_hand(v, x)[-1], rtol=1e-5, atol=1e-6)
        for b in range(3):
            def to_end(h0):
                for f, q in same:
                    h0 = h0 + f(q, h0)
                return h0

            np.testing.assert_allclose(pe.terms[b].sum(0), jax.jacfwd(to_end)(x0[b]), rtol=1e-5, atol=1e-6)
            # and the module's own input Jacobian: head . (sum_m E_m) . stem
            whole = jax.jacfwd(lambda xi: model.apply(v, xi[None])[0])(x[b])
            chain = p["head"]["kernel"].T @ pe.terms[b].sum(0) @ p["stem"]["kernel"].T
            np.testing.assert_allclose(chain, whole, rtol=1e-5, atol=1e-6)
    assert branch_stack(same).thetas["Dense_0"]["kernel"].shape == (K, WIDTH, WIDTH)  # stacked
    assert branch_stack(mixed).thetas.shape == (K,)  # lax.switch over the K functions
    with pytest.raises(ValueError, match="path_expansion: a stack of your own"):
        path_expansion(same, x0, x)
    with pytest.raises(ValueError, match="no branches"):
        branch_stack([])
    with pytest.raises(ValueError, match=r"has no residual blocks.*branch_stack\(\[\(f_1, params_1\)"):
        path_expansion(model, v, x)  # a module of one's own goes through branch_stack, and is told so


# ---- NNX --------------------------------------------------------------------------------------------


class NNXBlock(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs):
        self.lin = nnx.Linear(width, width, rngs=rngs)

    def __call__(self, h):
        return self.lin(nnx.tanh(h))


class NNXResMLP(nnx.Module):
    def __init__(self, width: int, num_blocks: int, rngs: nnx.Rngs):
        self.stem = nnx.Linear(1, width, rngs=rngs)
        self.blocks = nnx.List([NNXBlock(width, rngs) for _ in range(num_blocks)])
        self.head = nnx.Linear(width, 1, rngs=rngs)

    def __call__(self, x):
        h = self.stem(x)
        self.sow(nnx.Intermediate, "stem_out", h)
        for block in self.blocks:
            h = h + block(h)
            block.sow(nnx.Intermediate, "block_out", h)
        return self.head(h)


def _nnx_branch(p, h):
    return nnx.tanh(h) @ p["lin"]["kernel"] + p["lin"]["bias"]


def test_an_nnx_model_of_ones_own_through_to_linen():
    model = bridge.to_linen(NNXResMLP, WIDTH, K)
    x = jax.random.normal(jax.random.key(1), (16, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # flax 0.12: sow outside nnx.capture
        v = model.init(jax.random.key(0), x)
        p = v["params"]
        stream = [x @ p["stem"]["kernel"] + p["stem"]["bias"]]
        for k in range(K):
            stream.append(stream[-1] + _nnx_branch(p["blocks"][k], stream[-1]))
        stream = jnp.stack(stream)
        np.testing.assert_allclose(stream_activations(model, v, x), stream, rtol=1e-5, atol=1e-6)
        out = variance_through_depth(model, v, x)
        np.testing.assert_allclose(out["variance"], jnp.var(stream.reshape(K + 1, -1), 1), rtol=1e-5)

        grid = jnp.linspace(-1.0, 1.0, 7)
        direct = jax.vmap(jax.grad(lambda t: model.apply(v, t.reshape(1, 1))[0, 0]))(grid)
        np.testing.assert_allclose(input_gradients(model, v, grid), direct, rtol=1e-5, atol=1e-6)

        x0 = stream_input(model, v, x[:2])
        pe = path_expansion([(_nnx_branch, p["blocks"][k]) for k in range(K)], x0)
        for b in range(2):
            whole = jax.jacfwd(lambda xi: model.apply(v, xi[None])[0])(x[b])
            chain = p["head"]["kernel"].T @ pe.terms[b].sum(0) @ p["stem"]["kernel"].T
            np.testing.assert_allclose(chain, whole, rtol=1e-5, atol=1e-6)


def test_a_linen_model_held_by_tonnx_and_nnx_objects_refused(user_model):
    model, _, x = user_model
    wrapped = bridge.ToNNX(model, rngs=nnx.Rngs(0))
    bridge.lazy_init(wrapped, x)
    module, variables = from_nnx(wrapped)
    assert module is model and set(variables) == {"params"}
    np.testing.assert_allclose(wrapped(x), model.apply(variables, x), rtol=1e-6)
    np.testing.assert_allclose(variance_through_depth(*from_nnx(wrapped), x)["variance"],
                               variance_through_depth(model, variables, x)["variance"], rtol=1e-6)
    grid = jnp.linspace(-1.0, 1.0, 5)
    for call in (lambda: variance_through_depth(wrapped, variables, x),
                 lambda: input_gradients(wrapped, variables, grid),
                 lambda: path_expansion(wrapped, variables, x)):
        with pytest.raises(TypeError, match="is an NNX module.*from_nnx"):
            call()
    with pytest.raises(TypeError, match="nnx.State.*from_nnx"):
        variance_through_depth(model, nnx.state(wrapped), x)
    with pytest.raises(TypeError, match="NNX module of its own.*to_linen"):
        from_nnx(NNXResMLP(WIDTH, K, nnx.Rngs(0)))
