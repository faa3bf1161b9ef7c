"""BatchNorm and the loss surface: Santurkar et al.'s measurements (lecture 000, "BatchNorm and the loss surface").

The lecture: BatchNorm can make "the loss vary more smoothly along optimisation directions", "gradients
change more gradually" and "larger learning rates practical"; and noise injected after each BatchNorm
layer (a changing input distribution for the next layer) trains about as well as standard BatchNorm.

Along the gradient direction
----------------------------
At parameters theta with gradient g = grad L(theta) on one minibatch, step along the gradient with step
sizes eta_1 < ... < eta_K (the points ``theta - eta_k g``, what SGD at learning rate eta_k would reach):

- ``losses[k] = L(theta - eta_k g)``; the **loss range** is ``max_k losses - min_k losses`` (the width of
  Santurkar et al.'s shaded "loss landscape" band at one training step; the start theta itself is not
  one of the points unless a step size 0 is passed);
- ``grad_changes[k] = |grad L(theta - eta_k g) - g|`` (l2 over every parameter); the **gradient
  change** is its maximum over k ("gradient predictiveness": how far the gradient moves);
- the **effective beta-smoothness** is ``max_k grad_changes[k] / (eta_k |g|)``: the largest change of
  gradient per unit distance moved.

``params_loss_fn(module, variables, inputs, labels)`` is the loss as a function of the whole ``params``
tree, in the mode ``train`` says (no default; ``True``: batch statistics, ``batch_stats`` updates discarded).
``probe_gradient_direction(loss_fn, params, step_sizes)`` returns ``loss0``, ``grad_norm``, ``losses``
(K,), ``grad_changes`` (K,) and the three summaries ``loss_range``, ``grad_change``,
``beta_smoothness``; it is jnp throughout (jit it, vmap it over seeds). On the quadratic
``L = 1/2 theta^T A theta`` the answers are known: ``losses[k] = L0 - eta_k |g|^2 + eta_k^2 g^T A g / 2``,
``grad_changes[k] = eta_k |A g|`` and the beta-smoothness is ``|A g| / |g|`` (tests check these).

The largest learning rate that still trains
-------------------------------------------
``trains(final_loss, diverged, threshold)``: a run trains when it never diverged (no non-finite loss or
gradient) and its last-epoch mean training loss is below ``threshold``. A learning rate trains when every
seed does. ``largest_trainable_learning_rate(learning_rates, ok)`` is the largest learning rate of the
grid that trains (NaN when none does). The grid and threshold are the caller's; the experiment states its.

Noisy BatchNorm
---------------
``NoisyBatchNorm`` is BatchNorm (``resjax.nn.make_norm('batch')``, PyTorch defaults) followed, in
training mode only, by a random per-unit affine map that changes every step, plus per-example noise:

    z'_ij = s_tj * z_ij + mu_tj + sigma * e_tij,
    mu_tj ~ U(-shift, shift),  s_tj ~ U(scale_low, scale_high),  e_tij ~ N(0, 1)

for training step t, unit j and example i (z: the BatchNorm output after its learned scale and offset).
So the next layer's input has, per unit, a mean and a spread that are neither 0 and 1 nor constant from
one step to the next: injected covariate shift, our reading of Santurkar et al. ("each activation for
each sample in the batch using i.i.d. noise sampled from a non-zero mean and non-unit variance
distribution ... this noise distribution changes at each time step"); their exact distributions are not
reproduced. Evaluation mode (``train=False``) adds nothing. With ``shift = 0``, ``scale_low = scale_high
= 1`` and ``sigma = 0`` it is exactly standard BatchNorm.

The noise needs no rng stream: each layer draws a key at ``init`` (from the ``'params'`` rng, so it
differs per seed and per layer) and keeps it with a step counter in its ``'batch_stats'`` collection;
every training-mode call with ``batch_stats`` mutable uses ``fold_in(key, step)`` and advances the
counter. It therefore trains unchanged under ``resjax.train`` (which makes only ``batch_stats`` mutable).
Calls with ``batch_stats`` immutable reuse the current step's noise.

``NoisyBNMLP`` is ``resjax.nn.PlainMLP(norm='batch')`` with ``NoisyBatchNorm`` in place of each
BatchNorm (same names: ``stem``, ``hidden_k``, ``norm_k`` (the BatchNorm inside is ``norm_k/bn``), ``head``).

Every function raises ``ValueError`` naming the setting: step sizes that are empty, negative or not
increasing, a batch of one in training mode, a threshold <= 0, mismatched shapes, bad noise settings.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import ArrayLike

from resjax.analysis.protocol import applied
from resjax.nn.init import get_bias_initializer, get_initializer
from resjax.nn.norms import make_norm

# ---- the loss of the whole parameter tree ----------------------------------------------------------


def _tree_norm(tree) -> jnp.ndarray:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree_util.tree_leaves(tree)))


def params_loss_fn(module: nn.Module, variables: dict, inputs: ArrayLike, labels: ArrayLike, *,
                   train: bool | None, loss: Callable | None = None, **apply_kwargs: Any) -> Callable:
    """``loss(params)`` of ``module`` on one batch; ``batch_stats`` held fixed (updates discarded).

    ``module``: any Linen module or ``apply_fn`` (``resjax.analysis.protocol``). ``train`` (no default): ``True``,
    training mode, batch statistics (``batch_stats`` made mutable, its updates
    discarded); ``train=False``: the running estimates. ``loss(outputs, labels)`` defaults to the mean softmax
    cross-entropy with integer labels; ``apply_kwargs`` go to ``module.apply``. ``train=None``: for a model that
    takes no ``train`` (a model that does and has BatchNorm refuses it, naming ``train``). ``ValueError`` for inputs
    without a batch axis, or a batch of one in training mode.
    """
    if jnp.ndim(inputs) < 2:
        raise ValueError(f"inputs: need a batch axis and a feature axis, got shape {tuple(jnp.shape(inputs))}")
    if train and jnp.shape(inputs)[0] < 2:
        raise ValueError(f"inputs: a batch of {jnp.shape(inputs)[0]} example(s) has no batch variance in training "
                         "mode; need >= 2")
    if loss is None:
        loss = lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    model = applied(module, variables, "params_loss_fn")
    model.train_kwargs(train)  # a train for a model without one: ValueError now
    rest = {k: v for k, v in variables.items() if k not in ("params", "intermediates")}
    mutable = ["batch_stats"] if "batch_stats" in rest else False

    def loss_fn(params):
        out = model({"params": params, **rest}, inputs, train=train, mutable=mutable, **apply_kwargs)
        return loss(out[0] if mutable else out, labels)

    return loss_fn


def check_step_sizes(step_sizes: ArrayLike) -> np.ndarray:
    """``step_sizes`` as a float64 array when it is a non-empty 1-D sequence of finite values >= 0 in strictly
    increasing order; else ``ValueError`` naming ``step_sizes``."""
    s = np.asarray(step_sizes, np.float64)
    if s.ndim != 1 or s.size == 0:
        raise ValueError(f"step_sizes: need a non-empty 1-D sequence, got shape {s.shape}")
    if not np.all(np.isfinite(s)) or np.any(s < 0):
        raise ValueError(f"step_sizes: must be finite and >= 0, got {s.tolist()}")
    if np.any(np.diff(s) <= 0):
        raise ValueError(f"step_sizes: must be strictly increasing, got {s.tolist()}")
    return s


def probe_gradient_direction(loss_fn: Callable, params: Any, step_sizes: ArrayLike) -> dict:
    """Loss and gradient at ``params - eta_k g`` for each step size; see the module docstring."""
    if not isinstance(step_sizes, jax.core.Tracer):
        check_step_sizes(step_sizes)
    etas = jnp.asarray(step_sizes, jnp.float32)
    vg = jax.value_and_grad(loss_fn)
    loss0, g = vg(params)
    gnorm = _tree_norm(g)

    def at(eta):
        moved = jax.tree_util.tree_map(lambda p, d: p - eta * d, params, g)
        loss, g2 = vg(moved)
        change = _tree_norm(jax.tree_util.tree_map(jnp.subtract, g2, g))
        return loss, change

    losses, changes = jax.lax.map(at, etas)
    return {
        "loss0": loss0, "grad_norm": gnorm, "losses": losses, "grad_changes": changes,
        **summarise(losses, changes, etas, gnorm),
    }


def summarise(losses: jax.Array, grad_changes: jax.Array, step_sizes: ArrayLike, grad_norm: ArrayLike) -> dict:
    """``loss_range``, ``grad_change`` and ``beta_smoothness`` of one probe (NaN-propagating)."""
    dist = jnp.asarray(step_sizes) * grad_norm
    ratio = jnp.where(dist > 0, grad_changes / jnp.where(dist > 0, dist, 1.0), 0.0)
    return {"loss_range": jnp.max(losses) - jnp.min(losses), "grad_change": jnp.max(grad_changes),
            "beta_smoothness": jnp.max(ratio)}


# ---- largest learning rate that trains -------------------------------------------------------------


def trains(final_loss: ArrayLike, diverged: ArrayLike, threshold: float) -> np.ndarray:
    """Per run: never diverged and the last-epoch mean training loss is finite and below ``threshold``."""
    if not threshold > 0:
        raise ValueError(f"threshold: the training-loss threshold must be > 0, got {threshold!r}")
    final_loss, diverged = np.asarray(final_loss, np.float64), np.asarray(diverged, bool)
    if final_loss.shape != diverged.shape:
        raise ValueError(f"diverged: shape {diverged.shape} does not match final_loss {final_loss.shape}")
    return (~diverged) & np.isfinite(final_loss) & (final_loss < threshold)


def largest_trainable_learning_rate(learning_rates: Sequence[float], ok: ArrayLike) -> float:
    """The largest learning rate whose runs all train. ``ok``: ``(L,)`` or ``(L, seeds)`` booleans."""
    lrs = np.asarray(learning_rates, np.float64)
    ok = np.asarray(ok, bool)
    if ok.shape[:1] != lrs.shape:
        raise ValueError(f"ok: leading axis {ok.shape[:1]} must match the {lrs.shape[0]} learning rates")
    every = ok.reshape(len(lrs), -1).all(axis=1)
    return float(lrs[every].max()) if every.any() else float("nan")


# ---- noisy BatchNorm -------------------------------------------------------------------------------


def _key_data(key) -> jnp.ndarray:
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(key)
    return key


def check_noise(shift: float, scale_low: float, scale_high: float, sigma: float) -> None:
    """Raise ``ValueError`` naming the setting unless ``shift >= 0``, ``0 < scale_low <= scale_high`` and
    ``sigma >= 0``, all finite."""
    if not (np.isfinite(shift) and shift >= 0):
        raise ValueError(f"shift: must be finite and >= 0, got {shift!r}")
    if not (np.isfinite(scale_low) and np.isfinite(scale_high) and 0 < scale_low <= scale_high):
        raise ValueError(f"scale_low, scale_high: need 0 < scale_low <= scale_high, got {scale_low!r}, {scale_high!r}")
    if not (np.isfinite(sigma) and sigma >= 0):
        raise ValueError(f"sigma: must be finite and >= 0, got {sigma!r}")


class NoisyBatchNorm(nn.Module):
    """BatchNorm, then (training mode only) ``s_tj z + mu_tj + sigma e_tij``; see the module docstring."""

    shift: float = 0.5
    scale_low: float = 0.5
    scale_high: float = 1.5
    sigma: float = 0.25

    def __post_init__(self):
        check_noise(self.shift, self.scale_low, self.scale_high, self.sigma)
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array, train: bool | None = None) -> jax.Array:
        """BatchNorm of ``x`` (the layer ``bn``), then, in training mode only, the per-unit noise.

        Args:
            x: ``(batch, units)`` (or ``(..., units)``): BatchNorm and the noise are per unit (last axis).
            train: ``True``: training mode: BatchNorm uses the minibatch's statistics and updates its running
                estimates, and ``s_tj z + mu_tj + sigma e_tij`` is returned, drawn from
                ``fold_in(noise_key, noise_step)``; ``False``: evaluation: the running estimates, no noise.
                ``None`` (the default): ``apply`` raises ``ValueError`` naming ``train`` (this layer has
                BatchNorm); ``init`` may omit it (it only needs shapes).

        Returns:
            The shape of ``x``: the noisy BatchNorm output in training mode, the BatchNorm output otherwise.

        Collections:
            ``batch_stats``: ``bn/mean`` and ``bn/var`` (the running estimates), ``noise_key`` (drawn at
            ``init`` from the ``'params'`` rng) and ``noise_step``. With ``train=True``, ``apply`` needs
            ``mutable=['batch_stats']``: the estimates are updated and ``noise_step`` advances by one.
        """
        z = make_norm("batch", train=train, name="bn")(x)
        key = self.variable("batch_stats", "noise_key", lambda: _key_data(self.make_rng("params")))
        step = self.variable("batch_stats", "noise_step", lambda: jnp.zeros((), jnp.int32))
        if not train:
            return z
        k = jax.random.fold_in(jax.random.wrap_key_data(key.value), step.value)
        if self.is_mutable_collection("batch_stats") and not self.is_initializing():
            step.value = step.value + 1
        k_mu, k_s, k_e = jax.random.split(k, 3)
        units = z.shape[-1]
        mu = jax.random.uniform(k_mu, (units,), z.dtype, -self.shift, self.shift)
        s = jax.random.uniform(k_s, (units,), z.dtype, self.scale_low, self.scale_high)
        e = jax.random.normal(k_e, z.shape, z.dtype)
        return s * z + mu + self.sigma * e


class _NoisyBNLayer(nn.Module):
    """A hidden layer of ``NoisyBNMLP``: Dense (no bias: BatchNorm follows), ``NoisyBatchNorm``, ReLU, named as a
    block of ``PlainMLP`` (``linear_0``, ``norm_0``), so that the two networks draw the same weights from a key."""

    width: int
    kernel_init: str
    noise: tuple  # NoisyBatchNorm's (shift, scale_low, scale_high, sigma)

    @nn.compact
    def __call__(self, h: jax.Array, train: bool | None) -> jax.Array:
        h = nn.Dense(self.width, use_bias=False, kernel_init=get_initializer(self.kernel_init), name="linear_0")(h)
        return nn.relu(NoisyBatchNorm(*self.noise, name="norm_0")(h, train))


class NoisyBNMLP(nn.Module):
    """``PlainMLP(norm='batch')`` with ``NoisyBatchNorm`` after each hidden linear layer (which, as in
    ``PlainMLP``, has no bias: BatchNorm follows it), laid out as ``PlainMLP`` (``stem``, ``blocks_k/linear_0``,
    ``blocks_k/norm_0``, ``head``): from one key both draw the same initial weights."""

    width: int
    depth: int
    num_classes: int = 10
    shift: float = 0.5
    scale_low: float = 0.5
    scale_high: float = 1.5
    sigma: float = 0.25
    kernel_init: str = "he_uniform"
    bias_init: str = "zeros"

    def __post_init__(self):
        for name in ("width", "depth", "num_classes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {v!r}")
        check_noise(self.shift, self.scale_low, self.scale_high, self.sigma)
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array, train: bool | None = None) -> jax.Array:
        """The logits: ``stem`` (Dense, ReLU), then ``depth`` blocks ``blocks_k``: ``linear_0`` (Dense, no bias),
        ``norm_0`` (``NoisyBatchNorm``) and ReLU, then ``head`` (Dense).

        Args:
            x: ``(batch, features)``.
            train: ``True``: training mode (each ``NoisyBatchNorm`` normalises with the minibatch's
                statistics, updates its running estimates and adds its noise); ``False``: evaluation (the
                running estimates, no noise). The model has BatchNorm, so ``apply`` without ``train``
                (``None``, the default) raises ``ValueError`` naming ``train``; ``init`` may omit it.

        Returns:
            The logits, ``(batch, num_classes)``.

        Collections:
            ``batch_stats``: per block ``blocks_k/norm_0/bn/mean``, ``.../bn/var``, ``.../noise_key`` and
            ``.../noise_step``; with ``train=True``, ``apply`` needs ``mutable=['batch_stats']``.
        """
        init = get_initializer(self.kernel_init)
        bias = lambda h: get_bias_initializer(self.bias_init, h.shape[-1])
        h = nn.relu(nn.Dense(self.width, kernel_init=init, bias_init=bias(x), name="stem")(x))
        noise = (self.shift, self.scale_low, self.scale_high, self.sigma)
        for k in range(self.depth):
            h = _NoisyBNLayer(self.width, self.kernel_init, noise, name=f"blocks_{k}")(h, train)
        return nn.Dense(self.num_classes, kernel_init=init, bias_init=bias(h), name="head")(h)


__all__ = ["NoisyBNMLP", "NoisyBatchNorm", "check_noise", "check_step_sizes", "largest_trainable_learning_rate",
           "params_loss_fn", "probe_gradient_direction", "summarise", "trains"]
