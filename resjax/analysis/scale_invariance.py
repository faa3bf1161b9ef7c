"""Scale invariance of a weight layer whose output goes straight into BatchNorm (lecture 000, "Scale invariance").

For such a layer, in training mode (batch statistics) and ignoring BatchNorm's epsilon, the loss depends
only on the direction of the layer's weights W, never on their length:

1. ``L(aW) = L(W)`` for every a > 0;
2. ``grad L(aW) = grad L(W) / a`` (differentiate 1. in W), so |grad| is proportional to 1/|W|;
3. ``W . grad L(W) = 0`` (differentiate 1. in a at a = 1): every SGD step is perpendicular to W;
4. so a finite step lengthens W: ``|W - alpha g|^2 - |W|^2 = alpha^2 |g|^2`` exactly;
5. a perpendicular step of length alpha |g| turns W by ``arctan(alpha |g| / |W|)``; since |g| scales like
   1/|W|, the turning rate is ``alpha / |W|^2`` times the gradient at the unit-length weights: the
   *effective learning rate* ``alpha / |W|^2``. Exactly: one SGD step from aW at learning rate alpha
   points where one step from W at learning rate alpha / a^2 points (same direction after the step).

The functions
-------------
``weight_loss_fn(module, variables, inputs, labels, path, train=True)`` returns ``loss(W)``: the module
applied in training mode (``train=True``, which the identities need; ``train`` has no default), ``batch_stats``
mutable and the updates discarded (so nothing changes), with the array at ``path`` replaced by W.
``path`` names the weight: ``'blocks_0/linear_0/kernel'`` or
``('blocks_0', 'linear_0', 'kernel')``, inside ``'params'`` unless it starts with another collection's name. The
loss is the mean softmax cross-entropy with integer ``labels`` unless ``loss(outputs, labels)`` is given. It
works for any Flax module or ``apply_fn`` (``resjax.analysis.protocol``; ``train=None`` for one that takes no
``train``); the caller chooses a weight whose output goes
straight into BatchNorm (for ``resjax.nn.PlainMLP(norm='batch')`` every ``blocks_k/linear_0/kernel``; not the
stem, whose output goes into a ReLU, nor anything before a residual addition). Whether the identities
hold is what ``scale_identities`` measures; nothing here assumes them.

``scale_identities(loss_fn, W, a, alpha)`` measures the four identities at one point and one a, as
relative deviations (0 when the identity holds exactly):

- ``loss``: ``|L(aW) - L(W)| / |L(W)|``;
- ``grad``: ``|grad L(aW) - grad L(W) / a| / |grad L(W) / a|``;
- ``cosine``: ``|W . g| / (|W| |g|)`` (the cosine between weights and gradient; 0 = perpendicular);
- ``step``: ``|(|W - alpha g|^2 - |W|^2) - alpha^2 |g|^2| / (alpha^2 |g|^2)``, computed in float64 from the
  float32 W and g (``|W|^2`` and ``|W - alpha g|^2`` are nearly equal; float32 would cancel). In exact
  arithmetic this equals ``2 |W . g| / (alpha |g|^2)``: identity 4 is identity 3 seen through a step.

BatchNorm's epsilon breaks the invariance slightly: it is added to the batch variance a^2 s^2, so the
deviation grows as a shrinks (about ``epsilon / (2 a^2 s^2)``). To test the lecture's "ignoring epsilon"
build the module with ``epsilon=0`` (e.g. ``norm=functools.partial(nn.BatchNorm, use_running_average=False,
epsilon=0.0)`` or ``resjax.nn.make_norm('batch', train=True, epsilon=0.0)``).

``sgd_step_geometry(W, g, alpha, weight_decay=0)`` describes one SGD step ``W' = W - alpha (g + lambda W)``
(an L2 penalty ``lambda/2 |W|^2``; for plain SGD the same as multiplying W by ``1 - alpha lambda``, i.e.
decoupled decay): the norms before and after, the angle turned (``angle_between``, a formula stable for
small angles), the growth of the squared norm, the lecture's prediction ``alpha^2 |g|^2`` (no decay), the
step length, the predicted angle ``arctan(alpha |g| / (|W| (1 - alpha lambda)))`` (exact when g is
perpendicular to W), and the effective learning rate ``alpha / |W|^2``. jnp throughout: jit and vmap it.

Every function raises ``ValueError`` naming the setting for a <= 0, a negative or non-finite learning
rate or weight decay, a path that names no array, weights of zero length, shapes that do not match, and a
batch of one example in training mode (no batch variance).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import ArrayLike

from resjax.analysis.protocol import applied

if TYPE_CHECKING:
    import flax.linen as nn

#: The collections a weight ``path`` may start with (otherwise it is inside ``'params'``).
COLLECTIONS = ("params", "batch_stats")


# ---- paths ---------------------------------------------------------------------------------------


def parse_path(path: str | Sequence[str]) -> tuple[str, ...]:
    """``'blocks_0/linear_0/kernel'`` or ``('blocks_0', 'linear_0', 'kernel')`` ->
    ``('params', 'blocks_0', 'linear_0', 'kernel')``."""
    if isinstance(path, str):
        parts = tuple(p for p in path.split("/") if p)
    elif isinstance(path, (tuple, list)) and all(isinstance(p, str) for p in path):
        parts = tuple(path)
    else:
        raise ValueError(f"path: must be a 'a/b/kernel' string or a tuple of names, got {path!r}")
    if not parts:
        raise ValueError("path: empty")
    if parts[0] not in COLLECTIONS:
        parts = ("params",) + parts
    return parts


def get_weight(variables: dict, path: str | Sequence[str]) -> jnp.ndarray:
    """The array at ``path`` in ``variables`` (``ValueError`` naming the path if there is none)."""
    parts = parse_path(path)
    node: Any = variables
    for i, p in enumerate(parts):
        if not hasattr(node, "keys") or p not in node:
            have = sorted(node.keys()) if hasattr(node, "keys") else type(node).__name__
            raise ValueError(f"path: {'/'.join(parts)!r} not found: no {p!r} under {'/'.join(parts[:i]) or 'variables'} "
                             f"(has {have})")
        node = node[p]
    if hasattr(node, "keys"):
        raise ValueError(f"path: {'/'.join(parts)!r} names a collection of {sorted(node.keys())}, not one array")
    return node


def replace_weight(variables: dict, path: str | Sequence[str], weight: ArrayLike) -> dict:
    """A copy of ``variables`` with the array at ``path`` replaced (same shape required)."""
    parts = parse_path(path)
    old = get_weight(variables, path)
    if jnp.shape(weight) != jnp.shape(old):
        raise ValueError(f"weight: shape {jnp.shape(weight)} does not match {'/'.join(parts)!r}, {jnp.shape(old)}")
    variables = flax.core.unfreeze(variables) if isinstance(variables, flax.core.FrozenDict) else variables

    def put(node, i):
        node = dict(node)
        node[parts[i]] = weight if i == len(parts) - 1 else put(node[parts[i]], i + 1)
        return node

    return put(variables, 0)


# ---- the loss as a function of one weight ----------------------------------------------------------


def _check_batch(inputs) -> None:
    if jnp.ndim(inputs) < 2:
        raise ValueError(f"inputs: need a batch axis and a feature axis, got shape {tuple(jnp.shape(inputs))}")
    if jnp.shape(inputs)[0] < 2:
        raise ValueError(f"inputs: a batch of {jnp.shape(inputs)[0]} example(s) has no batch variance in training "
                         "mode; need >= 2")


def cross_entropy(logits: jax.Array, labels: ArrayLike) -> jnp.ndarray:
    """Mean softmax cross-entropy of ``logits`` ``(B, classes)`` with integer ``labels`` ``(B,)``: a scalar."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def weight_loss_fn(module: nn.Module, variables: dict, inputs: ArrayLike, labels: ArrayLike | None,
                   path: str | Sequence[str], *, train: bool | None, loss: Callable | None = None,
                   **apply_kwargs: Any) -> Callable[[jnp.ndarray], jnp.ndarray]:
    """``loss(W)``: the module's loss with the weight at ``path`` replaced by W; see the module docstring.

    ``train`` has no default: ``True`` is training mode (batch statistics; ``batch_stats`` is made mutable and its
    updates discarded, so the running estimates are neither used nor changed); ``train=False`` uses the
    running estimates. ``loss(outputs, labels)`` defaults to ``cross_entropy`` (then ``labels`` is needed);
    ``apply_kwargs`` go to ``module.apply`` (e.g. ``tau=...``). ``ValueError`` for a path that names no array,
    missing labels, or a batch of one in training mode.
    """
    model = applied(module, variables, "weight_loss_fn")
    model.train_kwargs(train)  # a train for a model without one: ValueError now
    get_weight(variables, path)  # validates the path
    if train:
        _check_batch(inputs)
    if loss is None:
        if labels is None:
            raise ValueError("labels: needed for the default cross-entropy loss (or pass loss=...)")
        loss = cross_entropy
    variables = {k: v for k, v in variables.items() if k != "intermediates"}
    mutable = ["batch_stats"] if "batch_stats" in variables else False

    def loss_fn(weight):
        out = model(replace_weight(variables, path, weight), inputs, train=train, mutable=mutable,
                           **apply_kwargs)
        outputs = out[0] if mutable else out
        return loss(outputs, labels)

    return loss_fn


