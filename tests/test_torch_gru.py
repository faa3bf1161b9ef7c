"""``TorchGRUCell`` (``resjax.nn.recurrent``): PyTorch's GRU in flax, and ``ReferenceGRU``'s ``cell`` option.

With torch installed (not a dependency: those tests skip without it), a ``torch.nn.GRU``'s weights loaded through
``from_torch_gru`` give its outputs and gradients in float64 to 1e-12; without torch, the parameter counts, one
step of the cell against its formulas written in numpy, and the errors."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from resjax.nn import ReferenceGRU, TorchGRUCell, build_model, from_torch_gru

#: The float64 parity tolerance, absolute (outputs below 1, gradients up to about 30: float64 rounding is ~1e-14).
TOL = 1e-12


def _count(tree):
    return sum(a.size for a in jax.tree_util.tree_leaves(tree))


def _max_err(actual, expected, what):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, what
    return float(np.max(np.abs(actual - expected)))


def _torch_gru(torch, seed=0):
    """A bidirectional ``torch.nn.GRU(1, 6)`` in float64, its weights N(0, 0.5^2) (wider than the default draws,
    so that the gates leave their linear range)."""
    torch.manual_seed(seed)
    gru = torch.nn.GRU(1, 6, batch_first=True, bidirectional=True).double()
    with torch.no_grad():
        for p in gru.parameters():
            p.normal_(0.0, 0.5)
    return gru


def _bidirectional():
    cell = lambda: TorchGRUCell(6, param_dtype=jnp.float64)  # noqa: E731
    return nn.Bidirectional(nn.RNN(cell()), nn.RNN(cell()))


def _as_tree(pair):
    forward, backward = pair
    return {"forward_rnn": {"cell": forward}, "backward_rnn": {"cell": backward}}


def test_cell_matches_torch_gru_outputs_and_gradients_in_float64():
    """Outputs over (batch 5, length 40, 1) and the gradients of sum(outputs * r) with respect to the input and
    to every weight and bias of both directions: torch's to 1e-12 (absolute)."""
    torch = pytest.importorskip("torch")
    gru = _torch_gru(torch)
    rng = np.random.default_rng(1)
    x_np, r_np = rng.normal(size=(5, 40, 1)), rng.normal(size=(5, 40, 12))
    x = torch.tensor(x_np, requires_grad=True)
    out_torch, _ = gru(x)
    (out_torch * torch.tensor(r_np)).sum().backward()
    grads_torch = from_torch_gru({name: p.grad for name, p in gru.named_parameters()})

    model = _bidirectional()
    with jax.enable_x64(True):
        params = jax.tree_util.tree_map(jnp.asarray, _as_tree(from_torch_gru(gru)))
        assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(
            model.init(jax.random.key(0), jnp.asarray(x_np))["params"])

        def loss(params, x):
            out = model.apply({"params": params}, x)
            return jnp.sum(out * r_np), out

        (_, out), (g_params, g_x) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
            params, jnp.asarray(x_np))
        assert out.dtype == jnp.float64 and g_x.dtype == jnp.float64

    errors = {"outputs": _max_err(out, out_torch.detach().numpy(), "outputs"),
              "input gradient": _max_err(g_x, x.grad.numpy(), "input gradient")}
    expected = _as_tree(grads_torch)
    for path, g in jax.tree_util.tree_leaves_with_path(g_params):
        name = jax.tree_util.keystr(path)
        want = expected[path[0].key][path[1].key][path[2].key]
        assert np.max(np.abs(want)) > 1e-3, name  # a gradient that is there to compare
        errors[f"gradient of {name}"] = _max_err(g, want, name)
    assert len(errors) == 2 + 8
    bad = {k: v for k, v in errors.items() if not v < TOL}
    assert not bad, f"differences from torch above {TOL}: {bad}"


