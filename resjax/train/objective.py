"""The objective of a run: the loss the trainers minimise, the metrics they record, and what the targets must be.

Both feeders take it the same way, by name in the config or as your own functions::

    make_train(config, data)                                  # train.loss = 'cross_entropy' (the default)
    config.train.loss, config.train.label_smoothing = "cross_entropy", 0.1
    make_train(config, data, loss="mse")                      # regression on float targets [N, K]
    make_train(config, data, loss=my_loss, metrics={"top5_error": top_k_error(5)})
    make_image_train(config, train_source, test_source, loss=my_loss, metrics=...)

A loss is ``loss(outputs, targets) -> per-example losses`` (shape ``(B,)``): ``outputs`` is what the model's
``apply`` returns for a batch (logits, or any array or pytree of your model's), ``targets`` the batch's rows of
the data's ``y`` (integer class labels, soft labels, regression values: any dtype and shape your loss accepts).
The trainers average it over the batch (training) or sum it over a split (evaluation). A loss may ask for more by
keyword-only arguments, found by their names:

* ``intermediates``: the model's sown values (``self.sow('intermediates', ...)``; the model is applied with the
  ``'intermediates'`` collection mutable), for an auxiliary term on an inner representation::

      def loss(outputs, targets, *, intermediates):
          ce = optax.softmax_cross_entropy_with_integer_labels(outputs, targets)
          h = intermediates["blocks_0"]["out"][0]             # a sown [B, D] activation
          return ce + 1e-3 * jnp.mean(h ** 2, axis=-1)          # per example

* ``hparams``: the run's traced hyperparameters (``label_smoothing``, ``learning_rate``, ...), the values a grid
  varies inside one program.

A metric is ``metric(outputs, targets) -> per-example values`` (``(B,)``; bools count as 0/1), with the same
optional keywords. Each metric ``m`` is recorded per epoch as ``batch_m`` (the mean over the epoch's
minibatches, training mode), ``train_m`` (the whole training set in evaluation mode: on-device feeder; NaN from the
host feeder, which does not re-read the training set) and ``test_m`` (the test set in evaluation mode), next to
``train_loss`` and ``test_loss``: in the history, the grid's frame and ``metrics.jsonl``.

Built in by name (``train.loss`` or ``loss=``):

  'cross_entropy'  softmax cross-entropy of logits ``[B, C]`` against integer labels ``[B]`` (exactly
                   ``optax.softmax_cross_entropy_with_integer_labels``, bit-identical to resjax before objectives
                   existed) or against probabilities ``[B, C]`` (soft labels). With ``train.label_smoothing`` > 0,
                   or a ``label_smoothing`` in ``hparams`` (a traced value: a grid axis), the targets are
                   ``optax.smooth_labels`` of the one-hot labels. Metric: ``error`` (the argmax is not the label, or
                   not the soft label's argmax).
  'mse'            the mean over each example's values of ``(outputs - targets) ** 2``; targets of exactly the
                   outputs' per-example shape (a regression target of one value per example is ``[N, 1]``). No
                   built-in metric.

Built-in metrics by name (``metrics={'name': 'top5_error'}`` or ``metrics=('top5_error',)``): ``error``,
``top5_error`` (``top_k_error(k)`` for another k), ``mse``, ``mae``.

What is checked before any training (``Objective.check``, ``ValueError`` naming the array or setting): integer
targets of a classification objective as class labels (``resjax.data.check_labels``); other targets finite; the
loss and each metric evaluated on the shapes of a batch (``jax.eval_shape``) must give one value per example; the
'mse' targets must have the outputs' per-example shape (no silent broadcasting).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import keyword
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = ["LOSSES", "METRIC_FUNCTIONS", "Objective", "cross_entropy", "error", "make_objective",
           "mean_squared_error", "top_k_error"]


# ---- built-in losses and metrics (per example) ---------------------------------------------------------------

def _is_int(targets: Any) -> bool:
    return jnp.issubdtype(jnp.asarray(targets).dtype, jnp.integer)


def cross_entropy(outputs: jax.Array, targets: jax.Array, *, hparams: Mapping | None = None) -> jax.Array:
    """Per-example softmax cross-entropy of ``outputs`` (logits ``[B, C]``) against integer labels ``[B]`` or
    probabilities ``[B, C]``; label smoothing when ``hparams`` holds ``label_smoothing``."""
    smoothing = None if hparams is None else hparams.get("label_smoothing")
    if smoothing is None and _is_int(targets):
        return optax.softmax_cross_entropy_with_integer_labels(outputs, targets)
    probs = jax.nn.one_hot(targets, outputs.shape[-1], dtype=outputs.dtype) if _is_int(targets) else targets
    if smoothing is not None:
        probs = optax.smooth_labels(probs, jnp.asarray(smoothing, probs.dtype))
    return optax.softmax_cross_entropy(outputs, probs)


def mean_squared_error(outputs: jax.Array, targets: jax.Array) -> jax.Array:
    """Per-example mean over each example's values of ``(outputs - targets) ** 2``."""
    d = jnp.asarray(outputs) - jnp.asarray(targets, jnp.result_type(outputs))
    return jnp.mean(jnp.reshape(d * d, (d.shape[0], -1)), axis=-1)


