"""Zhang et al.'s tau-ResNet (resjax.nn.tau_resnet), log-space stability tracking (resjax.analysis.stability)
and the four issue-5 experiments (quick modes)."""

import json
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import common, fixup_one_step, tau_batchnorm_growth, tau_stability, tau_training
from resjax.analysis import stability
from resjax.analysis.propagation import stream_activations
from resjax.nn import PlainMLP, build_model, resolve_tau, stack_unrolled
from resjax.nn.tau_mlp import plain_params_from_residual, tau_resnet

X = jax.random.normal(jax.random.key(0), (6, 12))
V = jax.random.normal(jax.random.key(1), (6, 10))


def _scan_params_from_unrolled(kind, variables, depth):
    """The scanned layout of an unrolled tau_resnet's variables (the plain network's blocks are named alike)."""
    return {name: stack_unrolled(col, depth) for name, col in variables.items()}


# ---- the model ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["tau", "bn", "fixup", "plain"])
def test_scan_equals_unrolled_for_every_kind(kind):
    depth = 5
    unrolled = tau_resnet(kind, 8, depth, tau=0.7, scan=False)
    scanned = tau_resnet(kind, 8, depth, tau=0.7, scan=True)
    v = unrolled.init(jax.random.key(2), X)
    if kind == "fixup":  # W_l = 0 makes every block the identity; compare on random W_l as well
        v = jax.tree_util.tree_map(lambda a: a, v)
        for k in range(depth):
            v["params"][f"blocks_{k}"]["linear_0"]["kernel"] = 0.3 * jax.random.normal(jax.random.key(k), (8, 8))
    vs = _scan_params_from_unrolled(kind, v, depth)
    with jax.default_matmul_precision("highest"):
        for train in ([False, True] if kind == "bn" else [False]):
            mutable = ["batch_stats"] if train else False
            a = unrolled.apply(v, X, train=train, mutable=mutable)
            b = scanned.apply(vs, X, train=train, mutable=mutable)
            a, b = (a[0], b[0]) if train else (a, b)
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm", ["none", "batch"])
def test_plain_mlp_scan_equals_unrolled(norm):
    depth = 4
    unrolled = PlainMLP(width=8, depth=depth, norm=norm, bias_init="fan_in")
    scanned = PlainMLP(width=8, depth=depth, norm=norm, bias_init="fan_in", scan=True)
    v = unrolled.init(jax.random.key(3), X)
    p = v["params"]
    vs = {name: stack_unrolled(col, depth) for name, col in v.items()}  # the residual MLPs' layout
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(unrolled.apply(v, X, train=False), scanned.apply(vs, X, train=False), rtol=1e-5, atol=1e-5)
    shapes = jax.eval_shape(scanned.init, jax.random.key(3), X)  # scanned.init's own layout, traced only
    assert shapes["params"]["blocks"]["block"]["linear_0"]["kernel"].shape == (depth, 8, 8)
    # the default is unchanged: unrolled, parameters named blocks_0 ...
    assert PlainMLP(width=8, depth=2).scan is False and "blocks_0" in p


def test_model_follows_the_papers_shapes_and_draws():
    model = tau_resnet("tau", 128, 50, tau="1/sqrt(L)")
    assert model.tau == pytest.approx(50 ** -0.5) and model.scaling == "tau" and model.order == "post"
    p = jax.jit(model.init)(jax.random.key(4), X)["params"]
    assert set(p) == {"stem", "blocks", "head"} and "bias" not in p["stem"]
    assert set(p["blocks"]["block"]) == {"linear_0"} and set(p["blocks"]["block"]["linear_0"]) == {"kernel"}
    # A, W_l: variance 2/m (m = 128); B: variance 1/d (d = 10)
    assert np.var(p["stem"]["kernel"]) == pytest.approx(2 / 128, rel=0.1)
    assert np.var(p["blocks"]["block"]["linear_0"]["kernel"]) == pytest.approx(2 / 128, rel=0.02)
    assert np.var(p["head"]["kernel"]) == pytest.approx(1 / 10, rel=0.15)
    assert tau_resnet("tau", 8, 10, seed_indexing=True).num_blocks == 9
    # the config route used by make_train
    assert build_model(kind="tau_resnet", variant="plain", width=8, depth=3, num_classes=10).depth == 3


