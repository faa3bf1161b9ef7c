"""The exact path expansion (resjax.analysis.paths): brute force, full Jacobians, JVP/VJP forms, counts."""

import itertools
import json
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import common, path_lengths
from resjax.analysis import paths
from resjax.nn import PlainMLP, ResidualMLP

HIGHEST = jax.default_matmul_precision("highest")


def _brute_force(jacs: np.ndarray) -> np.ndarray:
    """Sum of every one of the 2^K path products, grouped by length, in float64."""
    num, d = jacs.shape[0], jacs.shape[1]
    out = np.zeros((num + 1, d, d))
    for subset in itertools.product((0, 1), repeat=num):
        term = np.eye(d)
        for k in range(num):  # block 1 first, later blocks multiply on the left
            if subset[k]:
                term = jacs[k] @ term
        out[sum(subset)] += term
    return out


def _rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("num_blocks", [1, 3, 8, 10])
def test_recursion_equals_brute_force_term_by_term(num_blocks):
    jacs = jax.random.normal(jax.random.key(num_blocks), (num_blocks, 5, 5)) / np.sqrt(5)
    with HIGHEST:
        terms = paths.expand_by_length(jacs)
    brute = _brute_force(np.asarray(jacs, np.float64))
    assert terms.shape == (num_blocks + 1, 5, 5)
    for m in range(num_blocks + 1):
        assert _rel(terms[m], brute[m]) < 1e-5, m


