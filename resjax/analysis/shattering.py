"""Shattered gradients: input gradients on a grid, autocorrelation estimators, half-correlation distance.

Balduzzi et al. (2017) and the lecture ("Shattered gradients") measure how quickly the input gradient
``dy/dx`` of a scalar-input, scalar-output network decorrelates as the input moves. Everything here is a
pure function of ``(module, variables, inputs)`` or of arrays; nothing trains.

- ``make_grid(num_points, low, high)``: ``num_points`` inputs spaced ``(high - low) / num_points`` apart
  on ``[low, high)``, as ``np.arange(low, high, (high - low) / num_points)`` (the udlbook notebook's grid).
- ``init_many(module, key, num_networks)``: ``num_networks`` independent parameter draws, vmapped;
  every leaf gets a leading network axis.
- ``input_gradients(module, variables, grid)``: ``dy/dx`` at every grid point for one network, by
  ``jax.grad`` vmapped over the grid (automatic differentiation, never finite differences); a model of more
  than one input or output goes along a line through its input space to one of its outputs with
  ``embed=lambda t: x0 + t * v`` and ``readout=lambda y: y[0, c]`` (``scalar_function``);
  ``input_gradients_many`` does the same for stacked variables (vmapped over networks too).
- ``autocorrelation(signal, max_lag, estimator)``: the autocorrelation of a 1-D signal (or of each row of
  ``(..., n)``) at lags ``0 .. max_lag`` (in grid steps). Estimators (``ESTIMATORS``), with ``a_i`` the
  signal and ``P(l)`` the ``n - l`` overlapping pairs ``(a_i, a_{i+l})``:

  * ``raw``: the uncentred mean product over the overlapping pairs, ``mean_P(l) a_i a_{i+l}``, divided
    by its lag-0 value ``mean a_i^2``;
  * ``notebook``: the uncentred *sum* over the overlapping pairs divided by its lag-0 value,
    ``sum_P(l) a_i a_{i+l} / sum a_i^2``: what ``np.correlate(a, a, mode='same')`` normalised at lag 0
    computes, the form the udlbook notebook 11.1 asks for. It tapers by ``(n - l) / n`` relative to
    ``raw`` (the biased estimator);
  * ``mean_subtracted``: subtract the global mean ``abar``, sum ``(a_i - abar)(a_{i+l} - abar)`` over the
    overlapping pairs, divide by the overlap count ``n - l``, and normalise by the lag-0 value (the
    standard unbiased-in-count sample autocorrelation);
  * ``pearson``: the Pearson correlation of the overlapping pairs at each lag, with each side's own mean
    and standard deviation: literally "the correlation between dy/dx at x and at x + delta, over all x".

  ``raw`` and ``notebook`` of a constant signal are 1 at every lag; ``mean_subtracted`` and ``pearson``
  are undefined (0/0) for a constant signal and return NaN, as does ``pearson`` at a lag with a single
  pair or a constant side ("constant": a spread below float rounding, about 1e-5 of the signal's largest
  magnitude in float32, so rounding noise never reads as a correlation of +-1).
- ``half_correlation_distance(curve, spacing)``: the input distance at which the curve first falls below
  one half, by linear interpolation between the last grid lag at or above 0.5 and the first below it
  (0 if ``curve[0]`` is already below; NaN if it never falls below or the curve is NaN before then).
- ``shattering_statistics(grads, spacing, ...)``: per-network curves, their average over networks, and
  the half-correlation distance of the average (the lecture's "averaged over twenty networks") and of
  each network.

Bad settings (a grid of fewer than 2 points, ``high <= low``, ``max_lag`` out of range, an unknown
estimator, a module whose output is not a single number) raise ``ValueError`` naming the setting (the last:
``readout``; a model that refuses a ``(1, 1)`` input: ``embed`` and ``readout``).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, Callable

import flax
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from resjax.analysis.protocol import applied

if TYPE_CHECKING:
    import flax.linen as nn

__all__ = [
    "ESTIMATORS", "autocorrelation", "check_estimator", "half_correlation_distance", "init_many", "input_gradients",
    "input_gradients_many", "make_grid", "scalar_function", "shattering_statistics",
]

#: The autocorrelation estimators ``autocorrelation`` knows (see the module docstring).
ESTIMATORS = ("raw", "notebook", "mean_subtracted", "pearson")


# ---- inputs and gradients -----------------------------------------------------------------------------


def make_grid(num_points: int, low: float = -2.0, high: float = 2.0) -> jnp.ndarray:
    """``num_points`` points on ``[low, high)`` spaced ``(high - low) / num_points`` apart."""
    if not isinstance(num_points, (int, np.integer)) or isinstance(num_points, bool) or num_points < 2:
        raise ValueError(f"grid_points: need an integer >= 2 grid points, got {num_points!r}")
    if not (np.isfinite(low) and np.isfinite(high)) or high <= low:
        raise ValueError(f"grid_range: need finite low < high, got low={low!r}, high={high!r}")
    step = (high - low) / num_points
    return jnp.asarray(low + step * np.arange(num_points), jnp.float32)


def _check_grid(grid) -> jnp.ndarray:
    grid = jnp.asarray(grid)
    if grid.ndim != 1 or grid.shape[0] < 2:
        raise ValueError(f"grid: need a 1-D grid of at least 2 points, got shape {tuple(grid.shape)}")
    return grid


def init_many(module: nn.Module, key: jax.Array, num_networks: int, input_size: int = 1, **init_kwargs: Any) -> Any:
    """``num_networks`` independent initialisations of ``module`` (vmapped ``module.init``); every leaf
    of the returned variables has a leading axis of size ``num_networks``."""
    if not isinstance(num_networks, (int, np.integer)) or isinstance(num_networks, bool) or num_networks < 1:
        raise ValueError(f"num_networks: need an integer >= 1, got {num_networks!r}")
    applied(module, None, "init_many")  # an NNX module: say what to pass
    if not hasattr(module, "init"):
        raise TypeError(f"init_many: needs a Linen module (with .init), got {type(module).__name__}; initialise a "
                        "plain apply_fn's variables yourself")
    keys = jax.random.split(key, num_networks)
    x = jnp.zeros((1, input_size), jnp.float32)
    # Not jitted: compiling a deep unrolled module's init costs seconds, running it eagerly a fraction.
    return jax.vmap(lambda k: module.init(k, x, **init_kwargs))(keys)


def scalar_function(module: nn.Module | Callable[..., Any], variables: dict, *,
                    embed: Callable[[jax.Array], Any] | None = None,
                    readout: Callable[[Any], jax.Array] | None = None,
                    **apply_kwargs: Any) -> Callable[[ArrayLike], jax.Array]:
    """``t -> y`` for a model as a function of one number: ``readout(model(embed(t)))``.

    ``module``: a Linen module or an ``apply_fn(variables, x, **kwargs)`` (``resjax.analysis.protocol``);
    NNX objects are refused with a ``TypeError`` saying what to pass. ``embed(t)``: the model's input for the
    number ``t`` (default: the ``(1, 1)`` array holding ``t``, for a model of one input; for any other model a
    line through its input space, e.g. ``lambda t: x0 + t * v`` with ``x0``, ``v`` of the input's shape).
    ``readout(y)``: one number from the model's output (default: the output itself, which must hold one
    number; e.g. ``lambda logits: logits[0, c]`` for class ``c``). Both are traced with the model (jnp only).

    The call is checked on ``jax.eval_shape`` before anything is computed: a model that refuses the input
    (an image model given ``(1, 1)``) or an output of more than one number raises ``ValueError`` naming
    ``embed`` or ``readout``, the argument that fixes it.
    """
    model = applied(module, variables, "scalar_function")
    given_embed, given_readout = embed, readout
    if embed is None:
        def embed(t):
            return jnp.reshape(t, (1, 1))
    if readout is None:
        def readout(y):
            return y
    t0 = jnp.zeros((), jnp.float32)
    try:  # the model's own refusal of the input (an image model's of a (1, 1) input), before anything is computed
        out = jax.eval_shape(lambda v: model.apply(v, embed(t0), **apply_kwargs), variables)
    except (ValueError, TypeError, flax.errors.FlaxError) as err:  # FlaxError: parameters of another input shape
        if given_embed is None:
            raise ValueError(f"module: input gradients need a model of one number (a (1, 1) input to a single "
                             f"output); {model.name} refuses a (1, 1) input: {err}. For another model pass embed=, "
                             "a line through its input space (e.g. embed=lambda t: x0 + t * v, x0 and v shaped as "
                             "its input batch of one), and readout=, one number from its output (e.g. "
                             "readout=lambda y: y[0, 0])") from None
        raise ValueError(f"embed: {model.name} refuses the input that embed gives: {err}") from None
    number = jax.eval_shape(readout, out)
    leaves = jax.tree_util.tree_leaves(number)
    if len(leaves) != 1 or int(np.prod(leaves[0].shape)) != 1:
        shapes = [tuple(a.shape) for a in leaves]
        name = "readout" if given_readout is not None else "module"
        raise ValueError(f"{name}: input gradients need a scalar output (one number), got output shape(s) "
                         f"{shapes[0] if len(shapes) == 1 else shapes}"
                         + ("" if given_readout is not None else
                            "; pass readout=, one number from the output (e.g. readout=lambda y: y[0, 0])"))

    def f(t):
        return jnp.reshape(readout(model.apply(variables, embed(t), **apply_kwargs)), ())

    return f


def input_gradients(module: nn.Module | Callable[..., Any], variables: dict, grid: ArrayLike, *,
                    embed: Callable[[jax.Array], Any] | None = None, readout: Callable[[Any], jax.Array] | None = None,
                    **apply_kwargs: Any) -> jnp.ndarray:
    """``dy/dt`` of ``y = readout(model(embed(t)))`` at every point ``t`` of ``grid`` (shape ``(n,)``), by
    ``jax.grad`` vmapped over the grid. By default (no ``embed``, no ``readout``) the model must map a ``(1, 1)``
    input to one number, and this is ``dy/dx``; ``embed`` and ``readout`` (see ``scalar_function``) take any
    model along a line through its input space to one of its outputs (a model that refuses the default names
    them). ``apply_kwargs`` go to ``module.apply`` (e.g. ``tau=...``, ``train=False``); a plain
    ``apply_fn(variables, x, **kwargs)`` may stand for the module."""
    grid = _check_grid(grid)
    f = scalar_function(module, variables, embed=embed, readout=readout, **apply_kwargs)
    return jax.vmap(jax.grad(f))(grid)


def input_gradients_many(module: nn.Module | Callable[..., Any], variables: dict, grid: ArrayLike, *,
                         embed: Callable[[jax.Array], Any] | None = None,
                         readout: Callable[[Any], jax.Array] | None = None, **apply_kwargs: Any) -> jnp.ndarray:
    """``input_gradients`` for stacked variables (leading network axis, e.g. from ``init_many``):
    shape ``(networks, n)``, one jitted program vmapped over networks and grid points."""
    grid = _check_grid(grid)
    applied(module, variables, "input_gradients_many")
    fn = jax.jit(jax.vmap(lambda v, g: input_gradients(module, v, g, embed=embed, readout=readout, **apply_kwargs),
                          in_axes=(0, None)))
    return fn(variables, grid)


# ---- autocorrelation ----------------------------------------------------------------------------------


def check_estimator(estimator: str) -> None:
    """Raise ``ValueError`` naming ``estimator`` unless it is one of ``ESTIMATORS``."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator: unknown autocorrelation estimator {estimator!r}; choose one of {ESTIMATORS}")


