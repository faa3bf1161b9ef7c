"""Block-output norms of the CIFAR ResNets (resjax.analysis.resnet_signal) and the resnet_signal experiment."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import common, resnet_signal
from resjax.analysis.resnet_signal import (
    block_output_norms,
    block_outputs,
    mean_log10_norm,
)
from resjax.nn.resnet import cifar_resnet
from tests.conftest import xla_optimisations


@pytest.fixture(scope="module")
def images():
    """4 CIFAR-shaped images: the quick run's batch (``get_config('quick').batch_size``), so that the tests run
    op by op below reuse the programs the quick run compiles for its unrolled networks (one per op and shape)."""
    return jax.random.normal(jax.random.key(3), (4, 32, 32, 3))


def _sown_in_order(model, variables, x, train):
    """The block outputs of a scanned CIFAR ResNet read by hand from the sown intermediates, in depth order, and
    the model's own output (logits) from the same ``model.apply``."""
    logits, state = model.apply(variables, x, train=train, mutable=["intermediates", "batch_stats"])
    inter = state["intermediates"]
    n = model.stage_sizes[0]
    outs = []
    for s in (1, 2, 3):
        outs.append(inter[f"stage{s}_first"]["block_out"][0])
        stacked = inter[f"stage{s}"]["block"]["block_out"][0]
        outs += [stacked[k] for k in range(n - 1)]
    return outs, logits


def test_norms_equal_a_hand_computation_from_the_sown_intermediates(images):
    """Scanned stages (the unrolled layout is checked against exact values in the tau = 0 test below)."""
    model = cifar_resnet(20, norm="batch", scan=True)

    def everything(key, x):
        variables = model.init(key, x)
        with jax.default_matmul_precision("highest"):
            norms = block_output_norms(model, variables, x, train=True)
            logs, logits = block_output_norms(model, variables, x, train=True, log10=True, return_output=True)
            sown, direct = _sown_in_order(model, variables, x, train=True)  # direct: model.apply's own logits
            hand = [jnp.sqrt(jnp.sum(jnp.square(h.reshape(len(x), -1)), axis=1)) for h in sown]
        return norms, logs, logits, jnp.stack(hand), direct, block_outputs(model, variables, x, train=True)

    # one compilation for everything (each eager apply would compile the scan again)
    norms, logs, logits, hand, direct, stages = jax.device_get(jax.jit(everything)(jax.random.key(0), images))
    assert norms.shape == (model.num_blocks, len(images)) == (9, 4)
    np.testing.assert_allclose(norms, hand, rtol=1e-5)
    np.testing.assert_allclose(logs, np.log10(hand), atol=1e-5)
    np.testing.assert_allclose(logits, direct, rtol=1e-5, atol=1e-6)
    # one stacked array per stage, with the stage's shape
    assert [a.shape for a in stages] == [(3, 4, 32, 32, 16), (3, 4, 16, 16, 32), (3, 4, 8, 8, 64)]
    np.testing.assert_array_equal(resnet_signal.elements_per_example(20),
                                  np.repeat([np.prod(a.shape[2:]) for a in stages], 3))


def test_batchnorm_uses_batch_statistics_by_default(images):
    """Op by op at the quick run's settings (unrolled, batch 4, ``highest`` precision): the quick run's own
    programs for its BatchNorm network."""
    model = cifar_resnet(14, norm="batch")
    variables = model.init(jax.random.key(0), images)
    with jax.default_matmul_precision("highest"):
        train = np.asarray(block_output_norms(model, variables, images, train=True))
        running = np.asarray(block_output_norms(model, variables, images, train=False))
    assert not np.allclose(train, running)  # running estimates 0/1 at init: no normalisation
    assert np.all(np.isfinite(train))


def test_tau_zero_blocks_pass_the_stem_through(images):
    """With tau = 0 every post-activation block is relu(shortcut) = shortcut (the stem output is >= 0): stage 1
    keeps |stem|, stages 2 and 3 the norms of the stem subsampled by option A (stride 2, then 4)."""
    model = cifar_resnet(20, norm="none", scaling="tau", scalar_biases=True)
    variables = model.init(jax.random.key(1), images)
    # tau = 0 traced: a concrete tau <= 0 is refused, a traced one cannot be checked by value
    def norms_and_stem(t):  # one program
        _, state = model.apply(variables, images, tau=t, mutable=["intermediates"])
        return block_output_norms(model, variables, images, train=True, tau=t), state["intermediates"]["stem"][0]

    norms, stem = jax.device_get(jax.jit(norms_and_stem)(0.0))
    stem = np.asarray(stem, np.float64)
    expect = [np.linalg.norm(stem[:, ::k, ::k].reshape(len(images), -1), axis=1) for k in (1, 2, 4)]
    np.testing.assert_allclose(norms, np.repeat(np.stack(expect), 3, axis=0), rtol=1e-5)


