"""Training image models fed by a host data loader: ``make_image_train(config, model, train_source, ...)``.

Unlike ``make_train`` (MNIST-1D, the whole run one ``lax.scan``), image data sets do not fit in a program,
so epochs run on the host: each minibatch of ``train_source.epoch(...)`` goes through one jitted,
state-donating ``train_step``; after every epoch the model is evaluated on ``test_source`` (evaluation mode,
running BatchNorm statistics) and, every ``checkpoint_every`` epochs, the whole state is checkpointed::

    trainer = make_image_train(image_train_config(), model, train_source, test_source)
    state, history = trainer.fit(0)                                  # one run, seed 0
    state, history = trainer.fit([0, 1, 2], checkpoint_dir="ckpt")   # three seeds, one state with a seed axis

Seeds. ``init``/``fit`` take a seed integer, a list of them (a leading seed axis), a PRNG key, or keys of
shape ``(S,)``. Seed ``s`` initialises from ``jax.random.key(s)`` and reads the data in the order of
``source.epoch(epoch, ..., seed=s)``; a key ``k`` reads it with a seed integer drawn from ``k``. Several seeds
are trained together, one state with a leading seed axis, over ``source.stacked_epoch`` batches (row ``s`` is
seed ``s``'s own data order): one ``jax.vmap``-ed step on accelerators, the single-seed step per seed on the
CPU (``config.seed_axis``, ``seed_axis_mode``); nothing names the seed axis, so BatchNorm never pools
across seeds.

Determinism and exact resume. Every random number is a function of the state: the step's model RNG
(``rngs={'dropout': ...}``, for models that draw any) is ``fold_in(run_key, step)``, the data order and
augmentation are the loader's pure function of ``(seed, epoch)``, and the learning rate is the schedule of
the optimiser's step count over ``config.epochs`` (not over the ``epochs`` a ``fit`` call stops at). The
state (``ImageState``) holds parameters, ``batch_stats``, optimiser state, step, epoch, key, data seed,
divergence and the history so far, so a run stopped after ``k`` epochs and resumed from its checkpoint is
bit-identical to an unstopped one.

Divergence. A step whose loss or any gradient entry is non-finite marks its seed as diverged: from then on
its state is frozen (``jnp.where``), its epoch metrics are NaN, ``diverged_epoch`` (1-based; -1 if never)
and ``diverged_step`` record when; the other seeds go on, nothing raises, and ``fit`` stops early once every
seed has diverged.

Data parallelism. With ``mesh`` (``make_data_mesh()``: axis ``'data'``), each batch's example axis is
sharded over the devices and the state replicated; jit + GSPMD make BatchNorm's batch statistics and the
loss means global (see ``resjax.train.distributed``, also for several hosts). ``batch_size`` and
``eval_batch_size`` must be multiples of the mesh size.

History (``fit``'s second value, ``history(state)``): per epoch ``train_loss`` and ``train_acc`` (means over
the epoch's minibatches, training mode, i.e. batch statistics and augmentation), ``test_loss`` and
``test_acc`` (evaluation mode, the whole test set; NaN without ``test_source``) and ``lr`` (the rate of the
epoch's first step); per run ``best_test_acc`` (max over epochs), ``final_test_acc`` (the last epoch's),
``diverged_epoch``, ``diverged_step``, and ``epochs`` (completed). Arrays have a leading seed axis when the
state has one.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from resjax.train import distributed
from resjax.train.checkpoint import Checkpoints, _json
from resjax.train.distributed import make_data_mesh
from resjax.train.optim import check_optimizer, make_optimizer
from resjax.train.schedules import check_schedule, make_schedule
from resjax.train.state import TrainState, guarded_step

EPOCH_METRICS = ("train_loss", "train_acc", "test_loss", "test_acc", "lr")
_DATA_SEED_TAG = 0x64617461  # fold_in tag for drawing a data seed from a key


def image_train_config() -> ml_collections.ConfigDict:
    """Defaults: the CIFAR ResNet recipe of He et al. as the tau-ResNet repository runs it (SGD, momentum
    0.9, batch 128, learning rate 0.1 divided by 10 at epochs 100 and 150 of 200, weight decay 1e-4 on every
    parameter, flips and crops)."""
    c = ml_collections.ConfigDict()
    c.batch_size = 128
    c.eval_batch_size = 1000
    c.epochs = 200
    c.optimizer = "sgd"  # 'sgd' | 'adam'
    c.learning_rate = 0.1
    c.momentum = 0.9
    c.nesterov = False
    c.adam_b1 = 0.9
    c.adam_b2 = 0.999
    c.adam_eps = 1e-8
    c.weight_decay = 1e-4  # coupled L2, added to the gradient (PyTorch SGD's weight_decay)
    c.weight_decay_on = "all"  # 'all' | 'kernels'
    c.scalar_lr_factor = 1.0  # learning-rate factor for 0-d parameters (Fixup, tau-ResNet repos: 0.1)
    c.grad_clip_norm = 0.0  # global-norm clipping; 0 = off
    c.schedule = "step"  # 'constant' | 'step' | 'cosine'
    c.milestones = (100, 150)
    c.decay_factor = 0.1
    c.warmup_epochs = 0.0
    c.augment = True
    c.shuffle = True
    c.checkpoint_every = 10  # epochs; 0 = only at the end of each fit
    c.checkpoint_keep = 2
    c.seed = 0
    c.seed_axis = "auto"  # 'auto' | 'vmap' | 'unroll' | 'loop': how several seeds are stepped (seed_axis_mode)
    return c


class ImageState(NamedTuple):
    """Everything a run is, as one pytree (a leading seed axis on every leaf when several seeds)."""

    state: TrainState
    key: jax.Array  # typed PRNG key; the step's model RNG is fold_in(key, step)
    data_seed: jnp.ndarray  # int32: the loader's seed
    epoch: jnp.ndarray  # epochs completed
    diverged_epoch: jnp.ndarray  # 1-based, -1 if never
    history: dict  # name -> float32[config.epochs], NaN where not yet run


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _check_config(config) -> None:
    for name in ("batch_size", "eval_batch_size", "epochs"):
        v = config.get(name)
        if not _is_int(v) or v < 1:
            raise ValueError(f"{name}: must be an integer >= 1, got {v!r}")
    v = config.get("checkpoint_every", 0)
    if not _is_int(v) or v < 0:
        raise ValueError(f"checkpoint_every: must be an integer >= 0, got {v!r}")
    v = config.get("checkpoint_keep", 2)
    if v is not None and (not _is_int(v) or v < 1):
        raise ValueError(f"checkpoint_keep: must be an integer >= 1 or None, got {v!r}")
    v = config.get("seed", 0)
    if not _is_int(v) or not 0 <= v < 2**31:
        raise ValueError(f"seed: must be an integer in [0, 2**31), got {v!r}")
    seed_axis_mode(config)
    check_optimizer(config)


@dataclasses.dataclass(frozen=True, eq=False)
class ImageTrainer:
    """See the module docstring. Build with ``make_image_train``."""

    config: Any
    model: Any
    train_source: Any
    test_source: Any
    mesh: Any
    tx: optax.GradientTransformation
    schedule: Callable
    steps_per_epoch: int

    # ---- pure per-seed functions -------------------------------------------------------------------

    def _init_one(self, key, data_seed) -> ImageState:
        init_key, run_key = jax.random.split(key)
        x = jnp.zeros((2, *self.train_source.image_shape), jnp.float32)
        variables = self.model.init({"params": init_key, "dropout": jax.random.fold_in(init_key, 1)}, x, train=False)
        params = variables["params"]
        state = TrainState(step=jnp.int32(0), params=params, batch_stats=variables.get("batch_stats", {}),
                           opt_state=self.tx.init(params))
        history = {name: jnp.full((self.config.epochs,), jnp.nan, jnp.float32) for name in EPOCH_METRICS}
        return ImageState(state, run_key, jnp.asarray(data_seed, jnp.int32), jnp.int32(0), jnp.int32(-1), history)

    def _step_one(self, s: ImageState, images, labels):
        ts = s.state
        rng = jax.random.fold_in(s.key, ts.step)

        def loss_fn(params):
            variables = {"params": params, **({"batch_stats": ts.batch_stats} if ts.batch_stats else {})}
            logits, updates = self.model.apply(variables, images, train=True, mutable=["batch_stats"],
                                               rngs={"dropout": rng})
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            return loss, (logits, updates.get("batch_stats", ts.batch_stats))

        (loss, (logits, batch_stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(ts.params)
        ts, diverged_epoch = guarded_step(ts, self.tx, grads, loss, batch_stats, s.diverged_epoch, s.epoch)
        acc = jnp.mean(jnp.argmax(logits, -1) == labels)
        return s._replace(state=ts, diverged_epoch=diverged_epoch), (loss, acc)

    def _eval_one(self, s: ImageState, images, labels, mask):
        logits = self.model.apply(s.state.variables(), images, train=False)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
        return jnp.sum(jnp.where(mask, loss, 0.0)), jnp.sum(jnp.where(mask, correct, 0.0))

    def _end_epoch_one(self, s: ImageState, metrics: dict) -> ImageState:
        diverged = s.diverged_epoch >= 0
        history = {name: h.at[s.epoch].set(metrics[name] if name == "lr" else jnp.where(diverged, jnp.nan, metrics[name]))
                   for name, h in s.history.items()}
        return s._replace(epoch=s.epoch + 1, history=history)

    # ---- compiled versions (one per seed-axis choice) ---------------------------------------------

    def _jit(self, fn, donate: bool):
        kwargs = {"donate_argnums": 0} if donate else {}
        if self.mesh is not None:
            kwargs["out_shardings"] = distributed.replicated(self.mesh)
        return jax.jit(fn, **kwargs)

    def _over_seeds(self, name: str, fn, shared: int = 0):
        """``fn`` over a leading seed axis. ``config.seed_axis`` (see ``seed_axis_mode``): 'vmap' = one
        vmapped program; 'unroll' = one program holding one copy of ``fn`` per seed (a Python loop at trace
        time; not ``lax.map``, whose loop body is as slow on XLA:CPU as a scan over conv blocks); 'loop' =
        the single-seed program called once per seed (one compile; each seed's slice taken and the results
        stacked by small jitted programs). The last ``shared`` arguments have no seed axis."""
        mode = seed_axis_mode(self.config)
        if mode == "vmap":
            return self._jit(jax.vmap(fn, in_axes=(0,) + (None,) * shared) if shared else jax.vmap(fn),
                             donate=name == "step")

        def per_seed_calls(one, *args):
            seeded, common_args = args[:len(args) - shared], args[len(args) - shared:]
            num_seeds = jax.tree_util.tree_leaves(seeded[0])[0].shape[0]
            outs = [one(*(_take(a, i) for a in seeded), *common_args) for i in range(num_seeds)]
            return outs

        if mode == "unroll":
            return self._jit(lambda *args: _stack(*per_seed_calls(fn, *args)), donate=name == "step")
        one = self._compiled(name, False)
        return lambda *args: _stack_jit(*per_seed_calls(one, *args))

    @functools.cache
    def _compiled(self, name: str, seeded: bool):
        if name == "init":
            fn = jax.vmap(self._init_one) if seeded else self._init_one
            return self._jit(fn, donate=False)
        if name == "step":
            return self._over_seeds(name, self._step_one) if seeded else self._jit(self._step_one, donate=True)
        if name == "eval":
            return (self._over_seeds(name, self._eval_one, shared=3) if seeded
                    else self._jit(self._eval_one, donate=False))
        if name == "end_epoch":
            return self._jit(jax.vmap(self._end_epoch_one) if seeded else self._end_epoch_one, donate=True)
        raise KeyError(name)

    # ---- public API -------------------------------------------------------------------------------

    def init(self, key=None, num_seeds: int | None = None) -> ImageState:
        """A fresh state. ``key``: a seed integer (default ``config.seed``), a list of seed integers, a
        PRNG key or PRNG keys of shape ``(S,)``. With ``num_seeds`` (or a list / ``(S,)`` keys) every leaf
        has a leading seed axis: seed integers ``key, key+1, ...``, or ``jax.random.split(key, num_seeds)``."""
        keys, data_seeds, seeded = self._keys(key, num_seeds)
        return self.train_state(keys, data_seeds, seeded)

    def train_state(self, keys, data_seeds, seeded: bool) -> ImageState:
        return self._compiled("init", seeded)(keys, jnp.asarray(data_seeds, jnp.int32))

    def train_step(self, state: ImageState, images, labels):
        """One donated, jitted step on a placed batch; returns ``(state, (loss, acc))``."""
        return self._compiled("step", _seeded(state))(state, images, labels)

    def evaluate(self, state: ImageState, source=None, batch_size: int | None = None) -> dict:
        """``{'loss', 'acc'}`` over the whole of ``source`` (default: ``test_source``) in evaluation mode
        (running BatchNorm statistics, no augmentation); one value per seed. The last partial batch is
        padded to ``batch_size`` (default ``config.eval_batch_size``) and masked, so one program serves."""
        source = self.test_source if source is None else source
        if source is None:
            raise ValueError("source: no test_source to evaluate on")
        batch_size = self.config.eval_batch_size if batch_size is None else batch_size
        if not _is_int(batch_size) or batch_size < 1:
            raise ValueError(f"batch_size: must be an integer >= 1, got {batch_size!r}")
        _check_divides("batch_size", batch_size, self.mesh)
        fn = self._compiled("eval", _seeded(state))
        loss_sum = correct = 0.0
        count = 0
        for images, labels in source.epoch(0, batch_size, seed=0, shuffle=False, augment=False, drop_remainder=False):
            images, labels = np.asarray(images, np.float32), np.asarray(labels, np.int32)
            n = len(labels)
            mask = np.arange(batch_size) < n
            if n < batch_size:
                images = np.concatenate([images, np.zeros((batch_size - n, *images.shape[1:]), np.float32)])
                labels = np.concatenate([labels, np.zeros(batch_size - n, np.int32)])
            l, c = fn(state, *(self._place(a, seeded=False) for a in (images, labels, mask)))
            loss_sum, correct, count = loss_sum + l, correct + c, count + n
        if count == 0:
            raise ValueError("source: the evaluation source yielded no examples")
        return {"loss": loss_sum / count, "acc": correct / count}

    def fit(self, keys_or_state=None, *, epochs: int | None = None, checkpoint_dir=None, resume: bool = True,
            progress: bool | str | Callable[[int, dict], None] | None = None):
        """Train until ``epochs`` (default ``config.epochs``) epochs are done; returns ``(state, history)``.

        ``keys_or_state``: what ``init`` takes, or an ``ImageState`` to continue. ``checkpoint_dir``: save
        every ``config.checkpoint_every`` epochs and when the call ends; with ``resume`` and a checkpoint
        there, continue from the newest one (when it is further along than the state given; it must come
        from the same seeds). ``resume=False`` refuses a directory that already holds checkpoints.
        ``progress``: True or a label for a tqdm bar, or ``callback(epochs_done, summary)`` (the epoch's
        metrics as numpy arrays). A state passed in is consumed: the first step donates its buffers.
        """
        epochs = self.config.epochs if epochs is None else epochs
        if not _is_int(epochs) or not 1 <= epochs <= self.config.epochs:
            raise ValueError(f"epochs: must be an integer in [1, config.epochs={self.config.epochs}], got {epochs!r}")
        state = keys_or_state if isinstance(keys_or_state, ImageState) else self.init(keys_or_state)
        seeded = _seeded(state)
        num_seeds = int(state.epoch.shape[0]) if seeded else None
        ckpt = None
        if checkpoint_dir is not None:
            ckpt = Checkpoints(checkpoint_dir, keep=self.config.get("checkpoint_keep", 2))
            if ckpt.latest() is not None:
                if not resume:
                    raise ValueError(f"checkpoint_dir: {ckpt.directory} already holds checkpoints; pass resume=True "
                                     "or use an empty directory")
                state = self._resume(ckpt, state, num_seeds)
        data_seeds = np.atleast_1d(np.asarray(jax.device_get(state.data_seed))).tolist()
        done = int(np.max(jax.device_get(state.epoch)))
        every = self.config.get("checkpoint_every", 0)
        bar = _progress(epochs, done, progress)
        end_epoch = self._compiled("end_epoch", seeded)
        try:
            while done < epochs and not np.all(np.asarray(jax.device_get(state.diverged_epoch)) >= 0):
                losses, accs = [], []
                for images, labels in self._batches(done, data_seeds, seeded):
                    state, (loss, acc) = self.train_step(state, self._place(images, seeded), self._place(labels, seeded))
                    losses.append(loss)
                    accs.append(acc)
                if not losses:
                    raise ValueError("batch_size: the training source yielded no full batch")
                metrics = {"train_loss": jnp.mean(jnp.stack(losses), 0), "train_acc": jnp.mean(jnp.stack(accs), 0)}
                shape = metrics["train_loss"].shape
                if self.test_source is not None:
                    ev = self.evaluate(state)
                    metrics["test_loss"], metrics["test_acc"] = ev["loss"], ev["acc"]
                else:
                    metrics["test_loss"] = metrics["test_acc"] = jnp.full(shape, jnp.nan, jnp.float32)
                metrics["lr"] = jnp.full(shape, self.learning_rate(done), jnp.float32)
                state = end_epoch(state, metrics)
                done += 1
                if ckpt is not None and every and done % every == 0:
                    self._save(ckpt, state, done, num_seeds)
                if bar is not None:
                    bar(done, {k: np.asarray(jax.device_get(v)) for k, v in metrics.items()})
        finally:
            if bar is not None:
                bar.close()
        if ckpt is not None:
            if ckpt.latest() != done:
                self._save(ckpt, state, done, num_seeds)
            ckpt.close()
        return state, self.history(state)

    def learning_rate(self, epoch: int) -> float:
        """The learning rate of the first step of ``epoch`` (0-based)."""
        return float(self.schedule(epoch * self.steps_per_epoch))

    def history(self, state: ImageState) -> dict:
        """The run's history so far as numpy arrays (see the module docstring)."""
        epoch, hist, diverged, step = jax.device_get((state.epoch, state.history, state.diverged_epoch, state.state.step))
        done = int(np.max(epoch))
        out = {name: np.asarray(v)[..., :done] for name, v in hist.items()}
        acc = out["test_acc"]
        finite = np.isfinite(acc)
        out["best_test_acc"] = np.where(finite.any(-1), np.max(np.where(finite, acc, -np.inf), -1), np.nan)
        out["final_test_acc"] = acc[..., -1] if done else np.full(np.shape(diverged), np.nan)
        out["diverged_epoch"] = np.asarray(diverged)
        out["diverged_step"] = np.where(np.asarray(diverged) >= 0, np.asarray(step) + 1, -1)
        out["epochs"] = done
        return out

    # ---- host helpers -----------------------------------------------------------------------------

    def _keys(self, key, num_seeds):
        if num_seeds is not None and (not _is_int(num_seeds) or num_seeds < 1):
            raise ValueError(f"num_seeds: must be an integer >= 1, got {num_seeds!r}")
        key = self.config.get("seed", 0) if key is None else key
        if _is_int(key) or (isinstance(key, (list, tuple)) or (isinstance(key, np.ndarray) and key.dtype.kind in "iu")):
            if _is_int(key):
                seeded = num_seeds is not None
                ints = [int(key) + i for i in range(num_seeds or 1)]
            else:
                ints = [int(k) for k in np.asarray(key).reshape(-1)]
                seeded = True
                if not ints or (num_seeds is not None and num_seeds != len(ints)):
                    raise ValueError(f"num_seeds: {num_seeds} does not match the {len(ints)} seeds given")
            if any(not 0 <= i < 2**31 for i in ints):
                raise ValueError(f"seed: seed integers must be in [0, 2**31), got {ints}")
            keys = jnp.stack([jax.random.key(i) for i in ints])
            data_seeds = np.asarray(ints, np.int32)
            return (keys if seeded else keys[0]), (data_seeds if seeded else data_seeds[0]), seeded
        if not (hasattr(key, "dtype") and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)):
            raise ValueError(f"key: expected a seed integer, a list of them or a typed PRNG key (jax.random.key), got {key!r}")
        if key.ndim == 0 and num_seeds is not None:
            key = jax.random.split(key, num_seeds)
        elif key.ndim == 1 and num_seeds is not None and key.shape[0] != num_seeds:
            raise ValueError(f"num_seeds: {num_seeds} does not match the {key.shape[0]} keys given")
        elif key.ndim > 1:
            raise ValueError(f"key: expected one key or a 1-d array of keys, got shape {key.shape}")
        seeded = key.ndim == 1
        draw = lambda k: (jax.random.bits(jax.random.fold_in(k, _DATA_SEED_TAG), (), jnp.uint32) >> 1).astype(jnp.int32)
        data_seeds = np.asarray(jax.device_get(jax.vmap(draw)(key) if seeded else draw(key)))
        return key, data_seeds, seeded

    def _batches(self, epoch: int, data_seeds: list, seeded: bool):
        kw = {"shuffle": bool(self.config.get("shuffle", True)), "augment": bool(self.config.get("augment", False)),
              "drop_remainder": True}
        b, src = self.config.batch_size, self.train_source
        if not seeded:
            yield from src.epoch(epoch, b, seed=int(data_seeds[0]), **kw)
            return
        if not hasattr(src, "stacked_epoch"):  # one loader per seed, stacked here
            for batch in zip(*(src.epoch(epoch, b, seed=int(s), **kw) for s in data_seeds)):
                yield np.stack([x for x, _ in batch]), np.stack([y for _, y in batch])
            return
        out = src.stacked_epoch(epoch, b, [int(s) for s in data_seeds], **kw)
        if isinstance(out, tuple) and len(out) == 2 and np.ndim(out[0]) in (5, 6):  # the whole epoch at once
            images, labels = np.asarray(out[0]), np.asarray(out[1])
            if images.ndim == 5:  # [S, steps * B, H, W, C]
                steps = images.shape[1] // b
                images = images[:, : steps * b].reshape(images.shape[0], steps, b, *images.shape[2:])
                labels = labels[:, : steps * b].reshape(labels.shape[0], steps, b)
            for i in range(images.shape[1]):
                yield images[:, i], labels[:, i]
            return
        yield from out

    def _place(self, x, seeded: bool):
        """A host batch as a device array: sharded over the mesh's 'data' axis (example axis), else plain."""
        x = np.asarray(x)
        if self.mesh is None:
            return jnp.asarray(x)
        sharding = distributed.batch_sharding(self.mesh, seeded)
        return distributed.global_batch(distributed.host_block(x, 1 if seeded else 0), sharding, x.shape)

    def _config_dict(self) -> dict:
        return self.config.to_dict() if hasattr(self.config, "to_dict") else dict(self.config)

    def _meta(self, state: ImageState, done: int, num_seeds) -> dict:
        return {"epoch": done, "num_seeds": num_seeds, "data_seeds": np.asarray(jax.device_get(state.data_seed)),
                "config": self._config_dict(),
                "history": {k: v for k, v in self.history(state).items()}}

    def _save(self, ckpt: Checkpoints, state: ImageState, done: int, num_seeds) -> None:
        ckpt.save(done, state, self._meta(state, done, num_seeds))

    def _resume(self, ckpt: Checkpoints, state: ImageState, num_seeds) -> ImageState:
        meta = ckpt.meta()
        saved, ours = _resume_config(meta.get("config", {})), _resume_config(self._config_dict())
        if saved != ours:
            changed = sorted(k for k in set(saved) | set(ours) if saved.get(k) != ours.get(k))
            raise ValueError(f"checkpoint_dir: the checkpoint in {ckpt.directory} was made with other settings "
                             f"({', '.join(changed)}); resuming needs the same config. Use another directory.")
        if meta.get("num_seeds") != num_seeds:
            raise ValueError(f"checkpoint_dir: the checkpoint in {ckpt.directory} has num_seeds="
                             f"{meta.get('num_seeds')}, this run {num_seeds}")
        if int(meta["epoch"]) <= int(np.max(jax.device_get(state.epoch))):
            return state
        restored = ckpt.restore(state)
        same = (np.array_equal(jax.device_get(restored.data_seed), jax.device_get(state.data_seed))
                and np.array_equal(jax.device_get(jax.random.key_data(restored.key)),
                                   jax.device_get(jax.random.key_data(state.key))))
        if not same:
            raise ValueError(f"checkpoint_dir: the checkpoint in {ckpt.directory} was made from other seeds; "
                             "use another directory, or resume=False with an empty one")
        return restored