def test_reference_gru_matches_a_torch_gru_base():
    """The whole ``ReferenceGRU(cell='torch')`` against the reference's model written in torch (a bidirectional
    GRU, every position's outputs of both directions flattened position-major, one linear layer), its weights
    loaded: logits equal to float32's rounding (the model computes in float32)."""
    torch = pytest.importorskip("torch")

    class GRUBase(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gru = torch.nn.GRU(1, 6, batch_first=True, bidirectional=True)
            self.linear = torch.nn.Linear(40 * 12, 10)

        def forward(self, x):
            out, _ = self.gru(x[..., None])
            return self.linear(out.reshape(x.shape[0], -1))

    torch.manual_seed(2)
    reference = GRUBase().double()
    x = np.random.default_rng(3).normal(size=(4, 40))
    logits_torch = reference(torch.tensor(x)).detach().numpy()

    model = ReferenceGRU()
    forward, backward = from_torch_gru(reference.gru, dtype=np.float32)
    head = {"kernel": reference.linear.weight.detach().numpy().T, "bias": reference.linear.bias.detach().numpy()}
    params = {"forward_cell": forward, "backward_cell": backward,
              "head": {k: v.astype(np.float32) for k, v in head.items()}}
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 40))))["params"]
    assert jax.tree_util.tree_map(np.shape, params) == jax.tree_util.tree_map(np.shape, shapes)
    logits = model.apply({"params": params}, jnp.asarray(x, jnp.float32))
    err = _max_err(logits, logits_torch, "logits")
    assert err < 1e-5 * max(1.0, float(np.max(np.abs(logits_torch)))), err


def test_parameter_counts_of_the_two_cells():
    """5,134 (PyTorch's, 162 per direction: 3 (H I + H^2 + 2 H)) and flax's 5,110 (150 per direction)."""
    x = jnp.zeros((1, 40))
    counts = {}
    for cell in ("torch", "flax"):
        params = jax.eval_shape(lambda: build_model("reference_gru", num_classes=10, cell=cell).init(
            jax.random.key(0), x))["params"]
        counts[cell] = (_count(params), _count(params["forward_cell"]), _count(params["backward_cell"]))
    assert counts == {"torch": (5134, 162, 162), "flax": (5110, 150, 150)}
    assert build_model("reference_gru", num_classes=10).cell == "torch"
    cell = jax.eval_shape(lambda: TorchGRUCell(5).init(jax.random.key(0), jnp.zeros((2, 5)), jnp.zeros((2, 3))))
    assert jax.tree_util.tree_map(lambda a: a.shape, cell["params"]) == {
        "input_kernel": (3, 15), "input_bias": (15,), "hidden_kernel": (5, 15), "hidden_bias": (15,)}
    assert _count(cell) == 3 * (5 * 3 + 5 * 5 + 2 * 5)


def _sigmoid(a):
    return 1.0 / (1.0 + np.exp(-a))


def _step(p, h, x):
    """PyTorch's GRU step in numpy, gates r, z, n along the last axis of each parameter."""
    (w_ir, w_iz, w_in), (b_ir, b_iz, b_in) = np.split(p["input_kernel"], 3, -1), np.split(p["input_bias"], 3)
    (w_hr, w_hz, w_hn), (b_hr, b_hz, b_hn) = np.split(p["hidden_kernel"], 3, -1), np.split(p["hidden_bias"], 3)
    r = _sigmoid(x @ w_ir + b_ir + h @ w_hr + b_hr)
    z = _sigmoid(x @ w_iz + b_iz + h @ w_hz + b_hz)
    n = np.tanh(x @ w_in + b_in + r * (h @ w_hn + b_hn))
    return (1 - z) * n + z * h


def test_one_step_is_pytorchs_formula():
    """H = 1, one input: every weight and bias chosen (each gate's different), the new carry against the
    formulas by hand; then three steps of ``nn.RNN`` against the numpy loop, and H = 3 with drawn weights."""
    p = {"input_kernel": np.array([[0.5, -1.0, 1.5]]), "input_bias": np.array([0.1, 0.2, -0.3]),
         "hidden_kernel": np.array([[-0.7, 0.4, 0.9]]), "hidden_bias": np.array([0.25, -0.5, 0.8])}
    h, x = 0.6, -0.8
    r = _sigmoid(0.5 * x + 0.1 + -0.7 * h + 0.25)
    z = _sigmoid(-1.0 * x + 0.2 + 0.4 * h - 0.5)
    n = np.tanh(1.5 * x - 0.3 + r * (0.9 * h + 0.8))
    by_hand = (1 - z) * n + z * h
    cell = TorchGRUCell(1)
    params = {"params": jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), p)}
    carry, out = cell.apply(params, jnp.full((1, 1), h, jnp.float32), jnp.full((1, 1), x, jnp.float32))
    np.testing.assert_allclose(np.asarray(carry), [[by_hand]], rtol=1e-6)
    np.testing.assert_array_equal(carry, out)
    # b_hn outside the reset product, or z's other sign, would be this far off: the case tells them apart
    assert abs(by_hand - ((1 - z) * np.tanh(1.5 * x - 0.3 + r * 0.9 * h + 0.8) + z * h)) > 1e-2
    assert abs(by_hand - (z * n + (1 - z) * h)) > 1e-2

    xs = np.array([[[-0.8], [0.3], [1.1]]])
    ys = nn.RNN(TorchGRUCell(1)).apply({"params": {"cell": params["params"]}}, jnp.asarray(xs, jnp.float32))
    hs, h = [], np.zeros((1, 1))
    for t in range(3):
        h = _step(p, h, xs[:, t])
        hs.append(h)
    np.testing.assert_allclose(np.asarray(ys), np.stack(hs, 1), rtol=1e-6, atol=1e-7)

    x3, h3 = jax.random.normal(jax.random.key(1), (4, 2)), jax.random.normal(jax.random.key(2), (4, 3))
    big = TorchGRUCell(3).init(jax.random.key(3), h3, x3)
    carry, _ = TorchGRUCell(3).apply(big, h3, x3)
    np.testing.assert_allclose(np.asarray(carry), _step(jax.tree_util.tree_map(np.asarray, big["params"]),
                                                        np.asarray(h3), np.asarray(x3)), rtol=1e-5, atol=1e-6)