def test_log10_norms_do_not_overflow_where_the_squares_would(images):
    """No BN, no biases: the net is positively homogeneous, so scaling the input by c adds log10 c to every
    log10 norm, past float32's squaring range (|h|^2 > 3.4e38) and up to the entries' own overflow."""
    model = cifar_resnet(14, norm="none", scalar_biases=True)
    variables = model.init(jax.random.key(2), images)
    base = np.asarray(block_output_norms(model, variables, images, train=True, log10=True))
    big = np.asarray(block_output_norms(model, variables, images * 1e25, train=True, log10=True))
    assert np.all(base + 25 > np.log10(np.finfo(np.float32).max) / 2)  # naive squares would overflow
    np.testing.assert_allclose(big, base + 25, atol=1e-4)
    huge = np.asarray(block_output_norms(model, variables, images * 1e38, train=True, log10=True))
    assert np.any(np.isposinf(huge)) and not np.any(np.isnan(huge))  # overflowed entries: inf, never nan


def test_mean_log10_norm():
    x = np.array([[0.0, 1.0, 2.0], [300.0, 301.0, 302.0]])
    expect = np.log10(np.mean(10.0 ** x, axis=1))
    np.testing.assert_allclose(np.asarray(mean_log10_norm(x, axis=1)), expect, rtol=1e-5)
    assert np.isposinf(np.asarray(mean_log10_norm(np.array([1.0, np.inf]))))


def test_helpers_refuse_what_they_cannot_read(images):
    from resjax.nn.tau_mlp import tau_resnet

    mlp = tau_resnet("tau", 8, 3, 10)
    with pytest.raises(ValueError, match="model"):
        block_output_norms(mlp, {}, images, train=True)


def test_curve_statistics_on_exact_curves():
    depth = 110  # n = 18 blocks per stage
    ls = np.arange(1, 55)
    # sqrt(l) in stage 1: exponent 0.5
    assert resnet_signal.bn_stage1_exponent(np.log10(3.0 * np.sqrt(ls)), depth) == pytest.approx(0.5, abs=1e-9)
    # |h_l|^2 = E (c_s + l): the per-entry mean square grows by exactly 1 per block
    e = resnet_signal.elements_per_example(depth)
    log10 = 0.5 * np.log10(e * (5.0 + ls))[:, None] * np.ones((1, 4))
    np.testing.assert_allclose(resnet_signal.ms_increments(log10, depth), [1.0, 1.0, 1.0])
    # a x1.5 growth per block within stages, with drops between them
    curve = ls * np.log10(1.5) - np.repeat([0, 5, 10], 18)
    assert resnet_signal.median_within_stage_increment(curve, depth) == pytest.approx(np.log10(1.5))
    assert [s.stop - s.start for s in resnet_signal.stage_slices(depth)] == [18, 18, 18]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("resnet_signal")
    config = resnet_signal.get_config("quick")
    return common.run_experiment(resnet_signal, config, out), out


