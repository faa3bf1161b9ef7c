"""Every public analysis of ``resjax.analysis`` on every model kind ``build_model`` knows, and on a Flax-only model.

Each cell of the matrix (an analysis, a case) either asserts the analysis's property on that model (a variance
positive and finite at every depth, a path expansion that sums to the Jacobian of the stack or of a ResNet stage,
an autocorrelation of 1 at lag 0, a loss of one weight equal to the model's loss, ...) or asserts the
``ValueError`` that names what the model lacks (a sown ``'block_out'``, a skip, ``order='pre'``, a scalar input,
...). ``EXPECT`` is the table: per case, the analyses that apply, and for the others the text their
``ValueError`` must contain. Nothing is skipped: ``test_the_matrix_covers_every_kind_and_analysis`` requires a
case of every ``build_model`` kind and a row of every name in ``resjax.analysis.__all__`` (the names that take
no model have their own tests at the end).

Sizes are tiny (depth 1-2, width 4-8, 8x8 images) and each case is initialised once (module-scoped fixtures).
``densenet121`` has 121 fixed layers: its variables are abstract (``jax.eval_shape`` of ``init``), every
refusal happens before anything is computed, and its loss functions are checked on ``jax.eval_shape``.
"""

from __future__ import annotations

import functools
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import resjax.analysis as A
from resjax.analysis.shattering import make_grid, scalar_function
from resjax.nn import build_model
from resjax.nn.norms import is_batch_norm

MLP_INPUT = (4, 5)
IMAGES = (4, 8, 8, 3)
SIGNALS = (4, 12)  # MNIST-1D's layout (batch, length): the 1-D models add the channel axis


class UserBlock(nn.Module):
    """A residual block of the user's own: ``x + W2 relu(W1 x)``; sows its output as the protocol says."""

    width: int

    @nn.compact
    def __call__(self, x):
        h = x + nn.Dense(self.width, name="w2")(nn.relu(nn.Dense(self.width, name="w1")(x)))
        self.sow("intermediates", "block_out", h)
        return h


class UserMLP(nn.Module):
    """A Flax-only residual MLP (no resjax class, no ``train``): stem, two ``UserBlock``s, head."""

    width: int = 4
    num_classes: int = 3

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(self.width, name="stem")(x)
        self.sow("intermediates", "stem_out", h)
        for k in range(2):
            h = UserBlock(self.width, name=f"blocks_{k}")(h)
        return nn.Dense(self.num_classes, name="head")(h)


#: case -> (config or a Flax module, input shape, the path of a weight (one followed by BatchNorm where the
#: model has it: ``scale_identities`` then checks the invariance)).
CASES = {
    "plain_mlp": (dict(kind="plain_mlp", width=4, depth=2, num_classes=3), MLP_INPUT, "blocks_0/linear_0/kernel"),
    "residual_mlp": (dict(kind="residual_mlp", width=4, num_blocks=2, num_classes=3, norm="batch", order="pre",
                          use_bias=False, num_layers=2), MLP_INPUT, "blocks_0/linear_0/kernel"),
    "residual_stack": (dict(kind="residual_stack", width=4, num_blocks=2, use_bias=False), (4, 4),
                       "blocks_0/linear_0/kernel"),
    "tau_resnet": (dict(kind="tau_resnet", variant="tau", width=4, depth=2, num_classes=3), MLP_INPUT,
                   "blocks/block/linear_0/kernel"),
    "resnet": (dict(kind="resnet", stage_sizes=(2, 2), stage_widths=(4, 8), stem_width=4, num_classes=3,
                    order="pre"), IMAGES, "stage1_first/conv_0/kernel"),
    "cifar_resnet": (dict(kind="cifar_resnet", depth=8, num_classes=3), IMAGES, "stem_conv/kernel"),
    "imagenet_resnet": (dict(kind="imagenet_resnet", depth=18, num_classes=3), IMAGES, "stem_conv/kernel"),
    "taki_resnet": (dict(kind="taki_resnet", num_blocks=2, features=4, kernel_size=3, num_classes=3), IMAGES,
                    "stem_conv/kernel"),
    "densenet": (dict(kind="densenet", block_layers=(1, 1), growth_rate=4, init_features=8, num_classes=3,
                      stem="cifar"), IMAGES, "block_0/layer_0/conv1x1/kernel"),
    "densenet121": (dict(kind="densenet121", num_classes=3), (2, 32, 32, 3), "stem_conv/kernel"),
    "densenet_bc_cifar": (dict(kind="densenet_bc_cifar", depth=10, growth_rate=4, num_classes=3), IMAGES,
                          "block_0/layer_0/conv1x1/kernel"),
    "unet": (dict(kind="unet", features=(4, 8)), IMAGES, "down_0/conv_0/kernel"),
    "hourglass": (dict(kind="hourglass", num_stacks=1, depth=1, features=4, num_heatmaps=2), IMAGES,
                  "stem/conv_0/kernel"),
    "user_mlp": (UserMLP(), MLP_INPUT, "blocks_0/w1/kernel"),
    "resnet1d": (dict(kind="resnet1d", stage_sizes=(2, 2), stage_widths=(4, 8), stem_width=4, num_classes=3,
                      order="pre"), SIGNALS, "stage1_first/conv_0/kernel"),
    "small_resnet1d": (dict(kind="small_resnet1d", width=4, num_classes=3), SIGNALS, "stem_conv/kernel"),
    "logistic": (dict(kind="logistic", num_classes=3), SIGNALS, "linear/kernel"),
    "reference_mlp": (dict(kind="reference_mlp", width=4, num_classes=3), SIGNALS, "blocks_0/branch/linear/kernel"),
    "reference_cnn": (dict(kind="reference_cnn", channels=4, num_classes=3), SIGNALS, "conv_0/kernel"),
    "reference_gru": (dict(kind="reference_gru", hidden=3, num_classes=3), SIGNALS, "head/kernel"),
}
ABSTRACT = {"densenet121"}  # abstract variables: refusals before computing, loss functions on eval_shape
# loss functions on eval_shape only for the largest concrete models too (the suite's time: 33 s of compiling their
# second-order programs); their numbers are checked by the other families, the loss functions' on the small kinds
LOSS_SHAPES_ONLY = ABSTRACT | {"imagenet_resnet", "densenet", "densenet_bc_cifar"}

