"""Forward and backward stability through depth, tracked in log space (Zhang et al., seed 003, Section 3).

Why log space. With tau = 1 a 1,000-block ResNet multiplies the norm of its stream by about
``exp(c L)``: float32 overflows long before the last block, so a direct forward pass gives ``inf``.
Every layer that ``log_space_propagation`` accepts is *positively homogeneous* of degree 1 in its
input (no biases, no normalisation, ReLU): ``f(c h) = c f(h)`` for c > 0. So the stream can be
renormalised to unit norm before every layer and the scale accumulated as a sum of logs:

    u_0 = h_0 / |h_0|,   s_0 = log |h_0|
    v_l = f_l(u_(l-1)),  s_l = s_(l-1) + log |v_l|,  u_l = v_l / |v_l|

and then ``h_l = exp(s_l) u_l`` exactly (up to rounding), whatever its size. ``f_l`` is the module's
own layer applied with layer l's parameters: ``resjax.nn.ResidualBlock(**module.block_kwargs())`` for a
``ResidualMLP``/``ResidualStack`` (``order='pre'`` or ``'post'``) and a ``PlainMLP`` (whose blocks have no
skip); parameters are read from the scanned layout (``blocks/block``) or stacked from the unrolled one. Norms are per example (the seed's theorems are per input sample).

The backward pass is tracked the same way. For one example, take the scalar read-out
``F = <v, y>`` with a fixed output cotangent v (default: the all-ones vector over sqrt(d)), so
``dF/dh_K = B^T v``. A homogeneous layer's Jacobian is homogeneous of degree 0 in its input
(``J(c h) = J(h)``), so ``dF/dh_(l-1) = J_l(u_(l-1))^T dF/dh_l`` can be renormalised too; and the gradient
with respect to layer l's parameters is bilinear in (input, cotangent):

    |grad_(theta_l) F| = exp(s_(l-1) + t_l) |grad_(theta_l) <g_l, f_l(u_(l-1))>|

with ``g_l`` the unit cotangent at the layer's output and ``t_l`` its log norm. For a tau block
theta_l = W_l and the gradient is ``tau D_l dh_l h_(l-1)^T`` (seed, Section 3.2).

The output ``y = B h_K + b`` (the head's bias included) is exact in log space as well:
``log |y| = s_K + log |B u_K + b exp(-s_K)|``.

``log_space_propagation(module, variables, inputs, cotangent=None, tau=None, backward=True)`` returns
(all natural logs, per example; K = number of layers)::

    log_norm            (K + 1, B)   log |h_l|, l = 0..K (l = 0: the stem output, h_0 = relu(A x))
    log_ratio           (K + 1, B)   log |h_l| / |h_0|
    log_output_norm     (B,)         log |y|
    log_grad_norm       (K, B)       log |grad_(theta_l) <v, y>|, l = 1..K     (backward=True)
    log_total_grad_norm (B,)         log sqrt(sum_l |grad_(theta_l) <v, y>|^2)  (backward=True)

``direct_norms(module, variables, inputs, tau=None)`` gives ``|h_l|`` by the ordinary forward pass
(``'intermediates'``), for checking the log-space pass where nothing overflows.

A module whose layers are not positively homogeneous (biases, BatchNorm or another norm, Fixup's scalar
biases, SkipInit, an activation other than ReLU) raises ``ValueError`` naming the setting: renormalising
its stream would change its output.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from resjax.analysis.propagation import stream_activations
from resjax.nn.block import ResidualBlock
from resjax.nn.mlp import PlainMLP, ResidualMLP, ResidualStack
from resjax.nn.residual import stack_unrolled

__all__ = ["direct_norms", "layer_and_params", "log_log_slope", "log_space_propagation"]

_RELUS = (nn.relu, jax.nn.relu)


def _check_homogeneous(module) -> None:
    if not isinstance(module, (ResidualMLP, ResidualStack, PlainMLP)):
        raise ValueError(f"module: {type(module).__name__} is not supported; use resjax.nn.ResidualMLP, ResidualStack "
                         "or PlainMLP (e.g. from resjax.nn.tau_resnet)")
    if getattr(module, "use_bias", True):
        raise ValueError(f"use_bias: {type(module).__name__} has biases, so its layers are not positively homogeneous; "
                         "log-space tracking needs use_bias=False")
    if getattr(module, "norm", "none") != "none":
        raise ValueError(f"norm: {module.norm!r} is not positively homogeneous; log-space tracking needs norm='none'")
    if getattr(module, "scaling", "none") not in ("none", "tau", "rescale"):
        raise ValueError(f"scaling: {module.scaling!r} adds learned scalars (biases or gains) to each block; "
                         "log-space tracking supports 'none', 'tau' and 'rescale'")
    if getattr(module, "activation", nn.relu) not in _RELUS:
        raise ValueError("activation: log-space tracking needs ReLU (a positively homogeneous activation)")


def layer_and_params(module: nn.Module, variables: dict) -> tuple[nn.Module, dict, Any]:
    """``(layer, call_kwargs, params)``: the module's own repeated layer (an unbound Flax module), the keyword
    arguments it is called with, and its parameters stacked on a leading layer axis of size K."""
    params = variables["params"]
    if isinstance(module, (ResidualMLP, ResidualStack, PlainMLP)):  # the plain blocks: ResidualBlock(skip=False)
        layer = ResidualBlock(**module.block_kwargs())
        stacked = params["blocks"]["block"] if module.scan else \
            stack_unrolled(params, module.stack_size)["blocks"]["block"]
        return layer, {"train": False}, stacked
    raise ValueError(f"module: {type(module).__name__} is not supported; use resjax.nn.ResidualMLP, ResidualStack or "
                     "PlainMLP (e.g. from resjax.nn.tau_resnet)")


def _stem(module, variables, inputs, apply_kwargs) -> jnp.ndarray:
    """h_0: the module's own stem output (``'stem_out'``), per example."""
    _, state = module.apply({"params": variables["params"]}, inputs, train=False, mutable=["intermediates"],
                            **apply_kwargs)
    return state["intermediates"]["stem_out"][0]