SEED_AXIS_MODES = ("auto", "vmap", "unroll", "loop")


def seed_axis_mode(config) -> str:
    """How a seed axis runs the training and evaluation steps: ``config.seed_axis`` 'vmap', 'unroll',
    'loop' or 'auto' = 'loop' on the CPU, 'vmap' elsewhere (see ``ImageTrainer._over_seeds``).

    Vmapping a convolution over seeds makes one grouped convolution (each seed its own kernels), which
    XLA:CPU runs about 4x slower than the seeds one after another; unrolling the seeds into one program
    runs at the sequential speed but multiplies the compile time by the number of seeds (``benchmarks.resnet``
    measures all three: ResNet-56, 4 seeds, 2-core CPU). On accelerators the vmapped program is the one to
    use. All modes give the same numbers to float tolerance (tested)."""
    mode = config.get("seed_axis", "auto")
    if mode not in SEED_AXIS_MODES:
        raise ValueError(f"seed_axis: unknown value {mode!r}; choose one of {SEED_AXIS_MODES}")
    if mode == "auto":
        return "loop" if jax.default_backend() == "cpu" else "vmap"
    return mode


RESUME_FREE = ("checkpoint_every", "checkpoint_keep")  # settings a resumed run may change


def _resume_config(config: dict) -> dict:
    """The settings that must match for an exact resume, JSON-normalised (tuples as lists)."""
    return {k: v for k, v in _json(dict(config)).items() if k not in RESUME_FREE}


