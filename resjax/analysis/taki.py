"""Taki (2017), "Deep Residual Networks and Weight Initialization" (seed 004): gradient variance at init.

The model and the quantity
--------------------------
Taki's plain ResNet has one weight layer per block and no activation after the sum; with BatchNorm
(his Fig. 1b) the stream is normalised at the branch input. resjax builds it as a
``resjax.nn.ResidualStack`` (``make_stack``) of ``ResidualBlock(order='pre', num_layers=1,
use_bias=False)``: the stream ``x_0`` (the inputs) .. ``x_L`` (after L blocks) and

    x_{l+1} = x_l + f(N(x_l)) W_{l+1},      N = BatchNorm (batch statistics) or the identity.

Taki's block is ``z + f(W N(z))`` (linear, then activation); resjax's pre-activation block applies the
activation first. For the identity activation (the seed's assumption) the two are the same block;
for ReLU the recursions for the delta below coincide too (shown in the derivation), only the weight
gradients differ. Everything here is indexed by the stream: ``l = 0..L``, ``l`` = blocks passed.

The seed's gradient quantity is the delta ``delta_l = dE/dx_l`` (its delta_z^l); its analysis takes a
loss whose delta at the top has zero mean (E[delta_L] = 0). ``backprop_deltas`` uses exactly that: the
loss ``E = sum(g * x_L)`` with ``g ~ N(0, 1)`` drawn independently of everything else, so
``delta_L = g`` (variance 1) and every ``delta_l`` is the vector-Jacobian product of g through the
blocks above l (one ``jax.vjp`` of the whole stack; ``delta_l`` is read off as the cotangent of a
zero perturbation added to each block's output). Its variance is the mean of ``delta_l^2`` over the
batch and the width (the mean is zero), averaged over draws of weights, inputs and g.

Derivation (mean field: width n and batch B large, weights independent of the deltas above them)
--------------------------------------------------------------------------------------------------
Write q = n Var[w] (n = fan-in), and for z ~ N(0, 1): a = E[f'(z)^2], v = Var[f(z)], m2 = E[f(z)^2]:
identity a = v = m2 = 1; ReLU a = 1/2, v = 1/2 - 1/(2 pi), m2 = 1/2.

Backward through block l+1: ``delta_l = delta_{l+1} + N'(x_l)^T [f'(.) * (delta_{l+1} W^T)]``. The
weights have zero mean and are independent of delta_{l+1}, so the cross term vanishes and

    Var[delta_l] = Var[delta_{l+1}] (1 + q a / s_l),                          (the seed's (38))

where ``s_l`` is what N divides by: s_l = 1 without normalisation, and with BatchNorm s_l = the
per-unit batch variance of x_l (BatchNorm's mean/variance-projection terms are O(1/B) and dropped,
as the seed does with N -> infinity). In Taki's order ``f(W N(z))`` the mask f'(u) sits before W^T
instead of after it; the factor is the same 1 + q a / s_l.

- Plain ResNet (no normalisation): Var[delta_l] = Var[delta_L] (1 + q a)^(L - l), exponential in
  depth. He's initialisation q = 2: 2^(L-l) with ReLU (a = 1/2), 3^(L-l) with the identity (a = 1).
  (He's rule applied to the identity activation would be q = 1, giving 2^(L-l); the experiment uses
  He's actual draw, N(0, 2/n), for both activations.)
- Taki's initialisation (28), q = c/L: Var[delta_l] = (1 + c a / L)^(L - l) Var[delta_L] <= e^(c a)
  Var[delta_L]: bounded at any depth (e = 2.718 for identity, e^(1/2) = 1.649 for ReLU, c = 1).
- BatchNorm at the branch input: forward, each unit's batch variance grows by the branch's,
  s_{l+1} = s_l + q v (BN output has unit per-unit variance; a branch unit is a sum of n weighted
  units), so s_l = Var[x] + l q v, and

      Var[delta_l] = Var[delta_L] prod_{j=l}^{L-1} (1 + q a / (Var[x] + j q v)).

  Identity (a = v = 1), neglecting Var[x] as the seed does (its footnote 9): prod (1 + 1/j) = L/l,
  the seed's Var[delta_l] = Var[delta_L] L / l, with no Var[w] in it. Keeping Var[x] and with
  q = Var[x] (the seed's n Var[w] = 1 and unit-variance inputs) the product is exactly (L+1)/(l+1).
  ReLU: the factor tends to 1 + kappa/j with kappa = a/v = pi/(pi - 1) = 1.467, so
  Var[delta_l] ~ Var[delta_L] (L/l)^kappa: a power law, still independent of Var[w] (the seed's
  footnote 7 says the linear law holds for ReLU for its other BN placement, in an appendix not in
  the seed text; for this placement the per-unit batch variance of relu(z), 1/2 - 1/(2 pi), is what
  the stream gains per block while the mask passes 1/2, hence kappa > 1).
  BatchNorm is scale invariant, so the whole curve depends on Var[w] and Var[x] only through
  Var[x]/(n Var[w]): the seed's "no dependency on Var[w]" is exact up to the Var[x] term it
  neglects, which matters at small l.

Weight gradients (the seed's "combining it with the backpropagation rule"): for block l+1 the kernel
gradient is ``G = f(N(x_l))^T delta_{l+1}`` summed over the batch, E[G^2] = sum_{n,m}
E[f_n f_m delta_n delta_m]. Without normalisation the examples' deltas are uncorrelated (each is
linear in its own g), so per example E[G^2]/B = E[f(x_l)^2] Var[delta_{l+1}] = m2 E[x_l^2]
Var[delta_{l+1}] with E[x_l^2] = Var[x] (1 + q m2)^l (resjax's order): with He and ReLU
2^l 2^(L-l-1), the same at every layer but exponential in L. With BatchNorm the cross terms do not
vanish: BatchNorm's backward pass removes the batch mean of what it passes back, so each unit's batch
sum of delta_l stays that of g at every l, and a non-centred feature (ReLU: batch mean
1/sqrt(2 pi)) picks it up: E[G^2]/B = v Var[delta_{l+1}] + (m2 - v) Var[delta_L] (identity: m2 = v,
so Var[delta_{l+1}], the same L/l growth). ``weight_grad_variance`` gives these curves (resjax's
order only).

Functions
---------
Analytic (numpy, float64; ``(L + 1,)`` curves of Var[delta_l] / Var[delta_L], l = 0..L):
``delta_variance`` (the general recursion), ``he_curve``, ``taki_curve``, ``bn_curve``,
``seed_bn_curve`` (L/l, the seed's closed form; NaN at l = 0), ``taki_bound`` (e^(c a)),
``bn_growth_power`` (a/v: 1 identity, pi/(pi-1) ReLU), ``weight_grad_variance``.
Measured: ``make_stack`` (the model), ``backprop_deltas`` (one network, one batch),
``gradient_variance`` (vmapped over draws, mapped over kernel gains if given, jitted; log10 second
moments per layer, robust to the 3^100-sized values of the identity/He case, whose squares overflow
float32), ``scale_kernels``, ``mean_over_draws``,
``growth_exponent`` (power-law fit of a curve). Bad settings raise ``ValueError`` naming them.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from resjax.nn.block import ResidualBlock
from resjax.nn.init import get_initializer
from resjax.nn.mlp import ResidualStack
from resjax.nn.residual import stack_unrolled

__all__ = [
    "ACTIVATIONS", "MOMENTS", "NORMS", "backprop_deltas", "bn_curve", "bn_growth_power", "delta_variance",
    "gradient_variance", "growth_exponent", "he_curve", "identity", "log10_mean_square", "make_stack",
    "mean_over_draws", "scale_kernels", "scaled_fan_in", "seed_bn_curve", "taki_bound", "taki_curve",
    "weight_grad_variance",
]

#: The normalisations of Taki's model: none, or BatchNorm at the branch input.
NORMS = ("none", "batch")


def identity(x: jax.Array) -> jax.Array:
    """The identity activation (the seed's simplifying assumption)."""
    return x


#: The activations of Taki's model by name.
ACTIVATIONS: dict[str, Callable] = {"linear": identity, "identity": identity, "relu": nn.relu}

# a = E[f'(z)^2], v = Var[f(z)], m2 = E[f(z)^2] for z ~ N(0, 1).
MOMENTS = {
    "linear": {"a": 1.0, "v": 1.0, "m2": 1.0},
    "relu": {"a": 0.5, "v": 0.5 - 1.0 / (2.0 * math.pi), "m2": 0.5},
}
MOMENTS["identity"] = MOMENTS["linear"]


# ---- validation --------------------------------------------------------------------------------------


def _check_int(setting: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{setting}: must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_positive(setting: str, value: Any) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{setting}: must be a number > 0, got {value!r}") from None
    if isinstance(value, bool) or not math.isfinite(x) or x <= 0:
        raise ValueError(f"{setting}: must be a finite number > 0, got {value!r}")
    return x


def _moments(activation: str) -> dict:
    if activation not in MOMENTS:
        raise ValueError(f"activation: unknown activation {activation!r}; choose one of {tuple(MOMENTS)}")
    return MOMENTS[activation]


def _check_norm(norm: str) -> str:
    if norm not in NORMS:
        raise ValueError(f"norm: unknown normalisation {norm!r} for Taki's model; choose one of {NORMS}")
    return norm


# ---- analytic curves ---------------------------------------------------------------------------------


def delta_variance(num_blocks: int, n_var_w: float, activation: str = "linear", norm: str = "none",
                   input_variance: float = 1.0) -> np.ndarray:
    """Var[delta_l] / Var[delta_L], l = 0..L (``(L + 1,)``, float64), from the mean-field recursion
    Var[delta_l] = Var[delta_{l+1}] (1 + q a / s_l); see the module docstring.

    ``n_var_w`` = q = n Var[w]; ``norm='none'``: s_l = 1; ``norm='batch'``: s_l = Var[x] + l q v with
    Var[x] = ``input_variance``.
    """
    L = _check_int("num_blocks", num_blocks)
    q = _check_positive("n_var_w", n_var_w)
    mom = _moments(activation)
    _check_norm(norm)
    s0 = _check_positive("input_variance", input_variance)
    j = np.arange(L, dtype=np.float64)  # block j + 1 reads x_j
    s = np.ones(L) if norm == "none" else s0 + j * q * mom["v"]
    factors = 1.0 + q * mom["a"] / s  # Var[delta_j] / Var[delta_{j+1}]
    # Var[delta_l] = prod_{j >= l} factors[j]; reverse cumulative product, computed in log space.
    log_tail = np.concatenate([np.cumsum(np.log(factors)[::-1])[::-1], [0.0]])
    return np.exp(log_tail)


def he_curve(num_blocks: int, activation: str = "relu") -> np.ndarray:
    """Plain ResNet, He's draw N(0, 2/n): (1 + 2a)^(L - l) (2^(L-l) ReLU, 3^(L-l) identity)."""
    return delta_variance(num_blocks, 2.0, activation, "none")


def taki_curve(num_blocks: int, activation: str = "linear", c: float = 1.0) -> np.ndarray:
    """Plain ResNet, Taki's eq. (28) N(0, c/(nL)): (1 + c a / L)^(L - l) <= e^(c a)."""
    c = _check_positive("c", c)
    return delta_variance(num_blocks, c / _check_int("num_blocks", num_blocks), activation, "none")


def bn_curve(num_blocks: int, activation: str = "linear", n_var_w: float = 1.0,
             input_variance: float = 1.0) -> np.ndarray:
    """BatchNorm at the branch input, with the Var[x] term: prod_{j>=l} (1 + q a/(Var[x] + j q v)).

    Identity with q = Var[x]: exactly (L + 1)/(l + 1).
    """
    return delta_variance(num_blocks, n_var_w, activation, "batch", input_variance)


def seed_bn_curve(num_blocks: int) -> np.ndarray:
    """The seed's closed form L / l, l = 0..L (NaN at l = 0, where Var[x], neglected there, dominates)."""
    L = _check_int("num_blocks", num_blocks)
    l = np.arange(L + 1, dtype=np.float64)
    with np.errstate(divide="ignore"):
        out = L / l
    out[0] = np.nan
    return out


def taki_bound(activation: str = "linear", c: float = 1.0) -> float:
    """lim_{L -> inf} (1 + c a / L)^L = e^(c a): the bound on Var[delta_0]/Var[delta_L] under eq. (28)."""
    return math.exp(_check_positive("c", c) * _moments(activation)["a"])


def bn_growth_power(activation: str = "linear") -> float:
    """kappa in Var[delta_l] ~ (L/l)^kappa with BatchNorm (Var[x] neglected): a/v; 1 identity, pi/(pi-1) ReLU."""
    mom = _moments(activation)
    return mom["a"] / mom["v"]


def weight_grad_variance(num_blocks: int, n_var_w: float, activation: str = "linear", norm: str = "none",
                         input_variance: float = 1.0) -> np.ndarray:
    """Per-example second moment of block j's kernel gradient, j = 1..L (``(L,)``), with Var[delta_L] = 1.

    resjax's order ``x + f(N(x)) W``: without normalisation m2 Var[x] (1 + q m2)^(j-1) Var[delta_j];
    with BatchNorm v Var[delta_j] + (m2 - v) Var[delta_L] (see the module docstring).
    """
    delta = delta_variance(num_blocks, n_var_w, activation, norm, input_variance)
    mom = _moments(activation)
    j = np.arange(num_blocks, dtype=np.float64)
    if norm == "batch":
        return mom["v"] * delta[1:] + (mom["m2"] - mom["v"])
    return mom["m2"] * input_variance * (1.0 + n_var_w * mom["m2"]) ** j * delta[1:]


def growth_exponent(curve: ArrayLike, l_min: int, l_max: int) -> float:
    """p in curve_l ~ l^(-p): least-squares slope of -log(curve) on log(l) over l_min <= l <= l_max.

    ``curve`` is indexed by l = 0..L (positive values); 1: the seed's L/l.
    """
    curve = np.asarray(curve, dtype=np.float64)
    l_min = _check_int("l_min", l_min)
    l_max = _check_int("l_max", l_max, l_min + 1)
    if l_max >= curve.shape[-1]:
        raise ValueError(f"l_max: {l_max} beyond the curve's last index {curve.shape[-1] - 1}")
    l = np.arange(l_min, l_max + 1, dtype=np.float64)
    slope = np.polyfit(np.log(l), np.log(curve[l_min:l_max + 1]), 1)[0]
    return float(-slope)


# ---- the model and the measurement -------------------------------------------------------------------


def make_stack(width: int, num_blocks: int, *, kernel_init: str | Callable, activation: str = "relu",
               norm: str = "none", scan: bool = True) -> ResidualStack:
    """Taki's model as a ``ResidualStack``: ``x + f(N(x)) W`` per block, one bias-free layer, no stem."""
    _check_int("width", width)
    _check_int("num_blocks", num_blocks)
    _moments(activation)
    _check_norm(norm)
    return ResidualStack(width=width, num_blocks=num_blocks, num_layers=1, order="pre", norm=norm,
                         scaling="none", kernel_init=kernel_init, use_bias=False,
                         activation=ACTIVATIONS[activation], scan=scan)


def scaled_fan_in(n_var_w: float) -> Callable:
    """N(0, n_var_w / fan_in), untruncated: the initialiser for a chosen n Var[w]."""
    return get_initializer("fan_in", gain=math.sqrt(_check_positive("n_var_w", n_var_w)))


def _block_variables(module: ResidualStack, variables: dict) -> dict:
    """Every collection's per-block subtree with a leading block axis (scanned or unrolled layout)."""
    if not isinstance(module, ResidualStack):
        raise ValueError(f"module: need a resjax.nn.ResidualStack (the input is the stream), got {type(module).__name__}")
    out = {}
    for col in ("params", "batch_stats"):
        if col in variables:
            tree = dict(variables[col])
            if not module.scan:
                tree = stack_unrolled(tree, module.num_blocks)
            out[col] = tree["blocks"]["block"]
    return out


def backprop_deltas(module: ResidualStack, variables: dict, inputs: jnp.ndarray, cotangent: jnp.ndarray,
                    *, train: bool) -> dict:
    """One ``jax.vjp`` of the stack at ``inputs`` with ``cotangent`` = dE/dx_L.

    Returns ``stream`` ``(L + 1, B, D)`` (x_0..x_L), ``delta`` ``(L + 1, B, D)`` (dE/dx_l; delta_L is
    the cotangent) and ``kernel_grad`` ``(L, D, D)`` (dE/dW of each block's first linear layer). The
    blocks are the module's own ``ResidualBlock`` (same fields, same variables), applied in a
    ``lax.scan``; a zero perturbation added to each block's output makes its cotangent dE/dx_l.
    ``train`` (no default): ``True``, BatchNorm uses the batch's statistics (their running-estimate updates
    are discarded); ``False``, the running estimates.
    """
    if jnp.ndim(inputs) != 2 or jnp.shape(inputs) != jnp.shape(cotangent):
        raise ValueError(f"inputs: need (batch, width) inputs and a cotangent of the same shape, got "
                         f"{tuple(jnp.shape(inputs))} and {tuple(jnp.shape(cotangent))}")
    if jnp.shape(inputs)[0] < 2:
        raise ValueError(f"batch_size: need >= 2 examples (BatchNorm statistics), got {jnp.shape(inputs)[0]}")
    block = ResidualBlock(**module.block_kwargs())
    per_block = _block_variables(module, variables)
    num_blocks = module.num_blocks

    def run(x0, eps, block_vars):
        def body(x, per):
            v, e = per
            y, _ = block.apply(v, x, train, mutable=["batch_stats"])
            y = y + e
            return y, y

        x_last, xs = jax.lax.scan(body, x0, (block_vars, eps))
        return x_last, xs

    eps = jnp.zeros((num_blocks,) + tuple(jnp.shape(inputs)), inputs.dtype)
    x_last, vjp_fn, xs = jax.vjp(run, inputs, eps, per_block, has_aux=True)
    d0, d_eps, d_vars = vjp_fn(cotangent.astype(x_last.dtype))
    return {
        "stream": jnp.concatenate([inputs[None], xs]),
        "delta": jnp.concatenate([d0[None], d_eps]),
        "kernel_grad": d_vars["params"]["linear_0"]["kernel"],
    }


def log10_mean_square(a: jnp.ndarray, axis: int | tuple[int, ...]) -> jnp.ndarray:
    """log10 mean(a^2) over ``axis``, without squaring large values (3^50-sized entries square past float32)."""
    m = jnp.max(jnp.abs(a), axis=axis, keepdims=True)
    m = jnp.where(m > 0, m, 1.0)
    ms = jnp.mean(jnp.square(a / m), axis=axis)
    return 2.0 * jnp.log10(jnp.squeeze(m, axis=axis)) + jnp.log10(ms)


def scale_kernels(params: Any, gain: ArrayLike) -> Any:
    """Every ``kernel`` leaf of a parameter tree times ``gain`` (a traced scalar is fine)."""
    def f(path, leaf):
        name = getattr(path[-1], "key", None)
        return leaf * gain if name == "kernel" else leaf

    return jax.tree_util.tree_map_with_path(f, params)


def gradient_variance(module: ResidualStack, key: jax.Array, *, batch_size: int, num_draws: int,
                      input_variance: float = 1.0, kernel_gains: Sequence[float] | None = None,
                      train: bool) -> dict:
    """Per-layer gradient second moments at initialisation over ``num_draws`` draws (vmapped, jitted).

    Draw d (``keys = split(key, num_draws)``; ``kp, kx, kg = split(keys[d], 3)``): the network
    ``module.init(kp, x)``, inputs ``x = sqrt(input_variance) N(0, 1)`` of shape (batch, width) and the
    top delta ``g ~ N(0, 1)``. Returns numpy arrays, one row per draw:
    ``log10_delta_sq`` ``(draws, L + 1)``: log10 mean(delta_l^2) over batch and width;
    ``log10_kernel_grad_sq`` ``(draws, L)``: log10 of mean(G_j^2)/B, block j = 1..L (per example);
    ``log10_stream_sq`` ``(draws, L + 1)``: log10 mean(x_l^2).

    ``kernel_gains`` (a sequence): the measurement is repeated for each gain, which multiplies every
    kernel after ``init`` (so Var[w] -> gain^2 Var[w]: a sweep over n Var[w] in one compiled program,
    ``lax.map`` over gains, on the same draws); the outputs then have a leading gains axis
    ``(gains, draws, ...)``.

    ``train`` (no default): ``True`` runs BatchNorm on each batch's statistics (the seed's setting),
    ``False`` on the running estimates (at initialisation: no normalisation). ``module`` must be a
    ``resjax.nn.ResidualStack`` (``make_stack``): the inputs are the stream (``ValueError`` otherwise).
    """
    if not isinstance(module, ResidualStack):
        raise ValueError(f"module: need a resjax.nn.ResidualStack (the input is the stream; see make_stack), got "
                         f"{type(module).__name__}")
    batch_size = _check_int("batch_size", batch_size, 2)
    num_draws = _check_int("num_draws", num_draws)
    s0 = _check_positive("input_variance", input_variance)
    width = module.width
    if kernel_gains is not None:
        gains = [_check_positive("kernel_gains", g) for g in kernel_gains]
        if not gains:
            raise ValueError("kernel_gains: need at least one gain (or None)")

    def one(k, gain):
        kp, kx, kg = jax.random.split(k, 3)
        x = math.sqrt(s0) * jax.random.normal(kx, (batch_size, width))
        variables = dict(module.init(kp, x))
        variables["params"] = scale_kernels(variables["params"], gain)
        g = jax.random.normal(kg, (batch_size, width))
        out = backprop_deltas(module, variables, x, g, train=train)
        return {
            "log10_delta_sq": log10_mean_square(out["delta"], (1, 2)),
            "log10_kernel_grad_sq": log10_mean_square(out["kernel_grad"], (1, 2)) - math.log10(batch_size),
            "log10_stream_sq": log10_mean_square(out["stream"], (1, 2)),
        }

    keys = jax.random.split(key, num_draws)
    over_draws = jax.vmap(one, in_axes=(0, None))
    if kernel_gains is None:
        out = jax.jit(over_draws)(keys, jnp.float32(1.0))
    else:
        # Gains run one after another inside the program (lax.map), draws side by side (vmap): one
        # compilation, and memory for one gain's draws at a time.
        out = jax.jit(lambda ks, gs: jax.lax.map(lambda gain: over_draws(ks, gain), gs))(
            keys, jnp.asarray(gains, jnp.float32))
    return {k: np.asarray(v, dtype=np.float64) for k, v in out.items()}


def mean_over_draws(log10_values: ArrayLike) -> np.ndarray:
    """log10 of the arithmetic mean over draws (axis 0) of 10^values: the expectation the curves give."""
    x = np.asarray(log10_values, dtype=np.float64) * math.log(10.0)
    top = np.max(x, axis=0)
    return (top + np.log(np.mean(np.exp(x - top), axis=0))) / math.log(10.0)
