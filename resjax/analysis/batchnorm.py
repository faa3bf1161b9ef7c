"""BatchNorm by hand, batch noise, running estimates and normalisation axes (pure functions).

Lecture 000, "Batch normalisation" ... "Training and inference", "Batch noise", "Normalisation
choices", "Train and eval modes" and "Running estimates".

The four steps by hand
----------------------
``batch_mean``, ``batch_variance`` (population, dividing by |B|, which BatchNorm normalises with; or
``unbiased=True``, dividing by |B| - 1, torch.var's default and PyTorch's stored running variance),
``standardise`` and ``scale_shift``; ``batchnorm_steps`` runs all four and returns every stage.
``apply_norm(kind, x, ...)`` runs resjax's own layer (``resjax.nn.make_norm``, flax underneath) on ``x``
and returns its output and updated ``batch_stats``, so that the two can be compared.

Batch noise
-----------
``example_outputs(key, example, batch_sizes, num_batches, ...)``: one example's BatchNorm output in
``num_batches`` random minibatches of each size, every batch = the example plus ``B - 1`` others drawn
i.i.d. from the data distribution N(data_mean, data_std^2) (the example is one of the B values the
statistics are taken over, as it is in training). All sizes and batches run as one vmapped program:
each batch is drawn at the largest size and masked down to B (flax's BatchNorm ``mask=``), batch size
B's others come from ``fold_in(key, B)`` so that sizes are independent. ``via='layer'`` runs resjax's
BatchNorm; ``via='hand'`` the four steps. ``delta_method_std(z, B)`` = sqrt((1 + z^2/2) / B), the
first-order spread for an example z data standard deviations from the mean (the batch mean contributes
1/B, the batch standard deviation z^2/(2B)).

Running estimates
-----------------
Each training step moves the stored estimate a fraction rho towards the batch statistic:
``m <- (1 - rho) m + rho m_batch``. ``running_update(m, m_batch, rho)`` computes it exactly as flax's
``BatchNorm`` updates its ``batch_stats``: ``momentum * m + (1 - momentum) * m_batch`` with flax's
``momentum = 1 - rho`` (the same formula for the mean and for the (population) variance). Conventions:

=========  ===================  ==========================
framework  name                 value
=========  ===================  ==========================
lecture    rho                  rho
PyTorch    ``momentum``         rho (default 0.1)
flax       ``momentum``         1 - rho (default 0.99, rho = 0.01)
resjax     ``momentum`` / rho   momentum 0.9 = PyTorch's rho 0.1
=========  ===================  ==========================

``rho_from_flax``, ``flax_from_rho``, ``rho_from_torch``, ``torch_from_rho``, ``torch_from_flax``,
``flax_from_torch`` convert. PyTorch stores the unbiased batch variance, flax the population one
(``unbiased_from_population``).

``running_estimate(batch_stats, rho, init)`` scans the update over a sequence; ``lag_and_noise(true,
batch_stats, rho, init)`` splits the estimate's error exactly (the update is linear): the estimate of
the noise-free signal lags it by ``lag = true - EMA(true)``, and the noise ``EMA(batch - true)`` (from
0) is what the batch noise leaves in the estimate. On a ramp of slope a the lag settles at
a (1 - rho) / rho, i.e. ``lag_steps(rho)`` = (1 - rho) / rho steps; batch noise of standard
deviation s leaves ``noise_std(rho, s)`` = s sqrt(rho / (2 - rho)) in the settled estimate.

Normalisation axes
------------------
flax is channels-last: the lecture's ``(B, C, H, W)`` is flax's ``(B, H, W, C)`` (axis 1 of NCHW is
axis 3 of NHWC). ``reduction_axes(kind, layout)`` gives the axes each of resjax's layers (with
``make_norm``'s defaults, or ``layer_axes='example'`` for a LayerNorm built with
``reduction_axes=(1, 2, 3)``) takes one mean and variance over, numbered in ``layout``;
``statistic_groups(kind, shape, ...)`` labels every value of an NHWC activation with the group it
shares one mean and variance with (GroupNorm also splits the channels into ``num_groups``);
``normalise_by_groups`` is the numpy reduction over those groups, and ``groups_from_layer`` recovers the
groups from what a layer actually does (two values share statistics iff one's output depends on the
other's input: the connected components of the layer's Jacobian).

Errors (``ValueError`` naming the setting): a batch of one in training mode (``batch_size``), a group
count that does not divide the channels (``num_groups``), rho outside (0, 1] (``rho``), flax momentum
outside [0, 1) (``momentum``), an unknown normalisation or layout.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from resjax.nn.norms import make_norm

#: The activation layouts ``reduction_axes`` numbers axes in (flax is channels-last, NHWC).
LAYOUTS = ("NHWC", "NCHW")
#: The normalisations ``reduction_axes`` and ``statistic_groups`` describe.
AXIS_KINDS = ("batch", "layer", "group", "instance")


# ---- validation ----------------------------------------------------------------------------------


def _traced(v) -> bool:
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(v))


def check_rho(rho: ArrayLike) -> None:
    """Raise ``ValueError`` naming ``rho`` unless every value lies in (0, 1]; traced values (inside jit or
    vmap) are not checked here."""
    if _traced(rho):  # values inside jit/vmap are checked by their caller
        return
    r = np.asarray(rho)
    if not np.all((r > 0) & (r <= 1)):
        raise ValueError(f"rho: the running-estimate rate must lie in (0, 1], got {rho}")


def check_flax_momentum(momentum: ArrayLike) -> None:
    """Raise ``ValueError`` naming ``momentum`` unless every value of flax's BatchNorm momentum (1 - rho)
    lies in [0, 1); traced values are not checked here."""
    if _traced(momentum):
        return
    m = np.asarray(momentum)
    if not np.all((m >= 0) & (m < 1)):
        raise ValueError(f"momentum: flax's BatchNorm momentum (1 - rho) must lie in [0, 1), got {momentum}")


def check_torch_momentum(momentum: ArrayLike) -> None:
    """Raise ``ValueError`` naming ``momentum`` unless every value of PyTorch's BatchNorm momentum (= rho)
    lies in (0, 1]; traced values are not checked here."""
    if _traced(momentum):
        return
    m = np.asarray(momentum)
    if not np.all((m > 0) & (m <= 1)):
        raise ValueError(f"momentum: PyTorch's BatchNorm momentum (= rho) must lie in (0, 1], got {momentum}")


def _check_batch(n: int, what: str = "batch_size") -> None:
    if n < 2:
        raise ValueError(f"{what}: batch statistics in training mode need at least 2 values, got {n} "
                         "(a batch of one has no spread; use the running estimates, evaluation mode)")


# ---- conventions ---------------------------------------------------------------------------------


def flax_from_rho(rho: ArrayLike) -> ArrayLike:
    """flax's BatchNorm ``momentum`` for the running-estimate rate rho: ``1 - rho`` (rho checked)."""
    check_rho(rho)
    return 1 - rho


