"""Signal propagation at initialisation: variance through depth and gradient scale (resjax.analysis.propagation)."""

import json
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import common, gradient_scale, variance_growth
from resjax.analysis import propagation as prop
from resjax.nn import ResidualStack
from resjax.nn import ResidualMLP

WIDTH, BLOCKS, BATCH, NETS = 128, 6, 128, 8


def _curves(norm="none", scaling="none", scan=True, seed=0):
    """Variance curves of NETS networks (vmapped over weights and inputs), train-mode BatchNorm."""
    model = ResidualStack(width=WIDTH, num_blocks=BLOCKS, norm=norm, scaling=scaling, scan=scan)

    def one(key):
        kp, kx = jax.random.split(key)
        x = jax.random.normal(kx, (BATCH, WIDTH))
        v = model.init(kp, x)
        out = prop.variance_through_depth(model, v, x, train=True)
        out["ratio"] = prop.branch_variance_ratio(model, v, x, train=True)
        return out

    out = jax.jit(jax.vmap(one))(jax.random.split(jax.random.key(seed), NETS))
    return {k: np.asarray(v) for k, v in out.items()}


@pytest.fixture(scope="module")
def curves():
    return {name: _curves(**kw) for name, kw in variance_growth.BLOCKS.items()}


def test_added_variance_doubles_per_block_on_average(curves):
    v = curves["added"]["variance"].mean(0)
    np.testing.assert_allclose(v[1:] / v[:-1], 2.0, rtol=0.15)
    np.testing.assert_allclose(v, prop.doubling_guide(BLOCKS) * v[0], rtol=0.3)
    assert abs(float(np.mean(prop.log2_growth_per_block(curves["added"]["variance"]))) - 1) < 0.1


def test_rescaled_variance_stays_constant(curves):
    v = curves["rescaled"]["variance"].mean(0)
    np.testing.assert_allclose(v, v[0], rtol=0.2)


def test_normalised_variance_grows_by_one_per_block(curves):
    v = curves["normalised"]["variance"].mean(0)
    np.testing.assert_allclose(np.diff(v), 1.0, atol=0.15)
    np.testing.assert_allclose(v, prop.linear_guide(BLOCKS, v0=v[0]), rtol=0.05)
    # The per-unit batch variance (udlbook 11.3) misses the units' batch means: about 1 - 1/pi per block.
    np.testing.assert_allclose(np.diff(curves["normalised"]["per_unit_variance"].mean(0)), 1 - 1 / math.pi, atol=0.1)
    # Relative size of later branches: 1/(k + 1).
    np.testing.assert_allclose(curves["normalised"]["ratio"].mean(0), prop.ratio_guide(BLOCKS), rtol=0.1)


def test_rescale_is_the_added_stream_over_two_to_the_half_k():
    """Zero biases and a positively homogeneous ReLU: same weights, h_k(rescaled) = h_k(added) / 2^(k/2)."""
    x = jax.random.normal(jax.random.key(0), (16, 32))
    added, rescaled = (ResidualStack(width=32, num_blocks=5, scaling=s) for s in ("none", "rescale"))
    v = added.init(jax.random.key(1), x)
    with jax.default_matmul_precision("highest"):
        a = prop.stream_activations(added, v, x)
        r = prop.stream_activations(rescaled, v, x)
    np.testing.assert_allclose(r, a / 2.0 ** (np.arange(6)[:, None, None] / 2), rtol=1e-4, atol=1e-6)


def test_scan_and_residual_mlp_layouts_are_read_in_depth_order():
    x = jax.random.normal(jax.random.key(0), (8, 5))
    model = ResidualMLP(width=16, num_blocks=12)
    v = jax.jit(model.init)(jax.random.key(1), x)
    stream, inter = jax.jit(lambda v: (prop.stream_activations(model, v, x),
                                       model.apply(v, x, mutable=["intermediates"])[1]))(v)
    assert stream.shape == (13, 8, 16)
    np.testing.assert_array_equal(stream[11], inter["intermediates"]["blocks_10"]["block_out"][0])
    scanned = ResidualStack(width=16, num_blocks=4, scan=True)
    h = jax.random.normal(jax.random.key(2), (8, 16))
    s = prop.stream_activations(scanned, scanned.init(jax.random.key(3), h), h)
    assert s.shape == (5, 8, 16)
    np.testing.assert_array_equal(s[0], h)


def test_identity_factors_keep_the_norm():
    jac = jnp.zeros((7, 10, 10))
    for kind in ("residual", "residual_scaled"):
        np.testing.assert_allclose(prop.product_norms(jac, kind, num_blocks=7), 1.0, rtol=1e-6)
    np.testing.assert_array_equal(prop.product_norms(jac, "plain")[1:], 0.0)