def test_fixup_block_is_the_identity_at_init():
    model = tau_resnet("fixup", 16, 7)
    v = jax.jit(model.init)(jax.random.key(5), X)
    stream = jax.jit(lambda v: stream_activations(model, v, X))(v)
    for k in range(1, 8):
        np.testing.assert_array_equal(stream[k], stream[0])
    assert np.all(v["params"]["blocks"]["block"]["linear_0"]["kernel"] == 0)
    assert np.any(v["params"]["head"]["kernel"] != 0)  # the seed's B is random (not resjax's scaling='fixup')


# ---- log-space tracking -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind,scan", [("tau", True), ("tau", False), ("plain", True), ("plain", False)])
def test_log_space_tracking_equals_the_direct_pass(kind, scan):
    model = tau_resnet(kind, 16, 6, tau=0.8, scan=scan)
    v = model.init(jax.random.key(6), X)
    with jax.default_matmul_precision("highest"):
        out = stability.log_space_propagation(model, v, X, cotangent=V)
        direct = stability.direct_norms(model, v, X)
        np.testing.assert_allclose(np.exp(out["log_norm"]), direct, rtol=1e-4)
        np.testing.assert_allclose(np.exp(out["log_ratio"]), direct / direct[:1], rtol=1e-4)
        np.testing.assert_allclose(np.exp(out["log_output_norm"]), jnp.linalg.norm(model.apply(v, X), axis=-1), rtol=1e-4)
        if scan:  # per-example gradient of <v_i, y_i> with respect to each W_l, by autodiff (one program)
            def f(p, i):
                return jnp.sum(V[i] * model.apply({"params": p}, X[i][None])[0])
            path = ("blocks", "block", "linear_0")  # the plain network's blocks are named alike
            grad = jax.jit(jax.grad(f))  # example i traced: one program for both
            for i in (0, 3):
                g = grad(v["params"], i)
                for name in path:
                    g = g[name]
                direct_g = np.linalg.norm(np.asarray(g["kernel"]).reshape(6, -1), axis=-1)
                np.testing.assert_allclose(np.exp(out["log_grad_norm"][:, i]), direct_g, rtol=1e-4)


def test_log_space_stays_finite_where_float32_overflows():
    model = tau_resnet("tau", 16, 400, tau=1.0)
    v = jax.jit(model.init)(jax.random.key(7), X)
    direct = np.asarray(jax.jit(lambda v: stability.direct_norms(model, v, X))(v))
    assert not np.all(np.isfinite(direct[-1]))  # |h_L| beyond float32
    out = jax.jit(lambda v: stability.log_space_propagation(model, v, X, cotangent=V))(v)
    assert np.all(np.isfinite(out["log_ratio"])) and np.all(np.isfinite(out["log_grad_norm"]))
    assert np.median(out["log_ratio"][-1]) / np.log(10) > 40
    # where the direct pass is finite, the two agree
    ok = np.isfinite(direct).all(axis=1) & (direct.max(axis=1) < 1e30)
    np.testing.assert_allclose(np.exp(out["log_norm"][ok]), direct[ok], rtol=1e-3)


def test_tau_inverse_sqrt_depth_keeps_the_forward_ratio_bounded_and_quarter_power_grows():
    width, draws = 32, 8
    depths, names = (4, 16, 64), ("sqrt", "quarter")

    @jax.jit
    def last_log_ratios():  # one program: every depth's draws, each at both taus
        x = jax.random.normal(jax.random.key(8), (4, 12))
        out = []
        for depth in depths:
            model = tau_resnet("tau", width, depth, tau=1.0)
            params = jax.vmap(lambda k: model.init(k, x))(jax.random.split(jax.random.key(depth), draws))
            run = jax.vmap(lambda v, t: stability.log_space_propagation(model, v, x, tau=t, backward=False)
                           ["log_ratio"][-1], in_axes=(0, None))
            out.append(jax.vmap(lambda t: run(params, t))(jnp.array([depth ** -0.5, depth ** -0.25], jnp.float32)))
        return out

    medians = {(name, depth): float(np.exp(np.median(ratios[j])))
               for depth, ratios in zip(depths, jax.device_get(last_log_ratios())) for j, name in enumerate(names)}
    for depth in (4, 16, 64):
        assert 0.25 <= medians["sqrt", depth] <= 4, medians
    assert medians["quarter", 4] < medians["quarter", 16] < medians["quarter", 64]
    assert medians["quarter", 64] > 2 * medians["sqrt", 64]