def rho_from_flax(momentum: ArrayLike) -> ArrayLike:
    """The running-estimate rate rho of flax's BatchNorm ``momentum``: ``1 - momentum`` (checked)."""
    check_flax_momentum(momentum)
    return 1 - momentum


def torch_from_rho(rho: ArrayLike) -> ArrayLike:
    """PyTorch's BatchNorm ``momentum`` for rho: rho itself (checked)."""
    check_rho(rho)
    return rho


def rho_from_torch(momentum: ArrayLike) -> ArrayLike:
    """The rho of PyTorch's BatchNorm ``momentum``: the same value (checked)."""
    check_torch_momentum(momentum)
    return momentum


def flax_from_torch(momentum: ArrayLike) -> ArrayLike:
    """flax's ``momentum`` from PyTorch's: ``1 - momentum`` (PyTorch's 0.1 is flax's 0.9)."""
    return flax_from_rho(rho_from_torch(momentum))


def torch_from_flax(momentum: ArrayLike) -> ArrayLike:
    """PyTorch's ``momentum`` from flax's: ``1 - momentum`` (flax's default 0.99 is PyTorch's 0.01)."""
    return torch_from_rho(rho_from_flax(momentum))


def unbiased_from_population(var: ArrayLike, n: int) -> ArrayLike:
    """The unbiased variance (divide by n - 1) from the population one (divide by n) of n values."""
    _check_batch(n, "n")
    return var * n / (n - 1)


