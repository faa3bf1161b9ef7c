"""Block-output norms of the convolutional ResNets of ``resjax.nn.resnet`` (Zhang et al., seed 003, Figure 2).

``resjax.nn.ResNet`` sows every block's output as ``intermediates/.../block_out``: the first block of
stage s as ``stage{s}_first``, the remaining ones either unrolled (``stage{s}_0``, ``stage{s}_1``, ...)
or, with ``scan=True``, stacked on a leading axis under ``stage{s}/block``. The functions here put them
back in depth order, blocks l = 1..L (L = ``model.num_blocks`` = sum of the stage sizes).

- ``block_outputs(model, variables, x, train=..., tau=None)``: one array per stage, the stage's block
  outputs stacked in order, ``(n_s, B, H_s, W_s, C_s)`` (the shape changes from stage to stage, never
  within one); concatenated over stages they are blocks 1..L.
- ``block_output_norms(model, variables, x, ...)``: the per-example L2 norm of every block output,
  ``|h_(i,l)| = sqrt(sum over H, W, C of h_(i,l)^2)``, as ``(L, B)``; ``log10=True`` gives
  ``log10 |h_(i,l)|`` instead. Both are computed without squaring overflow: the norm is
  ``a * |h / a|`` with ``a = max |h|`` per example, so a stream whose squares exceed float32's range
  (|h| above about 1.8e19) still gets its norm as long as its entries are finite; an overflowed stream
  (an ``inf`` or ``nan`` entry) gives ``inf``. ``return_output=True`` also returns the network's output (the logits)
  from the same forward pass.
- ``mean_log10_norm(log10_norms)``: log10 of the batch mean of the norms, from per-example log10 norms
  (a log-sum-exp, so it never overflows either).

``train`` has no default (as the models' own calls, it says which BatchNorm statistics are used):
``train=True`` runs BatchNorm on the batch's own statistics, as the first training step ("epoch 0") does;
at initialisation the running estimates are 0 and 1, so ``train=False`` would not normalise at all.
The updated ``batch_stats`` are discarded: nothing here changes ``variables``.
Pure functions of (model, variables, inputs): jit-able with ``model`` static.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from resjax.nn.resnet import ResNet

__all__ = ["block_output_norms", "block_outputs", "mean_log10_norm"]


def _stage_outputs(inter: dict, stage: int) -> jnp.ndarray:
    """The block outputs of stage ``stage`` (1-based), stacked in order: ``(n_s, B, H, W, C)``."""
    first = f"stage{stage}_first"
    if first not in inter:
        raise ValueError(f"variables: no sown block output for {first!r}; was the model applied with "
                         "mutable=['intermediates']?")
    first_out = inter[first]["block_out"][0][None]
    scanned = inter.get(f"stage{stage}")
    if scanned is not None:  # nn.scan: one block_out with a leading axis of the stage's remaining blocks
        return jnp.concatenate([first_out, scanned["block"]["block_out"][0]], axis=0)
    pattern = re.compile(rf"stage{stage}_(\d+)$")
    unrolled = sorted((int(m.group(1)), key) for key in inter if (m := pattern.match(key)))
    return jnp.concatenate([first_out] + [inter[key]["block_out"][0][None] for _, key in unrolled], axis=0)


def block_outputs(model: ResNet, variables: dict, x: jnp.ndarray, *, train: bool,
                  tau: float | jax.Array | None = None,
                  return_output: bool = False) -> list[jnp.ndarray] | tuple[list[jnp.ndarray], jnp.ndarray]:
    """The block outputs of a ``resjax.nn.ResNet``, one stacked array per stage (see the module docstring);
    ``return_output=True``: ``(block outputs, the network's output (logits))`` from the same pass."""
    if not isinstance(model, ResNet):
        raise ValueError(f"model: need a resjax.nn.ResNet (e.g. resjax.nn.cifar_resnet), got {type(model).__name__}")
    kwargs = {} if tau is None else {"tau": tau}
    logits, state = model.apply(dict(variables), x, train=train, mutable=["intermediates", "batch_stats"], **kwargs)
    inter = state["intermediates"]
    outs = [_stage_outputs(inter, s) for s in range(1, len(model.stage_sizes) + 1)]
    found = sum(o.shape[0] for o in outs)
    if found != model.num_blocks:
        raise ValueError(f"model: found {found} block outputs, expected {model.num_blocks}")
    return (outs, logits) if return_output else outs


def _log10_norm(h: jnp.ndarray) -> jnp.ndarray:
    """Per-example log10 L2 norm of ``h`` (batch first), safe against squaring overflow."""
    flat = h.reshape(h.shape[0], -1)
    finite = jnp.all(jnp.isfinite(flat), axis=1)
    a = jnp.max(jnp.abs(jnp.where(jnp.isfinite(flat), flat, 0.0)), axis=1)
    safe_a = jnp.where(a > 0, a, 1.0)
    rel = jnp.linalg.norm(flat / safe_a[:, None], axis=1)
    out = jnp.where(a > 0, jnp.log10(safe_a) + jnp.log10(jnp.where(a > 0, rel, 1.0)), -jnp.inf)
    return jnp.where(finite, out, jnp.inf)


def block_output_norms(model: ResNet, variables: dict, x: jnp.ndarray, *, train: bool,
                       tau: float | jax.Array | None = None, log10: bool = False,
                       return_output: bool = False) -> jnp.ndarray | tuple[jnp.ndarray, jnp.ndarray]:
    """Per-example L2 norms ``(L, B)`` of the L block outputs (``log10=True``: their log10); ``inf`` where a
    block output overflowed. ``return_output=True``: ``(norms, the network's output)`` from the same pass.
    See the module docstring."""
    outs, logits = block_outputs(model, variables, x, train=train, tau=tau, return_output=True)
    logs = jnp.concatenate([jax.vmap(_log10_norm)(h) for h in outs])
    norms = logs if log10 else jnp.power(jnp.asarray(10.0, logs.dtype), logs)
    return (norms, logits) if return_output else norms


def mean_log10_norm(log10_norms: ArrayLike, axis: int = -1) -> jnp.ndarray:
    """``log10(mean over axis of 10**log10_norms)`` without overflow (``inf`` stays ``inf``)."""
    v = jnp.asarray(log10_norms) * jnp.log(10.0)
    top = jnp.max(v, axis=axis, keepdims=True)
    safe_top = jnp.where(jnp.isfinite(top), top, 0.0)
    m = jnp.log(jnp.mean(jnp.exp(v - safe_top), axis=axis)) + jnp.squeeze(safe_top, axis)
    m = jnp.where(jnp.squeeze(jnp.isposinf(top), axis), jnp.inf, m)
    return m / jnp.log(10.0)
