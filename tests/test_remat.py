"""``remat``: the scanned blocks rematerialised in segments (``resjax.nn.residual.stack_blocks``), on the models
that scan their blocks. The same parameters (layout and ``init`` values), logits and gradient as the plain scan:
bit for bit on CPU for the unnormalised MLPs (``experiments.fixup_one_step``'s models); with a normalisation the
last bits can differ (measured: at most 2.4e-7 absolute with BatchNorm, 3e-8 with LayerNorm, 1.1e-6 on a
BatchNorm ResNet's gradient), so those are compared to 1e-5 relative."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from resjax.nn import ResidualMLP, ResNet, TakiResNet, stack_blocks, tau_resnet, unstack_scanned
from resjax.nn.residual import remat_segment

X = jax.random.normal(jax.random.key(0), (32, 12))
Y = jax.random.randint(jax.random.key(1), (32,), 0, 10)


def _init_both(plain, remat, x, **kwargs):
    """Both models' variables from one key: the remat model's are the plain model's (layout and values). Each
    ``init`` jitted: one program (eagerly, every op with new shapes compiles a program of its own)."""
    v0, v1 = (jax.jit(lambda k, x, m=m: m.init(k, x, **kwargs))(jax.random.key(2), x) for m in (plain, remat))
    chex.assert_trees_all_equal_shapes_and_dtypes(v0, v1)
    chex.assert_trees_all_equal(v0, v1)
    return v0


def _loss_and_grads(model, variables, params, x, y, **kwargs):
    """Loss, gradient and the updated state (``batch_stats`` when present, and the sown ``intermediates``)."""
    state = {k: v for k, v in variables.items() if k != "params"}

    def loss(p):
        logits, new_state = model.apply({"params": p, **state}, x, mutable=[*state, "intermediates"], **kwargs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), (logits, new_state)

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)


@pytest.mark.parametrize("kind", ["tau", "fixup"])
@pytest.mark.parametrize("remat", [True, 3, 7, 20])  # isqrt(7) = 2; 7 = 2 x 3 + 1 (a remainder); one segment; > K
def test_logits_and_gradient_equal_the_plain_scans_bit_for_bit(kind, remat):
    plain, model = tau_resnet(kind, 8, 7, 10), tau_resnet(kind, 8, 7, 10, remat=remat)
    assert plain.remat is False and model.remat == remat
    variables = _init_both(plain, model, X[:2])
    assert jax.tree_util.tree_map(jnp.shape, variables["params"]["blocks"]) == {
        "block": {"linear_0": {"kernel": (7, 8, 8)}}}  # one subtree, leading axis K
    # fixup: W_l = 0 at init: take other parameters, where the blocks do something
    params = jax.jit(lambda ps: jax.tree_util.tree_map(lambda p: p + 0.1 * jax.random.normal(jax.random.key(3), p.shape),
                                                       ps))(variables["params"])
    (l0, (y0, s0)), g0 = _loss_and_grads(plain, variables, params, X, Y)
    (l1, (y1, s1)), g1 = _loss_and_grads(model, variables, params, X, Y)
    chex.assert_trees_all_equal((l0, y0, g0, s0), (l1, y1, g1, s1))  # intermediates: block_out, leading axis K
    assert s1["intermediates"]["blocks"]["block"]["block_out"][0].shape == (7, 32, 8)


def test_a_traced_tau_under_vmap():
    plain, model = tau_resnet("tau", 8, 5, 10), tau_resnet("tau", 8, 5, 10, remat=2)
    variables = _init_both(plain, model, X[:2])
    taus = jnp.array([0.1, 0.5, 1.0])

    def grads(m):
        loss = lambda p, t: optax.softmax_cross_entropy_with_integer_labels(  # noqa: E731
            m.apply({"params": p}, X, tau=t), Y).mean()
        return jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0)))(variables["params"], taus)

    chex.assert_trees_all_equal(grads(plain), grads(model))


@pytest.mark.parametrize("norm", ["batch", "layer"])
def test_with_a_normalisation_state_and_gradient_match(norm):
    kw = dict(width=8, num_blocks=5, num_layers=2, norm=norm, scan=True)
    plain, model = ResidualMLP(**kw), ResidualMLP(**kw, remat=2)
    variables = _init_both(plain, model, X[:2], train=False)
    (l0, (y0, s0)), g0 = _loss_and_grads(plain, variables, variables["params"], X, Y, train=True)
    (l1, (y1, s1)), g1 = _loss_and_grads(model, variables, variables["params"], X, Y, train=True)
    chex.assert_trees_all_equal_shapes_and_dtypes((l0, y0, g0, s0), (l1, y1, g1, s1))  # batch_stats: axis K
    chex.assert_trees_all_close((l0, y0, g0, s0), (l1, y1, g1, s1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make", [
    lambda **kw: ResNet(stage_sizes=(3,), stage_widths=(4,), stem_width=4, scan=True, **kw),  # 2 scanned blocks
    lambda **kw: TakiResNet(num_blocks=5, features=4, kernel_size=3, **kw),
], ids=["resnet", "taki"])
def test_conv_models(make):
    x, y = jax.random.normal(jax.random.key(0), (4, 8, 8, 3)), Y[:4]
    plain, model = make(), make(remat=True)
    variables = _init_both(plain, model, x[:2], train=False)
    (l0, (y0, s0)), g0 = _loss_and_grads(plain, variables, variables["params"], x, y, train=True)
    (l1, (y1, s1)), g1 = _loss_and_grads(model, variables, variables["params"], x, y, train=True)
    chex.assert_trees_all_equal_shapes_and_dtypes((g0, s0), (g1, s1))
    chex.assert_trees_all_close((l0, y0, g0, s0), (l1, y1, g1, s1), rtol=1e-5, atol=1e-6)


def test_its_parameters_unstack_into_the_unrolled_model():
    model, unrolled = tau_resnet("tau", 8, 4, 10, remat=True), tau_resnet("tau", 8, 4, 10, scan=False)
    params = model.init(jax.random.key(0), X[:2])["params"]
    np.testing.assert_allclose(model.apply({"params": params}, X),
                               unrolled.apply({"params": unstack_scanned(params, 4)}, X), rtol=1e-6, atol=1e-6)


def test_segments():
    assert remat_segment(False, 1000) is None
    assert remat_segment(True, 1000) == 31 and remat_segment(True, 3) == 1 and remat_segment(5, 3) == 5


@pytest.mark.parametrize("bad", [0, -2, 2.5, "yes", None, (2, 3)])
@pytest.mark.parametrize("make", [
    lambda r: ResidualMLP(width=4, num_blocks=3, scan=True, remat=r),
    lambda r: tau_resnet("tau", 4, 3, remat=r),
    lambda r: ResNet(stage_sizes=(2,), stage_widths=(4,), scan=True, remat=r),
    lambda r: TakiResNet(num_blocks=3, remat=r),
], ids=["mlp", "tau_resnet", "resnet", "taki"])
def test_a_bad_remat_is_refused_at_construction(make, bad):
    with pytest.raises(ValueError, match=r"^remat: must be False, True or a segment length"):
        make(bad)


@pytest.mark.parametrize("make", [
    lambda: ResidualMLP(width=4, num_blocks=3, remat=True),  # scan=False by default
    lambda: tau_resnet("tau", 4, 3, scan=False, remat=2),
    lambda: ResNet(stage_sizes=(2,), stage_widths=(4,), remat=True),
    lambda: TakiResNet(num_blocks=3, scan=False, remat=True),
], ids=["mlp", "tau_resnet", "resnet", "taki"])
def test_remat_needs_scan(make):
    with pytest.raises(ValueError, match=r"^remat: .*needs scan=True"):
        make()


def test_stack_blocks_checks_remat_too():
    import flax.linen as nn

    from resjax.nn import ResidualBlock

    class Mine(nn.Module):
        remat: object

        @nn.compact
        def __call__(self, x):
            return stack_blocks(ResidualBlock, dict(features=4, kind="mlp"), 3, x, None, None, scan=False,
                                remat=self.remat)

    with pytest.raises(ValueError, match="^remat: .*needs scan=True"):
        Mine(True).init(jax.random.key(0), jnp.ones((2, 4)))
    with pytest.raises(ValueError, match="^remat: must be"):
        Mine(0).init(jax.random.key(0), jnp.ones((2, 4)))


@pytest.mark.parametrize("make", [
    lambda **kw: tau_resnet("tau", 4, 3, **kw),
    lambda **kw: ResNet(stage_sizes=(2,), stage_widths=(4,), scan=True, **kw),
    lambda **kw: TakiResNet(num_blocks=3, **kw),
], ids=["mlp", "resnet", "taki"])
def test_a_checkpoint_described_before_remat_resumes_without_it(make):
    """A checkpoint records ``describe_model``; one written before the field existed lacks its line."""
    from resjax.train.checkpoint import describe_model, same_model_description

    now = describe_model(make())
    before = "\n".join(line for line in now.splitlines() if line.strip() != "remat = False")
    assert before != now and same_model_description(before, now)
    assert not same_model_description(before, describe_model(make(remat=True)))


def test_interop_takes_a_remat_resnet():
    """``resjax.interop`` builds the unrolled twin of a scanned ResNet (``clone(scan=False, remat=False)``)."""
    from resjax import interop
    from resjax.nn import cifar_resnet

    assert interop.torch_layout(cifar_resnet(20, scan=True, remat=True)) == interop.torch_layout(
        cifar_resnet(20, scan=True))