def test_gradient_scale_matches_explicit_products_and_theory():
    key = jax.random.key(0)
    depth, width, draws = 30, 16, 200
    norms = jax.jit(lambda k: prop.gradient_scale(k, depth, width, draws, num_blocks=depth))(key)
    # Draw 0 again, by hand: its Jacobians and start vector, multiplied out with product_norms.
    k0 = jax.random.split(key, draws)[0]
    jacs = jnp.stack([prop.random_relu_jacobian(jax.random.fold_in(k0, i), width) for i in range(1, depth + 1)])
    start = prop._unit_start(jax.random.fold_in(k0, 0), width)
    for kind in prop.KINDS:
        np.testing.assert_allclose(norms[kind][0], prop.product_norms(jacs, kind, depth, start), rtol=1e-4)
    med = {k: np.median(np.asarray(v), axis=0) for k, v in norms.items()}
    # Plain: E|g|^2 stays 1 but the typical (median) gradient shrinks and the spread widens.
    assert med["plain"][-1] < 0.7
    p10, p90 = np.percentile(norms["plain"][:, -1], [10, 90])
    assert p90 / p10 > 4
    # Residual: |g_k| ~ 2^(k/2); small branches: ~ (1 + 1/K)^(k/2), close to 1.
    assert abs(np.log2(med["residual"][-1]) / depth - 0.5) < 0.08
    assert 1.0 < med["residual_scaled"][-1] < 2.0
    np.testing.assert_allclose(np.mean(np.asarray(norms["plain"][:, 1:]) ** 2, 0)[:5], 1.0, rtol=0.25)


@pytest.mark.parametrize("call, setting", [
    (lambda: prop.gradient_scale(jax.random.key(0), 5, 0, 3), "width"),
    (lambda: prop.gradient_scale(jax.random.key(0), 0, 4, 3), "depth"),
    (lambda: prop.gradient_scale(jax.random.key(0), 5, 4, 0), "num_draws"),
    (lambda: prop.gradient_scale(jax.random.key(0), 5, 4, 3, num_blocks=0), "num_blocks"),
    (lambda: prop.gradient_scale(jax.random.key(0), 5, 4, 3, kinds=("skip",)), "kind"),
    (lambda: prop.product_norms(jnp.zeros((3, 4, 4)), "residual_scaled"), "num_blocks"),
    (lambda: prop.product_norms(jnp.zeros((3, 4, 4)), "residual_scaled", num_blocks=0), "num_blocks"),
    (lambda: prop.product_norms(jnp.zeros((0, 4, 4)), "plain"), "depth"),
    (lambda: prop.random_relu_jacobian(jax.random.key(0), 0), "width"),
    (lambda: prop.doubling_guide(0), "num_blocks"),
    (lambda: ResidualStack(width=0, num_blocks=3), "width"),
    (lambda: ResidualStack(width=4, num_blocks=0), "num_blocks"),
    (lambda: ResidualStack(width=4, num_blocks=2, norm="bogus"), "norm"),
])
def test_bad_settings_raise_value_error_naming_them(call, setting):
    with pytest.raises(ValueError, match=setting):
        call()


def test_bad_inputs_and_modules_raise_value_error():
    model = ResidualStack(width=4, num_blocks=2)
    x = jnp.ones((3, 4))
    v = model.init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="inputs"):
        prop.variance_through_depth(model, v, x[:1])
    with pytest.raises(ValueError, match="inputs"):
        prop.variance_through_depth(model, v, jnp.ones(4))
    with pytest.raises(ValueError, match="order"):
        post = ResidualStack(width=4, num_blocks=2, order="post")
        prop.branch_variance_ratio(post, post.init(jax.random.key(0), x), x)

    class Dense(nn.Module):
        @nn.compact
        def __call__(self, h, train=False):
            return nn.Dense(4)(h)

    d = Dense()
    with pytest.raises(ValueError, match="module"):
        prop.variance_through_depth(d, d.init(jax.random.key(0), x), x)


@pytest.mark.parametrize("module", [gradient_scale, variance_growth])
def test_quick_run_writes_results_and_figure(module, tmp_path):
    results = common.run_experiment(module, module.get_config("quick"), tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["experiment"] == module.NAME and set(saved) == {"experiment", "config", "metrics", "seconds"}
    m = saved["metrics"]
    if module is gradient_scale:
        names = [f"grad_norm_at_50.{k}.{s}" for k in prop.KINDS for s in ("p10", "median", "p90")]
    else:
        names = [f"{p}.{b}" for p in ("variance_after_20", "variance_after_20_mean", "per_unit_variance_after_20",
                                      "per_unit_variance_after_20_mean", "log2_growth_per_block_mean")
                 for b in variance_growth.BLOCKS] + ["branch_ratio_mean.normalised", "branch_ratio_guide"]
        assert len(m["variance_after_20_all.added"]) == results["config"]["num_networks"]
    for name in names:
        assert name in m and m[name] is not None, name
    for claim in module.CLAIMS:  # every claim can be evaluated on the metrics
        claim.measure(m)
        claim.holds(m)
    assert (tmp_path / f"{module.NAME}.png").stat().st_size > 10_000