def _take(tree, i: int):
    return _take_jit(tree, jnp.int32(i))


@jax.jit
def _take_jit(tree, i):
    return jax.tree_util.tree_map(lambda a: a[i], tree)


def _stack(*trees):
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *trees)


_stack_jit = jax.jit(_stack)


def _seeded(state: ImageState) -> bool:
    return np.ndim(state.epoch) == 1


def _check_divides(name: str, value: int, mesh) -> None:
    n = distributed.data_size(mesh)
    if value % n:
        raise ValueError(f"{name}: {value} does not split evenly over the {n} devices of the mesh's 'data' axis")


class _Bar:
    def __init__(self, total, done, progress):
        self.callback = progress if callable(progress) else None
        self.tqdm = None
        if self.callback is None:
            from tqdm.auto import tqdm

            desc = progress if isinstance(progress, str) else "epochs"
            self.tqdm = tqdm(total=total, initial=done, desc=desc, unit="epoch", leave=False, disable=None)

    def __call__(self, done, summary):
        if self.callback is not None:
            self.callback(done, summary)
        else:
            self.tqdm.update(1)
            loss, acc = summary["train_loss"], summary["test_acc"]
            self.tqdm.set_postfix(train_loss=f"{np.nanmean(loss) if np.isfinite(loss).any() else np.nan:.4f}",
                                  test_acc=f"{np.nanmean(acc) if np.isfinite(acc).any() else np.nan:.4f}")

    def close(self):
        if self.tqdm is not None:
            self.tqdm.close()