# ---- the four steps by hand ----------------------------------------------------------------------


def batch_mean(h: ArrayLike, axis: int | Sequence[int] = 0) -> jax.Array:
    """The mean over ``axis`` (the batch): BatchNorm's first step."""
    return jnp.mean(h, axis=axis)


def batch_variance(h: ArrayLike, axis: int | Sequence[int] = 0, unbiased: bool = False) -> jax.Array:
    """Population variance (divide by |B|; what BatchNorm normalises with) or the unbiased one."""
    n = math.prod(np.shape(h)[a] for a in np.atleast_1d(axis))
    _check_batch(n)
    m = jnp.mean(h, axis=axis, keepdims=True)
    return jnp.sum((h - m) ** 2, axis=axis) / (n - 1 if unbiased else n)


def standardise(h: ArrayLike, mean: ArrayLike, var: ArrayLike, epsilon: float = 1e-5) -> jax.Array:
    """``(h - mean) / sqrt(var + epsilon)``: BatchNorm's third step (``mean`` and ``var`` broadcast
    against ``h``)."""
    return (h - mean) / jnp.sqrt(var + epsilon)


def scale_shift(h_hat: ArrayLike, gamma: ArrayLike = 1.0, delta: ArrayLike = 0.0) -> ArrayLike:
    """``gamma * h_hat + delta``: BatchNorm's last step, the learned scale and offset."""
    return gamma * h_hat + delta


def batchnorm_steps(h: ArrayLike, gamma: ArrayLike = 1.0, delta: ArrayLike = 0.0, epsilon: float = 1e-5,
                    axis: int | Sequence[int] = 0) -> dict:
    """Every stage of BatchNorm over ``axis`` (training mode): mean, centred values, population and
    unbiased variance, standardised values, output."""
    h = jnp.asarray(h, jnp.float32)
    n = math.prod(np.shape(h)[a] for a in np.atleast_1d(axis))
    _check_batch(n)
    axis = tuple(int(a) for a in np.atleast_1d(axis)) if np.ndim(axis) else int(axis)
    return _batchnorm_steps(h, gamma, delta, epsilon, axis)


@functools.partial(jax.jit, static_argnums=(4,))
def _batchnorm_steps(h, gamma, delta, epsilon, axis) -> dict:
    m = batch_mean(h, axis)
    var = batch_variance(h, axis)
    mk = jnp.expand_dims(m, axis)
    vk = jnp.expand_dims(var, axis)
    h_hat = standardise(h, mk, vk, epsilon)
    return {"input": h, "mean": m, "centred": h - mk, "var_population": var,
            "var_unbiased": batch_variance(h, axis, unbiased=True), "std": jnp.sqrt(var),
            "standardised": h_hat, "output": scale_shift(h_hat, gamma, delta)}


# ---- resjax's own layer --------------------------------------------------------------------------


class _Norm(nn.Module):
    kind: str
    overrides: tuple = ()

    @nn.compact
    def __call__(self, x: jax.Array, train: bool, **call_kwargs: Any) -> jax.Array:
        """``make_norm(kind, train=train, name='norm', **overrides)(x, **call_kwargs)``."""
        return make_norm(self.kind, train=train, name="norm", **dict(self.overrides))(x, **call_kwargs)