def test_default_initialisation_is_pytorchs_and_half_params_are_rounded_draws():
    """Every weight and bias drawn in U(+-1/sqrt(H)) (spread over it, not a constant); a bfloat16 ``param_dtype``
    holds the float32 draws rounded; the carry starts at zero in ``param_dtype``."""
    cell = TorchGRUCell(16)
    x, key = jnp.zeros((2, 4)), jax.random.key(5)
    carry = cell.initialize_carry(key, x.shape)
    assert carry.shape == (2, 16) and carry.dtype == jnp.float32 and not np.any(np.asarray(carry))
    assert cell.num_feature_axes == 1
    params = cell.init(key, carry, x)["params"]
    for name, leaf in params.items():
        leaf = np.asarray(leaf)
        assert np.max(np.abs(leaf)) <= 0.25 and np.max(np.abs(leaf)) > 0.2 and np.std(leaf) > 0.1, name
    half = TorchGRUCell(16, param_dtype=jnp.bfloat16).init(key, carry.astype(jnp.bfloat16), x)["params"]
    for name in params:
        assert half[name].dtype == jnp.bfloat16
        np.testing.assert_array_equal(half[name], params[name].astype(jnp.bfloat16))
    assert TorchGRUCell(2, param_dtype=jnp.bfloat16).initialize_carry(key, (3, 1)).dtype == jnp.bfloat16


def test_from_torch_gru_reads_a_state_dict_without_torch():
    """Kernels transposed, biases as they are; ``bias=False`` gives zeros; two layers raise naming ``gru``."""
    rng = np.random.default_rng(4)
    sd = {"weight_ih_l0": rng.normal(size=(9, 2)), "weight_hh_l0": rng.normal(size=(9, 3)),
          "bias_ih_l0": rng.normal(size=9), "bias_hh_l0": rng.normal(size=9)}
    p = from_torch_gru(sd)
    np.testing.assert_array_equal(p["input_kernel"], sd["weight_ih_l0"].T)
    np.testing.assert_array_equal(p["hidden_kernel"], sd["weight_hh_l0"].T)
    np.testing.assert_array_equal(p["input_bias"], sd["bias_ih_l0"])
    np.testing.assert_array_equal(p["hidden_bias"], sd["bias_hh_l0"])
    no_bias = from_torch_gru({k: v for k, v in sd.items() if k.startswith("weight")}, dtype=np.float32)
    assert no_bias["input_bias"].dtype == np.float32 and not np.any(no_bias["hidden_bias"])
    with pytest.raises(ValueError, match="gru"):
        from_torch_gru({**sd, **{k.replace("_l0", "_l1"): v for k, v in sd.items()}})
    with pytest.raises(ValueError, match="gru"):
        from_torch_gru({"weight": sd["weight_ih_l0"]})


@pytest.mark.parametrize("value", ["pytorch", "", None, 1])
def test_unknown_cell_names_the_setting(value):
    with pytest.raises(ValueError, match=r"cell.*'torch', 'flax'"):
        build_model("reference_gru", num_classes=10, cell=value)
    with pytest.raises(ValueError, match="cell"):
        ReferenceGRU(cell=value)