def _mean_absolute_error(outputs: jax.Array, targets: jax.Array) -> jax.Array:
    d = jnp.abs(jnp.asarray(outputs) - jnp.asarray(targets, jnp.result_type(outputs)))
    return jnp.mean(jnp.reshape(d, (d.shape[0], -1)), axis=-1)


def error(outputs: jax.Array, targets: jax.Array) -> jax.Array:
    """Per example, whether the argmax of ``outputs`` misses the label (or the soft label's argmax): a bool."""
    labels = targets if _is_int(targets) else jnp.argmax(targets, -1)
    return jnp.argmax(outputs, -1) != labels


def top_k_error(k: int) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """The metric "the label is not among the ``k`` largest outputs" (per example, a bool)."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"top_k_error: k must be an integer >= 1, got {k!r}")

    def top_k(outputs: jax.Array, targets: jax.Array) -> jax.Array:
        labels = targets if _is_int(targets) else jnp.argmax(targets, -1)
        _, best = jax.lax.top_k(outputs, min(int(k), outputs.shape[-1]))
        return ~jnp.any(best == labels[:, None], axis=-1)

    top_k.__name__ = top_k.__qualname__ = f"top{int(k)}_error"
    return top_k


#: The losses known by name: name -> (loss, its default metrics, whether integer targets are class labels).
LOSSES = {"cross_entropy": (cross_entropy, ("error",), True), "mse": (mean_squared_error, (), False)}
#: The metrics known by name.
METRIC_FUNCTIONS = {"error": error, "top5_error": top_k_error(5), "mse": mean_squared_error,
                    "mae": _mean_absolute_error}


# ---- the objective --------------------------------------------------------------------------------------------

def _keywords(fn: Callable) -> frozenset:
    """Which of the optional keywords (``intermediates``, ``hparams``) ``fn`` takes."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(k for k in ("intermediates", "hparams") if k in params)


def _describe(fn: Callable) -> str:
    if isinstance(fn, functools.partial):
        return f"partial({_describe(fn.func)}, ...)"
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