def _pairs(n: int, max_lag: int):
    """Index ``a[i + l]`` for lags ``l = 0..max_lag`` (rows) and positions ``i`` (columns), and the mask
    of overlapping pairs (``i + l < n``)."""
    lags = np.arange(max_lag + 1)[:, None]
    idx = np.arange(n)[None, :] + lags
    valid = idx < n
    return np.minimum(idx, n - 1), valid


def autocorrelation(signal: ArrayLike, max_lag: int | None = None, estimator: str = "pearson") -> jnp.ndarray:
    """Autocorrelation of ``signal`` (shape ``(..., n)``, along the last axis) at lags ``0..max_lag``
    (default ``n // 2``); shape ``(..., max_lag + 1)``. See the module docstring for the estimators."""
    check_estimator(estimator)
    a = jnp.asarray(signal)
    if a.ndim < 1 or a.shape[-1] < 2:
        raise ValueError(f"signal: need at least 2 points along the last axis, got shape {tuple(a.shape)}")
    n = a.shape[-1]
    max_lag = n // 2 if max_lag is None else max_lag
    if not isinstance(max_lag, (int, np.integer)) or isinstance(max_lag, bool) or not 0 <= max_lag <= n - 1:
        raise ValueError(f"max_lag: need an integer in [0, {n - 1}] for a signal of {n} points, got {max_lag!r}")
    return _autocorrelation(a.astype(jnp.promote_types(a.dtype, jnp.float32)), int(max_lag), estimator)