# What each analysis family needs; a case that lacks it must raise ValueError with this text (a regex).
NO_SOWS = r"sowed no 'block_out'"
NOT_RESNET = r"need a resjax\.nn\.ResNet"
NO_BLOCKS = r"has no residual blocks"
NOT_SCALAR = r"refuses a \(1, 1\) input.*pass embed=.*and readout="  # the refusal names the arguments that fix it
POST_ORDER = r"order='post' .* build the model with order='pre' .* pass stage="  # names both fixes
NOT_LOG_SPACE = r"is not supported"
NOT_STACK = r"need a resjax\.nn\.ResidualStack"
EXPECT = {
    #                  propagation        resnet_signal  paths                  shattering  log space     taki
    "plain_mlp": dict(propagation=True, ratio=r"skip", resnet=NOT_RESNET, paths=r"no skip", shattering=True,
                      log_space=r"use_bias", taki=NOT_STACK),
    "residual_mlp": dict(propagation=True, ratio=True, resnet=NOT_RESNET, paths=True, shattering=True,
                         log_space=r"norm", taki=NOT_STACK),
    "residual_stack": dict(propagation=True, ratio=True, resnet=NOT_RESNET, paths=True, shattering=True,
                           log_space=True, taki=True),
    "tau_resnet": dict(propagation=True, ratio=r"order", resnet=NOT_RESNET, paths=r"order", shattering=True,
                       log_space=True, taki=NOT_STACK),
    "resnet": dict(propagation=True, ratio=True, resnet=True, paths=True, shattering=NOT_SCALAR,
                   log_space=NOT_LOG_SPACE, taki=NOT_STACK),
    "cifar_resnet": dict(propagation=True, ratio=r"order", resnet=True, paths=POST_ORDER,
                         shattering=NOT_SCALAR, log_space=NOT_LOG_SPACE, taki=NOT_STACK),
    "imagenet_resnet": dict(propagation=True, ratio=r"order", resnet=True, paths=POST_ORDER, shattering=NOT_SCALAR,
                            log_space=NOT_LOG_SPACE, taki=NOT_STACK),
    "taki_resnet": dict(propagation=True, ratio=True, resnet=NOT_RESNET, paths=True, shattering=NOT_SCALAR,
                        log_space=NOT_LOG_SPACE, taki=NOT_STACK),
    **{kind: dict(propagation=NO_SOWS, ratio=NO_SOWS, resnet=NOT_RESNET, paths=NO_BLOCKS, shattering=NOT_SCALAR,
                  log_space=NOT_LOG_SPACE, taki=NOT_STACK)
       for kind in ("densenet", "densenet121", "densenet_bc_cifar", "unet", "hourglass")},
    "user_mlp": dict(propagation=True, ratio=True, resnet=NOT_RESNET, paths=NO_BLOCKS, shattering=True,
                     log_space=NOT_LOG_SPACE, taki=NOT_STACK),
    # 1-D ResNets: a ResNet's analyses, stage by stage; a (1, 1) input is a signal of length 1 (its gradients work)
    "resnet1d": dict(propagation=True, ratio=True, resnet=True, paths=True, shattering=True, log_space=NOT_LOG_SPACE,
                     taki=NOT_STACK),
    "small_resnet1d": dict(propagation=True, ratio=r"order", resnet=True, paths=POST_ORDER,
                           shattering=True, log_space=NOT_LOG_SPACE, taki=NOT_STACK),
    # the MNIST-1D reference models: the MLP's one residual block sows its output (a stream to measure); the others
    # have no residual blocks
    "reference_mlp": dict(propagation=True, ratio=True, resnet=NOT_RESNET, paths=NO_BLOCKS, shattering=True,
                          log_space=NOT_LOG_SPACE, taki=NOT_STACK),
    **{kind: dict(propagation=NO_SOWS, ratio=NO_SOWS, resnet=NOT_RESNET, paths=NO_BLOCKS, shattering=True,
                  log_space=NOT_LOG_SPACE, taki=NOT_STACK) for kind in ("logistic", "reference_gru")},
    "reference_cnn": dict(propagation=NO_SOWS, ratio=NO_SOWS, resnet=NOT_RESNET, paths=NO_BLOCKS,
                          shattering=NOT_SCALAR, log_space=NOT_LOG_SPACE, taki=NOT_STACK),
}
IDS = list(CASES)