@dataclasses.dataclass(frozen=True, eq=False)
class Objective:
    """A loss and named metrics (see the module docstring); build with :func:`make_objective`.

    Attributes:
        loss: ``loss(outputs, targets, [*, intermediates, hparams]) -> (B,)``.
        metrics: name -> ``metric(outputs, targets, [...]) -> (B,)``, in the order they are recorded.
        name: the loss's name (a built-in's, or the function's qualified name), recorded with checkpoints.
        classes: whether integer targets are class labels (checked as such before training).
        smoothing: whether the loss reads ``hparams['label_smoothing']`` (the built-in cross-entropy).
    """

    loss: Callable
    metrics: Mapping[str, Callable]
    name: str
    classes: bool = True
    smoothing: bool = False

    @functools.cached_property
    def _needs(self) -> dict:
        return {name: _keywords(fn) for name, fn in (("loss", self.loss), *self.metrics.items())}

    @property
    def needs_intermediates(self) -> bool:
        """Whether the loss or a metric reads the model's sown ``intermediates``."""
        return any("intermediates" in k for k in self._needs.values())

    @property
    def metric_names(self) -> tuple[str, ...]:
        """The per-epoch history names: ``train_loss``, ``batch_<m>``, ``train_<m>``, ``test_loss``, ``test_<m>``
        for each metric, ``lr`` (the default objective's are ``resjax.train.core.METRICS``)."""
        ms = tuple(self.metrics)
        return ("train_loss", *(f"batch_{m}" for m in ms), *(f"train_{m}" for m in ms), "test_loss",
                *(f"test_{m}" for m in ms), "lr")

    def describe(self) -> str:
        """A text recorded with checkpoints: the loss and the metrics by name (a resume compares it)."""
        return f"loss={self.name}; metrics=" + ",".join(f"{k}:{_describe(f)}" for k, f in self.metrics.items())

    def _call(self, which: str, fn: Callable, outputs, targets, intermediates, hparams):
        kw = {}
        if "intermediates" in self._needs[which]:
            kw["intermediates"] = intermediates if intermediates is not None else {}
        if "hparams" in self._needs[which]:
            kw["hparams"] = hparams if hparams is not None else {}
        return fn(outputs, targets, **kw)

    def per_example_loss(self, outputs: Any, targets: jax.Array, intermediates: Any = None,
                         hparams: Mapping | None = None) -> jax.Array:
        """The loss of each example, ``(B,)``."""
        return self._call("loss", self.loss, outputs, targets, intermediates, hparams)

    def per_example_metrics(self, outputs: Any, targets: jax.Array, intermediates: Any = None,
                            hparams: Mapping | None = None) -> dict:
        """Each metric's per-example values, ``name -> (B,)``."""
        return {m: self._call(m, fn, outputs, targets, intermediates, hparams) for m, fn in self.metrics.items()}

    # ---- checks before training ----------------------------------------------------------------------------

    def check(self, apply_outputs: Callable[[jax.ShapeDtypeStruct], Any], example_shape: tuple, y: Any,
              name: str = "data.y_train", hparams: Mapping | None = None) -> None:
        """``ValueError`` (naming ``name`` or ``loss``/``metrics.<m>``) unless the loss and every metric, evaluated
        on the shapes of a batch of 2 (``apply_outputs(x) -> (outputs, intermediates)`` under ``jax.eval_shape``),
        give one value per example; 'mse' targets must have the outputs' per-example shape; non-integer targets
        must be finite."""
        y = np.asarray(y)
        if y.ndim == 0 or len(y) == 0:
            raise ValueError(f"{name}: want one target per example (a leading example axis), got shape {y.shape}")
        if y.dtype == np.bool_ or y.dtype.kind not in "iuf":
            raise ValueError(f"{name}: want integer labels or floating targets, got dtype {y.dtype}")
        if y.dtype.kind == "f":
            bad = ~np.isfinite(y.reshape(len(y), -1)).all(axis=1)
            if bad.any():
                i = int(np.argmax(bad))
                raise ValueError(f"{name}: example {i} has a non-finite target; refusing to train on it")
        x = jax.ShapeDtypeStruct((2, *example_shape), jnp.float32)
        t = jax.ShapeDtypeStruct((2, *y.shape[1:]), jnp.int32 if y.dtype.kind in "iu" else jnp.float32)
        outputs, inter = jax.eval_shape(apply_outputs, x)  # the model traced once; the functions on its shapes
        if self.loss is mean_squared_error:
            out = jax.tree_util.tree_leaves(outputs)
            if len(out) != 1 or tuple(out[0].shape[1:]) != tuple(y.shape[1:]):
                shapes = [tuple(o.shape[1:]) for o in out]
                fix = "; give one target per example as [N, 1]" if y.ndim == 1 and shapes == [(1,)] else ""
                raise ValueError(f"{name}: targets of per-example shape {tuple(y.shape[1:])} for the loss 'mse', but "
                                 f"the model's outputs are {shapes[0] if len(shapes) == 1 else shapes} per example: "
                                 f"they must be equal (no broadcasting){fix}")
        if self.loss is cross_entropy and y.dtype.kind == "f":
            out = jax.tree_util.tree_leaves(outputs)
            if len(out) != 1 or tuple(out[0].shape[1:]) != tuple(y.shape[1:]):
                hint = " (convert whole-valued float labels with .astype(int))" if y.ndim == 1 else ""
                raise ValueError(f"{name}: floating targets of per-example shape {tuple(y.shape[1:])} for the loss "
                                 "'cross_entropy', which takes integer class labels [N] or probabilities of the "
                                 f"outputs' per-example shape {tuple(out[0].shape[1:]) if out else ()}{hint}")
        hp = {k: jax.ShapeDtypeStruct((), jnp.float32) for k in (hparams or {})}
        for which, fn in (("loss", self.loss), *((f"metrics.{m}", f) for m, f in self.metrics.items())):
            key = "loss" if which == "loss" else which.split(".", 1)[1]
            try:
                v = jax.eval_shape(lambda o, t, i, h: self._call(key, fn, o, t, i, h), outputs, t, inter, hp)
            except Exception as e:  # noqa: BLE001  (a user's function: its own error, named and explained)
                raise ValueError(f"{which}: fails on the model's outputs ({_shapes(outputs)}) and targets of "
                                 f"{name} ({t.dtype.name}{list(t.shape)}): {type(e).__name__}: {e}") from e
            if not (isinstance(v, jax.ShapeDtypeStruct) and v.shape == (2,)):
                raise ValueError(f"{which}: must return one value per example, shape (B,); on a batch of 2 it "
                                 f"returned {_shapes(v)} (return the per-example values, not their mean)")