def test_log_space_refuses_a_non_homogeneous_module():
    x = X[:4]
    def variables(model):  # the variables' shapes: the refusals come before anything is computed
        return jax.eval_shape(model.init, jax.random.key(0), x)

    bn = tau_resnet("bn", 8, 3)
    with pytest.raises(ValueError, match="norm"):
        stability.log_space_propagation(bn, variables(bn), x)
    biased = PlainMLP(width=8, depth=2)
    with pytest.raises(ValueError, match="use_bias"):
        stability.log_space_propagation(biased, variables(biased), x)
    plain = tau_resnet("plain", 8, 3)
    with pytest.raises(ValueError, match="tau"):
        stability.log_space_propagation(plain, variables(plain), x, tau=0.5)


def test_plain_params_share_the_residual_draws():
    res, plain = tau_resnet("tau", 8, 4), tau_resnet("plain", 8, 4)
    p = jax.jit(res.init)(jax.random.key(9), X)["params"]
    q = plain_params_from_residual(p)
    assert jax.tree_util.tree_structure(q) == jax.tree_util.tree_structure(
        jax.eval_shape(plain.init, jax.random.key(0), X)["params"])
    np.testing.assert_array_equal(q["blocks"]["block"]["linear_0"]["kernel"], p["blocks"]["block"]["linear_0"]["kernel"])
    # named alike, the plain network's own init draws the residual one's A, W_l and B
    chex.assert_trees_all_equal(jax.jit(plain.init)(jax.random.key(9), X)["params"], p)


def test_batchnorm_after_the_branch_grows_like_sqrt_l():
    model = tau_resnet("bn", 32, 300)
    x = jax.random.normal(jax.random.key(10), (64, 12))
    stream = jax.jit(lambda k: stream_activations(model, model.init(k, x), x, train=True))(jax.random.key(11))
    curve = np.mean(np.linalg.norm(np.asarray(stream), axis=-1), axis=-1)
    assert abs(stability.log_log_slope(curve, start=30) - 0.5) < 0.15


# ---- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,setting", [
    (dict(tau=0.0), "tau"), (dict(tau=-0.5), "tau"), (dict(tau="1/L^2"), "tau"), (dict(tau="-1"), "tau"),
    (dict(depth=0), "depth"), (dict(depth=1, seed_indexing=True), "depth"), (dict(kind="resnet"), "kind"),
    (dict(width=0), "width"),
])
def test_bad_settings_raise_value_error_naming_them(kwargs, setting):
    args = {"kind": "tau", "width": 8, "depth": 4, **kwargs}
    with pytest.raises(ValueError, match=setting):
        tau_resnet(args.pop("kind"), args.pop("width"), args.pop("depth"), **args)


def test_resolve_tau_refuses_non_positive_values():
    assert resolve_tau("1/sqrt(L)", 100) == pytest.approx(0.1)
    for bad in (0, -1.0, "0", "nan"):
        with pytest.raises(ValueError, match="tau"):
            resolve_tau(bad, 10)
    with pytest.raises(ValueError, match="variant"):
        build_model(kind="tau_resnet", width=8, depth=3)


# ---- experiments ----------------------------------------------------------------------------------