def _module(case):
    spec = CASES[case][0]
    return build_model(spec) if isinstance(spec, dict) else spec


def _has_bn(variables) -> bool:
    return bool(variables.get("batch_stats"))


def _train(case, variables):
    """The train argument this case takes: True where the model has a train argument, None where it has none."""
    return None if case == "user_mlp" else True


class Case:
    def __init__(self, name):
        self.name, (_, shape, self.path) = name, CASES[name]
        self.module = _module(name)
        self.x = jax.random.normal(jax.random.key(1), shape)
        if name in ABSTRACT:
            self.variables = jax.eval_shape(self.module.init, jax.random.key(0), self.x)
        else:
            self.variables = jax.jit(self.module.init)(jax.random.key(0), self.x)
        self.train = _train(name, self.variables)
        self.bn = _has_bn(self.variables)

    def outputs(self, variables=None):
        """The model's outputs on ``x`` (its own variables unless others are given; BatchNorm's updates dropped)."""
        mutable = ["batch_stats"] if self.bn else False
        kw = {} if self.train is None else {"train": self.train}
        out = self.module.apply(self.variables if variables is None else variables, self.x, mutable=mutable, **kw)
        return out[0] if mutable else out

    def loss(self, outputs, labels):
        """Cross-entropy for a classifier, the mean square of the output(s) otherwise."""
        if isinstance(outputs, list) or outputs.ndim != 2 or outputs.shape[-1] != 3:
            return sum(jnp.mean(jnp.square(o)) for o in (outputs if isinstance(outputs, list) else [outputs]))
        return optax.softmax_cross_entropy_with_integer_labels(outputs, labels).mean()


@pytest.fixture(scope="module")
def cases():
    built = {}

    def get(name):
        if name not in built:
            built[name] = Case(name)
        return built[name]

    return get


def _refused(expected, call):
    with pytest.raises(ValueError, match=expected):
        call()


# ---- signal propagation -----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", IDS)
def test_variance_through_depth(cases, case):
    """Positive, finite variance at every depth; a conv ResNet's per stage (its stage sizes); or the ValueError."""
    c = cases(case)
    expected = EXPECT[case]["propagation"]
    if c.bn:  # no silent mode: a model with BatchNorm refuses a call that says nothing about train
        _refused(r"train", lambda: A.variance_through_depth(c.module, c.variables, c.x))
    if expected is not True:
        _refused(expected, lambda: A.variance_through_depth(c.module, c.variables, c.x, train=c.train))
        _refused(expected, lambda: A.stream_activations(c.module, c.variables, c.x, train=c.train))
        return
    stages = getattr(_module(case), "stage_sizes", None)  # a conv ResNet's (not tau_resnet's, not Taki's)

    @jax.jit
    def run(variables, x):  # the case's calls in one program, not one program per eager op
        out = A.variance_through_depth(c.module, variables, x, train=c.train)
        if stages is None:
            return out, A.stream_activations(c.module, variables, x, train=c.train)
        return (out, A.stream_activations(c.module, variables, x, train=True, by_stage=True),
                A.block_outputs(c.module, variables, x, train=True))

    out, *streams = run(c.variables, c.x)
    v, stage = np.asarray(out["variance"]), np.asarray(out["stage"])
    assert np.all(np.isfinite(v)) and np.all(v > 0) and np.all(np.asarray(out["per_unit_variance"]) > 0)
    assert stage[0] == 0
    if stages is not None:  # one stage index per block, grouped as the ResNet's stages
        assert np.bincount(stage[1:])[1:].tolist() == list(stages)
        _refused(r"changes shape at block", lambda: jax.eval_shape(  # refused from the shapes alone
            lambda v: A.stream_activations(c.module, v, c.x, train=True), c.variables))
        by_stage, outs = streams
        for mine, theirs in zip(by_stage[1:], outs):  # the same blocks in the same order as resnet_signal
            np.testing.assert_array_equal(np.asarray(mine), np.asarray(theirs))
        for s, h in enumerate(by_stage):
            np.testing.assert_allclose(v[stage == s], np.var(np.asarray(h).reshape(len(h), -1), axis=1), rtol=1e-5)
    else:
        assert set(stage[1:].tolist()) == {1}
        stream = np.asarray(streams[0])
        np.testing.assert_allclose(v, np.var(stream.reshape(len(stream), -1), axis=1), rtol=1e-5)