def norm_module(kind: str, **overrides: Any) -> nn.Module:
    """A module wrapping ``make_norm(kind, **overrides)`` under the name ``'norm'``."""
    return _Norm(kind, tuple(sorted(overrides.items())))


def apply_norm(kind: str, x: ArrayLike, *, train: bool, gamma: ArrayLike | None = None,
               delta: ArrayLike | None = None, batch_stats: dict | None = None, mask: ArrayLike | None = None,
               **overrides: Any) -> tuple[jnp.ndarray, dict]:
    """Run resjax's normalisation layer ``kind`` on ``x``: ``(output, batch_stats after)``.

    ``gamma``/``delta`` replace the initial scale (1) and offset (0); ``batch_stats`` ({'mean', 'var'})
    the stored running estimates (BatchNorm). Training mode returns the updated estimates; evaluation
    mode runs with nothing mutable and returns the stored ones. Pure and jit/vmap friendly (jitted, with
    ``kind``, ``train`` and the ``make_norm`` overrides static).
    """
    try:
        static = tuple(sorted(overrides.items()))
        hash(static)
    except TypeError as err:
        raise ValueError(f"overrides: make_norm settings must be hashable (numbers, strings, tuples): {err}") from None
    return _apply_norm(kind, bool(train), static, jnp.asarray(x, jnp.float32), gamma, delta, batch_stats, mask)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _apply_norm(kind, train, static, x, gamma, delta, batch_stats, mask):
    module = _Norm(kind, static)
    kw = {} if mask is None else {"mask": mask}
    variables = module.init(jax.random.key(0), x, False)
    params = dict(variables.get("params", {}).get("norm", {}))
    if gamma is not None:
        params["scale"] = jnp.broadcast_to(jnp.asarray(gamma, jnp.float32), params["scale"].shape)
    if delta is not None:
        params["bias"] = jnp.broadcast_to(jnp.asarray(delta, jnp.float32), params["bias"].shape)
    new = {}
    if params:
        new["params"] = {"norm": params}
    if "batch_stats" in variables:
        stats = variables["batch_stats"]["norm"] if batch_stats is None else batch_stats
        new["batch_stats"] = {"norm": {k: jnp.asarray(v, jnp.float32) for k, v in stats.items()}}
    if train:
        y, upd = module.apply(new, x, True, mutable=["batch_stats"], **kw)
        return y, upd.get("batch_stats", {}).get("norm", {})
    y = module.apply(new, x, False, **kw)
    return y, new.get("batch_stats", {}).get("norm", {})


# ---- batch noise ---------------------------------------------------------------------------------


def data_standardised(example: ArrayLike, data_mean: ArrayLike, data_std: ArrayLike) -> ArrayLike:
    """The value standardising with the data's own mean and standard deviation gives."""
    return (example - data_mean) / data_std


def delta_method_std(z: ArrayLike, batch_size: ArrayLike) -> np.ndarray:
    """First-order spread of the BatchNorm output of an example z data-sds from the mean."""
    return np.sqrt((1 + np.asarray(z) ** 2 / 2) / np.asarray(batch_size, dtype=float))