@pytest.mark.parametrize("module,keys", [
    (tau_stability, ["log10_forward_norm_ratio.L^-1/2.L4", "forward_norm_ratio.1.L4", "median_grad_norm.L^-1/4.L4",
                     "median_grad_norm.plain.L4", "total_grad_norm.L^-1.L4"]),
    (tau_batchnorm_growth, ["bn_norm_growth_exponent", "curves.bn_mean_norm"]),
    (fixup_one_step, ["log10_output_norm_after_one_step.fixup.L4", "log10_output_norm_after_one_step.tau.L4"]),
    (tau_training, ["final_train_loss.plain.L4", "final_train_loss.tau=1/sqrt(L).L4", "diverged_epoch.tau=1/L^(1/4).L4"]),
])
def test_quick_mode_writes_results(module, keys, tmp_path):
    common.run_experiment(module, module.get_config("quick"), tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["experiment"] == module.NAME
    for k in keys:
        assert k in results["metrics"], k
    assert (tmp_path / f"{module.NAME}.png").stat().st_size > 10_000


# ---- claims: verdicts on hand-made metrics (one set for which every claim must hold, one for which it must fail)


def _verdicts(module, m):
    return [claim.holds(m) for claim in module.CLAIMS], [claim.measure(m) for claim in module.CLAIMS]


def _stability_metrics(half, quarter, total, grad, seconds=None):
    """tau_stability's metrics at depths 10, 100, 1000: log10 norm ratios for tau = L^-1/2 and L^-1/4, log10
    total gradient norm and gradient ratio to the plain network over tau (tau = L^-1/2)."""
    m = {}
    for i, d in enumerate((10, 100, 1000)):
        m[f"log10_forward_norm_ratio.L^-1/2.L{d}"] = half[i]
        m[f"log10_forward_norm_ratio.L^-1/4.L{d}"] = quarter[i]
        m[f"log10_total_grad_norm.L^-1/2.L{d}"] = total[i]
        m[f"grad_ratio_to_plain_over_tau.L^-1/2.L{d}"] = grad[i]
    if seconds is not None:
        m["seconds_depth_1000"] = seconds
    return m


def test_tau_stability_claims_hold_and_fail_on_the_right_metrics():
    holds, measured = _verdicts(tau_stability, _stability_metrics(
        half=(0.0, 0.1, 0.0), quarter=(0.5, 1.5, 3.0), total=(0.0, 0.1, 0.15), grad=(1.0, 0.5, 2.0), seconds=30.0))
    assert holds == [True] * 6
    assert measured == ["L=10: 1, L=100: 1.26, L=1000: 1", "1x", "L=10: 3.16, L=100: 31.6, L=1000: 1e+03",
                        "L=10: 1, L=100: 1.26, L=1000: 1.41 (spread 1.41x)", "L=10: 1, L=100: 0.5, L=1000: 2", 30.0]
    holds, measured = _verdicts(tau_stability, _stability_metrics(
        half=(0.0, 0.0, 0.7), quarter=(0.5, 0.9, 3.0), total=(0.0, 0.0, 0.3), grad=(1.0, 0.2, 1.0), seconds=90.0))
    assert holds == [False] * 6
    assert measured == ["L=10: 1, L=100: 1, L=1000: 5.01", "5.01x", "L=10: 3.16, L=100: 7.94, L=1000: 1e+03",
                        "L=10: 1, L=100: 1, L=1000: 2 (spread 2.00x)", "L=10: 1, L=100: 0.2, L=1000: 1", 90.0]
    # the ratio must also grow at every step for tau = L^-1/4; the timing is reported only when measured
    m = _stability_metrics(half=(0.0,) * 3, quarter=(0.5, 1.5, 1.2), total=(0.0,) * 3, grad=(1.0,) * 3)
    assert _verdicts(tau_stability, m)[0] == [True, True, False, True, True, None]
    assert math.isnan(tau_stability.CLAIMS[-1].measure(m))


def test_tau_batchnorm_growth_claim_holds_and_fails_on_the_right_metrics():
    (claim,) = tau_batchnorm_growth.CLAIMS
    m = {"bn_norm_growth_exponent": 0.55, "bn_norm_growth_exponent_logspaced": 0.5,
         "bn_norm_growth_exponent_second_half": 0.6}
    assert claim.holds(m) is True and claim.measure(m) == "0.550 (log-spaced 0.500, second half 0.600)"
    for bad in (0.65, 0.35):
        assert claim.holds({**m, "bn_norm_growth_exponent": bad}) is False


def _fixup_metrics(fixup: dict, tau: dict):
    return {**{f"log10_output_norm_after_one_step.fixup.L{d}": v for d, v in fixup.items()},
            **{f"log10_output_norm_after_one_step.tau.L{d}": v for d, v in tau.items()}}


def test_fixup_one_step_claims_hold_and_fail_on_the_right_metrics():
    good = _fixup_metrics({10: 0.5, 30: 0.8, 100: 1.0, 1000: 2.0}, {10: 0.3, 30: 0.4, 100: 0.5, 1000: 0.7})
    holds, measured = _verdicts(fixup_one_step, good)
    assert holds == [True, True]
    assert measured == ["L=10: 0.50, L=30: 0.80, L=100: 1.00, L=1000: 2.00", "L=10: 0.30, L=30: 0.40, L=100: 0.50, L=1000: 0.70"]
    # Fixup gains less than 1 from 10 to 1000; tau drifts by more than 0.5
    bad = _fixup_metrics({10: 0.5, 30: 0.8, 100: 1.0, 1000: 1.4}, {10: 0.3, 30: 0.4, 100: 0.5, 1000: 0.9})
    assert _verdicts(fixup_one_step, bad)[0] == [False, False]
    # not growing at every one of 10 < 100 < 1000 fails too, even with a large total gain
    assert fixup_one_step.CLAIMS[0].holds(_fixup_metrics({10: 0.5, 100: 0.4, 1000: 3.0}, {10: 0.0, 100: 0.0, 1000: 0.0})) is False
    # with fewer than two of the depths the Fixup claim is reported without a verdict
    only = _fixup_metrics({10: 0.5, 30: 0.9}, {10: 0.3, 30: 0.3})
    assert _verdicts(fixup_one_step, only) == ([None, True], ["L=10: 0.50, L=30: 0.90", "L=10: 0.30, L=30: 0.30"])


def _training_metrics(runs: dict):
    """tau_training's metrics from ``{name: {depth: (final losses, diverged epochs, max losses)}}``."""
    m = {}
    for name, by_depth in runs.items():
        for d, (final, div, peak) in by_depth.items():
            m[f"final_train_loss.{name}.L{d}"] = list(final)
            m[f"diverged_epoch.{name}.L{d}"] = list(div)
            m[f"max_train_loss.{name}.L{d}"] = list(peak)
    return m


def _fine(*finals):
    return {d: (f, [None] * 3, [2.3] * 3) for d, f in zip((10, 100, 1000), finals)}


def test_tau_training_claims_hold_and_fail_on_the_right_metrics():
    exploding = {10: ([0.5] * 3, [None] * 3, [2.3] * 3),
                 100: ([None, 0.4, 0.4], [2, None, None], [None, 50.0, 12.0]),
                 1000: ([None] * 3, [1, 1, 1], [None] * 3)}
    good = _training_metrics({"tau=1/L^(1/4)": exploding,
                              "tau=1/sqrt(L)": _fine([0.1, 0.2, 0.3], [0.2] * 3, [0.25] * 3),
                              "tau=1/L": _fine([0.5] * 3, [0.6] * 3, [0.7] * 3),
                              "plain": _fine([0.1] * 3, [0.3] * 3, [0.9] * 3)})
    holds, measured = _verdicts(tau_training, good)
    assert holds == [True] * 4
    assert measured == [
        "L=100: diverged epochs [2, None, None], max loss [None, 50.0, 12.0]; "
        "L=1000: diverged epochs [1, 1, 1], max loss [None, None, None]",
        "1/sqrt(L): L=10: 0.200, L=100: 0.200, L=1000: 0.250 | 1/L: L=10: 0.500, L=100: 0.600, L=1000: 0.700",
        "L=10: 0.200, L=100: 0.200, L=1000: 0.250",
        "L=10: 0.100, L=100: 0.300, L=1000: 0.900"]
    calm = {**exploding, 100: ([0.4] * 3, [None, None, None], [3.0, 50.0, 12.0])}  # one seed at L = 100 stays below 10
    bad = _training_metrics({"tau=1/L^(1/4)": calm,
                             "tau=1/sqrt(L)": {**_fine([0.2] * 3, [0.2] * 3), 1000: ([0.4, None, 0.4], [None, 5, None], [2.3, None, 2.3])},
                             "tau=1/L": _fine([0.5] * 3, [0.6] * 3, [0.7] * 3),
                             "plain": _fine([0.1] * 3, [0.3] * 3, [0.2] * 3)})
    holds, measured = _verdicts(tau_training, bad)
    assert holds == [False] * 4
    assert measured[1] == "1/sqrt(L): L=10: 0.200, L=100: 0.200, L=1000: diverged (epochs [5]) | 1/L: L=10: 0.500, L=100: 0.600, L=1000: 0.700"
    # the spread claim on finite losses: 0.4 is more than 1.5x 0.2
    spread = _training_metrics({"tau=1/sqrt(L)": _fine([0.2] * 3, [0.2] * 3, [0.4] * 3), "plain": _fine(*[[0.1] * 3] * 3)})
    assert tau_training.CLAIMS[2].holds(spread) is False
    # no depth >= 100: the explosion claim is reported without a verdict
    shallow = _training_metrics({name: {10: v[10]} for name, v in
                                 (("tau=1/L^(1/4)", exploding), ("plain", _fine([0.1] * 3)))})
    assert tau_training.CLAIMS[0].holds(shallow) is None
    assert tau_training.CLAIMS[0].measure(shallow) == "no depth >= 100 in this run"