def _shapes(tree: Any) -> str:
    leaves = jax.tree_util.tree_leaves(tree)
    if len(leaves) == 1 and not isinstance(tree, (dict, list, tuple)):
        return f"{leaves[0].dtype}{list(leaves[0].shape)}"
    return str(jax.tree_util.tree_map(lambda a: f"{a.dtype}{list(a.shape)}", tree))


def make_objective(train: Any = None, loss: str | Callable | None = None,
                   metrics: Mapping[str, str | Callable] | tuple | list | None = None) -> Objective:
    """The run's objective: ``loss`` (a built-in's name or your function; default ``train.loss``, else
    'cross_entropy') with its built-in metrics plus ``metrics`` (name -> function or built-in name, or a tuple of
    built-in names; the same name replaces a built-in one). ``ValueError`` naming the setting for an unknown name,
    a metric name that is not an identifier or clashes with ``loss``, or a label smoothing outside [0, 1)."""
    cfg_loss = train.get("loss", "cross_entropy") if train is not None else "cross_entropy"
    smoothing = float(train.get("label_smoothing", 0.0)) if train is not None else 0.0
    loss = cfg_loss if loss is None else loss
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"train.label_smoothing: must be in [0, 1), got {smoothing!r}")
    if isinstance(loss, str):
        if loss not in LOSSES:
            raise ValueError(f"loss: unknown loss {loss!r}; choose one of {sorted(LOSSES)} or pass a function "
                             "loss(outputs, targets) -> per-example losses")
        fn, defaults, classes = LOSSES[loss]
        name, built = loss, {m: METRIC_FUNCTIONS[m] for m in defaults}
    elif callable(loss):
        fn, name, built, classes = loss, _describe(loss), {}, True
    else:
        raise ValueError(f"loss: want a built-in name or a function, got {loss!r}")
    if smoothing and fn is not cross_entropy:
        raise ValueError(f"train.label_smoothing: {smoothing} is for the loss 'cross_entropy', not {name!r}")
    if metrics is None:
        metrics = {}
    elif isinstance(metrics, (tuple, list)):
        metrics = {m: m for m in metrics}
    elif not isinstance(metrics, Mapping):
        raise ValueError(f"metrics: want a mapping name -> function (or a tuple of built-in names), got {metrics!r}")
    out = dict(built)
    for m, f in metrics.items():
        if not isinstance(m, str) or not m.isidentifier() or keyword.iskeyword(m) or m == "loss":
            raise ValueError(f"metrics: {m!r} is not a usable metric name (an identifier other than 'loss')")
        if isinstance(f, str):
            if f not in METRIC_FUNCTIONS:
                raise ValueError(f"metrics.{m}: unknown metric {f!r}; choose one of {sorted(METRIC_FUNCTIONS)} or "
                                 "pass a function metric(outputs, targets) -> per-example values")
            f = METRIC_FUNCTIONS[f]
        if not callable(f):
            raise ValueError(f"metrics.{m}: want a function or a built-in name, got {f!r}")
        out[m] = f
    return Objective(fn, out, name, classes=classes, smoothing=fn is cross_entropy)
