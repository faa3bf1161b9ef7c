"""Shattered gradients: autograd input gradients, autocorrelation estimators, half-correlation distance,
bias initialisation, and the experiment's --quick run."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import common, shattered_gradients
from resjax.analysis import shattering
from resjax.nn import PlainMLP, ResidualBlock, ResidualMLP
from resjax.nn.init import get_bias_initializer

# ---- input gradients ---------------------------------------------------------------------------------


class _Cubic(nn.Module):
    """y = a x^3 + b x with learnable a, b: dy/dx = 3 a x^2 + b."""

    @nn.compact
    def __call__(self, x):
        a = self.param("a", nn.initializers.normal(1.0), ())
        b = self.param("b", nn.initializers.normal(1.0), ())
        return a * x ** 3 + b * x


def test_input_gradients_of_a_known_function():
    v = {"params": {"a": jnp.float32(2.0), "b": jnp.float32(-1.0)}}
    grid = shattering.make_grid(16)
    np.testing.assert_allclose(shattering.input_gradients(_Cubic(), v, grid), 6 * grid ** 2 - 1, rtol=1e-6, atol=1e-6)


def test_relu_network_gradient_by_hand_and_many_networks_match_jacfwd():
    # One hidden layer with hand-set weights: y = relu(x - 1) * 3 + relu(-x) * 5 -> dy/dx = 3 [x > 1] - 5 [x < 0].
    module = PlainMLP(width=2, depth=1, num_classes=1)
    v = jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((1, 1)))  # the parameters' structure
    p = jax.tree_util.tree_map(lambda a: np.zeros(a.shape, a.dtype), v["params"])
    p["stem"] = {"kernel": np.array([[1.0, -1.0]], np.float32), "bias": np.array([-1.0, 0.0], np.float32)}
    p["blocks_0"] = {"linear_0": {"kernel": np.eye(2, dtype=np.float32), "bias": np.zeros(2, np.float32)}}
    p["head"] = {"kernel": np.array([[3.0], [5.0]], np.float32), "bias": np.zeros(1, np.float32)}
    grid = jnp.array([-1.5, -0.5, 0.5, 1.5, 1.9])
    by_hand = jax.jit(lambda p: shattering.input_gradients(module, {"params": p}, grid))(p)  # one program
    np.testing.assert_allclose(by_hand, [-5, -5, 0, 3, 3])

    module = ResidualMLP(width=6, num_blocks=3, num_classes=1, scaling="tau", kernel_init="fan_in", bias_init="fan_in")

    @jax.jit
    def run(key, tau):  # one program, not one per eager op
        many = shattering.init_many(module, key, 3)
        one = lambda n: jax.tree_util.tree_map(lambda a: a[n], many)  # noqa: E731  network n's variables
        jacs = [jax.vmap(jax.jacfwd(lambda x, vn=one(n): module.apply(vn, x.reshape(1, 1))[0, 0]))(grid)
                for n in range(3)]
        # A traced tau reaches the module through apply_kwargs: tau = 0 removes every branch (traced: a concrete
        # tau <= 0 is refused).
        g0 = shattering.input_gradients(module, one(0), grid, tau=tau)
        return many, shattering.input_gradients_many(module, many, grid), jacs, g0

    many, g, jacs, g0 = run(jax.random.key(1), 0.0)
    assert g.shape == (3, 5)
    for n in range(3):
        np.testing.assert_allclose(g[n], jacs[n], rtol=1e-5, atol=1e-6)
    p0 = jax.tree_util.tree_map(lambda a: np.asarray(a[0]), many)["params"]
    np.testing.assert_allclose(g0, (p0["stem"]["kernel"] @ p0["head"]["kernel"])[0, 0], rtol=1e-5)


def test_input_gradients_refuse_bad_input():
    v = {"params": {"a": jnp.float32(1.0), "b": jnp.float32(0.0)}}
    with pytest.raises(ValueError, match="grid"):
        shattering.input_gradients(_Cubic(), v, jnp.array([0.5]))
    with pytest.raises(ValueError, match="grid_points"):
        shattering.make_grid(1)
    with pytest.raises(ValueError, match="grid_range"):
        shattering.make_grid(8, 2.0, -2.0)
    with pytest.raises(ValueError, match="num_networks"):
        shattering.init_many(_Cubic(), jax.random.key(0), 0)
    wide = PlainMLP(width=4, depth=1, num_classes=3)
    with pytest.raises(ValueError, match="scalar output"):
        shattering.input_gradients(wide, wide.init(jax.random.key(0), jnp.zeros((1, 1))), jnp.arange(4.0))


def test_make_grid_is_the_notebooks_arange():
    np.testing.assert_allclose(shattering.make_grid(256), np.arange(-2, 2, 4 / 256), atol=1e-6)


# ---- autocorrelation ---------------------------------------------------------------------------------


def test_estimators_on_a_cosine():
    n, omega = 512, 2 * np.pi / 64
    a = np.cos(omega * np.arange(n))
    lags = np.arange(33)
    # A cosine's autocorrelation is cos(omega * lag), up to the partial periods at the ends.
    for est in ("pearson", "mean_subtracted", "raw"):
        np.testing.assert_allclose(shattering.autocorrelation(a, 32, est), np.cos(omega * lags), atol=0.03, err_msg=est)
    # Pearson is exactly np.corrcoef of the overlapping pairs at each lag.
    b = np.random.default_rng(2).normal(size=50).cumsum()
    ref = [1.0] + [np.corrcoef(b[:-lag], b[lag:])[0, 1] for lag in range(1, 40)]
    np.testing.assert_allclose(shattering.autocorrelation(b, 39, "pearson"), ref, rtol=1e-4, atol=1e-5)
    # The notebook's np.correlate(mode='same') / lag 0 is the raw sum: it tapers by (n - l) / n.
    a = np.random.default_rng(0).normal(size=100) + 0.3
    ref = np.correlate(a, a, mode="same")
    ref = ref / ref[50]
    np.testing.assert_allclose(shattering.autocorrelation(a, 49, "notebook"), ref[50:], rtol=1e-4, atol=1e-5)


def test_white_noise_decorrelates_at_lag_one_and_offsets_matter_only_when_uncentred():
    a = np.random.default_rng(1).normal(size=(4, 4096))
    for est in shattering.ESTIMATORS:
        ac = np.asarray(shattering.autocorrelation(a, 3, est))
        np.testing.assert_allclose(ac[:, 0], 1.0, rtol=1e-5)
        assert np.all(np.abs(ac[:, 1:]) < 0.06), est
    shifted = a + 3.0  # an offset of 3 standard deviations: uncentred estimators stay near 9 / 10
    assert np.all(np.asarray(shattering.autocorrelation(shifted, 3, "raw"))[:, 1:] > 0.85)
    np.testing.assert_allclose(shattering.autocorrelation(shifted, 3, "pearson"),
                               shattering.autocorrelation(a, 3, "pearson"), atol=1e-4)


def test_constant_slope_and_linear_ramp():
    const = np.full(64, 2.5)  # dy/dx of a linear function
    np.testing.assert_allclose(shattering.autocorrelation(const, 10, "raw"), 1.0, rtol=1e-6)
    np.testing.assert_allclose(shattering.autocorrelation(const, 10, "notebook"), 1 - np.arange(11) / 64, rtol=1e-6)
    assert np.isnan(shattering.autocorrelation(const, 10, "pearson")).all()
    assert np.isnan(shattering.autocorrelation(const, 10, "mean_subtracted")).all()
    # The pairs of a ramp lie on a line: Pearson correlation 1 at every lag with at least two pairs.
    np.testing.assert_allclose(shattering.autocorrelation(np.arange(64.0), 62, "pearson"), 1.0, atol=1e-5)


def test_half_correlation_distance_interpolates_exactly():
    half_distance = jax.jit(shattering.half_correlation_distance, static_argnums=1)  # a program per shape, not per op
    spacing = 1 / 64
    ramp = 1 - 0.03 * np.arange(40)  # crosses 0.5 at lag 50/3
    assert float(half_distance(ramp, spacing)) == pytest.approx(50 / 3 * spacing, rel=1e-5)
    batched = np.stack([ramp, 1 - 0.1 * np.arange(40), np.ones(40), np.r_[0.4, np.ones(39)]])
    np.testing.assert_allclose(half_distance(batched, 0.5),
                               [50 / 3 * 0.5, 2.5, np.nan, 0.0], rtol=1e-5)
    assert np.isnan(float(half_distance(np.r_[1.0, np.nan, 0.2], 1.0)))
    # Through the estimators: the Pearson autocorrelation of a cosine crosses 0.5 at a sixth of its period.
    a = np.cos(2 * np.pi * np.arange(1024) / 96)
    d = half_distance(shattering.autocorrelation(a, 40, "pearson"), 1.0)
    assert float(d) == pytest.approx(16.0, abs=0.1)


def test_autocorrelation_refuses_bad_input():
    with pytest.raises(ValueError, match="estimator"):
        shattering.autocorrelation(np.ones(8), 2, "spectral")
    with pytest.raises(ValueError, match="signal"):
        shattering.autocorrelation(np.ones(1), 0)
    with pytest.raises(ValueError, match="max_lag"):
        shattering.autocorrelation(np.ones(8), 8)
    with pytest.raises(ValueError, match="spacing"):
        shattering.half_correlation_distance(np.ones(8), 0.0)
    with pytest.raises(ValueError, match="curve"):
        shattering.half_correlation_distance(np.ones(1), 1.0)


# ---- bias initialisation -----------------------------------------------------------------------------


def _init_params(module, shape):
    """``module``'s parameters for inputs of ``shape``, as numpy arrays (init jitted: one program)."""
    params = jax.jit(module.init)(jax.random.key(0), jnp.zeros(shape))["params"]
    return jax.tree_util.tree_map(np.asarray, params)


