"""Taki (seed 004): the c/(nL) initialiser, the analytic gradient-variance curves, the measurement
(resjax.analysis.taki) and the experiment's quick mode (experiments/taki_init.py)."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import common, taki_init
from resjax.analysis import taki as T
from resjax.nn import INITIALIZERS, ResidualStack, get_initializer
from resjax.nn.init import taki_init as taki_factory


# ---- the initialiser -----------------------------------------------------------------------------------


@pytest.mark.parametrize("spec, c, L", [("taki(L=10)", 1.0, 10), ("taki(c=2, L=10)", 2.0, 10),
                                        ("taki( c = 0.5 , K = 4 )", 0.5, 4)])
def test_taki_initialiser_variance_is_c_over_nL(spec, c, L):
    n = 400
    w = get_initializer(spec)(jax.random.key(0), (n, 300))
    assert abs(float(jnp.var(w)) * n * L / c - 1) <= 0.03
    assert abs(float(jnp.mean(w))) < 0.01 * math.sqrt(c / (n * L)) * 10
    # The three spellings draw the same numbers; gain still multiplies the draw.
    key = jax.random.key(1)
    a = get_initializer(spec)(key, (8, 8))
    np.testing.assert_array_equal(a, get_initializer("taki", c=c, num_blocks=L)(key, (8, 8)))
    np.testing.assert_array_equal(a, taki_factory(c, L)(key, (8, 8)))
    np.testing.assert_allclose(get_initializer(spec, gain=2.0)(key, (8, 8)), 2 * a, rtol=1e-6)


def test_taki_initialiser_through_a_module_and_existing_names_unchanged():
    m = ResidualStack(width=64, num_blocks=5, kernel_init="taki(c=1, L=5)", use_bias=False)
    v = m.init(jax.random.key(0), jnp.ones((2, 64)))
    k = v["params"]["blocks_0"]["linear_0"]["kernel"]
    assert k.shape == (64, 64) and 0.5 < float(jnp.var(k)) * 64 * 5 < 1.5
    assert "taki" not in INITIALIZERS  # the parameter-free list is unchanged
    w = get_initializer("he_normal")(jax.random.key(0), (300, 200))
    assert abs(float(jnp.var(w)) * 300 / 2 - 1) < 0.03


@pytest.mark.parametrize("bad", ["taki", "taki(c=0, L=10)", "taki(c=-1, L=10)", "taki(L=0)", "taki(L=2.5)",
                                 "taki(q=1, L=3)", "taki(c=x, L=3)"])
def test_taki_initialiser_bad_settings_raise(bad):
    with pytest.raises(ValueError, match="kernel_init"):
        get_initializer(bad)


def test_taki_factory_and_keyword_errors():
    for kwargs in (dict(c=0.0, num_blocks=3), dict(c=1.0, num_blocks=0), dict(c=float("inf"), num_blocks=3)):
        with pytest.raises(ValueError, match="kernel_init"):
            taki_factory(**kwargs)
    with pytest.raises(ValueError, match="kernel_init"):
        get_initializer("fan_in", c=1.0)  # parameters on a parameter-free name


# ---- analytic curves ----------------------------------------------------------------------------------


def test_plain_curves_are_exponential_and_taki_bounded():
    np.testing.assert_allclose(T.he_curve(3, "relu"), [8, 4, 2, 1])
    np.testing.assert_allclose(T.he_curve(3, "linear"), [27, 9, 3, 1])
    L = 50
    l = np.arange(L + 1)
    np.testing.assert_allclose(T.taki_curve(L, "linear"), (1 + 1 / L) ** (L - l))
    np.testing.assert_allclose(T.taki_curve(L, "relu", c=2.0), (1 + 1 / L) ** (L - l))
    for L in (10, 100, 1000):
        assert T.taki_curve(L, "linear")[0] < T.taki_bound("linear") == pytest.approx(math.e)
    assert T.taki_curve(1000, "relu")[0] == pytest.approx(math.exp(0.5), rel=1e-3)
    np.testing.assert_allclose(T.delta_variance(4, 0.5, "linear", "none"), 1.5 ** np.arange(4, -1, -1))


def test_bn_curve_is_L_over_l():
    L = 20
    l = np.arange(L + 1)
    # n Var[w] = Var[x]: exactly (L + 1)/(l + 1); the seed's L/l is the large-l form.
    np.testing.assert_allclose(T.bn_curve(L, "linear"), (L + 1) / (l + 1))
    np.testing.assert_allclose(T.seed_bn_curve(L)[1:], L / l[1:])
    assert np.isnan(T.seed_bn_curve(L)[0])
    big = T.bn_curve(10_000, "linear", n_var_w=1.0, input_variance=1e-6)
    np.testing.assert_allclose(big[100:], T.seed_bn_curve(10_000)[100:], rtol=1e-6)
    # No Var[w] in it: only Var[x]/(n Var[w]) matters (BatchNorm is scale invariant).
    for q in (0.25, 4.0):
        np.testing.assert_allclose(T.bn_curve(L, "relu", q, input_variance=q), T.bn_curve(L, "relu", 1.0, 1.0))
    # ReLU: factor 1 + kappa/j asymptotically, kappa = pi/(pi - 1).
    assert T.bn_growth_power("relu") == pytest.approx(math.pi / (math.pi - 1))
    assert T.growth_exponent(T.bn_curve(100_000, "relu"), 1000, 100_000) == pytest.approx(math.pi / (math.pi - 1), rel=2e-3)
    assert T.growth_exponent(T.seed_bn_curve(100), 1, 100) == pytest.approx(1.0)


def test_weight_grad_curves():
    # He + ReLU without normalisation: 2^l * 2^(L-l-1) * m2: the same at every layer.
    np.testing.assert_allclose(T.weight_grad_variance(5, 2.0, "relu", "none"), 0.5 * 2.0 ** 4)
    np.testing.assert_allclose(T.weight_grad_variance(5, 1.0, "linear", "batch"), T.bn_curve(5, "linear")[1:])


def test_analytic_bad_inputs_raise():
    with pytest.raises(ValueError, match="num_blocks"):
        T.he_curve(0)
    with pytest.raises(ValueError, match="n_var_w"):
        T.delta_variance(5, 0.0)
    with pytest.raises(ValueError, match="c"):
        T.taki_curve(5, c=0.0)
    with pytest.raises(ValueError, match="activation"):
        T.bn_curve(5, "tanh")
    with pytest.raises(ValueError, match="norm"):
        T.delta_variance(5, 1.0, norm="layer")
    with pytest.raises(ValueError, match="width"):
        T.make_stack(0, 10, kernel_init="fan_in")
    with pytest.raises(ValueError, match="batch_size"):
        T.gradient_variance(T.make_stack(8, 2, kernel_init="fan_in"), jax.random.key(0), batch_size=1, num_draws=2,
                            train=True)


# ---- measurement: the exact identity on one network, then the experiment's quick mode -------------------


def test_deltas_are_the_input_gradient_of_the_module():
    """delta_0 from backprop_deltas equals jax.vjp through ResidualStack.apply itself (BatchNorm, train)."""
    m = T.make_stack(16, 3, kernel_init="fan_in", activation="relu", norm="batch")
    x = jax.random.normal(jax.random.key(0), (32, 16))
    g = jax.random.normal(jax.random.key(1), (32, 16))
    v = m.init(jax.random.key(2), x)
    with jax.default_matmul_precision("highest"):
        out = T.backprop_deltas(m, v, x, g, train=True)
        y, vjp = jax.vjp(lambda z: m.apply(v, z, train=True, mutable=["batch_stats"])[0], x)
        np.testing.assert_allclose(out["stream"][-1], y, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out["delta"][0], vjp(g)[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(out["delta"][-1], g)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("taki_init")
    results = common.run_experiment(taki_init, taki_init.get_config("quick"), out)
    return out, results


def test_quick_mode_writes_results_and_figure(quick):
    out, results = quick
    saved = json.loads((out / "results.json").read_text())
    assert saved["experiment"] == "taki_init" and (out / "taki_init.png").stat().st_size > 0
    m = saved["metrics"]
    for case in ("he", "taki", "bn"):
        for act in ("linear", "relu"):
            assert m[f"grad_var_ratio_first_to_last.{case}.{act}"] > 0
            assert m[f"max_rel_dev.{case}.{act}"] is not None
    for claim in taki_init.CLAIMS:
        claim.measure(m)
        claim.holds(m)
    assert isinstance(taki_init.report_section(m), str)


def test_measured_matches_analytic_at_small_width(quick):
    """10 blocks, width 32, 8 draws: every case's curve within loose tolerance of the mean-field one."""
    m = quick[1]["metrics"]
    for case in ("he", "taki", "bn", "plain_nvar_0p25", "plain_nvar_4", "bn_nvar_0p25", "bn_nvar_4"):
        for act in ("linear", "relu"):
            assert m[f"max_abs_log10_dev.{case}.{act}"] < 0.12, (case, act)  # within ~30% at every layer
    assert m["init_check.max_abs_diff.taki"] < 1e-6 and m["init_check.max_abs_diff.he"] < 1e-6


def test_bn_growth_independent_of_var_w_unlike_plain(quick):
    """Over n Var[w] in {1/4, 1, 4}: BatchNorm's mid-to-last growth spreads like the Var[x] term predicts
    (short stack: 10 blocks), the plain ResNet's by orders of magnitude."""
    m = quick[1]["metrics"]
    for act in ("linear", "relu"):
        bn, plain = m[f"bn_growth_spread.mid_to_last.{act}"], m[f"plain_growth_spread.mid_to_last.{act}"]
        assert bn == pytest.approx(m[f"analytic_bn_growth_spread.mid_to_last.{act}"], rel=0.15)
        assert bn < 2.0 and plain > 100
