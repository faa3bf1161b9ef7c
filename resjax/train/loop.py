"""Seed-vmapped training: ``make_train(config)`` returns a pure ``train(key, hparams) -> (state, metrics)``.

A run is ``epochs`` epochs of ``N // batch_size`` minibatch steps (the last partial batch of each epoch
is dropped, so every step has the same shape; each epoch draws a fresh permutation from
``fold_in(key, epoch)``, so a run does not depend on how it is chunked). Steps and epochs are
``lax.scan``; the whole run is one program:

    trainer = make_train(config)
    state, metrics = jax.jit(jax.vmap(trainer))(jax.random.split(key, 3))

``hparams`` holds the values a sweep may vary inside one program: ``learning_rate``, ``weight_decay``
(an L2 penalty on kernels, see ``sgd``) and (for models with ``scaling='tau'``) ``tau``. They are arrays, vmapped like the keys.

``trainer.sweep(keys, hparams, chunk_epochs=...)`` runs the same computation as jitted chunks of epochs
with a thin host loop between them (progress bar, logging); one chunk is the whole run as one program.
With more than one device the seeds are sharded across devices (``jax.sharding``, one mesh axis
``'seeds'``; nothing in the model names that axis, so BatchNorm never pools statistics across seeds);
when the seeds do not divide evenly, the last run is repeated to fill the devices and dropped from the
results. On a CPU, ``resjax.use_every_cpu_core()`` makes each core a device (the experiment and
benchmark entry points call it), which is how a sweep uses more than one core efficiently.

Divergence: a step whose loss or any gradient entry is non-finite marks its seed as diverged; from then on
that seed's state is frozen (``jnp.where``, no Python control flow), its epoch metrics are NaN, and
``diverged_epoch`` (1-based; -1 if never) records the epoch and ``diverged_step`` (1-based, counted over
the whole run) the step. Its seed-mates are unaffected.

Metrics per epoch: ``train_loss`` (mean minibatch loss over the epoch, training mode),
``train_error`` and ``test_error`` (fractions, evaluation mode, whole sets, after the epoch).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from resjax.data import Dataset, load_dataset
from resjax.nn import build_model
from resjax.train.state import TrainState, guarded_step

METRICS = ("train_loss", "train_error", "test_error")


def default_config() -> ml_collections.ConfigDict:
    """The training settings every experiment starts from (the lecture's MNIST-1D setup)."""
    c = ml_collections.ConfigDict()
    c.data = "mnist1d"
    c.model = ml_collections.ConfigDict({"kind": "plain_mlp", "width": 64, "depth": 8})
    c.batch_size = 100
    c.epochs = 300
    c.learning_rate = 0.005
    c.momentum = 0.0
    c.weight_decay = 0.0
    c.tau = ml_collections.FieldReference(None, field_type=float)
    return c


class Carry(NamedTuple):
    state: TrainState
    key: jax.Array
    epoch: jnp.ndarray  # epochs completed
    diverged_epoch: jnp.ndarray  # 1-based epoch of divergence, -1 if none


def _check(config) -> None:
    if config.learning_rate < 0:
        raise ValueError(f"learning_rate: must be >= 0, got {config.learning_rate}")
    if config.get("weight_decay", 0.0) < 0:
        raise ValueError(f"weight_decay: must be >= 0, got {config.weight_decay}")
    if not 0 <= config.momentum < 1:
        raise ValueError(f"momentum: must be in [0, 1), got {config.momentum}")
    for name in ("batch_size", "epochs"):
        v = config[name]
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: must be an integer >= 1, got {v!r}")


@dataclasses.dataclass(frozen=True, eq=False)
class Trainer:
    """The pure pieces of a training run; see the module docstring. Build with ``make_train``."""

    config: Any
    model: Any
    data: Dataset
    tx: optax.GradientTransformation
    uses_tau: bool

    # ---- pure functions (jit/vmap them) ------------------------------------------------------------

    def default_hparams(self) -> dict:
        hp = {"learning_rate": jnp.float32(self.config.learning_rate),
              "weight_decay": jnp.float32(self.config.get("weight_decay", 0.0))}
        if self.uses_tau:
            tau = self.config.get("tau")
            if tau is not None:
                hp["tau"] = jnp.float32(tau)
        return hp

    def _model_kwargs(self, hparams) -> dict:
        return {"tau": hparams["tau"]} if self.uses_tau and "tau" in hparams else {}

    def init(self, key, hparams=None) -> Carry:
        hparams = {**self.default_hparams(), **(hparams or {})}
        init_key, data_key = jax.random.split(key)
        x0 = jnp.asarray(self.data.x_train[: self.config.batch_size])
        variables = self.model.init(init_key, x0, train=False, **self._model_kwargs(hparams))
        params = variables["params"]
        opt_state = self.tx.init(params)
        for name in ("learning_rate", "weight_decay"):
            opt_state.hyperparams[name] = jnp.asarray(hparams[name], jnp.float32)
        state = TrainState(step=jnp.int32(0), params=params, batch_stats=variables.get("batch_stats", {}),
                           opt_state=opt_state)
        return Carry(state, data_key, jnp.int32(0), jnp.int32(-1))

    def loss_and_updates(self, params, batch_stats, x, y, hparams):
        variables = {"params": params, **({"batch_stats": batch_stats} if batch_stats else {})}
        logits, updates = self.model.apply(variables, x, train=True, mutable=["batch_stats"],
                                           **self._model_kwargs(hparams))
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss, updates.get("batch_stats", batch_stats)

    def error(self, state: TrainState, x, y, hparams) -> jnp.ndarray:
        logits = self.model.apply(state.variables(), x, train=False, **self._model_kwargs(hparams))
        return jnp.mean(jnp.argmax(logits, -1) != y)

    def train_step(self, carry: Carry, idx, hparams):
        state = carry.state
        x = jnp.asarray(self.data.x_train)[idx]
        y = jnp.asarray(self.data.y_train)[idx]
        grad_fn = jax.value_and_grad(self.loss_and_updates, has_aux=True)
        (loss, batch_stats), grads = grad_fn(state.params, state.batch_stats, x, y, hparams)
        state, diverged_epoch = guarded_step(state, self.tx, grads, loss, batch_stats, carry.diverged_epoch,
                                             carry.epoch)
        return carry._replace(state=state, diverged_epoch=diverged_epoch), loss

    def train_epoch(self, carry: Carry, hparams):
        n, b = len(self.data.y_train), self.config.batch_size
        steps = n // b
        perm = jax.random.permutation(jax.random.fold_in(carry.key, carry.epoch), n)
        batches = perm[: steps * b].reshape(steps, b)
        carry, losses = jax.lax.scan(lambda c, idx: self.train_step(c, idx, hparams), carry, batches)
        carry = carry._replace(epoch=carry.epoch + 1)
        nan_if_diverged = lambda v: jnp.where(carry.diverged_epoch >= 0, jnp.nan, v)  # noqa: E731
        metrics = {
            "train_loss": jnp.mean(losses),
            "train_error": self.error(carry.state, jnp.asarray(self.data.x_train), jnp.asarray(self.data.y_train), hparams),
            "test_error": self.error(carry.state, jnp.asarray(self.data.x_test), jnp.asarray(self.data.y_test), hparams),
        }
        return carry, {k: nan_if_diverged(v) for k, v in metrics.items()}

    def run_epochs(self, carry: Carry, hparams, num_epochs: int):
        """``num_epochs`` epochs as one ``lax.scan``; metrics have a leading epoch axis."""
        return jax.lax.scan(lambda c, _: self.train_epoch(c, hparams), carry, None, length=num_epochs)

    def __call__(self, key, hparams=None):
        """The whole run as one pure function: ``(state, metrics)``; metrics include ``diverged_epoch``."""
        hparams = self.default_hparams() if hparams is None else hparams
        carry, metrics = self.run_epochs(self.init(key, hparams), hparams, self.config.epochs)
        return carry.state, {**metrics, **divergence(carry)}

    # ---- host loop -----------------------------------------------------------------------------------

    def sweep(self, keys, hparams=None, chunk_epochs: int | None = None, progress: bool | str = False,
              callback: Callable[[int, dict], None] | None = None):
        """Every seed (and hparam setting) in one vmapped program, run in jitted chunks of epochs.

        ``keys``: ``(S,)`` PRNG keys. ``hparams``: dict of scalars or ``(S,)`` arrays (default: the
        config's). Returns ``(state, metrics)`` with numpy metrics of shape ``(S, epochs)`` and
        ``diverged_epoch`` and ``diverged_step`` of shape ``(S,)``. ``callback(epochs_done, metrics_so_far)`` runs after each chunk.
        """
        num = keys.shape[0]
        allowed = {"learning_rate", "weight_decay"} | ({"tau"} if self.uses_tau else set())
        unknown = set(hparams or {}) - allowed
        if unknown:
            raise ValueError(f"hparams: {sorted(unknown)} cannot vary in this program; allowed: {sorted(allowed)}")
        hp = {**self.default_hparams(), **(hparams or {})}
        for name, v in hp.items():
            v = np.asarray(v)
            if np.any(v < 0):
                raise ValueError(f"{name}: must be >= 0, got {v}")
            if v.ndim not in (0, 1) or (v.ndim == 1 and v.shape[0] != num):
                raise ValueError(f"hparams.{name}: must be a scalar or have one value per key ({num}), got shape {v.shape}")
        hp = {k: jnp.broadcast_to(jnp.asarray(v, jnp.float32), (num,)) for k, v in hp.items()}
        pad = (-num) % jax.device_count()  # repeat the last run so the seeds split evenly over devices
        if pad:
            keys, hp = jax.tree_util.tree_map(lambda a: jnp.concatenate([a, jnp.repeat(a[-1:], pad, 0)]), (keys, hp))
        keys, hp = shard_over_seeds((keys, hp))

        epochs = self.config.epochs
        chunk_epochs = epochs if chunk_epochs is None else max(1, min(chunk_epochs, epochs))
        carry = self._init_fn(keys, hp)
        chunks, done = [], 0
        bar = _progress(epochs, progress)
        while done < epochs:
            n = min(chunk_epochs, epochs - done)
            carry, metrics = self._chunk_fn(n)(carry, hp)
            chunks.append(jax.device_get(metrics))
            done += n
            if bar is not None:
                bar.update(n)
                last = chunks[-1]["train_error"][:, -1]
                bar.set_postfix(train_error=f"{np.mean(last[np.isfinite(last)]) if np.isfinite(last).any() else np.nan:.4f}")
            if callback is not None:
                callback(done, {k: v[:num] for k, v in _concat(chunks).items()})
        if bar is not None:
            bar.close()
        metrics = _concat(chunks)
        metrics.update(jax.device_get(divergence(carry)))
        keep = lambda a: a[:num]  # noqa: E731  (drop the padding runs)
        return jax.tree_util.tree_map(keep, carry.state), {k: keep(v) for k, v in metrics.items()}

    @functools.cached_property
    def _init_fn(self):
        return jax.jit(jax.vmap(self.init))

    @functools.lru_cache(maxsize=None)
    def _chunk_fn(self, num_epochs: int):
        run = jax.vmap(functools.partial(self.run_epochs, num_epochs=num_epochs))
        return jax.jit(run, donate_argnums=0)


def divergence(carry: Carry) -> dict:
    """``diverged_epoch`` and ``diverged_step`` (1-based; -1 if the run never diverged). A diverged
    state is frozen, so its step counter stopped at the last good step."""
    diverged = carry.diverged_epoch >= 0
    return {"diverged_epoch": carry.diverged_epoch,
            "diverged_step": jnp.where(diverged, carry.state.step + 1, -1)}


def _concat(chunks: list[dict]) -> dict:
    return {k: np.concatenate([c[k] for c in chunks], axis=1) for k in chunks[0]}


def _progress(total: int, progress: bool | str):
    if not progress:
        return None
    from tqdm.auto import tqdm

    desc = progress if isinstance(progress, str) else "epochs"
    return tqdm(total=total, desc=desc, unit="epoch", leave=False, disable=None)  # silent when not a terminal


def shard_over_seeds(tree):
    """Place arrays whose leading axis is the seed axis across all devices (replicated on one device).

    Only when the number of seeds divides evenly over the devices; otherwise the tree is returned as is.
    """
    devices = jax.devices()
    leaves = jax.tree_util.tree_leaves(tree)
    if len(devices) == 1 or not leaves or leaves[0].shape[0] % len(devices):
        return tree
    mesh = jax.sharding.Mesh(np.asarray(devices), ("seeds",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("seeds"))
    return jax.device_put(tree, sharding)


def _kernels(params):
    return jax.tree_util.tree_map_with_path(lambda path, _: getattr(path[-1], "key", None) == "kernel", params)


def sgd(learning_rate, weight_decay, momentum=None) -> optax.GradientTransformation:
    """SGD on ``g + weight_decay * W`` for every ``kernel`` (an L2 penalty on weights, not on biases or
    norm parameters; for plain SGD the same as decoupled decay by ``1 - learning_rate * weight_decay``)."""
    return optax.chain(optax.add_decayed_weights(weight_decay, mask=_kernels), optax.sgd(learning_rate, momentum))


def make_train(config, data: Dataset | None = None) -> Trainer:
    """A ``Trainer`` for ``config`` (see ``default_config``); ``data`` overrides ``config.data``.

    Validates every setting (``ValueError`` naming it) before anything is traced.
    """
    _check(config)
    data = load_dataset(config.data) if data is None else data
    if config.batch_size > len(data.y_train):
        raise ValueError(f"batch_size: {config.batch_size} exceeds the {len(data.y_train)} training examples")
    model_cfg = dict(config.model)
    model_cfg.setdefault("num_classes", data.num_classes)
    model = build_model(**model_cfg)
    uses_tau = getattr(model, "scaling", None) == "tau"
    tx = optax.inject_hyperparams(sgd, static_args="momentum")(
        learning_rate=config.learning_rate, weight_decay=config.get("weight_decay", 0.0),
        momentum=config.momentum or None)
    return Trainer(config=config, model=model, data=data, tx=tx, uses_tau=uses_tau)
