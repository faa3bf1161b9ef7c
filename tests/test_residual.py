"""The residual contract, branch scalings, scan, and use from a user's own Flax code."""

from unittest import mock

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import resjax.nn.residual as residual
from benchmarks.throughput import largest_fusion
from resjax.nn import (ResidualBlock, ResidualMLP, computed_once, concat_merge, residual_add, stack_unrolled,
                       unstack_scanned)
from tests.conftest import default_emitters_block, xla_optimisations


def test_residual_add_adds_equal_shapes():
    a, b = jnp.ones((4, 8)), jnp.full((4, 8), 2.0)
    np.testing.assert_array_equal(residual_add(a, b), 3.0)


@pytest.mark.parametrize("branch_shape", [(4, 1), (1, 8), (8,), (4, 8, 1)])
def test_residual_add_refuses_to_broadcast(branch_shape):
    with pytest.raises(ValueError, match=r"residual_add: skip shape \(4, 8\)"):
        residual_add(jnp.ones((4, 8)), jnp.ones(branch_shape))


def test_residual_add_under_vmap_says_its_shapes_are_per_example():
    """Under ``jax.vmap`` the shapes that reach ``residual_add`` lack the mapped axes; the message says so and
    gives the shapes the caller passed (through nested vmaps too)."""
    skip, branch = jnp.ones((2, 3, 4)), jnp.ones((2, 3, 5))
    with pytest.raises(ValueError) as plain:
        residual_add(skip, branch)
    assert "per example" not in str(plain.value)
    for f, inner in ((jax.vmap(residual_add), "(3, 4)"), (jax.vmap(jax.vmap(residual_add)), "(4,)")):
        with pytest.raises(ValueError) as err:
            f(skip, branch)
        assert f"skip shape {inner}" in str(err.value)
        assert "shapes per example: this call is inside jax.vmap" in str(err.value)
        assert "with them the mapped arguments have shapes (2, 3, 4) and (2, 3, 5)" in str(err.value)
    with pytest.raises(ValueError, match="if this runs inside jax.vmap, these are per-example shapes"):
        jax.vmap(jax.jit(residual_add))(skip, branch)  # jit inside vmap traces per-example shapes


def test_residual_add_checks_under_jit():
    with pytest.raises(ValueError, match="residual_add"):
        jax.jit(residual_add)(jnp.ones((4, 8)), jnp.ones((4, 1)))


class _NarrowBranch(nn.Module):
    """A block whose branch returns one feature: must not broadcast onto the stream."""

    @nn.compact
    def __call__(self, x):
        return residual_add(x, nn.Dense(1)(x))


def test_mismatched_branch_inside_a_module_fails_at_init():
    with pytest.raises(ValueError, match=r"branch shape \(2, 1\)"):
        _NarrowBranch().init(jax.random.key(0), jnp.ones((2, 5)))


def _init(model, x, **kw):
    return model.init(jax.random.key(0), x, **kw)


X = jax.random.normal(jax.random.key(1), (16, 12))