@partial(jax.jit, static_argnums=(1, 2))
def _autocorrelation(a, max_lag: int, estimator: str):
    n = a.shape[-1]
    idx, valid = _pairs(n, max_lag)
    mask = jnp.asarray(valid, a.dtype)  # (L, n)
    count = mask.sum(-1)  # n - l
    x = a[..., None, :] * mask  # a_i on overlapping pairs, (..., L, n)
    y = a[..., idx] * mask  # a_{i+l}

    if estimator in ("raw", "notebook"):
        s = (x * y).sum(-1)
        s = s / count if estimator == "raw" else s
        return s / s[..., :1]
    # A spread below rounding level (a constant signal whose mean is computed inexactly) counts as zero,
    # so a constant signal is undefined (NaN) rather than correlated at +-1 by rounding noise.
    tiny = n * (64 * jnp.finfo(a.dtype).eps * jnp.abs(a).max(-1)) ** 2
    if estimator == "mean_subtracted":
        c = a - a.mean(-1, keepdims=True)
        s = ((c[..., None, :] * mask) * (c[..., idx] * mask)).sum(-1) / count
        s0 = jnp.where(s[..., :1] * n > tiny[..., None], s[..., :1], jnp.nan)
        return s / s0
    # pearson: each lag's own means and standard deviations
    mx = x.sum(-1, keepdims=True) / count[:, None]
    my = y.sum(-1, keepdims=True) / count[:, None]
    dx, dy = (x - mx) * mask, (y - my) * mask
    cov = (dx * dy).sum(-1)
    vx, vy = (dx * dx).sum(-1), (dy * dy).sum(-1)
    ok = (vx > tiny[..., None]) & (vy > tiny[..., None])
    return jnp.where(ok, cov / jnp.sqrt(jnp.where(ok, vx * vy, 1.0)), jnp.nan)


