"""Block-output norms of CIFAR ResNet-110 and ResNet-1202 at initialisation, with BatchNorm, with
tau = 1/sqrt(L), with neither, and Fixup against tau after one gradient step (Zhang et al., seed 003,
Section 3.4, Proposition 1 and Figure 2).

What the seed claims. (a) With BatchNorm after the branch, "the block output norm of ResNet with BN grows
roughly at the rate sqrt(l) at the initialization stage, where l is the block index"; Figure 2 checks it
on ResNet1202+BN ("at epoch 0 ... the output norm grows almost with the rate sqrt(l) as predicted in
Proposition 1"). (b) With tau = 1/sqrt(L) and no BN, "the norm of every residual block output is upper
bounded by (1+c)/(1-eps) if the input vector has norm 1" (Theorem 1; with Theorem 2 the norm
"concentrates around 1"), the same at every depth. (c) If tau is larger than L^(-1/2) in order (tau = 1,
no BN, is ResNet#: He et al.'s model with the BN layers removed), "the network output norm grows
uncontrollably as the depth L increases" (Theorem 3). (d) Fixup "could be unstable after gradient
updates": with W_l = 0 at initialisation every block gets the same gradient, so after one update the
blocks' product behaves like (D (I + eta dh h_0^T))^(L-1), "which grows exponentially"; "empirically, such
explosion is observed for deep ResNet with Fixup (see Figure 2)", while "the ResNet with tau is stable for
varying depths".

What is run. ``resjax.nn.cifar_resnet(depth, scan=True)`` (He et al.'s CIFAR ResNet, depth 6n+2, L = 3n
basic blocks of two 3x3 convs, option-A shortcuts, post-activation, He fan-out normal kernels) at depths
110 (L = 54) and 1202 (L = 600), on one batch of 8 random CIFAR-shaped images, every entry N(0, 1)
(32x32x3), seed 0:

- ``bn``: ResNet#+BN, the original model; BatchNorm on the batch's own statistics (``train=True``: the
  first training step, the seed's "epoch 0"; the running estimates at initialisation are 0 and 1 and would
  not normalise at all).
- ``tau``: no BN, tau = 1/sqrt(L) on the branch output, Fixup's scalar biases (zero at initialisation),
  Kaiming (He) initialisation: the seed's "same model as Fixup with setting tau = 1/sqrt(L) and using the
  Kaiming initialization".
- ``none``: the *same weights* as ``tau`` with tau = 1 (passed at call time): ResNet# without BN and
  without tau. Its stream grows by a constant factor per block, far past float32's 3.4e38 at 1202, so it is
  evaluated in float64 (``jax.enable_x64``; exact and finite here); the float32 pass is run as well and
  the first block whose float32 output overflows is recorded (``none.float32_overflow_block``).
- After gradient steps: ``num_steps`` (default 1) plain SGD steps (learning rate 0.1 on every parameter) of the
  mean cross-entropy on the same 8 images with random labels (uniform over 10 classes), for
  ``fixup`` (``scaling='fixup'``, Fixup's initialisation as ``resjax.nn.resnet`` implements it: last conv 0,
  the other conv times L^(-1/2), multiplier 1, scalar biases 0 *and a zero classifier*),
  ``fixup_random_head`` (the same with the classifier drawn at PyTorch's default, the same draw as
  ``tau``'s; the seed's Section 2 model has a random output layer B) and ``tau`` (as above).

The norm is the per-example L2 norm of a block's whole output (all H x W x C entries), averaged over the
8 images: "mean norm" below. It is computed overflow-safely (``resjax.analysis.resnet_signal``:
``block_output_norms``, read from the blocks' sown ``block_out`` intermediates, in depth order l = 1..L).
The output norm is the same for the logits. Every matmul/conv runs at
``jax.default_matmul_precision('highest')``.

A fact of this architecture that shapes every curve: at the two stage transitions an option-A shortcut
keeps a quarter of the positions and pads zero channels, so the per-example norm of the skip path halves
(|h|^2 loses 3/4 of its positions). The claims below therefore read the curves within stages, or bound
them loosely enough to include two halvings (a factor 4).

Measured (``<D>`` = depth):

- ``bn.stage1_exponent.d<D>``: least-squares slope of log(mean norm) against log l over the later half of
  stage 1 (blocks ceil(n/2)..n; stage 1 is the stage whose block index counts from the input: Proposition
  1's sqrt(l) applies there without an offset).
- ``bn.ms_increment.d<D>``: per stage, the median over the stage's later half of the per-block increment of
  the per-element mean square |h_l|^2 / (H W C) (averaged over images). Proposition 1's mechanism: every
  block adds a BN-normalised (unit variance per entry) branch to a stream it is nearly uncorrelated with,
  so |h_l|^2 grows by about one unit per entry per block, i.e. |h_l| ~ sqrt(l).
- ``tau.max_over_min.d<D>`` (every block), ``tau.within_stage_max_over_min.d<D>`` (per stage).
- ``none.log10_increment.d<D>``: median over within-stage blocks of the increment of log10(mean norm);
  ``none.float32_overflow_block.d<D>`` (1-based, ``null`` when float32 does not overflow: the report says "none
  (finite in float32)").
- ``null`` in ``bn.stage1_exponent``, ``bn.ms_increment`` and ``none.log10_increment`` at a depth with one block
  per stage (depth 8, ``--quick``'s shallower one): a slope within a stage, or an increment between two of its
  blocks, needs two blocks, so nothing was measured there (the report says "n/a (1 block per stage ...)"; the
  claims count it as not holding).
- ``log10_output_norm.<variant>.step<k>.d<D>`` and ``log10_max_block_norm.<variant>.step<k>.d<D>`` for
  k = 0..num_steps (``null`` for log10 0: Fixup's logits are exactly 0 at initialisation).
- ``curves.log10_norm.<bn|tau|none|none_float32>.d<D>`` (log10 mean norm, blocks 1..L, at
  initialisation) and ``curves.log10_norm.<variant>.step<k>.d<D>``.

Claims, with thresholds fixed from the seed's statements and the mechanism above before the default
(110/1202) run was made; the depths are the configured ones ("shallow" = the first, "deep" = the last):

- A1 (Prop. 1, sqrt(l)): ``bn.stage1_exponent`` in [0.35, 0.65] at every depth.
- A2 (Prop. 1's mechanism): every stage's ``bn.ms_increment`` in [0.5, 1.5] at every depth.
- B1 (Theorem 1, bounded): ``tau.max_over_min`` <= 10 at every depth (two option-A halvings account for 4
  of it; without tau the deep curve spans tens of decades).
- B2 (stable for varying depths): the last block's mean norm, deep over shallow, within [1/2, 2].
- C1 (Theorem 3, grows uncontrollably): ``none.log10_increment`` >= 0.1 (at least x1.26 per block) at every
  depth; the float32 overflow block is reported beside it.
- D1 (Fixup after one step): ``log10_output_norm.fixup.step1``, deep minus shallow, > 1 (a factor 10).
  With Fixup's zero classifier every gradient but the classifier's is exactly zero at initialisation (the
  stream's cotangent is W_head^T dL/dy = 0), so the first step cannot move a block: D1 tests the seed's
  sentence literally, and D2 is the setting where the first step does move every branch.
- D2: the same for ``fixup_random_head``.
- D3 (tau after one step): ``log10_output_norm.tau.step1``, deep minus shallow, within +-log10 2.

During development the init curves at depth 1202 were printed once (a timing check, before the claims
above were written); the thresholds come from the seed's statements and the mechanism, not from them,
and were not changed after the first default run (made with 3 steps, then cut to 1 for time). Because
A1-C1 (the claims on those initialisation curves) were written after that print, the report marks them
"threshold set after a probe" (``Claim.probe_threshold``); D1-D3 are not marked.

Settings the seed leaves open, and what is used: the inputs (random N(0,1) images: Figure 2 is at
initialisation, where the data only enter through the stem), the batch (8 images, to keep ResNet-1202 on
a 2-core CPU within minutes; BatchNorm statistics over 8 x 32 x 32 positions per channel in stage 1), one
weight draw, the learning rate (0.1, He et al.'s CIFAR rate; the seed trains Fixup "with the same
hyperparameter setting" as Fixup's code without listing it; here every parameter, the scalar biases
included, steps at 0.1; momentum does not change a first step), the labels (random) and the number of
steps (1 by default, the seed's "one gradient update"; ``--num_steps 3`` shows the next ones too).

Runtime. The forward passes are cheap (ResNet-1202, 8 images: under a second each). XLA:CPU runs the two
backward convolutions of a scanned block (input and kernel gradient) 20-50x slower inside the scan's while
loop than outside it, where it puts them in its fast convolution's layout; the SGD step therefore computes
the 3x3 convolutions' gradients with explicit transposes in that layout (``_conv3x3``: the same gradients as
the unrolled network, bit for bit), and one step of ResNet-1202 takes a few seconds instead of about 30-50 s
(the default run: 108 s before, 35 s after, back to back on a loaded 2-core CPU).

``--quick`` (tests): depths 8 and 14, batch 4, one step, blocks unrolled (``scan=False``; its programs, compiled
without XLA's optimisation passes, took 15 s against 21 s run op by op). ``--full``
(an accelerator): batch 32, 3 steps.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax import lax

from experiments import common
from resjax.analysis.resnet_signal import block_output_norms, mean_log10_norm
from resjax.analysis.stability import log_log_slope
from resjax.nn.resnet import cifar_resnet

NAME = "resnet_signal"
STEP_VARIANTS = ("fixup", "fixup_random_head", "tau")
FLOAT32_MAX = float(np.finfo(np.float32).max)


HELP = {
    "depths": "CIFAR ResNet depths 6n+2, e.g. \"(110, 1202)\"; the first is 'shallow', the last 'deep' in the claims",
    "batch_size": "random CIFAR-shaped images in the batch",
    "num_classes": "classes of the classifier (random labels for the gradient steps)",
    "learning_rate": "learning rate of the plain SGD steps (Fixup against tau)",
    "num_steps": "SGD steps taken before the after-step norms",
    "scan": "true/false: each stage's blocks under nn.scan (fast compiles at depth; same numbers)",
}


def get_config(size: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.depths = (110, 1202)
    c.batch_size = 8
    c.num_classes = 10
    c.learning_rate = 0.1
    c.num_steps = 1
    c.seed = 0
    c.scan = True  # nn.scan over each stage's identical blocks: ResNet-1202 compiles as fast as ResNet-20
    if size == "quick":  # unrolled: for a few blocks cheaper to compile than a scan
        c.depths, c.batch_size, c.scan = (8, 14), 4, False
    elif size == "full":
        c.batch_size, c.num_steps = 32, 3
    return c


def check(config) -> None:
    """The preflight hook (``experiments.common.preflight``); also called by ``run``."""
    if len(config.depths) < 1:
        raise ValueError("depths: need at least one depth")
    for d in config.depths:
        if not isinstance(d, int) or d < 8 or (d - 2) % 6:
            raise ValueError(f"depths: every depth must be 6n+2 with n >= 1, got {d!r}")
    if not isinstance(config.batch_size, int) or config.batch_size < 2:
        raise ValueError(f"batch_size: BatchNorm needs a batch of at least 2, got {config.batch_size!r}")
    if not config.learning_rate > 0:
        raise ValueError(f"learning_rate: must be > 0, got {config.learning_rate!r}")
    if not isinstance(config.num_steps, int) or config.num_steps < 1:
        raise ValueError(f"num_steps: must be an integer >= 1, got {config.num_steps!r}")


def stage_slices(depth: int) -> list[slice]:
    """The blocks of each of the three stages as slices of the 0-based block axis."""
    n = (depth - 2) // 6
    return [slice(s * n, (s + 1) * n) for s in range(3)]


def elements_per_example(depth: int) -> np.ndarray:
    """H * W * C of every block output of a CIFAR ResNet on 32x32 inputs: 16384, 8192, 4096 per stage."""
    n = (depth - 2) // 6
    return np.repeat([32 * 32 * 16, 16 * 16 * 32, 8 * 8 * 64], n).astype(np.float64)


def _stage_later_half(depth: int) -> list[slice]:
    return [slice(s.start + (s.stop - s.start) // 2, s.stop) for s in stage_slices(depth)]


def bn_stage1_exponent(curve_log10: np.ndarray, depth: int) -> float:
    """Slope of log(mean norm) against log l over blocks ceil(n/2)..n of stage 1 (l counted from 1)."""
    n = (depth - 2) // 6
    if n < 2:
        return float("nan")
    values = np.concatenate([[np.nan], 10.0 ** np.asarray(curve_log10[:n], np.float64)])  # index = l
    return log_log_slope(values, start=-(-n // 2) if n >= 3 else 1)


def ms_increments(log10_norms: np.ndarray, depth: int) -> list[float]:
    """Per stage: median over its later half of the per-block increment of mean_i |h_il|^2 / (H W C)."""
    ms = np.mean(10.0 ** (2 * np.asarray(log10_norms, np.float64)), axis=1) / elements_per_example(depth)
    out = []
    for s in stage_slices(depth):
        d = np.diff(ms[s])
        out.append(float(np.median(d[len(d) // 2:])) if len(d) else float("nan"))  # nan: a one-block stage
    return out


def median_within_stage_increment(curve_log10: np.ndarray, depth: int) -> float:
    """Median over every pair of consecutive blocks of one stage of the increment of ``curve_log10``."""
    d = np.concatenate([np.diff(np.asarray(curve_log10, np.float64)[s]) for s in stage_slices(depth)])
    return float(np.median(d)) if len(d) else float("nan")


def _mean_curve(log10_norms) -> np.ndarray:
    """log10 of the batch-mean norm per block from per-example log10 norms ``(L, B)``; ``inf`` if overflowed."""
    return np.asarray(mean_log10_norm(np.asarray(log10_norms, np.float64), axis=1), np.float64)


def _log10_output(logits) -> float:
    n = float(np.mean(np.linalg.norm(np.asarray(logits, np.float64), axis=1)))
    return math.log10(n) if n > 0 and math.isfinite(n) else (math.inf if n > 0 else -math.inf)


def _measure_fn(model):
    def measure(variables, x, tau):
        with jax.default_matmul_precision("highest"):
            return block_output_norms(model, variables, x, train=True, tau=tau, log10=True, return_output=True)

    return jax.jit(measure)


# ---- the SGD step's 3x3 convolutions ------------------------------------------------------------------
#
# Under ``nn.scan`` the blocks' convolutions sit in an XLA while loop, and XLA:CPU does not bring the two
# convolutions of their backward pass (input gradient: a kernel read as 01oi; kernel gradient: the batch
# read as features) into the layout of its fast convolution there, as it does outside a loop: it runs them
# with its generic loop emitter, 20-50x slower (ResNet-1202: about 30 s of a 31 s step). ``_conv3x3`` is
# the same convolution with the same two gradients, written with explicit transposes in the fast form; the
# gradients are then what the unrolled network gets (bit for bit, checked at depths 20 and 110), the
# forward pass is unchanged.

_NHWC_HWIO = lax.ConvDimensionNumbers(lhs_spec=(0, 3, 1, 2), rhs_spec=(3, 2, 0, 1), out_spec=(0, 3, 1, 2))


def _same3x3(x, k, precision):
    return lax.conv_general_dilated(x, k, (1, 1), ((1, 1), (1, 1)), lhs_dilation=(1, 1), rhs_dilation=(1, 1),
                                    dimension_numbers=_NHWC_HWIO, feature_group_count=1, precision=precision)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _conv3x3(x, k, precision):
    """``nn.Conv(features, (3, 3), padding=[(1, 1)] * 2, use_bias=False)`` on NHWC ``x`` with HWIO ``k``."""
    return _same3x3(x, k, precision)


def _conv3x3_fwd(x, k, precision):
    return _same3x3(x, k, precision), (x, k)


def _conv3x3_bwd(precision, res, g):
    x, k = res
    gx = _same3x3(g, jnp.transpose(jnp.flip(k, (0, 1)), (0, 1, 3, 2)), precision)  # g with the flipped kernel
    gk = _same3x3(jnp.transpose(x, (3, 1, 2, 0)), jnp.transpose(g, (1, 2, 0, 3)), precision)  # (I, 3, 3, O)
    return gx, jnp.transpose(gk, (1, 2, 0, 3))


_conv3x3.defvjp(_conv3x3_fwd, _conv3x3_bwd)


def _fast_conv_interceptor(next_fun, args, kwargs, context):
    """``nn.intercept_methods`` hook: every stride-1, 'same'-padded, bias-free 3x3 ``nn.Conv`` of float32
    NHWC inputs runs as ``_conv3x3`` (same parameter, same forward pass); any other module call as it is."""
    m = context.module
    if (type(m) is nn.Conv and context.method_name == "__call__" and len(args) == 1 and not kwargs
            and args[0].ndim == 4 and args[0].dtype == jnp.float32 and m.param_dtype == jnp.float32
            and tuple(m.kernel_size) == (3, 3) and m.strides in (1, (1, 1)) and not m.use_bias
            and m.mask is None and m.feature_group_count == 1 and m.dtype is None and m.precision is None
            and m.input_dilation in (1, (1, 1)) and m.kernel_dilation in (1, (1, 1))
            and m.shared_weights and m.conv_general_dilated is None and m.conv_general_dilated_cls is None
            and not isinstance(m.padding, str) and [tuple(p) for p in m.padding] == [(1, 1), (1, 1)]):
        x = args[0]
        k = m.param("kernel", m.kernel_init, (3, 3, x.shape[-1], m.features), m.param_dtype)
        return _conv3x3(x, k, lax.Precision.HIGHEST)  # the step runs at default_matmul_precision('highest')
    return next_fun(*args, **kwargs)


def _step_fn(model, learning_rate: float, fast_conv: bool = True):
    def step(params, x, y):
        def loss(p):
            with jax.default_matmul_precision("highest"):
                if fast_conv:  # scanned (see above)
                    with nn.intercept_methods(_fast_conv_interceptor):
                        logits = model.apply({"params": p}, x, train=True)
                else:
                    logits = model.apply({"params": p}, x, train=True)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        grads = jax.grad(loss)(params)
        return jax.tree_util.tree_map(lambda p, g: p - learning_rate * g, params, grads)

    return jax.jit(step)


def run_depth(depth: int, x, y, key, config) -> dict:
    m: dict = {}
    d = f"d{depth}"
    kw = {"num_classes": config.num_classes, "scan": config.scan}
    bn = cifar_resnet(depth, norm="batch", **kw)
    tau_model = cifar_resnet(depth, norm="none", scaling="tau", tau="1/sqrt(K)", scalar_biases=True, **kw)
    fixup = cifar_resnet(depth, norm="none", scaling="fixup", **kw)
    tau = 1.0 / math.sqrt(tau_model.num_blocks)

    # (a) BatchNorm, batch statistics
    v_bn = bn.init(key, x)
    ln_bn, _ = _measure_fn(bn)(v_bn, x, None)
    ln_bn = np.asarray(ln_bn, np.float64)
    curve_bn = _mean_curve(ln_bn)
    m[f"curves.log10_norm.bn.{d}"] = curve_bn
    m[f"bn.stage1_exponent.{d}"] = bn_stage1_exponent(curve_bn, depth)
    m[f"bn.ms_increment.{d}"] = ms_increments(ln_bn, depth)

    # (b) tau = 1/sqrt(L), no BN; (c) the same weights with tau = 1
    v_tau = tau_model.init(key, x)
    measure_tau = _measure_fn(tau_model)
    ln_tau, _ = measure_tau(v_tau, x, jnp.float32(tau))
    curve_tau = _mean_curve(ln_tau)
    m[f"curves.log10_norm.tau.{d}"] = curve_tau
    m[f"tau.max_over_min.{d}"] = float(10.0 ** (curve_tau.max() - curve_tau.min()))
    m[f"tau.within_stage_max_over_min.{d}"] = [float(10.0 ** (curve_tau[s].max() - curve_tau[s].min()))
                                             for s in stage_slices(depth)]
    ln32, _ = measure_tau(v_tau, x, jnp.float32(1.0))
    curve32 = _mean_curve(ln32)
    bad = np.flatnonzero(~np.isfinite(curve32))
    m[f"curves.log10_norm.none_float32.{d}"] = curve32
    m[f"none.float32_overflow_block.{d}"] = int(bad[0]) + 1 if len(bad) else None
    with jax.enable_x64(True):
        v64 = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), v_tau)
        ln64, _ = measure_tau(v64, jnp.asarray(x, jnp.float64), jnp.float64(1.0))  # retraced in float64
        ln64 = np.asarray(ln64, np.float64)
    curve_none = _mean_curve(ln64)
    m[f"curves.log10_norm.none.{d}"] = curve_none
    m[f"none.log10_increment.{d}"] = median_within_stage_increment(curve_none, depth)
    m[f"none.last_block_log10_norm.{d}"] = float(curve_none[-1])

    # (d) gradient steps
    v_fix = fixup.init(key, x)
    starts = {
        "fixup": (fixup, v_fix["params"], None),
        "fixup_random_head": (fixup, {**v_fix["params"], "head": v_tau["params"]["head"]}, None),
        "tau": (tau_model, v_tau["params"], jnp.float32(tau)),
    }
    fns = {}
    for variant, (model, params, t) in starts.items():
        if id(model) not in fns:
            fns[id(model)] = (_measure_fn(model), _step_fn(model, config.learning_rate, fast_conv=config.scan))
        measure, step = fns[id(model)]
        for k in range(config.num_steps + 1):
            if k:
                params = step(params, x, y)
            ln, logits = measure({"params": params}, x, t)
            curve = _mean_curve(ln)
            m[f"curves.log10_norm.{variant}.step{k}.{d}"] = curve
            m[f"log10_output_norm.{variant}.step{k}.{d}"] = _log10_output(logits)
            m[f"log10_max_block_norm.{variant}.step{k}.{d}"] = float(np.max(curve))
    m[f"tau.last_block_log10_norm.{d}"] = float(curve_tau[-1])
    return m


def run(config, out_dir) -> dict:
    check(config)
    kx, ky, kp = jax.random.split(jax.random.key(config.seed), 3)
    x = jax.random.normal(kx, (config.batch_size, 32, 32, 3), jnp.float32)
    y = jax.random.randint(ky, (config.batch_size,), 0, config.num_classes)
    m: dict = {"depths": list(config.depths)}
    for depth in config.depths:
        m.update(run_depth(depth, x, y, kp, config))
    plot(m, config, out_dir / f"{NAME}.png")
    return m


# ---- claims ----------------------------------------------------------------------------------------


def _ends(m: dict) -> tuple[int, int]:
    return m["depths"][0], m["depths"][-1]


def _per_depth(m: dict, key: str) -> dict:
    return {d: m[f"{key}.d{d}"] for d in m["depths"]}


def _missing(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def why_missing(depth: int) -> str:
    """What a per-depth slope or increment recorded as ``null`` means at ``depth``: a depth with one block per stage
    (depth 8) has no slope within a stage nor any increment between two of its blocks, so none was measured; at a
    deeper network the value was not finite."""
    if (depth - 2) // 6 < 2:
        return "n/a (1 block per stage: a slope or increment needs 2)"
    return "n/a (not finite)"


def _fmt(values: dict, fmt: str = "{:.3f}", missing=why_missing) -> str:
    """``'110: 0.523; 1202: 0.510'``: a value per depth; a ``null`` one (a list of them: once) as ``missing(depth)``
    says, never a bare 'null'."""
    def one(v, d):
        if isinstance(v, (list, tuple)):
            return missing(d) if v and all(_missing(x) for x in v) else "[" + ", ".join(one(x, d) for x in v) + "]"
        return missing(d) if _missing(v) else fmt.format(v)

    return "; ".join(f"{d}: {one(v, d)}" for d, v in values.items())


def _overflow_text(m: dict) -> str:
    """The first block whose float32 output overflows, per depth (``null`` in the results: none does)."""
    return "; ".join(f"{d}: " + ("none (finite in float32)" if b is None else f"block {b}")
                     for d, b in _per_depth(m, "none.float32_overflow_block").items())


def _all(values, test) -> bool:
    """``test`` holds for every value (lists flattened); a missing value (``None``/NaN: too few blocks) fails."""
    flat = [x for v in values for x in (v if isinstance(v, (list, tuple)) else [v])]
    return all(x is not None and not (isinstance(x, float) and math.isnan(x)) and test(x) for x in flat)


def _gap(m: dict, key: str) -> float | None:
    lo, hi = _ends(m)
    a, b = m[f"{key}.d{lo}"], m[f"{key}.d{hi}"]
    if a is None or b is None:
        return None
    return b - a


def _gap_text(m: dict, variant: str) -> str:
    lo, hi = _ends(m)
    a, b = (m[f"log10_output_norm.{variant}.step1.d{d}"] for d in (lo, hi))
    gap = _gap(m, f"log10_output_norm.{variant}.step1")

    def show(v):
        return "null" if v is None else f"{v:.2f}"

    return f"log10 output norm: {lo}: {show(a)}, {hi}: {show(b)}; gap {show(gap)}"


def _gap_holds(m: dict, variant: str, test) -> bool:
    gap = _gap(m, f"log10_output_norm.{variant}.step1")
    return gap is not None and test(gap)


SRC = "003 Zhang et al., Section 3.4 / Proposition 1 / Figure 2"
SRC_T = "003 Zhang et al., Section 3.1, Theorems 1-3"
SRC_F = "003 Zhang et al., Section 3.4 (Fixup) / Figure 2"
CLAIMS = [
    common.Claim("ResNet#+BN at initialisation (batch statistics): the block output norm grows like sqrt(l): "
                 "slope of log(mean norm) against log l over the later half of stage 1 in [0.35, 0.65] at every "
                 "depth", SRC, "about 0.5 (sqrt(l))",
                 lambda m: _fmt(_per_depth(m, "bn.stage1_exponent")),
                 lambda m: _all(_per_depth(m, "bn.stage1_exponent").values(), lambda v: 0.35 <= v <= 0.65),
                 probe_threshold=True),
    common.Claim("ResNet#+BN: the squared block output norm grows by about one unit per entry per block (Proposition 1's mechanism): "
                 "median increment of the per-entry mean square over each stage's later half in [0.5, 1.5], every "
                 "stage and depth", SRC, "1 (unit-variance BN branch)",
                 lambda m: _fmt(_per_depth(m, "bn.ms_increment")),
                 lambda m: _all(_per_depth(m, "bn.ms_increment").values(), lambda v: 0.5 <= v <= 1.5),
                 probe_threshold=True),
    common.Claim("no BN, tau = 1/sqrt(L): the block output norm stays bounded: max/min of the mean norm over all "
                 "blocks <= 10 at every depth (the two option-A stage transitions alone halve it twice)", SRC_T,
                 "bounded by (1+c)/(1-eps) times the input norm",
                 lambda m: _fmt(_per_depth(m, "tau.max_over_min")),
                 lambda m: _all(_per_depth(m, "tau.max_over_min").values(), lambda v: v <= 10),
                 probe_threshold=True),
    common.Claim("no BN, tau = 1/sqrt(L): stable for varying depth: the last block's mean norm of the deepest "
                 "network within a factor 2 of the shallowest's", SRC_T, "depth-independent",
                 lambda m: f"ratio {10 ** _gap(m, 'tau.last_block_log10_norm'):.3f}",
                 lambda m: abs(_gap(m, "tau.last_block_log10_norm")) <= math.log10(2),
                 probe_threshold=True),
    common.Claim("no BN, no tau (ResNet#): the block output norm grows exponentially: median within-stage "
                 "increment of log10(mean norm) >= 0.1 per block at every depth (measured in float64; the "
                 "first block whose float32 output overflows is shown)", SRC_T, "grows uncontrollably",
                 lambda m: (_fmt(_per_depth(m, "none.log10_increment")) + " per block; last block log10 norm "
                            + _fmt(_per_depth(m, "none.last_block_log10_norm"), "{:.1f}") + "; first float32 overflow "
                            + _overflow_text(m)),
                 lambda m: _all(_per_depth(m, "none.log10_increment").values(), lambda v: v >= 0.1),
                 probe_threshold=True),
    common.Claim("Fixup (its own initialisation, zero classifier): after one SGD step (lr 0.1) the output norm "
                 "blows up with depth: log10 of the deepest network's output norm exceeds the shallowest's by > 1", SRC_F,
                 "explodes at large depth",
                 lambda m: _gap_text(m, "fixup"),
                 lambda m: _gap_holds(m, "fixup", lambda g: g > 1)),
    common.Claim("Fixup with a random classifier (the seed's Section 2 setting: the first step moves every "
                 "branch): after one SGD step log10 of the deepest network's output norm exceeds the shallowest's by > 1",
                 SRC_F, "explodes at large depth",
                 lambda m: _gap_text(m, "fixup_random_head"),
                 lambda m: _gap_holds(m, "fixup_random_head", lambda g: g > 1)),
    common.Claim("tau = 1/sqrt(L) (Kaiming init, same model as Fixup otherwise): after one SGD step the output "
                 "norm of the deepest network is within a factor 2 of the shallowest's", SRC_F,
                 "stable for varying depths",
                 lambda m: _gap_text(m, "tau"),
                 lambda m: _gap_holds(m, "tau", lambda g: abs(g) <= math.log10(2))),
]


def report_section(m: dict) -> str:
    steps = sorted({int(k.split(".step")[1].split(".")[0]) for k in m if k.startswith("log10_output_norm.tau.step")})
    lines = [("log10 of the mean output (logits) norm / of the largest mean block-output norm after k SGD steps "
              "(lr as configured; k = 0: initialisation; '-' where the logits are exactly 0):"), "",
             "| variant | depth | " + " | ".join(f"k={k}" for k in steps) + " |",
             "|---|---|" + "---|" * len(steps)]

    def cell(v):
        return "-" if v is None or not math.isfinite(v) else f"{v:.2f}"

    for variant in STEP_VARIANTS:
        for d in m["depths"]:
            row = [f"{cell(m[f'log10_output_norm.{variant}.step{k}.d{d}'])} / "
                   f"{cell(m[f'log10_max_block_norm.{variant}.step{k}.d{d}'])}" for k in steps]
            lines.append(f"| {variant} | {d} | " + " | ".join(row) + " |")
    return "\n".join(lines)


# ---- figure ----------------------------------------------------------------------------------------


def _stage_lines(ax, depth: int, **kw) -> None:
    n = (depth - 2) // 6
    for b in (n + 0.5, 2 * n + 0.5):
        ax.axvline(b, **{"color": "gray", "ls": ":", "lw": 0.8, **kw})


def _none_to_nan(values) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], dtype=np.float64)


def plot(m: dict, config, path) -> None:
    plt = common.pyplot()

    depths = m["depths"]
    styles = {d: ls for d, ls in zip(depths, ["--", "-"] if len(depths) == 2 else ["-"] * len(depths))}
    styles[depths[-1]] = "-"
    deep = depths[-1]
    fig, axes = plt.subplots(2, 2, figsize=(14, 10))

    ax = axes[0, 0]
    for d in depths:
        curve = 10.0 ** _none_to_nan(m[f"curves.log10_norm.bn.d{d}"])
        ls = np.arange(1, len(curve) + 1)
        ax.plot(ls, curve, styles[d], color="tab:purple", lw=1.8, label=f"ResNet-{d}+BN (L = {len(curve)} blocks)")
    curve = 10.0 ** _none_to_nan(m[f"curves.log10_norm.bn.d{deep}"])
    n = (deep - 2) // 6
    ls = np.arange(1, n + 1)
    scale = np.exp(np.mean(np.log(curve[n // 2:n]) - 0.5 * np.log(ls[n // 2:])))
    ax.plot(ls, scale * np.sqrt(ls), "k:", lw=1.5, label=f"sqrt(l) guide over stage 1 ({scale:.3g} sqrt(l))")
    _stage_lines(ax, deep)
    ax.set_xscale("log")
    ax.set_yscale("log")
    from matplotlib.ticker import LogLocator, NullLocator, ScalarFormatter, StrMethodFormatter

    blocks = max(len(m[f"curves.log10_norm.bn.d{d}"]) for d in depths)
    if blocks <= 12:  # a few blocks: each one ticked, as an integer (not 2 x 10^0)
        ax.set_xticks(range(1, blocks + 1), [str(b) for b in range(1, blocks + 1)])
        ax.xaxis.set_minor_locator(NullLocator())
    else:
        ax.xaxis.set_major_formatter(StrMethodFormatter("{x:g}"))  # 1, 10, 100 blocks
    lo, hi = ax.get_ylim()
    if hi / lo < 10:  # less than a decade (few blocks): plain numbers, more of them, not one lone 10^2
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_locator(LogLocator(subs=(1.5, 2, 3, 4, 5, 6, 7, 8, 9)))
        ax.yaxis.set_minor_formatter(ScalarFormatter())
    ax.set_xlabel("block index l (log scale; dotted verticals: stage transitions of the deepest net)")
    ax.set_ylabel("block output norm |h_l| (per-example L2, mean over images)")
    ax.set_title("(a) with BatchNorm at initialisation (batch statistics)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")

    ax = axes[0, 1]
    for d in depths:
        tau_curve = _none_to_nan(m[f"curves.log10_norm.tau.d{d}"])
        none_curve = _none_to_nan(m[f"curves.log10_norm.none.d{d}"])
        ls = np.arange(1, len(tau_curve) + 1)
        ax.plot(ls, tau_curve, styles[d], color="tab:green", lw=1.8, label=f"ResNet-{d}, no BN, tau = 1/sqrt(L)")
        ax.plot(ls, none_curve, styles[d], color="tab:red", lw=1.8, label=f"ResNet-{d}, no BN, no tau (float64)")
        ob = m[f"none.float32_overflow_block.d{d}"]
        if ob is not None:
            ax.plot([ob], [none_curve[ob - 1]], "kx", ms=9, mew=2, label=f"ResNet-{d}: float32 overflows at block {ob}")
    if max(np.nanmax(_none_to_nan(m[f"curves.log10_norm.none.d{d}"])) for d in depths) > 30:
        ax.axhline(np.log10(FLOAT32_MAX), color="gray", ls="--", lw=1, label="float32 maximum (3.4e38)")
    _stage_lines(ax, deep)
    ax.set_xlabel("block index l")
    ax.set_ylabel("log10 of the block output norm |h_l|")
    ax.set_title("(b, c) no BatchNorm, at initialisation: the same weights, tau = 1/sqrt(L) and tau = 1",
                 fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)

    ax = axes[1, 0]
    colours = {"fixup": "tab:red", "fixup_random_head": "tab:orange", "tau": "tab:green"}
    labels = {"fixup": "Fixup", "fixup_random_head": "Fixup, random classifier", "tau": "tau = 1/sqrt(L)"}
    widths = {"fixup": 4.0, "fixup_random_head": 1.5, "tau": 1.5}  # Fixup drawn wide: the others may cover it
    for variant in STEP_VARIANTS:
        for d in depths:
            curve = _none_to_nan(m[f"curves.log10_norm.{variant}.step1.d{d}"])
            ax.plot(np.arange(1, len(curve) + 1) / len(curve), curve, styles[d], color=colours[variant],
                    lw=widths[variant], label=f"{labels[variant]}, ResNet-{d}")
    for b in (1 / 3, 2 / 3):
        ax.axvline(b, color="gray", ls=":", lw=0.8)
    ax.set_xlabel("relative depth l / L (block index over the number of blocks; dotted: stage transitions)")
    ax.set_ylabel("log10 of the block output norm |h_l|")
    ax.set_title(f"(d) no BatchNorm, after one SGD step (lr {config.learning_rate}, random labels)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)

    ax = axes[1, 1]
    for variant in STEP_VARIANTS:
        for d in depths:
            ks = np.arange(config.num_steps + 1)
            vals = np.array([m[f"log10_output_norm.{variant}.step{k}.d{d}"] for k in ks], dtype=object)
            vals = np.array([np.nan if v is None or not np.isfinite(v) else v for v in vals], dtype=np.float64)
            ax.plot(ks, vals, styles[d], marker="o", color=colours[variant], lw=1.5,
                    label=f"{labels[variant]}, ResNet-{d}")
    ax.set_xticks(np.arange(config.num_steps + 1))
    ax.set_xlabel("SGD steps k (0 = initialisation; Fixup's zero classifier gives |y| = 0 there, not drawn)")
    ax.set_ylabel("log10 of the output (logits) norm |y| (mean over images)")
    ax.set_title("(d) output norm over the first steps", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)

    fig.suptitle(f"Zhang et al. (seed 003) Figure 2: block output norms of CIFAR ResNets (depth 6n+2: "
                 f"{', '.join(map(str, depths))}) on {config.batch_size} random N(0,1) 32x32x3 images\n"
                 f"norm = per-example L2 norm of the whole block output (H x W x C entries), mean over the images; "
                 f"at the dotted stage transitions option-A shortcuts halve it", fontsize=11)
    common.save_figure(fig, path, dpi=100)


if __name__ == "__main__":
    common.main(__name__)