def test_three_block_try_terms_and_counts():
    j1, j2, j3 = (jax.random.normal(jax.random.key(i), (4, 4)) for i in range(3))
    with HIGHEST:
        e = paths.expand_by_length(jnp.stack([j1, j2, j3]))
        np.testing.assert_allclose(e[1], j1 + j2 + j3, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(e[2], j2 @ j1 + j3 @ j1 + j3 @ j2, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(e[3], j3 @ j2 @ j1, rtol=1e-5, atol=1e-5)
    assert paths.path_counts(3) == [1, 3, 3, 1]  # TRY: 3 through one branch, 3 through two


def test_path_counts_and_bands_for_54_blocks():
    counts = paths.path_counts(54)
    assert sum(counts) == 2 ** 54 and counts[27] == math.comb(54, 27)
    assert paths.central_band(54) == (25, 29)
    assert paths.share_of_paths(54, 25, 29) >= 0.5 > paths.share_of_paths(54, 25, 28)
    assert round(100 * paths.share_of_paths(54, 5, 17), 2) == 0.45
    np.testing.assert_allclose(paths.path_length_shares(54).sum(), 1.0)
    assert paths.central_band(3) in ((1, 2),)  # 3/8 + 3/8 of the paths


def _perturbed(model, x, seed=0):
    v = model.init(jax.random.key(seed), x)
    bump = lambda a: a + 0.2 * jax.random.normal(jax.random.key(a.size), a.shape)  # noqa: E731
    v = {"params": jax.tree_util.tree_map(bump, v["params"]), **{k: c for k, c in v.items() if k != "params"}}
    if "batch_stats" in v:  # running estimates away from (0, 1), so BatchNorm is not the identity
        v["batch_stats"] = jax.tree_util.tree_map_with_path(
            lambda path, a: bump(a) if path[-1].key == "mean" else jnp.abs(bump(a)) + 0.5, v["batch_stats"])
    return v


@pytest.mark.parametrize("norm,scan,scaling", [("batch", False, "none"), ("layer", True, "tau"),
                                               ("none", False, "skipinit")])
def test_sum_over_lengths_equals_the_module_jacobian(norm, scan, scaling):
    """sum_m E_m times d x_0/d input equals jacfwd of the module's own last block output."""
    k, width = 6, 7
    model = ResidualMLP(width=width, num_blocks=k, norm=norm, scaling=scaling, tau=0.7, scan=scan)
    x = jax.random.normal(jax.random.key(1), (2, 11))

    @jax.jit
    def everything(x):  # one program: the variables, the expansion and both Jacobians
        v = _perturbed(model, x)

        def last_block(inp):
            _, state = model.apply(v, inp[None], train=False, mutable=["intermediates"])
            sown = state["intermediates"]
            out = sown["blocks"]["block"]["block_out"][0][-1] if scan else sown[f"blocks_{k - 1}"]["block_out"][0]
            return out[0]

        def stem(inp):
            return paths.stream_input(model, v, inp[None])[0]

        with HIGHEST:
            return (paths.path_expansion(model, v, x), jax.vmap(jax.jacfwd(last_block))(x),
                    jax.vmap(jax.jacfwd(stem))(x))

    pe, full, d_stem = everything(x)
    for i in range(x.shape[0]):
        terms = jnp.einsum("mij,jk->mik", pe.terms[i], d_stem[i], precision="highest")
        assert float(paths.expansion_rel_error(terms, full[i])) < 1e-5
    assert pe.terms.shape == (2, k + 1, width, width) and pe.jacobians.shape == (2, k, width, width)


def test_unscaled_54_block_expansion_matches_jacfwd_relative_to_terms():
    model = ResidualMLP(width=8, num_blocks=54)  # no normalisation: the products grow like 2^27
    x = jax.random.normal(jax.random.key(2), (1, 5))
    v = model.init(jax.random.key(0), x)
    stack = paths.residual_stack_of(model, v)
    x0 = paths.stream_input(model, v, x)[0]
    with HIGHEST:
        terms = paths.expand_by_length(paths.block_jacobians(stack, x0)[0])
        full = jax.jacfwd(lambda z: paths.trajectory(stack, z)[-1])(x0)
    assert float(jnp.linalg.norm(full)) > 1e4
    assert float(paths.expansion_rel_error(terms, full)) < 1e-5


def test_jvp_and_vjp_forms_equal_the_dense_form():
    model = ResidualMLP(width=6, num_blocks=5, norm="batch", scan=True)

    @jax.jit
    def forms(x, vec):  # one program: the dense, JVP and VJP forms (op by op: one per op and shape)
        v = _perturbed(model, x, seed=1)
        stack = paths.residual_stack_of(model, v)
        x0 = paths.stream_input(model, v, x)[0]
        with HIGHEST:
            return (paths.expand_by_length(paths.block_jacobians(stack, x0)[0]), paths.expand_jvp(stack, x0, vec),
                    paths.expand_vjp(stack, x0, vec))

    vec = jax.random.normal(jax.random.key(4), (6,))
    terms, e, r = forms(jax.random.normal(jax.random.key(3), (1, 4)), vec)
    # Term by term, relative to the terms' total size: a branch is block(x) - x, so J v carries an absolute
    # float32 rounding of about eps |v| (see resjax.analysis.paths), whatever the size of J v itself.
    dense_e = np.asarray(jnp.einsum("mij,j->mi", terms, vec), np.float64)
    dense_r = np.asarray(jnp.einsum("mji,j->mi", terms, vec), np.float64)
    for got, want in ((e, dense_e), (r, dense_r)):
        scale = np.linalg.norm(want, axis=-1).sum()
        assert np.abs(np.asarray(got, np.float64) - want).max() < 1e-6 * scale
        assert _rel(got.sum(0), want.sum(0)) < 1e-5


def test_jvp_form_on_a_convolutional_stream():
    """Matrix-free: a (H, W, C) stream with conv branches, against jax.jvp of the whole stack."""
    conv = nn.Conv(3, (3, 3))

    @jax.jit
    def expansion_and_jvp(x0, v):  # one program (op by op: one per op and shape)
        kernels = jax.vmap(lambda k: conv.init(k, x0)["params"])(jax.random.split(jax.random.key(6), 4))
        stack = paths.BranchStack(lambda p, x: 0.5 * conv.apply({"params": p}, nn.relu(x)), kernels, 4)
        with HIGHEST:
            return paths.expand_jvp(stack, x0, v), jax.jvp(lambda z: paths.trajectory(stack, z)[-1], (x0,), (v,))[1]

    x0 = jax.random.normal(jax.random.key(5), (6, 6, 3))
    v = jax.random.normal(jax.random.key(7), x0.shape)
    e, full = expansion_and_jvp(x0, v)
    assert e.shape == (5, 6, 6, 3)
    assert _rel(e.sum(0), np.asarray(full, np.float64)) < 1e-5
    np.testing.assert_array_equal(e[0], v)


def test_path_magnitudes_match_enumerated_single_paths():
    k, d = 5, 4
    jacs = jax.random.normal(jax.random.key(8), (k, d, d))
    u = jax.random.normal(jax.random.key(9), (d,))
    for m in range(k + 1):
        subsets = [s for s in itertools.combinations(range(k), m)]
        masks = np.zeros((1, len(subsets), k), bool)
        norms = []
        for i, s in enumerate(subsets):
            masks[0, i, list(s)] = True
            prod = np.eye(d)
            for b in s:
                prod = np.asarray(jacs[b], np.float64) @ prod
            norms.append(np.linalg.norm(prod.T @ np.asarray(u, np.float64)))
        with HIGHEST:
            got = paths.path_magnitudes(jacs, u, masks, transpose=True)
        np.testing.assert_allclose(got[0], np.mean(norms), rtol=1e-5)
    masks = paths.random_path_masks(jax.random.key(0), 7, 16)
    np.testing.assert_array_equal(masks.sum(-1), np.repeat(np.arange(8)[:, None], 16, 1))
    mags = paths.sampled_path_magnitudes(jacs, u, jax.random.key(1), 4)
    np.testing.assert_allclose(mags[0], jnp.linalg.norm(u), rtol=1e-6)


def test_bad_inputs_raise_value_errors():
    with pytest.raises(ValueError, match="K = 0"):
        paths.expand_by_length(jnp.zeros((0, 4, 4)))
    with pytest.raises(ValueError, match=r"\(K, D, D\)"):
        paths.expand_by_length(jnp.zeros((3, 4, 5)))
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="K must be"):
            paths.path_counts(bad)
    with pytest.raises(ValueError, match="lo <= hi"):
        paths.share_of_paths(54, 17, 5)
    x = jnp.ones((2, 5))
    plain = PlainMLP(width=4, depth=2)
    with pytest.raises(ValueError, match="no residual blocks"):
        paths.residual_stack_of(plain, plain.init(jax.random.key(0), x))
    model = ResidualMLP(width=4, num_blocks=3)
    v = model.init(jax.random.key(0), x)
    no_blocks = {"params": {k: p for k, p in v["params"].items() if not k.startswith("blocks")}}
    with pytest.raises(ValueError, match=r"no residual blocks \(K = 0\)"):
        paths.residual_stack_of(model, no_blocks)
    for bad in (ResidualMLP(width=4, num_blocks=3, order="post"), ResidualMLP(width=4, num_blocks=3, scaling="rescale")):
        with pytest.raises(ValueError, match="not x \\+ f\\(x\\)"):
            paths.residual_stack_of(bad, bad.init(jax.random.key(0), x))
    stack = paths.residual_stack_of(model, v)
    x0 = jnp.ones(4)
    with pytest.raises(ValueError, match=r"v has shape \(5,\)"):
        paths.expand_jvp(stack, x0, jnp.ones(5))
    with pytest.raises(ValueError, match=r"u has shape"):
        paths.expand_vjp(stack, x0, jnp.ones((4, 1)))
    with pytest.raises(ValueError, match="K = 0"):
        paths.trajectory(stack._replace(num_blocks=0), x0)
    narrow = paths.BranchStack(lambda p, z: z[:2] * p, jnp.ones(3), 3)
    with pytest.raises(ValueError, match="equal shapes"):
        paths.block_jacobians(narrow, x0)
    with pytest.raises(ValueError, match="inputs must be a batch"):
        paths.path_expansion(model, v, jnp.ones(5))
    with pytest.raises(ValueError, match="masks"):
        paths.path_magnitudes(jnp.ones((3, 4, 4)), jnp.ones(4), np.ones((2, 2, 5), bool))


def test_quick_experiment_writes_results(tmp_path):
    config = path_lengths.get_config("quick")
    results = common.run_experiment(path_lengths, config, tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["experiment"] == "path_lengths" and set(saved) == {"experiment", "config", "metrics", "seconds"}
    m = saved["metrics"]
    assert m["central_half_band"] == [25, 29]
    assert round(100 * m["share_of_paths_5_to_17"], 2) == 0.45
    assert (m["try_three_blocks.one_branch"], m["try_three_blocks.two_branches"]) == (3, 3)
    assert m["expansion_rel_error"] < 1e-4
    for case, k in (("init_bn", config.num_blocks), ("init_nonorm", config.num_blocks),
                    ("before_training", config.model.num_blocks), ("after_training", config.model.num_blocks)):
        for name in ("gradient_share_by_length", "gradient_share_by_length_veit", "gradient_share_by_length_forward"):
            share = np.asarray(m[f"{name}.{case}"])
            assert share.shape == (k + 1,) and abs(share.sum() - 1) < 1e-4
    assert "cancellation" in path_lengths.report_section(m)
    assert (tmp_path / "path_lengths.png").stat().st_size > 10_000
    assert results["metrics"]["train_epochs"] == 1


def _path_metrics(**kw):
    m = {"try_three_blocks.one_branch": 3, "try_three_blocks.two_branches": 3, "central_half_band": [25, 29],
         "central_half_band_share": 0.52, "share_of_paths_5_to_17": 0.0045, "expansion_rel_error": 3e-6,
         "num_blocks": 54, "effective_path_length_veit.init_bn": 9.3, "effective_path_length.init_bn": 12.5,
         "trained_num_blocks": 32, "effective_path_length_veit.after_training": 7.0,
         "effective_path_length.after_training": 8.25}
    return {**m, **kw}


def test_path_length_claims_hold_and_fail_on_the_right_metrics():
    good = _path_metrics()
    assert [c.holds(good) for c in path_lengths.CLAIMS] == [True] * 6
    assert [c.measure(good) for c in path_lengths.CLAIMS] == [
        "3, 3", "25 to 29 (52.0% of paths)", "0.45%", "3.0e-06", "9.3 of K = 54 (exact sum: 12.5)",
        "7.0 of K = 32 (exact sum: 8.2)"]
    bad = _path_metrics(**{"try_three_blocks.two_branches": 2, "central_half_band": [24, 29],
                           "share_of_paths_5_to_17": 0.005, "expansion_rel_error": 2e-4,
                           "effective_path_length_veit.init_bn": 27.0, "effective_path_length_veit.after_training": 16.5})
    assert [c.holds(bad) for c in path_lengths.CLAIMS] == [False] * 6
    assert [c.measure(bad) for c in path_lengths.CLAIMS] == [
        "3, 2", "24 to 29 (52.0% of paths)", "0.50%", "2.0e-04", "27.0 of K = 54 (exact sum: 12.5)",
        "16.5 of K = 32 (exact sum: 8.2)"]
    # each verdict reads its own metric: one bad value fails one claim
    for i, (key, value) in enumerate([("try_three_blocks.one_branch", 4), ("central_half_band", [25, 30]),
                                      ("share_of_paths_5_to_17", 0.0044), ("expansion_rel_error", 1e-4),
                                      ("num_blocks", 18), ("trained_num_blocks", 14)]):
        m = _path_metrics(**{key: value})
        assert [c.holds(m) for c in path_lengths.CLAIMS] == [j != i for j in range(6)], key