@pytest.mark.parametrize("order", ["pre", "post"])
@pytest.mark.parametrize("norm", ["none", "batch", "layer"])
@pytest.mark.parametrize("scaling", ["none", "tau", "skipinit", "fixup", "rescale"])
def test_scan_equals_unrolled(order, norm, scaling):
    kw = dict(width=8, num_blocks=5, num_layers=2, order=order, norm=norm, scaling=scaling)
    unrolled, scanned = ResidualMLP(**kw), ResidualMLP(**kw, scan=True)
    v = _init(unrolled, X)
    # Perturb so that zero-initialised layers (SkipInit, Fixup) also matter.
    v = jax.tree_util.tree_map(lambda a: a + 0.1 * jax.random.normal(jax.random.key(a.size), a.shape), v)
    vs = {c: stack_unrolled(col, 5) for c, col in v.items()}
    with jax.default_matmul_precision("highest"):
        # the scanned model in both modes in one jitted program (eager, each nn.scan compiles a program of its
        # own); the unrolled one eagerly, whose ops the cases share
        scanned_out = jax.jit(lambda vs: [scanned.apply(vs, X, train=train, mutable=["batch_stats"])
                                          for train in (False, True)])(vs)
        for train in (False, True):
            yu, su = unrolled.apply(v, X, train=train, mutable=["batch_stats"])
            ys, ss = scanned_out[train]
            np.testing.assert_allclose(yu, ys, rtol=1e-5, atol=1e-5)
            if norm == "batch":
                chex.assert_trees_all_close(unstack_scanned(ss["batch_stats"], 5), su["batch_stats"], rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_equal_structs(unstack_scanned(vs["params"], 5), v["params"])


def test_scanned_params_have_a_depth_axis():
    v = _init(ResidualMLP(width=8, num_blocks=7, norm="batch", scan=True), X)
    assert v["params"]["blocks"]["block"]["linear_0"]["kernel"].shape == (7, 8, 8)
    assert v["batch_stats"]["blocks"]["block"]["norm_0"]["mean"].shape == (7, 8)
    assert set(v) == {"params", "batch_stats"}


@pytest.mark.parametrize("scan", [False, True])
def test_tau_is_traced_and_vmappable(scan):
    model = ResidualMLP(width=8, num_blocks=4, scaling="tau", tau="1/sqrt(K)", scan=scan)
    v = _init(model, X)
    taus = jnp.array([0.1, 0.25, 1.0])  # a concrete tau must be > 0; a traced 0 is tested below
    with jax.default_matmul_precision("highest"):
        ys = jax.jit(jax.vmap(lambda t: model.apply(v, X, tau=t)))(taus)
        for t, y in zip(taus, ys):
            np.testing.assert_allclose(y, model.apply(v, X, tau=float(t)), rtol=1e-5, atol=1e-6)
        # Without a traced tau, the rule is used: 1/sqrt(4) = 0.5.
        np.testing.assert_allclose(model.apply(v, X), model.apply(v, X, tau=0.5), rtol=1e-6)


def test_tau_zero_makes_every_block_the_identity():
    model = ResidualMLP(width=8, num_blocks=3, order="pre", scaling="tau")
    v = _init(model, X)
    # tau = 0 traced (a concrete tau <= 0 is refused; a traced one cannot be checked by value)
    _, inter = jax.jit(lambda t: model.apply(v, X, tau=t, mutable=["intermediates"]))(0.0)
    stem = inter["intermediates"]["stem_out"][0]
    for k in range(3):
        np.testing.assert_array_equal(inter["intermediates"][f"blocks_{k}"]["block_out"][0], stem)


@pytest.mark.parametrize("scaling", ["skipinit", "fixup"])
@pytest.mark.parametrize("num_layers", [1, 2, 3])
def test_skipinit_and_fixup_start_as_identity(scaling, num_layers):
    block = ResidualBlock(features=8, num_layers=num_layers, order="pre", scaling=scaling, num_blocks=10)
    v = block.init(jax.random.key(0), X[:, :8])
    np.testing.assert_array_equal(block.apply(v, X[:, :8]), X[:, :8])


def test_fixup_scales_inner_layers_and_zeroes_the_head():
    kw = dict(width=64, num_blocks=16, num_layers=3, scaling="fixup", kernel_init="he_normal")
    p = _init(ResidualMLP(**kw), jnp.ones((2, 64)))["params"]
    ref = _init(ResidualMLP(**{**kw, "scaling": "none"}), jnp.ones((2, 64)))["params"]
    assert not np.any(p["head"]["kernel"])
    assert not np.any(p["blocks_0"]["linear_2"]["kernel"])
    # Layers other than the last: He draws times K^(-1/(2m-2)) = 16^(-1/4) = 0.5.
    ratio = np.std(p["blocks_0"]["linear_0"]["kernel"]) / np.std(ref["blocks_0"]["linear_0"]["kernel"])
    assert abs(ratio - 0.5) < 0.05
    assert p["blocks_0"]["fixup_scale"] == 1.0


def test_unnormalised_residual_variance_doubles_per_block_and_rescale_keeps_it():
    """Lecture 'Variance growth': with He (2/fan-in) branches, Var(h_k) = 2 Var(h_(k-1)) at init;
    the 1/sqrt(2) sum keeps it constant. Averaged over 8 networks of width 512."""
    x = jax.random.normal(jax.random.key(2), (256, 512))
    kw = dict(width=512, num_blocks=8, order="pre", kernel_init="he_normal", use_bias=False)

    def second_moments(model):  # per seed: the stream's mean square at every depth (one jitted program per model)
        def one(seed):
            _, inter = model.apply(model.init(jax.random.key(seed), x), x, mutable=["intermediates"])
            i = inter["intermediates"]
            outs = [i["stem_out"][0]] + [i[f"blocks_{k}"]["block_out"][0] for k in range(8)]
            return jnp.stack([jnp.mean(o ** 2) for o in outs])

        one = jax.jit(one)
        return np.stack([np.asarray(one(seed)) for seed in range(8)])

    grow = np.mean(second_moments(ResidualMLP(**kw)), 0)
    flat = np.mean(second_moments(ResidualMLP(**kw, scaling="rescale")), 0)
    np.testing.assert_allclose(grow[1:] / grow[:-1], 2.0, rtol=0.1)
    np.testing.assert_allclose(flat[1:] / flat[:-1], 1.0, rtol=0.1)
    np.testing.assert_allclose(grow[-1] / grow[0], 2.0 ** 8, rtol=0.25)


class UserNet(nn.Module):
    """A user's own module: resjax blocks scanned with nn.scan inside it."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(16)(x)

        class Step(nn.Module):
            @nn.compact
            def __call__(self, h, _):
                return ResidualBlock(features=16, norm="layer", order="pre")(h, train), None

        x, _ = nn.scan(Step, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)()(x, None)
        return nn.Dense(2)(x)


def test_blocks_inside_user_module_under_jit_vmap_and_scan():
    net = UserNet()
    v = jax.jit(net.init)(jax.random.key(0), X)
    assert v["params"]["ScanStep_0"]["ResidualBlock_0"]["linear_0"]["kernel"].shape == (3, 16, 16)
    apply = jax.jit(net.apply)  # one program for every apply below
    y = apply(v, X)
    assert y.shape == (16, 2)
    # vmap over a stack of parameter sets (e.g. seeds): each equals its own apply.
    vs = jax.jit(jax.vmap(lambda k: net.init(k, X)))(jax.random.split(jax.random.key(3), 2))
    ys = jax.jit(jax.vmap(lambda vv: net.apply(vv, X)))(vs)
    for i in range(2):
        vi = jax.tree_util.tree_map(lambda a: a[i], vs)
        np.testing.assert_allclose(ys[i], apply(vi, X), rtol=1e-5, atol=1e-6)
    g = jax.jit(jax.grad(lambda vv: jnp.sum(net.apply(vv, X) ** 2)))(v)
    assert all(np.isfinite(leaf).all() for leaf in jax.tree_util.tree_leaves(g))


def test_concat_merge_checks_every_axis_but_the_channels():
    a, b = jnp.ones((2, 8, 8, 3)), jnp.zeros((2, 8, 8, 5))
    assert concat_merge(a, b).shape == (2, 8, 8, 8)
    with pytest.raises(ValueError, match=r"concat_merge: shapes \[\(2, 8, 8, 3\), \(2, 4, 4, 5\)\]"):
        concat_merge(a, jnp.zeros((2, 4, 4, 5)))
    with pytest.raises(ValueError, match="concat_merge"):
        concat_merge(a, jnp.zeros((2, 8, 3)))


@pytest.mark.parametrize("order, scaling", [("pre", "rescale"), ("post", "none"), ("post", "rescale"), ("pre", "none")])
def test_a_merge_ending_in_an_elementwise_op_is_computed_once_in_unrolled_blocks(order, scaling):
    """A block ending in the 1/sqrt(2) rescale or the post activation (an elementwise op of one operand) made XLA
    fuse it, with the sum before it and the blocks before that, into every consumer: each of K blocks' fusions
    recomputed the stream from the stem (a 32-block rescaled MLP's fusions took up to 97 operands and its step
    2.7x the time). ``computed_once`` keeps one array per block: no fusion of the training step then takes more
    operands than a few blocks' worth, at any depth; and the block's output is still the merge, bit for bit."""
    x = jax.random.normal(jax.random.key(1), (8, 12))
    model = ResidualMLP(width=16, num_blocks=24, num_classes=4, order=order, scaling=scaling)
    params = model.init(jax.random.key(0), x, train=False)["params"]
    step = jax.jit(jax.grad(lambda p: jnp.mean(model.apply({"params": p}, x, train=True) ** 2)))
    with xla_optimisations(True), default_emitters_block():  # as users' programs compile
        text = step.lower(params).compile().as_text()
    assert largest_fusion(text) <= 12, f"a fusion takes {largest_fusion(text)} operands: the stream is recomputed"

    summed = jnp.array([[1.5, -2.0, jnp.nan, 0.0]])
    for out in (summed * (1 / np.sqrt(2)), jax.nn.relu(summed)):
        np.testing.assert_array_equal(computed_once(out, summed), out)  # NaN where the sum is NaN, as `out` is


@pytest.mark.parametrize("scan, remat", [(False, False), (True, False), (True, True)])
def test_only_unrolled_blocks_pass_their_merge_through_computed_once(scan, remat):
    """In a scanned stack the block's output is the scan's carry, which XLA computes once anyway; there the select
    of ``computed_once`` only cost time (3% of a depth-100 tau network's epoch), so it is left out."""
    calls = []

    def spy(out, summed):
        calls.append(out.shape)
        return out

    model = ResidualMLP(width=8, num_blocks=5, order="post", scan=scan, remat=remat)
    with mock.patch.object(residual, "computed_once", spy):
        v = _init(model, X)
        calls.clear()
        model.apply(v, X, train=True)
    assert len(calls) == (0 if scan else 5)