@pytest.mark.parametrize("case", IDS)
def test_branch_variance_ratio(cases, case):
    """Finite positive ratios where blocks add to one stream (NaN where a stage changes its shape), or the error."""
    c = cases(case)
    expected = EXPECT[case]["ratio"]
    if expected is not True:
        _refused(expected, lambda: A.branch_variance_ratio(c.module, c.variables, c.x, train=c.train))
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ratio, stage = map(np.asarray, jax.jit(lambda v, x: (  # one program, not one per eager op
            A.branch_variance_ratio(c.module, v, x, train=c.train),
            A.variance_through_depth(c.module, v, x, train=c.train)["stage"]))(c.variables, c.x))
    changes = np.r_[False, stage[2:] != stage[1:-1]]  # block j starts a new stage after the first
    said = [str(w.message) for w in caught if "branch_variance_ratio" in str(w.message)]
    undefined = (np.flatnonzero(changes) + 1).tolist()  # no NaN without a warning naming the blocks, nor the reverse
    assert (len(said) == 1 and f"block(s) {undefined} change" in said[0]) if undefined else not said, said
    assert ratio.shape == (len(stage) - 1,)
    assert np.all(np.isnan(ratio[changes])) and np.all(np.isfinite(ratio[~changes])) and np.all(ratio[~changes] > 0)


@pytest.mark.parametrize("case", IDS)
def test_block_outputs_and_norms(cases, case):
    """A conv ResNet's per-example block-output norms: positive, finite, the norms of ``block_outputs``."""
    c = cases(case)
    if EXPECT[case]["resnet"] is not True:
        _refused(EXPECT[case]["resnet"], lambda: A.block_output_norms(c.module, c.variables, c.x, train=True))
        _refused(EXPECT[case]["resnet"], lambda: A.block_outputs(c.module, c.variables, c.x, train=True))
        return
    _refused(r"train", lambda: A.block_outputs(c.module, c.variables, c.x, train=None))  # BatchNorm needs it
    norms, outs = jax.jit(lambda v, x: (A.block_output_norms(c.module, v, x, train=True),  # one program
                                        A.block_outputs(c.module, v, x, train=True)))(c.variables, c.x)
    norms = np.asarray(norms)
    direct = np.concatenate([np.linalg.norm(np.asarray(h).reshape(h.shape[0], h.shape[1], -1), axis=-1) for h in outs])
    assert norms.shape == (c.module.num_blocks, c.x.shape[0])
    assert np.all(np.isfinite(norms)) and np.all(norms > 0)
    np.testing.assert_allclose(norms, direct, rtol=1e-5)


@pytest.mark.parametrize("case", IDS)
def test_log_space_propagation(cases, case):
    """Log-space norms equal the log of the direct forward norms, or the ValueError naming the setting."""
    c = cases(case)
    expected = EXPECT[case]["log_space"]
    if expected is not True:
        _refused(expected, lambda: A.log_space_propagation(c.module, c.variables, c.x))
        return
    out, stream = jax.jit(lambda v, x: (A.log_space_propagation(c.module, v, x),  # one program
                                        A.stream_activations(c.module, v, x, train=c.train)))(c.variables, c.x)
    stream = np.asarray(stream)
    np.testing.assert_allclose(np.asarray(out["log_norm"]), np.log(np.linalg.norm(stream, axis=-1)), atol=1e-4)
    assert np.all(np.isfinite(np.asarray(out["log_grad_norm"])))