# ---- the identities --------------------------------------------------------------------------------


def check_scale(a: ArrayLike) -> ArrayLike:
    """``a`` itself when every value is finite and > 0; else ``ValueError`` naming ``a``."""
    if not np.all(np.isfinite(a)) or np.any(np.asarray(a) <= 0):
        raise ValueError(f"a: the scale factor must be finite and > 0, got {a!r}")
    return a


def check_learning_rate(alpha: ArrayLike, setting: str = "alpha") -> None:
    """Raise ``ValueError`` naming ``setting`` unless every value of the learning rate is finite and >= 0."""
    if not np.all(np.isfinite(alpha)) or np.any(np.asarray(alpha) < 0):
        raise ValueError(f"{setting}: the learning rate must be finite and >= 0, got {alpha!r}")


def check_weight_decay(weight_decay: ArrayLike) -> None:
    """Raise ``ValueError`` naming ``weight_decay`` unless every value is finite and >= 0."""
    if not np.all(np.isfinite(weight_decay)) or np.any(np.asarray(weight_decay) < 0):
        raise ValueError(f"weight_decay: must be finite and >= 0, got {weight_decay!r}")


def _check_weights(weight) -> None:
    if not np.all(np.isfinite(np.asarray(weight))):
        raise ValueError("weights: not finite")
    if float(np.linalg.norm(np.asarray(weight, np.float64))) == 0.0:
        raise ValueError("weights: zero length; scale invariance needs a direction")