def test_bias_init_fan_in_variance_and_defaults():
    b = np.asarray(jax.jit(get_bias_initializer("fan_in", 4), static_argnums=1)(jax.random.key(0), (40000,)))
    assert float(np.var(b)) == pytest.approx(0.25, rel=0.03)
    v = _init_params(PlainMLP(width=300, depth=1, num_classes=1, kernel_init="fan_in", bias_init="fan_in"), (1, 1))
    assert float(np.var(v["stem"]["bias"])) == pytest.approx(1.0, rel=0.25)  # fan-in 1
    assert float(np.var(v["blocks_0"]["linear_0"]["bias"])) == pytest.approx(1 / 300, rel=0.25)
    v = _init_params(ResidualMLP(width=8, num_blocks=2, num_classes=1), (1, 3))
    assert all(float(np.abs(leaf).max()) == 0 for path, leaf in jax.tree_util.tree_leaves_with_path(v)
               if "bias" in jax.tree_util.keystr(path))
    v = _init_params(ResidualMLP(width=8, num_blocks=2, num_classes=1, bias_init="fan_in", scan=True), (1, 3))
    assert float(np.abs(v["blocks"]["block"]["linear_0"]["bias"]).min()) > 0


def test_bias_init_unknown_name_is_refused():
    for make in (lambda: PlainMLP(width=4, depth=1, bias_init="ones"),
                 lambda: ResidualMLP(width=4, num_blocks=1, bias_init="ones"),
                 lambda: ResidualBlock(features=4, bias_init="ones")):
        with pytest.raises(ValueError, match="bias_init"):
            make()