@pytest.mark.parametrize("case", IDS)
def test_gradient_variance(cases, case):
    """Taki's measurement: finite curves; with near-zero kernels the blocks are the identity and the delta keeps
    its size through depth; any other model: the ValueError naming ResidualStack."""
    c = cases(case)
    expected = EXPECT[case]["taki"]
    call = functools.partial(A.gradient_variance, c.module, jax.random.key(2), batch_size=4, num_draws=2,
                             train=False)
    if expected is not True:
        _refused(expected, call)
        return
    out = call(kernel_gains=[1e-4, 1.0])
    delta = out["log10_delta_sq"]
    assert delta.shape == (2, 2, c.module.num_blocks + 1) and np.all(np.isfinite(delta))
    np.testing.assert_allclose(delta[0], np.repeat(delta[0][:, -1:], delta.shape[-1], axis=1), atol=1e-3)


# ---- gradients / shattering -------------------------------------------------------------------------------


def _scalar_twin(case):
    """The case's model with one input and one output (a classifier with num_classes=1; a stack of width 1)."""
    spec = CASES[case][0]
    if not isinstance(spec, dict):
        return UserMLP(num_classes=1)
    if spec["kind"] == "residual_stack":
        return build_model({**spec, "width": 1})
    return build_model({**spec, "num_classes": 1})


def _first_number(y):
    """One number of any output (logits, an image, a list of heatmaps): its first leaf's first entry."""
    return jax.tree_util.tree_leaves(y)[0].reshape(-1)[0]


#: The cases whose gradients along a line are computed and compared (an image classifier with BatchNorm, an MLP
#: with BatchNorm, a model of several outputs); the others are traced (``jax.eval_shape``), the suite's time.
LINE_NUMBERS = {"cifar_resnet", "residual_mlp", "hourglass"}