def scale_identities(loss_fn: Callable, weight: ArrayLike, a: float, alpha: float) -> dict:
    """Relative deviations from the four identities at ``weight``, scale ``a`` and learning rate ``alpha``.

    Returns floats: ``loss``, ``grad``, ``cosine``, ``step`` (see the module docstring), plus the raw values
    ``loss_w``, ``loss_aw``, ``grad_norm`` (|g| at W), ``grad_norm_aw``, ``weight_norm``, ``growth``
    (|W - alpha g|^2 - |W|^2) and ``predicted_growth`` (alpha^2 |g|^2), all in float64.
    """
    check_scale(a)
    check_learning_rate(alpha)
    if alpha == 0:
        raise ValueError("alpha: must be > 0 to measure a step")
    _check_weights(weight)
    vg = jax.value_and_grad(loss_fn)
    l_w, g_w = vg(jnp.asarray(weight))
    l_aw, g_aw = vg(a * jnp.asarray(weight))
    return identity_deviations(weight, a, alpha, l_w, g_w, l_aw, g_aw)


def identity_deviations(weight: ArrayLike, a: float, alpha: float, l_w: ArrayLike, g_w: ArrayLike, l_aw: ArrayLike,
                        g_aw: ArrayLike) -> dict:
    """``scale_identities`` from values already computed: the loss and gradient at W and at aW."""
    check_scale(a)
    check_learning_rate(alpha)
    if alpha == 0:
        raise ValueError("alpha: must be > 0 to measure a step")
    w = np.asarray(weight, np.float64)
    g = np.asarray(g_w, np.float64)
    gaw = np.asarray(g_aw, np.float64)
    l_w, l_aw = float(l_w), float(l_aw)
    gn = float(np.linalg.norm(g))
    if gn == 0.0:
        raise ValueError("loss_fn: the gradient at these weights is exactly zero; nothing to measure")
    wn = float(np.linalg.norm(w))
    growth = float(np.sum((w - alpha * g) ** 2) - np.sum(w ** 2))
    predicted = alpha ** 2 * gn ** 2
    return {
        "loss": abs(l_aw - l_w) / abs(l_w),
        "grad": float(np.linalg.norm(gaw - g / a) / np.linalg.norm(g / a)),
        "cosine": abs(float(np.sum(w * g))) / (wn * gn),
        "step": abs(growth - predicted) / predicted,
        "loss_w": l_w, "loss_aw": l_aw, "grad_norm": gn, "grad_norm_aw": float(np.linalg.norm(gaw)),
        "weight_norm": wn, "growth": growth, "predicted_growth": predicted,
    }