def half_correlation_distance(curve: ArrayLike, spacing: float, level: float = 0.5) -> jnp.ndarray:
    """Distance at which ``curve`` (lags ``0, 1, ...`` times ``spacing``; shape ``(..., L)``) first falls
    below ``level``, linearly interpolated between the neighbouring lags. 0 if ``curve[0] < level``;
    NaN if it never falls below ``level`` or is NaN before it does."""
    c = jnp.asarray(curve)
    if c.ndim < 1 or c.shape[-1] < 2:
        raise ValueError(f"curve: need at least 2 lags, got shape {tuple(c.shape)}")
    if not np.isfinite(spacing) or spacing <= 0:
        raise ValueError(f"spacing: need a positive grid spacing, got {spacing!r}")
    below = c < level
    first = jnp.argmax(below, axis=-1)
    crossed = below.any(-1)
    prev = jnp.maximum(first - 1, 0)
    c_prev = jnp.take_along_axis(c, prev[..., None], -1)[..., 0]
    c_first = jnp.take_along_axis(c, first[..., None], -1)[..., 0]
    frac = jnp.where(first > 0, (c_prev - level) / jnp.where(first > 0, c_prev - c_first, 1.0), 0.0)
    dist = (prev + frac) * spacing
    lags = jnp.arange(c.shape[-1])
    nan_before = (jnp.isnan(c) & (lags <= jnp.where(crossed, first, c.shape[-1] - 1)[..., None])).any(-1)
    return jnp.where(crossed & ~nan_before, dist, jnp.nan)


def shattering_statistics(grads: ArrayLike, spacing: float, max_lag: int | None = None, estimator: str = "pearson",
                          level: float = 0.5) -> dict:
    """Autocorrelation of each network's ``dy/dx`` (rows of ``grads``, shape ``(networks, n)``), their mean
    over networks (networks whose curve is undefined, e.g. a constant gradient under ``pearson``, are
    left out and counted), and half-correlation distances of the mean curve and of each network.

    Returns ``{'distances', 'curves', 'mean_curve', 'half_distance', 'half_distance_per_network',
    'num_undefined'}`` as numpy arrays / numbers.
    """
    grads = jnp.asarray(grads)
    if grads.ndim != 2:
        raise ValueError(f"grads: need shape (networks, grid points), got {tuple(grads.shape)}")
    curves = np.asarray(autocorrelation(grads, max_lag, estimator))
    defined = np.isfinite(curves[:, 0])
    mean_curve = curves[defined].mean(0) if defined.any() else np.full(curves.shape[1], np.nan)
    return {
        "distances": spacing * np.arange(curves.shape[1]),
        "curves": curves,
        "mean_curve": mean_curve,
        "half_distance": float(half_correlation_distance(mean_curve, spacing, level)),
        "half_distance_per_network": np.asarray(half_correlation_distance(curves, spacing, level)),
        "num_undefined": int((~defined).sum()),
    }