# ---- the experiment ----------------------------------------------------------------------------------


def test_quick_run_writes_results(tmp_path):
    results = common.run_experiment(shattered_gradients, shattered_gradients.get_config("quick"), tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["experiment"] == "shattered_gradients"
    m = saved["metrics"]
    for net in shattered_gradients.NETWORKS:
        assert 0 < m[f"half_correlation_distance.{net}"] < 2
        for est in shattering.ESTIMATORS:
            assert f"half_correlation_distance_by_estimator.{est}.{net}" in m
        assert len(m[f"autocorrelation.{net}"]) == len(m["autocorrelation_distance"]) == 33
        assert len(m[f"half_correlation_distance_per_network.{net}"]) == 3
    assert m["half_correlation_distance.shallow"] == m["half_correlation_distance_by_estimator.pearson.shallow"]
    assert (tmp_path / "shattered_gradients.png").stat().st_size > 10_000
    section = shattered_gradients.report_section(results["metrics"])
    assert "pearson (default)" in section and "notebook" in section
    for claim in shattered_gradients.CLAIMS:
        claim.measure(m), claim.holds(m)


def test_bad_settings_are_refused_before_compiling(tmp_path):
    for name, value in [("width", 0), ("grid_points", 1), ("num_networks", 0), ("estimator", "fft")]:
        config = shattered_gradients.get_config("quick")
        config[name] = value
        with pytest.raises(ValueError, match=name if name != "grid_points" else "grid_points"):
            shattered_gradients.run(config, tmp_path)