def _along_a_line(c, kw):
    """Any model on its own variables: input_gradients along a line through its input space to one of its
    outputs (embed=, readout=) equals the forward-mode derivative of the same function; a readout of more than
    one number is refused by name."""
    t = jnp.linspace(-1.0, 1.0, 3)
    x0 = c.x[:1]
    v = jax.random.normal(jax.random.key(7), x0.shape)
    line = dict(embed=lambda s: x0 + s * v, readout=_first_number)
    if c.name in ABSTRACT:
        return
    if c.name not in LINE_NUMBERS:  # the function is built, its shapes checked (eval_shape): the suite's time
        scalar_function(c.module, c.variables, **line, **kw)
        return
    _refused(r"readout: input gradients need a scalar output", lambda: A.input_gradients(
        c.module, c.variables, t, embed=line["embed"], readout=lambda y: jax.tree_util.tree_leaves(y)[0], **kw))
    _refused(r"pass readout=", lambda: A.input_gradients(c.module, c.variables, t, embed=line["embed"], **kw))

    @jax.jit
    def run(variables):  # one program
        f = lambda s: _first_number(c.module.apply(variables, x0 + s * v, **kw))  # noqa: E731
        return A.input_gradients(c.module, variables, t, **line, **kw), jax.vmap(
            lambda s: jax.jvp(f, (s,), (jnp.ones_like(s),))[1])(t)

    grads, forward = map(np.asarray, run(c.variables))
    assert grads.shape == t.shape and np.all(np.isfinite(grads))
    np.testing.assert_allclose(grads, forward, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("case", IDS)
def test_input_gradients_and_shattering(cases, case):
    """dy/dx on a grid for a model of one number: finite, one network of init_many equal to input_gradients, an
    autocorrelation of 1 at lag 0; an image model refuses a (1, 1) input, naming embed= and readout=; every
    model along a line through its input space with them (``_along_a_line``)."""
    c = cases(case)
    expected = EXPECT[case]["shattering"]
    grid = make_grid(16)
    kw = {} if c.train is None else {"train": False}  # one example at a time: BatchNorm's running estimates
    _along_a_line(c, kw)
    if expected is not True:
        _refused(expected, lambda: A.input_gradients(c.module, c.variables, grid, **kw))
        return
    twin = _scalar_twin(case)

    @jax.jit
    def run(key):  # one program, not one per eager op
        many = A.init_many(twin, key, 2)
        grads = A.input_gradients_many(twin, many, grid, **kw)
        one = A.input_gradients(twin, jax.tree_util.tree_map(lambda a: a[1], many), grid, **kw)
        return grads, one, A.autocorrelation(grads, 4, "raw")

    grads, one, curves = map(np.asarray, run(jax.random.key(3)))
    assert grads.shape == (2, 16) and np.all(np.isfinite(grads))
    np.testing.assert_allclose(grads[1], one, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(curves[:, 0], 1.0, rtol=1e-6)
    stats = A.shattering_statistics(grads, spacing=0.25, max_lag=4, estimator="raw")
    np.testing.assert_allclose(stats["mean_curve"][0], 1.0, rtol=1e-6)
    half = float(A.half_correlation_distance(stats["mean_curve"], 0.25))
    assert np.isnan(half) or 0 < half <= 1.0


# ---- paths ------------------------------------------------------------------------------------------------


def _stage_of(case):
    return {"resnet": 2, "cifar_resnet": 1, "imagenet_resnet": 1, "resnet1d": 2, "small_resnet1d": 1}.get(case)


@pytest.mark.parametrize("case", IDS)
def test_path_expansion(cases, case):
    """The terms by length sum to the Jacobian of the stack (an MLP's blocks, a ResNet stage's blocks after its
    first), whose trajectory is the model's own stream; the matrix-free forms agree; or the ValueError."""
    c = cases(case)
    expected = EXPECT[case]["paths"]
    stage = _stage_of(case)
    kw = {} if stage is None else {"stage": stage}
    if stage is not None:  # a conv ResNet with the defaults (no stage): refused, naming what to pass
        _refused(r"pass stage=1 or 2 " if expected is True else expected,
                 lambda: A.path_expansion(c.module, c.variables, c.x))
    if case == "cifar_resnet":  # the refusals name the stages a deeper model has, or the depth it needs
        deeper = build_model(dict(kind="cifar_resnet", depth=20, order="pre"))
        _refused(r"pass stage=1, 2 or 3 ", lambda: A.path_expansion(deeper, c.variables, c.x))
        _refused(r"order='pre' .* pass stage=1, 2 or 3 ",
                 lambda: A.path_expansion(deeper.clone(order="post"), c.variables, c.x))
        _refused(r"no stage .*stage_sizes=\(1, 1, 1\).*cifar_resnet\(14\)",
                 lambda: A.path_expansion(c.module.clone(order="pre"), c.variables, c.x))
    if expected is not True:
        if case != "user_mlp":
            _refused(expected, lambda: A.path_expansion(c.module, c.variables, c.x, **kw))
            _refused(expected, lambda: A.residual_stack_of(c.module, c.variables, **kw))
            return
        _refused(expected, lambda: A.path_expansion(c.module, c.variables, c.x))  # then its own stack (below)

    @jax.jit
    def run(variables, x):  # the case's calls in one program, not one program per eager op
        if case == "user_mlp":  # its own stack: branch_stack of its blocks
            params = variables["params"]
            f = lambda p, h: UserBlock(4).apply({"params": p}, h[None])[0] - h  # noqa: E731
            stack = A.branch_stack([(f, params[f"blocks_{k}"]) for k in range(2)])
            x0 = A.stream_input(c.module, variables, x)
            pe, own = A.path_expansion(stack, x0), None
        else:
            stack = A.residual_stack_of(c.module, variables, **kw)
            x0 = A.stream_input(c.module, variables, x, **kw)
            pe = A.path_expansion(c.module, variables, x, **kw)
            # the stack's trajectory is the model's own stream (evaluation mode), from x0 to the stage's end
            streams = A.stream_activations(c.module, variables, x, train=None if c.train is None else False,
                                           by_stage=True)
            own = streams[stage] if stage else jnp.concatenate(streams)
        shape = x0.shape[1:]
        d = int(np.prod(shape))
        end = lambda z: A.paths.trajectory(stack, z.reshape(shape))[-1].reshape(d)  # noqa: E731
        v = jax.random.normal(jax.random.key(4), shape)
        return dict(pe=pe, own=own, num_blocks=stack.num_blocks, jac=jax.jacfwd(end)(x0[0].reshape(d)),
                    jacs=A.block_jacobians(stack, x0[0])[0], v=v.reshape(d),
                    e=A.expand_jvp(stack, x0[0], v).reshape(stack.num_blocks + 1, d),
                    r=A.expand_vjp(stack, x0[0], v).reshape(stack.num_blocks + 1, d),
                    mags=A.sampled_path_magnitudes(pe.jacobians[0], v.reshape(d), jax.random.key(5), 8))

    n = jax.tree_util.tree_map(np.asarray, run(c.variables, c.x))
    pe, jac, v, num_blocks = n["pe"], n["jac"], n["v"], int(n["num_blocks"])
    if n["own"] is not None:
        mine = np.moveaxis(pe.stream, 1, 0)
        np.testing.assert_allclose(mine[-1], n["own"][-1], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(pe.terms[0].sum(0), jac, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(n["jacs"], pe.jacobians[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(n["e"].sum(0), jac @ v, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(n["r"].sum(0), jac.T @ v, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(n["mags"][0], np.linalg.norm(v), rtol=1e-5)  # length 0: the skip path
    assert sum(A.path_counts(num_blocks)) == 2 ** num_blocks
    np.testing.assert_allclose(A.path_length_shares(num_blocks).sum(), 1.0)


# ---- loss functions: any model with or without train ------------------------------------------------------


@pytest.mark.parametrize("case", IDS)
def test_loss_functions(cases, case):
    """params_loss_fn and weight_loss_fn at the model's own parameters equal the model's loss; the probe along
    the gradient starts there; a weight followed by BatchNorm is scale-invariant (scale_identities)."""
    c = cases(case)
    labels = jnp.arange(c.x.shape[0]) % 3
    loss = c.loss
    if c.bn:  # no silent mode
        _refused(r"train", lambda: jax.eval_shape(
            lambda v: A.params_loss_fn(c.module, v, c.x, labels, train=None, loss=loss)(v["params"]), c.variables))
    if case == "user_mlp":  # a model without train refuses one
        _refused(r"takes no 'train'", lambda: A.params_loss_fn(c.module, c.variables, c.x, labels, train=True))
    loss_fn = A.params_loss_fn(c.module, c.variables, c.x, labels, train=c.train, loss=loss)
    weight_fn = A.weight_loss_fn(c.module, c.variables, c.x, labels, c.path, train=c.train, loss=loss)
    weight = A.scale_invariance.get_weight(c.variables, c.path)
    if case in LOSS_SHAPES_ONLY:  # shapes only: a scalar loss and a gradient of every parameter
        value, grad = jax.eval_shape(lambda v: jax.value_and_grad(
            A.params_loss_fn(c.module, v, c.x, labels, train=c.train, loss=loss))(v["params"]), c.variables)
        assert value.shape == () and jax.tree_util.tree_structure(grad) == jax.tree_util.tree_structure(
            c.variables["params"])
        w_grad = jax.eval_shape(lambda v: jax.grad(A.weight_loss_fn(c.module, v, c.x, labels, c.path, train=c.train,
                                                                    loss=loss))(weight), c.variables)
        assert w_grad.shape == weight.shape
        return

    @jax.jit
    def numbers(variables):  # one program for the case, not one per eager op (the loss functions are jnp)
        loss_fn = A.params_loss_fn(c.module, variables, c.x, labels, train=c.train, loss=loss)
        weight_fn = A.weight_loss_fn(c.module, variables, c.x, labels, c.path, train=c.train, loss=loss)
        weight = A.scale_invariance.get_weight(variables, c.path)
        g = jax.grad(weight_fn)(weight)
        return dict(direct=loss(c.outputs(variables), labels), loss=loss_fn(variables["params"]),
                    weight=weight_fn(weight), probe=A.probe_gradient_direction(loss_fn, variables["params"], [0.0, 1e-3]),
                    geo=A.sgd_step_geometry(weight, g, 0.1),
                    after=A.step_geometry_from_update(weight, weight - 0.1 * g, 0.1),
                    lr=A.effective_learning_rate(0.1, weight))

    n = numbers(c.variables)
    direct = float(n["direct"])
    assert np.isfinite(direct)
    np.testing.assert_allclose(float(n["loss"]), direct, rtol=1e-5)
    np.testing.assert_allclose(float(n["weight"]), direct, rtol=1e-5)
    probe = n["probe"]
    np.testing.assert_allclose(float(probe["losses"][0]), direct, rtol=1e-4)
    assert np.isfinite(float(probe["grad_norm"])) and float(probe["grad_changes"][0]) <= 1e-3 * float(
        probe["grad_norm"])  # step 0: the same gradient (to rounding)
    np.testing.assert_allclose(float(n["after"]["angle"]), float(n["geo"]["angle"]), rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(float(n["lr"]), 0.1 / float(np.sum(np.asarray(weight, np.float64) ** 2)), rtol=1e-5)
    if c.bn and c.train:  # the weight feeds BatchNorm: L(aW) = L(W), grad perpendicular to W
        dev = A.scale_identities(jax.jit(weight_fn), weight, 2.0, 0.1)
        assert float(dev["loss"]) < 1e-3 and float(dev["cosine"]) < 1e-3, dev


# ---- the analyses that take no model ----------------------------------------------------------------------


def test_model_free_analyses():
    """The names that take arrays or settings, not a model: one property each."""
    g = A.gradient_scale(jax.random.key(0), depth=3, width=4, num_draws=2)
    assert all(np.allclose(np.asarray(v)[:, 0], 1.0) for v in g.values())  # |g_0| = 1 for every kind
    steps = A.batchnorm_steps(jax.random.normal(jax.random.key(1), (8, 3)))
    np.testing.assert_allclose(np.asarray(steps["standardised"]).mean(0), 0.0, atol=1e-6)
    ex = A.example_outputs(jax.random.key(2), 0.5, [4, 8], 3)
    assert all(np.all(np.isfinite(np.asarray(v))) for v in jax.tree_util.tree_leaves(ex))
    np.testing.assert_allclose(float(A.running_update(0.0, 1.0, 0.1)), 0.1, rtol=1e-6)  # rho: the new share
    est = np.asarray(A.running_estimate(jnp.ones(50), 0.1))
    np.testing.assert_allclose(est[-1], 1 - 0.9 ** 50, rtol=1e-5)
    lag = A.lag_and_noise(jnp.ones(20), jnp.ones(20), 0.5, init=1.0)
    assert all(np.allclose(np.asarray(v), 0.0) for k, v in lag.items() if k in ("lag", "noise"))
    np.testing.assert_allclose(float(A.torch_from_flax(A.flax_from_torch(0.1))), 0.1)
    assert A.reduction_axes("batch") == (0, 1, 2)
    groups = A.statistic_groups("batch", (2, 2, 2, 3))
    assert len(np.unique(np.asarray(groups))) == 3
    with pytest.raises(TypeError, match="ToNNX"):
        A.from_nnx(UserMLP())
    assert A.BranchStack is type(A.branch_stack([(lambda p, x: p * x, jnp.ones(2))]))
    assert A.PathExpansion._fields == ("terms", "jacobians", "stream")


ROWS = {
    "test_variance_through_depth": ("variance_through_depth", "stream_activations"),
    "test_branch_variance_ratio": ("branch_variance_ratio",),
    "test_block_outputs_and_norms": ("block_output_norms", "block_outputs"),
    "test_log_space_propagation": ("log_space_propagation",),
    "test_gradient_variance": ("gradient_variance",),
    "test_input_gradients_and_shattering": ("input_gradients", "input_gradients_many", "init_many", "autocorrelation",
                                            "shattering_statistics", "half_correlation_distance"),
    "test_path_expansion": ("path_expansion", "residual_stack_of", "stream_input", "branch_stack", "block_jacobians",
                            "expand_jvp", "expand_vjp", "sampled_path_magnitudes", "path_counts",
                            "path_length_shares"),
    "test_loss_functions": ("params_loss_fn", "probe_gradient_direction", "weight_loss_fn", "scale_identities",
                            "sgd_step_geometry", "step_geometry_from_update", "effective_learning_rate"),
    "test_model_free_analyses": ("gradient_scale", "batchnorm_steps", "example_outputs", "running_update",
                                 "running_estimate", "lag_and_noise", "flax_from_torch", "torch_from_flax",
                                 "reduction_axes", "statistic_groups", "from_nnx", "BranchStack", "PathExpansion"),
}


def test_the_matrix_covers_every_kind_and_analysis():
    """A case of every build_model kind, an EXPECT row of every case, a test of every public analysis."""
    from resjax.nn import _families

    kinds = {spec["kind"] for spec, _, _ in CASES.values() if isinstance(spec, dict)}
    assert kinds == set(_families()), set(_families()) ^ kinds
    assert set(EXPECT) == set(CASES)
    covered = [name for names in ROWS.values() for name in names]
    assert sorted(covered) == sorted(set(covered)) and set(covered) == set(A.__all__), set(covered) ^ set(A.__all__)
    for test in ROWS:
        assert callable(globals()[test])
    source = open(__file__).read()
    for test, names in ROWS.items():  # each name is called in its row's test
        body = source[source.index(f"def {test}("):]
        body = body[:body.index("\ndef ", 1)] if "\ndef " in body[1:] else body
        missing = [n for n in names if not re.search(rf"A\.{n}\b", body)]
        assert not missing, (test, missing)


def test_no_analysis_picks_a_train_mode():
    """No public analysis defaults ``train`` to a mode: it has no default, or ``None`` (nothing passed, so a
    model with BatchNorm refuses the call by name: the ``_refused(r"train", ...)`` cells above)."""
    import inspect

    with_train = {}
    for name in A.__all__:
        obj = getattr(A, name)
        if callable(obj) and not isinstance(obj, type):
            param = inspect.signature(obj).parameters.get("train")
            if param is not None:
                with_train[name] = param.default
    assert {"block_output_norms", "params_loss_fn", "weight_loss_fn", "gradient_variance"} <= set(with_train)
    modes = {name: d for name, d in with_train.items() if d is not inspect.Parameter.empty and d is not None}
    assert not modes, modes