def example_outputs(key: jax.Array, example: float, batch_sizes: Sequence[int], num_batches: int, *,
                    data_mean: float = 0.0, data_std: float = 1.0, epsilon: float = 0.0,
                    via: str = "layer") -> jnp.ndarray:
    """The example's BatchNorm output (training mode, gamma 1, delta 0) in ``num_batches`` random
    minibatches of each size: shape ``(len(batch_sizes), num_batches)``. See the module docstring."""
    sizes = [int(b) for b in batch_sizes]
    if not sizes:
        raise ValueError("batch_sizes: give at least one batch size")
    for b in sizes:
        _check_batch(b)
    if int(num_batches) < 1:
        raise ValueError(f"num_batches: must be >= 1, got {num_batches}")
    if data_std <= 0:
        raise ValueError(f"data_std: must be > 0, got {data_std}")
    if via not in ("layer", "hand"):
        raise ValueError(f"via: 'layer' or 'hand', got {via!r}")
    bmax = max(sizes)

    def one_size(b):
        k = jax.random.fold_in(key, b)
        others = data_mean + data_std * jax.random.normal(k, (num_batches, bmax - 1))
        batches = jnp.concatenate([jnp.full((num_batches, 1), example, jnp.float32), others], axis=1)
        mask = jnp.arange(bmax) < b

        def one_batch(h):
            if via == "layer":
                y, _ = apply_norm("batch", h[:, None], train=True, epsilon=epsilon, mask=mask[:, None])
                return y[0, 0]
            m = jnp.sum(jnp.where(mask, h, 0.0)) / b
            var = jnp.sum(jnp.where(mask, (h - m) ** 2, 0.0)) / b
            return standardise(h[0], m, var, epsilon)

        return jax.vmap(one_batch)(batches)

    return jax.jit(jax.vmap(one_size))(jnp.asarray(sizes))


def loglog_slope(x: ArrayLike, y: ArrayLike) -> float:
    """Least-squares slope of log y against log x (the 1/sqrt(B) law has slope -1/2)."""
    return float(np.polyfit(np.log(np.asarray(x, float)), np.log(np.asarray(y, float)), 1)[0])


# ---- running estimates ---------------------------------------------------------------------------


def running_update(m: ArrayLike, m_batch: ArrayLike, rho: ArrayLike) -> ArrayLike:
    """One step of the running estimate, exactly as flax's BatchNorm updates ``batch_stats``:
    ``momentum * m + (1 - momentum) * m_batch`` with ``momentum = 1 - rho``."""
    check_rho(rho)
    momentum = 1 - rho
    return momentum * m + (1 - momentum) * m_batch


def running_estimate(batch_stats: ArrayLike, rho: ArrayLike, init: ArrayLike = 0.0) -> jnp.ndarray:
    """The running estimate after each step (``lax.scan`` of ``running_update`` over the leading axis)."""
    check_rho(rho)
    batch_stats = jnp.asarray(batch_stats, jnp.float32)

    def step(m, mb):
        m = running_update(m, mb, rho)
        return m, m

    _, trace = jax.lax.scan(step, jnp.broadcast_to(jnp.asarray(init, jnp.float32), batch_stats.shape[1:]),
                            batch_stats)
    return trace


def lag_steps(rho: ArrayLike) -> ArrayLike:
    """Settled lag (in steps) of a running estimate behind a linear ramp: (1 - rho) / rho."""
    check_rho(rho)
    return (1 - np.asarray(rho)) / np.asarray(rho)


def noise_std(rho: ArrayLike, batch_noise_std: ArrayLike) -> ArrayLike:
    """Settled standard deviation the batch noise leaves in the estimate: s sqrt(rho / (2 - rho))."""
    check_rho(rho)
    rho = np.asarray(rho)
    return batch_noise_std * np.sqrt(rho / (2 - rho))


def lag_and_noise(true: ArrayLike, batch_stats: ArrayLike, rho: ArrayLike, init: ArrayLike = 0.0) -> dict:
    """The estimate of ``batch_stats`` and its exact split into lag and noise (see module docstring).

    Returns ``estimate``, ``clean`` (the estimate of the noise-free ``true``), ``lag`` = true - clean,
    ``noise`` = the estimate of (batch - true) from 0, so that estimate = true - lag + noise (up to
    rounding), and ``error`` = estimate - true.
    """
    true = jnp.asarray(true, jnp.float32)
    batch_stats = jnp.asarray(batch_stats, jnp.float32)
    est = running_estimate(batch_stats, rho, init)
    clean = running_estimate(true, rho, init)
    noise = running_estimate(batch_stats - true, rho, 0.0)
    return {"estimate": est, "clean": clean, "lag": true - clean, "noise": noise, "error": est - true}