def test_quick_run_follows_the_contract(quick_run):
    results, out = quick_run
    assert json.loads((out / "results.json").read_text()) == results
    assert set(results) == {"experiment", "config", "metrics", "seconds"}
    assert results["experiment"] == "resnet_signal"
    m, c = results["metrics"], results["config"]
    assert m["depths"] == list(c["depths"])
    for d in c["depths"]:
        L = 3 * ((d - 2) // 6)
        for name in ("bn", "tau", "none", "none_float32"):
            assert len(m[f"curves.log10_norm.{name}.d{d}"]) == L
        for variant in resnet_signal.STEP_VARIANTS:
            for k in range(c["num_steps"] + 1):
                assert len(m[f"curves.log10_norm.{variant}.step{k}.d{d}"]) == L
                assert f"log10_output_norm.{variant}.step{k}.d{d}" in m
        # nothing overflows at these depths: the float64 and float32 passes agree
        assert m[f"none.float32_overflow_block.d{d}"] is None
        np.testing.assert_allclose(m[f"curves.log10_norm.none.d{d}"], m[f"curves.log10_norm.none_float32.d{d}"],
                                   atol=1e-4)
        # Fixup's classifier starts at 0: logits exactly 0 (JSON null for log10 0), and one step moves only it
        assert m[f"log10_output_norm.fixup.step0.d{d}"] is None
        np.testing.assert_allclose(m[f"curves.log10_norm.fixup.step1.d{d}"], m[f"curves.log10_norm.fixup.step0.d{d}"],
                                   atol=1e-6)
    # Fixup's first step moves only the classifier, so its output does not depend on the depth at all
    lo, hi = c["depths"][0], c["depths"][-1]
    assert m[f"log10_output_norm.fixup.step1.d{lo}"] == pytest.approx(m[f"log10_output_norm.fixup.step1.d{hi}"],
                                                                      abs=1e-5)
    assert (out / "resnet_signal.png").stat().st_size > 10_000
    for claim in resnet_signal.CLAIMS:
        claim.measure(m)
        assert claim.holds(m) in (True, False)
    assert "| fixup |" in resnet_signal.report_section(m)
    # #53: depth 8 has one block per stage: its slopes and increments are null, and the report says why
    measured = [str(claim.measure(m)) for claim in resnet_signal.CLAIMS]
    assert m["bn.stage1_exponent.d8"] is None and m["bn.ms_increment.d8"] == [None] * 3
    assert not any("null" in text for text in measured), measured
    why = "8: n/a (1 block per stage: a slope or increment needs 2)"
    assert measured[0].startswith(why + "; 14: ") and measured[1].startswith(why + "; 14: [")
    assert measured[4].startswith(why + "; 14: ") and measured[4].endswith(
        "first float32 overflow 8: none (finite in float32); 14: none (finite in float32)")


def test_report_says_what_a_null_per_depth_value_is():
    """#53: in the committed default run, float32 overflows at depth 1202 (block 227) and not at 110 (null)."""
    m = json.loads((pathlib.Path(__file__).resolve().parents[1] / "docs" / "report" / "resnet_signal" /
                    "results.json").read_text())["metrics"]
    assert m["none.float32_overflow_block.d110"] is None and m["none.float32_overflow_block.d1202"] == 227
    text = resnet_signal.CLAIMS[4].measure(m)
    assert text.endswith("first float32 overflow 110: none (finite in float32); 1202: block 227") and "null" not in text
    assert resnet_signal.why_missing(110) == "n/a (not finite)"  # enough blocks: a null there is not a short stage


def test_bad_settings_are_refused(tmp_path):
    config = resnet_signal.get_config("quick")
    config.depths = (15,)
    with pytest.raises(ValueError, match="depths"):
        resnet_signal.run(config, tmp_path)
    config = resnet_signal.get_config("quick")
    config.batch_size = 1
    with pytest.raises(ValueError, match="batch_size"):
        resnet_signal.run(config, tmp_path)


@pytest.mark.usefixtures("optimized_compiles")  # the promise is about the program the experiment compiles
@pytest.mark.parametrize("kind", ["tau", "fixup"])
def test_the_scanned_step_equals_the_unrolled_step_bit_for_bit(images, kind):
    # The experiment's scanned SGD step runs the blocks' 3x3 convolutions through _conv3x3 (both gradients written in
    # XLA:CPU's fast layout); it must give the parameters the unrolled network's plain step gives.
    from experiments import resnet_signal as rs
    from resjax.nn.residual import unstack_scanned

    kw = dict(norm="none", scaling="tau", tau="1/sqrt(K)", scalar_biases=True) if kind == "tau" else dict(
        norm="none", scaling="fixup")
    scanned, unrolled = (cifar_resnet(14, scan=s, num_classes=10, **kw) for s in (True, False))
    y = jnp.array([0, 1, 2, 3])
    with xla_optimisations(False):  # the inputs; the promise is about the steps, compiled as the experiment's
        params = jax.jit(scanned.init)(jax.random.key(0), images)["params"]
    if kind == "fixup":  # a random head, so that the first step moves the blocks too
        params = {**params, "head": jax.tree_util.tree_map(lambda a: 0.1 * jnp.ones_like(a), params["head"])}
    after = rs._step_fn(scanned, 0.1)(params, images, y)

    def unstacked(p):
        for s in (1, 2, 3):
            p = unstack_scanned(p, scanned.stage_sizes[0] - 1, name=f"stage{s}")
        return p

    expected = rs._step_fn(unrolled, 0.1, fast_conv=False)(unstacked(params), images, y)
    moved = unstacked(after)
    jax.tree_util.tree_map(np.testing.assert_array_equal, moved, expected)
    assert not np.array_equal(moved["stage1_0"]["conv_1"]["kernel"], unstacked(params)["stage1_0"]["conv_1"]["kernel"])