# ---- one step's geometry (jnp; jit/vmap) ---------------------------------------------------------


def angle_between(u: ArrayLike, v: ArrayLike) -> jnp.ndarray:
    """The angle between two arrays (flattened), in radians: ``2 atan2(|u^ - v^|, |u^ + v^|)``.

    Accurate for tiny angles, where ``arccos`` of the cosine loses everything below ~3e-4 rad in float32.
    """
    u = jnp.ravel(u) / jnp.linalg.norm(u)
    v = jnp.ravel(v) / jnp.linalg.norm(v)
    return 2.0 * jnp.arctan2(jnp.linalg.norm(u - v), jnp.linalg.norm(u + v))


def effective_learning_rate(alpha: ArrayLike, weight: ArrayLike) -> jnp.ndarray:
    """``alpha / |W|^2``: the rate at which SGD turns a scale-invariant weight, per unit gradient at |W| = 1."""
    return alpha / jnp.sum(jnp.square(weight))


def equivalent_learning_rate(alpha: ArrayLike, a: ArrayLike) -> ArrayLike:
    """The learning rate at W whose step points where a step at learning rate ``alpha`` from ``aW`` points."""
    check_scale(a)
    return alpha / a ** 2


def sgd_step_geometry(weight: jax.Array, grad: jax.Array, alpha: ArrayLike, weight_decay: ArrayLike = 0.0) -> dict:
    """One SGD step ``W' = W - alpha (g + weight_decay W)``, described; see the module docstring.

    Returns jnp scalars: ``norm_before``, ``norm_after``, ``angle`` (radians between W and W'),
    ``growth`` (|W'|^2 - |W|^2, computed as 2 W.d + |d|^2 with d = W' - W, without cancellation),
    ``predicted_growth`` (alpha^2 |g|^2), ``step_length`` (|d|), ``predicted_angle`` and
    ``effective_learning_rate`` (alpha / |W|^2), ``cosine`` (W.g / (|W| |g|)).
    """
    if jnp.shape(weight) != jnp.shape(grad):
        raise ValueError(f"grad: shape {jnp.shape(grad)} does not match the weights' {jnp.shape(weight)}")
    if not isinstance(alpha, jax.core.Tracer):
        check_learning_rate(alpha)
    if not isinstance(weight_decay, jax.core.Tracer):
        check_weight_decay(weight_decay)
    d = -alpha * (grad + weight_decay * weight)
    new = weight + d
    wn = jnp.linalg.norm(weight)
    gn = jnp.linalg.norm(grad)
    return {
        "norm_before": wn,
        "norm_after": jnp.linalg.norm(new),
        "angle": angle_between(weight, new),
        "growth": 2.0 * jnp.vdot(weight, d) + jnp.vdot(d, d),
        "predicted_growth": alpha ** 2 * gn ** 2,
        "step_length": jnp.linalg.norm(d),
        "predicted_angle": jnp.arctan2(alpha * gn, wn * (1.0 - alpha * weight_decay)),
        "effective_learning_rate": alpha / wn ** 2,
        "cosine": jnp.vdot(weight, grad) / (wn * gn),
    }


def step_geometry_from_update(before: jax.Array, after: jax.Array, alpha: ArrayLike,
                              weight_decay: ArrayLike = 0.0) -> dict:
    """``sgd_step_geometry`` recovered from the weights before and after one SGD step (the gradient is
    ``g = -(after - before) / alpha - weight_decay * before``); for recording inside a training loop."""
    grad = -(after - before) / alpha - weight_decay * before
    return sgd_step_geometry(before, grad, alpha, weight_decay)


__all__ = [
    "COLLECTIONS",
    "angle_between",
    "check_learning_rate",
    "check_scale",
    "check_weight_decay",
    "cross_entropy",
    "effective_learning_rate",
    "equivalent_learning_rate",
    "get_weight",
    "identity_deviations",
    "parse_path",
    "replace_weight",
    "scale_identities",
    "sgd_step_geometry",
    "step_geometry_from_update",
    "weight_loss_fn",
]