def drifting_mean(num_steps: int, start: int, end: int, low: float, high: float) -> np.ndarray:
    """A true mean at ``low`` until step ``start``, linear to ``high`` at step ``end``, then flat
    (steps 1..num_steps)."""
    if not 0 <= start < end:
        raise ValueError(f"drift: need 0 <= start < end, got start={start}, end={end}")
    t = np.arange(1, num_steps + 1)
    return low + (high - low) * np.clip((t - start) / (end - start), 0, 1)


# ---- normalisation axes --------------------------------------------------------------------------

_NAMES = {"NHWC": "BHWC", "NCHW": "BCHW"}


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: one of {LAYOUTS}, got {layout!r}")


def _check_kind(kind: str) -> None:
    if kind not in AXIS_KINDS:
        raise ValueError(f"norm: one of {AXIS_KINDS}, got {kind!r}")


def reduction_axes(kind: str, layout: str = "NHWC", layer_axes: str = "position") -> tuple[int, ...]:
    """Axes (numbered in ``layout``) of a 4-d activation that one mean and variance of resjax's layer
    ``kind`` are taken over. GroupNorm also takes them over the channels of one group, so its
    statistics are per (example, group); ``statistic_groups`` says which channels.

    ``layer_axes``: ``'position'`` = ``make_norm('layer')``'s default (flax's ``reduction_axes=-1``:
    the channels of each example at each position); ``'example'`` = a LayerNorm built with
    ``reduction_axes=(1, 2, 3)``, the lecture's "channels and spatial positions within each example".
    """
    _check_kind(kind)
    _check_layout(layout)
    if layer_axes not in ("position", "example"):
        raise ValueError(f"layer_axes: 'position' or 'example', got {layer_axes!r}")
    names = {"batch": "BHW", "instance": "HW", "group": "HWC",
             "layer": "C" if layer_axes == "position" else "HWC"}[kind]
    return tuple(sorted(_NAMES[layout].index(n) for n in names))


def layer_overrides(kind: str, layer_axes: str = "position", num_groups: int | None = None) -> dict:
    """``make_norm`` overrides that build the layer ``reduction_axes(kind, layer_axes=...)`` describes."""
    _check_kind(kind)
    if kind == "layer" and layer_axes == "example":
        return {"reduction_axes": (1, 2, 3)}
    if kind == "group":
        return {"num_groups": 32 if num_groups is None else num_groups}
    return {}


def statistic_groups(kind: str, shape: Sequence[int], *, num_groups: int | None = None,
                     layer_axes: str = "position") -> np.ndarray:
    """Integer labels, ``shape`` = NHWC ``(B, H, W, C)``: values with equal labels share one mean and
    variance in resjax's layer ``kind`` (``num_groups`` for GroupNorm, default 32 as ``make_norm``)."""
    _check_kind(kind)
    if len(shape) != 4:
        raise ValueError(f"shape: a (B, H, W, C) activation, got {tuple(shape)}")
    B, H, W, C = shape
    if kind == "batch" and B * H * W < 2:
        _check_batch(B * H * W)
    b, h, w, c = np.meshgrid(np.arange(B), np.arange(H), np.arange(W), np.arange(C), indexing="ij")
    if kind == "group":
        g = 32 if num_groups is None else num_groups
        if g < 1 or C % g:
            raise ValueError(f"num_groups: {g} groups do not divide the {C} channels")
        c = c // (C // g)
    keep = {"B": b, "H": h, "W": w, "C": c}
    reduced = set(_NAMES["NHWC"][a] for a in reduction_axes(kind, "NHWC", layer_axes))
    label = np.zeros(shape, np.int64)
    for name, size in zip("BHWC", (B, H, W, C)):
        if name not in reduced:
            label = label * size + keep[name]
        elif name == "C" and kind == "group":  # reduced within a group, the group itself is kept
            label = label * size + keep[name]
    return np.unique(label, return_inverse=True)[1].reshape(shape)