def _progress(total, done, progress):
    return None if not progress else _Bar(total, done, progress)


def make_image_train(config, model, train_source, test_source=None, *, mesh=None) -> ImageTrainer:
    """An ``ImageTrainer`` for ``model`` on ``train_source`` (see the module docstring and
    ``image_train_config``). ``mesh``: a ``jax.sharding.Mesh`` with axis ``'data'`` (``make_data_mesh()``)
    for data parallelism, or None for one device. Validates every setting (``ValueError`` naming it)
    before anything is traced."""
    _check_config(config)
    if mesh is not None and distributed.DATA_AXIS not in mesh.shape:
        raise ValueError(f"mesh: needs an axis named {distributed.DATA_AXIS!r}, got axes {tuple(mesh.shape)}")
    if config.batch_size > train_source.num_examples:
        raise ValueError(f"batch_size: {config.batch_size} exceeds the {train_source.num_examples} training examples")
    _check_divides("batch_size", config.batch_size, mesh)
    _check_divides("eval_batch_size", config.eval_batch_size, mesh)
    steps = train_source.num_batches(config.batch_size, drop_remainder=True)
    check_schedule(config, steps)
    schedule = make_schedule(config, steps)
    x = jax.ShapeDtypeStruct((2, *train_source.image_shape), jnp.float32)
    params = jax.eval_shape(lambda k, x: model.init(k, x, train=False)["params"], jax.random.key(0), x)  # traced, not compiled
    tx = make_optimizer(config, params, steps)
    return ImageTrainer(config=config, model=model, train_source=train_source, test_source=test_source, mesh=mesh,
                        tx=tx, schedule=schedule, steps_per_epoch=int(steps))


__all__ = ["EPOCH_METRICS", "ImageState", "ImageTrainer", "image_train_config", "make_data_mesh", "make_image_train"]