def _unit(x):
    n = jnp.linalg.norm(x, axis=-1)
    return x / jnp.where(n > 0, n, 1.0)[..., None], jnp.log(n)


def log_space_propagation(module: nn.Module, variables: dict, inputs: jnp.ndarray, *,
                          cotangent: jnp.ndarray | None = None, tau: float | jax.Array | None = None,
                          backward: bool = True) -> dict:
    """Forward (and backward) norms through every layer, in log space; see the module docstring.

    ``inputs``: ``(B, features)``. ``cotangent``: ``(B, num_classes)`` or ``(num_classes,)`` output
    cotangents v (default: ones / sqrt(num_classes)); a ``ResidualStack`` (no head) outputs its stream, so
    its cotangents have the stream's width. ``tau``: a (traced) tau for ``scaling='tau'``
    modules, as at call time. Pure and jit/vmap-able.
    """
    _check_homogeneous(module)
    if jnp.ndim(inputs) != 2:
        raise ValueError(f"inputs: need shape (batch, features), got {tuple(jnp.shape(inputs))}")
    layer, call_kwargs, stacked = layer_and_params(module, variables)
    uses_tau = getattr(module, "scaling", None) == "tau"
    if tau is not None and not uses_tau:
        raise ValueError(f"tau: {type(module).__name__} has no tau scaling (scaling={getattr(module, 'scaling', None)!r})")
    apply_kwargs = {"tau": tau} if uses_tau and tau is not None else {}
    layer_kwargs = {**call_kwargs, **apply_kwargs}

    def f(p, u):
        return layer.apply({"params": p}, u, **layer_kwargs)

    u0, s0 = _unit(_stem(module, variables, inputs, apply_kwargs))

    def fwd(carry, p):
        u, s = carry
        u_new, log_n = _unit(f(p, u))
        return (u_new, s + log_n), (u, s)

    (u_k, s_k), (u_in, s_in) = jax.lax.scan(fwd, (u0, s0), stacked)
    log_norm = jnp.concatenate([s_in, s_k[None]], axis=0)

    # A ResidualStack has no head: its output is the stream h_K itself (an identity head, no bias).
    head = variables["params"].get("head") or {"kernel": jnp.eye(u_k.shape[-1], dtype=u_k.dtype)}
    b = head.get("bias", jnp.zeros(head["kernel"].shape[-1], u_k.dtype))
    out = {
        "log_norm": log_norm,
        "log_ratio": log_norm - log_norm[:1],
        "log_output_norm": s_k + jnp.log(jnp.linalg.norm(u_k @ head["kernel"] + b * jnp.exp(-s_k)[:, None], axis=-1)),
    }
    if not backward:
        return out

    d = head["kernel"].shape[-1]
    v = jnp.ones((d,), u_k.dtype) / jnp.sqrt(d) if cotangent is None else jnp.asarray(cotangent, u_k.dtype)
    v = jnp.broadcast_to(v, (u_k.shape[0], d))
    g_k, t_k = _unit(v @ head["kernel"].T)  # dF/dh_K = B^T v

    def one_example(p, u, g):
        _, vjp = jax.vjp(lambda p_, u_: f(p_, u_[None])[0], p, u)
        gp, gu = vjp(g)
        sq = sum(jnp.sum(jnp.square(x)) for x in jax.tree_util.tree_leaves(gp))
        return jnp.sqrt(sq), gu

    def bwd(carry, xs):
        g, t = carry
        p, u, s = xs
        gnorm, gu = jax.vmap(one_example, in_axes=(None, 0, 0))(p, u, g)
        g_new, log_n = _unit(gu)
        return (g_new, t + log_n), jnp.log(gnorm) + s + t

    _, log_grad = jax.lax.scan(bwd, (g_k, t_k), (stacked, u_in, s_in), reverse=True)
    out["log_grad_norm"] = log_grad
    out["log_total_grad_norm"] = 0.5 * jax.scipy.special.logsumexp(2.0 * log_grad, axis=0)
    return out


def direct_norms(module: nn.Module, variables: dict, inputs: jnp.ndarray, *,
                 tau: float | jax.Array | None = None) -> jnp.ndarray:
    """``|h_l|`` per example, l = 0..K, ``(K + 1, B)``, by the ordinary forward pass (overflows where it does)."""
    kwargs = {"tau": tau} if tau is not None else {}
    stream = stream_activations(module, {"params": variables["params"]}, inputs, **kwargs)
    return jnp.linalg.norm(stream, axis=-1)


def log_log_slope(values: ArrayLike, start: int = 1) -> float:
    """Least-squares slope of ``log values[l]`` against ``log l`` for l = start..len(values)-1 (index = l)."""
    values = np.asarray(values, float)
    if values.ndim != 1 or len(values) < start + 2:
        raise ValueError(f"values: need a 1-D curve with at least {start + 2} points, got shape {values.shape}")
    if start < 1:
        raise ValueError(f"start: must be >= 1 (log 0 is undefined), got {start!r}")
    ls = np.arange(start, len(values))
    return float(np.polyfit(np.log(ls), np.log(values[start:]), 1)[0])