def normalise_by_groups(x: ArrayLike, labels: ArrayLike, epsilon: float = 1e-5) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Numpy reduction: ``(standardised x, mean per value, population variance per value)``, statistics
    over the values sharing a label (float64)."""
    x = np.asarray(x, np.float64)
    flat = np.asarray(labels).ravel()
    count = np.bincount(flat)
    mean = np.bincount(flat, x.ravel()) / count
    var = np.bincount(flat, (x.ravel() - mean[flat]) ** 2) / count
    m, v = mean[flat].reshape(x.shape), var[flat].reshape(x.shape)
    return (x - m) / np.sqrt(v + epsilon), m, v


def groups_from_layer(fn: Callable[[jax.Array], jax.Array], x: ArrayLike, tol: float = 1e-6) -> np.ndarray:
    """Labels recovered from what ``fn`` (a normalisation, x -> y of the same shape) does: the
    connected components of its Jacobian's nonzero pattern (entries above ``tol`` times the largest)."""
    from scipy.sparse.csgraph import connected_components

    x = jnp.asarray(x, jnp.float32)
    n = x.size
    # Forward mode: on CPU (jax/jaxlib 0.10.2) jit(jacrev(...)) of u * rsqrt(mean(u**2, -1)) on a (36, 6)
    # input returns wrong cross-row entries (eager jacrev and jit(jacfwd) agree with each other).
    jac = jax.jit(jax.jacfwd(lambda v: fn(v.reshape(x.shape)).ravel()))(x.ravel())
    a = np.abs(np.asarray(jac))
    adj = a > tol * a.max()
    _, labels = connected_components(adj | adj.T, directed=False)
    assert labels.shape == (n,)
    return labels.reshape(x.shape)


def same_partition(a: ArrayLike, b: ArrayLike) -> bool:
    """Whether two label arrays split the values into the same groups."""
    a, b = np.asarray(a).ravel(), np.asarray(b).ravel()
    pairs = np.unique(np.stack([a, b]), axis=1).shape[1]
    return a.shape == b.shape and pairs == len(np.unique(a)) == len(np.unique(b))


def nchw_to_nhwc(x: ArrayLike) -> np.ndarray | jax.Array:
    """The lecture's (B, C, H, W) activation as flax's (B, H, W, C)."""
    return np.moveaxis(np.asarray(x), 1, -1) if isinstance(x, np.ndarray) else jnp.moveaxis(x, 1, -1)


def nhwc_to_nchw(x: ArrayLike) -> np.ndarray | jax.Array:
    """Flax's (B, H, W, C) activation in the lecture's (B, C, H, W) layout (numpy stays numpy)."""
    return np.moveaxis(np.asarray(x), -1, 1) if isinstance(x, np.ndarray) else jnp.moveaxis(x, -1, 1)


__all__: list[Any] = [
    "AXIS_KINDS", "LAYOUTS", "apply_norm", "batch_mean", "batch_variance", "batchnorm_steps", "check_flax_momentum",
    "check_rho", "check_torch_momentum", "data_standardised", "delta_method_std", "drifting_mean",
    "example_outputs", "flax_from_rho", "flax_from_torch", "groups_from_layer", "lag_and_noise", "lag_steps",
    "layer_overrides", "loglog_slope", "nchw_to_nhwc", "nhwc_to_nchw", "noise_std", "norm_module",
    "normalise_by_groups", "reduction_axes", "rho_from_flax", "rho_from_torch", "running_estimate",
    "running_update", "same_partition", "scale_shift", "standardise", "statistic_groups", "torch_from_flax",
    "torch_from_rho", "unbiased_from_population",
]
