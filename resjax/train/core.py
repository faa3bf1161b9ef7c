"""The one training core that both feeders share.

A run is a ``RunState`` (``resjax.train.state``); the core turns it over with pure functions that jit and
vmap over seeds:

* ``init_run(key, data_seed, hparams)``: parameters from ``split(key)[0]``, the run key ``split(key)[1]``,
  the optimiser (``make_optimizer``: one builder, learning rate and weight decay injected per seed);
* ``train_step(run, (x, y), hparams)``: one minibatch in training mode (``batch_stats`` updated), the
  optimiser step and the divergence freeze (``guarded_step``: a seed whose loss or gradient becomes
  non-finite keeps its last good state; its seed-mates go on); returns ``(run, (loss, batch_error))``;
* ``eval_sums(run, x, y, mask, hparams)``: summed loss and wrong predictions in evaluation mode;
* ``end_epoch(run, metrics)``: the epoch's metrics into the history (NaN once diverged), ``epoch + 1``.

``hparams`` holds the values a sweep may vary inside one program (``HPARAMS``): ``learning_rate`` and
``weight_decay`` (written into the optimiser state at ``init_run``), for models with ``scaling='tau'``,
``tau`` (passed to ``model.apply``), and the optimiser settings a trainer traces (``Core.traced``, made by
``with_traced``: ``momentum``, ``adam_b1``, ``adam_b2``; written into the optimiser state like the rate). A
trainer traces none of the last by default, so its program is the one it always was; a grid
(``resjax.train.grid``) asks for those it varies. A trainer that packs depths or widths (``with_packed_depths``,
``with_packed_widths``; ``resjax.train.packing``) takes ``active_depth`` (passed to ``model.apply``; the blocks
past it are kept as they were after each step) and ``active_width`` (which network ``init_run`` draws).
Random numbers are functions of the state: the model's
``dropout`` stream is ``fold_in(key, step)``; data order is the feeder's function of ``(key or data_seed, epoch)``.

Metrics, one vocabulary for both feeders (``METRICS``; per epoch, NaN once a run has diverged):

  train_loss    mean minibatch loss over the epoch (training mode)
  batch_error   mean minibatch error over the epoch (training mode: batch statistics, augmentation)
  train_error   error on the whole training set in evaluation mode after the epoch (on-device feeder;
                NaN from the host feeder, which does not re-read the training set)
  test_loss, test_error   the whole test set in evaluation mode after the epoch
  lr            the learning rate of the epoch's first step

``history(run)`` adds per run ``best_test_error`` (min over epochs), ``final_test_error``,
``diverged_epoch`` and ``diverged_step`` (1-based; -1 if never) and ``epochs`` (completed). Errors are
fractions. The on-device feeder's ``train_error`` is what the lecture calls training error.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import types
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.typing import ArrayLike

from resjax.train.checkpoint import (CheckpointError, Checkpoints, _json, check_free_space, describe_model,
                                     estimated_size, same_model_description)
from resjax.train.config import check_train_config, is_int, step_periods
from resjax.train.distributed import is_main_process, to_host
from resjax.train.lock import DirectoryLock
from resjax.train.monitor import Progress, progress_bar
from resjax.train.objective import Objective, make_objective
from resjax.train.optim import make_optimizer
from resjax.train.schedules import float_dtype, make_schedule
from resjax.train.state import ModelState, RunState, guarded_step

__all__ = ["ADDED", "HPARAMS", "HPARAM_SETTINGS", "METRICS", "RESUME_FREE", "Core", "Progress",
           "check_run_config", "check_targets",
           "config_dict", "divergence",
           "progress_bar", "resume_config", "run_config", "seed_handles", "with_hyperparams"]

#: The per-epoch metrics of a run's history (see the module docstring).
METRICS = ("train_loss", "batch_error", "train_error", "test_loss", "test_error", "lr")
#: The values ``hparams`` may vary inside one program (``tau`` only for models with ``scaling='tau'``; ``momentum``,
#: ``adam_b1``, ``adam_b2`` where the optimiser has them, in a trainer that traces them: ``Core.with_traced``).
HPARAMS = ("learning_rate", "weight_decay", "tau", "momentum", "adam_b1", "adam_b2", "label_smoothing")
#: The config setting each of ``HPARAMS`` stands for (its value when a run is given none).
HPARAM_SETTINGS = {"learning_rate": "train.learning_rate", "weight_decay": "train.weight_decay", "tau": "model.tau",
                   "momentum": "train.momentum", "adam_b1": "train.adam_b1", "adam_b2": "train.adam_b2",
                   "label_smoothing": "train.label_smoothing"}
#: Each hyperparameter's range: ``(low, high, low_open)`` (``high`` excluded; None: no bound); the others' is ``>= 0``.
_HPARAM_RANGES = {"tau": (0.0, None, True), "momentum": (0.0, 1.0, False), "adam_b1": (0.0, 1.0, False),
                  "adam_b2": (0.0, 1.0, False), "label_smoothing": (0.0, 1.0, False)}
#: Settings a resumed run may change: when checkpoints are made and which epochs are evaluated (neither changes the
#: training).
RESUME_FREE = ("train.checkpoint_every", "train.checkpoint_keep", "train.eval_every")
# (``train.eval_every_steps`` is not free: in a step run it is the length of a history entry)
_DATA_SEED_TAG = 0x64617461  # fold_in tag for drawing a data seed from a key


def run_config(model: Any = None, train: ml_collections.ConfigDict | None = None,
               data: Any = None) -> ml_collections.ConfigDict:
    """A run config: ``model`` (a mapping of ``build_model`` settings, e.g. ``dict(kind='residual_mlp', ...)``),
    ``train`` (default ``train_config()``) and ``data`` (the on-device feeder's data set name, for
    ``resjax.data.load_dataset``). ``model`` and ``data`` are left out when None."""
    from resjax.train.config import train_config

    c = ml_collections.ConfigDict()
    if data is not None:
        c.data = data
    if model is not None:
        c.model = ml_collections.ConfigDict(dict(model))
    c.train = train if train is not None else train_config()
    return c


def config_dict(config: Any) -> dict:
    """``config`` as a plain dict (``ConfigDict.to_dict()``, or ``dict(config)``)."""
    return config.to_dict() if hasattr(config, "to_dict") else dict(config)


@dataclasses.dataclass(frozen=True, eq=False)
class Core:
    """The pure pieces of a run shared by both feeders (see the module docstring)."""

    config: Any  # the run config: ``config.train`` (and ``config.model`` when the model was built by name)
    model: Any
    tx: optax.GradientTransformation
    example_shape: tuple  # one example's shape, for ``model.init``
    uses_tau: bool
    steps_per_epoch: int
    # the trainers' own optimiser, schedule and parameter groups (``make_optimizer``'s keywords), if any
    optim: dict = dataclasses.field(default_factory=dict)
    # the loss and metrics (``resjax.train.objective``); None: ``config.train.loss`` and its built-in metrics
    objective: Objective | None = None

    @functools.cached_property
    def obj(self) -> Objective:
        """The run's objective: ``objective``, or the one ``config.train`` names."""
        return self.objective if self.objective is not None else make_objective(self.config.train)

    @property
    def metric_names(self) -> tuple[str, ...]:
        """The history's per-epoch metrics, in order (``METRICS`` for the default objective)."""
        return self.obj.metric_names

    # the optimiser settings traced besides the learning rate and weight decay (``with_traced``)
    traced: tuple = ()
    # the make_* function's arguments other than the config (``with_config`` rebuilds with them)
    make_args: dict = dataclasses.field(default_factory=dict, repr=False)
    # the depths of the runs packed into this program (``with_packed_depths``; ``resjax.train.packing``)
    packed_depths: tuple = ()
    # the widths of the runs packed into this program (``with_packed_widths``; ``resjax.train.packing``)
    packed_widths: tuple = ()
    # the packed program scans a stack that the config unrolls (``_packed``; ``resjax.train.packing.scanned``)
    packed_unrolled: bool = False
    # a shallower network's initial draws are the first blocks of a deeper one's (``packing.draws_are_prefixes``)
    packed_prefix: bool = False

    # ---- hyper-parameters ---------------------------------------------------------------------------

    def default_hparams(self) -> dict:
        """The config's ``learning_rate`` and ``weight_decay`` (and each setting of ``traced``) as scalars of the
        default float dtype (float64 under ``jax_enable_x64``): the ``hparams`` of a run given none."""
        t = self.config.train
        dtype = float_dtype()
        out = {"learning_rate": jnp.asarray(t.learning_rate, dtype),
               "weight_decay": jnp.asarray(t.get("weight_decay", 0.0), dtype)}
        for name in self.traced:
            out[name] = jnp.asarray(self.setting(HPARAM_SETTINGS[name]), dtype)
        if self.obj.smoothing and t.get("label_smoothing", 0.0):
            out["label_smoothing"] = jnp.asarray(t.label_smoothing, dtype)
        if self.packed_depths:
            out["active_depth"] = jnp.asarray(max(self.packed_depths), dtype)
        if self.packed_widths:
            out["active_width"] = jnp.asarray(max(self.packed_widths), dtype)
        return out

    def setting(self, path: str) -> Any:
        """The config's value at the dotted ``path`` (``'train.momentum'``); ``KeyError`` when there is none."""
        node = self.config
        for part in path.split("."):
            if not hasattr(node, "keys") or part not in node:
                raise KeyError(path)
            node = node[part]
        return node

    def hparam_names(self) -> tuple[str, ...]:
        """The names ``hparams`` may hold in this program: ``learning_rate`` (unless the optimiser is your own
        ``GradientTransformation`` object), ``weight_decay``, ``tau`` (a model with ``scaling='tau'``),
        ``label_smoothing`` (the built-in cross-entropy) and ``traced``."""
        names = ("learning_rate",) * (not self.own_rate) + ("weight_decay",) + ("tau",) * self.uses_tau
        names += ("active_depth",) * bool(self.packed_depths) + ("active_width",) * bool(self.packed_widths)
        return names + ("label_smoothing",) * self.obj.smoothing + tuple(self.traced)

    def traceable(self, name: str) -> bool:
        """Whether ``name`` (one of ``HPARAMS``) can vary inside this trainer's program, as it is or traced
        (``with_traced``)."""
        from resjax.train.optim import traceable

        return name in self.hparam_names() or name in traceable(self.config.train, self.optim.get("optimizer"))

    def with_traced(self, names: Sequence[str]) -> Core:
        """This trainer with the optimiser settings ``names`` (``momentum``, ``adam_b1``, ``adam_b2``; others of
        ``HPARAMS`` are traced already and ignored here) injected into the optimiser state, so that ``hparams``
        may vary them per run. The same training as the constant setting (``resjax.train.optim``); a trainer
        that traces none is the plain one (itself)."""
        from resjax.train.optim import TRACEABLE

        traced = tuple(n for n in HPARAMS if n in TRACEABLE and n in set(names) | set(self.traced))
        unknown = [n for n in names if n not in HPARAMS]
        if unknown:
            raise ValueError(f"hparams: {unknown} are not hyperparameters a program can trace; choose from {HPARAMS}")
        if traced == tuple(self.traced):
            return self
        return dataclasses.replace(self, traced=traced, tx=self._optimizer(self.config, traced))

    def with_packed_depths(self, depths: Sequence[int]) -> Core:
        """This trainer, its model built at the largest of ``depths``, training runs of each of ``depths`` in one
        program: ``hparams['active_depth']`` per run (``resjax.train.packing``: each run as the network of its depth
        trained alone, to float rounding). ``ValueError`` naming ``active_depth`` when the depth does not pack
        (``packing.packable``)."""
        return self._packed(depths, self.packed_widths)

    def with_packed_widths(self, widths: Sequence[int]) -> Core:
        """This trainer, its model built at the largest of ``widths``, training runs of each of ``widths`` in one
        program: ``hparams['active_width']`` per run (``resjax.train.packing``: a narrower run's units past its width
        are zero and stay zero). ``ValueError`` naming ``active_width`` when the width does not pack
        (``packing.packable_width``)."""
        return self._packed(self.packed_depths, widths)

    def _packed(self, depths: Sequence[int], widths: Sequence[int]) -> Core:
        from resjax.train.packing import KINDS, draws_are_prefixes, packable, packable_width, sized

        given = self.make_args.get("model") is not None
        for name, values, check in (("active_depth", depths, packable), ("active_width", widths, packable_width)):
            why = "a model given as an object" if given else check(self.config, self.optim)
            if values and why is not None:
                raise ValueError(f"{name}: this trainer's {name[7:]} cannot be packed: {why}")
            if values and (not all(is_int(v) for v in values) or min(values) < 1):
                raise ValueError(f"{name}: packed {name[7:]}s must be integers >= 1, got {list(values)}")
        depths, widths = tuple(sorted({int(d) for d in depths})), tuple(sorted({int(w) for w in widths}))
        config = sized(self.config, depths[-1] if depths else None, widths[-1] if widths else None)
        unrolled = self.packed_unrolled or bool(depths) and not config.model.get("scan", False)
        prefix = bool(depths) and draws_are_prefixes(self.model.clone(scan=False) if unrolled else self.model,
                                                     KINDS[config.model.kind], self.example_shape)
        if unrolled:  # one scanned block in the program, not one per depth (resjax.train.packing.scanned)
            config.model.scan = True
        t = self if config.to_dict() == self.config.to_dict() else self.with_config(config)
        return dataclasses.replace(t, packed_depths=depths, packed_widths=widths, packed_unrolled=unrolled,
                                   packed_prefix=prefix)

    def with_config(self, config: Any) -> Core:
        """This trainer rebuilt for ``config`` from the arguments it was made with (data, model or model factory,
        optimiser, schedule, parameter groups, hooks), tracing the same settings (``traced``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be rebuilt with another config")

    def _optimizer(self, config: Any, traced: Sequence[str] | None = None) -> optax.GradientTransformation:
        """``make_optimizer`` for ``config`` and this trainer's model, steps, own optimiser pieces and ``traced``."""
        x = jax.ShapeDtypeStruct((2, *self.example_shape), jnp.float32)
        params = jax.eval_shape(lambda k, x: self.model.init(k, x, train=False)["params"], jax.random.key(0), x)
        traced = self.traced if traced is None else traced
        return make_optimizer(config.train, params, self.steps_per_epoch, traced=traced, warn=False, **self.optim)

    @property
    def own_rate(self) -> bool:
        """Whether the optimiser is a user's ``GradientTransformation`` object, which holds its own rate."""
        return isinstance(self.optim.get("optimizer"), optax.GradientTransformation)

    def check_hparams(self, hparams: dict | None, num: int | None = None) -> dict:
        """``hparams`` merged over the defaults, validated (``ValueError`` naming the entry), as arrays of the
        default float dtype; with ``num``, broadcast to ``(num,)``."""
        allowed = set(self.hparam_names())
        unknown = set(hparams or {}) - allowed
        if unknown:
            why = ("; the optimiser given as a GradientTransformation holds its own learning rate (pass a factory "
                   "lambda learning_rate: ... to vary it)" if self.own_rate and "learning_rate" in unknown else "")
            later = sorted(n for n in unknown if n not in self.traced and self.traceable(n))
            if later:
                why += f"; {later} can vary in a trainer that traces them (trainer.with_traced({later}), or a grid)"
            raise ValueError(f"hparams: {sorted(unknown)} cannot vary in this program; allowed: {sorted(allowed)}{why}")
        hp = {**self.default_hparams(), **(hparams or {})}
        for name, v in hp.items():
            v = np.asarray(v)
            if not np.all(np.isfinite(v)):
                raise ValueError(f"hparams.{name}: must be finite (NaN and infinities are refused), got {v}")
            low, high, low_open = _HPARAM_RANGES.get(name, (0.0, None, False))
            if np.any(v <= low if low_open else v < low) or (high is not None and np.any(v >= high)):
                span = f"{'>' if low_open else '>='} {low:g}" + ("" if high is None else f" and < {high:g}")
                raise ValueError(f"hparams.{name}: must be {span}, got {v}")
            if name == "momentum" and np.any(v == 0):
                t = self.config.train
                if t.get("nesterov", False) or t.get("optimizer", "sgd") in ("nesterov", "momentum"):
                    raise ValueError(f"hparams.momentum: optimizer {t.get('optimizer')!r} (nesterov="
                                     f"{t.get('nesterov', False)}) needs momentum > 0, got {v}")
            if name in ("active_depth", "active_width"):
                from resjax.train.packing import check_packed

                check_packed(name, v, self.packed_depths if name == "active_depth" else self.packed_widths)
            if num is not None and (v.ndim not in (0, 1) or (v.ndim == 1 and v.shape[0] != num)):
                raise ValueError(f"hparams.{name}: must be a scalar or have one value per key ({num}), got shape {v.shape}")
        dtype = float_dtype()
        if num is None:
            return {k: jnp.asarray(v, dtype) for k, v in hp.items()}
        return {k: jnp.broadcast_to(jnp.asarray(v, dtype), (num,)) for k, v in hp.items()}

    def run_hparams(self, run: RunState, hparams: dict | None = None) -> dict:
        """The ``hparams`` of an existing run state: its optimiser state's ``learning_rate``,
        ``weight_decay`` and traced settings (per run with a seed axis) and ``hparams``' ``tau``. An optimiser
        value in ``hparams`` must equal the state's (``ValueError`` naming it): a state keeps the settings it
        was made with."""
        given = self.check_hparams(hparams, run.num_runs)
        # host copies: the state's own buffers are donated by the next step
        names = ("learning_rate", "weight_decay", *self.traced)
        own = {k: np.asarray(to_host(run.state.opt_state.hyperparams[k])) for k in names}
        for k, v in own.items():
            if hparams and k in hparams and not np.array_equal(to_host(given[k]), v):
                raise ValueError(f"hparams.{k}: the run state given was made with {v}, not {to_host(given[k])}; "
                                 "a run keeps its settings (start a new run to change them)")
        return {**own, **{k: v for k, v in given.items() if k not in own}}  # tau, label_smoothing

    def model_kwargs(self, hparams: dict | None) -> dict:
        """The extra keyword arguments of ``model.apply``: ``{'tau': hparams['tau']}`` for a model with
        ``scaling='tau'`` when ``hparams`` holds a tau, and ``active_depth`` (default: the largest) in a trainer
        that packs depths."""
        out = {"tau": hparams["tau"]} if self.uses_tau and hparams and "tau" in hparams else {}
        if self.packed_depths:
            out["active_depth"] = (hparams or {}).get("active_depth", max(self.packed_depths))
        return out

    def with_epochs(self, epochs: int) -> Core:
        """This trainer for runs of ``epochs`` epochs in all (``config.train.epochs = epochs``, the optimiser's
        schedule over that many): what ``fit(..., epochs=E)`` past ``config.train.epochs`` extends a run with.
        The learning rate of every step is then that of an ``epochs``-epoch run: for a constant or step
        schedule (milestones are epochs) the steps already taken had the same rates, so an extended run equals
        a run configured for ``epochs`` from the start; a cosine schedule (or one with warm-up over a fraction
        of the run) is re-timed, and the extension goes on at the longer run's rate of each step."""
        if not is_int(epochs) or epochs < 1:
            raise ValueError(f"epochs: must be an integer >= 1, got {epochs!r}")
        config = ml_collections.ConfigDict(self.config.to_dict())
        config.train.epochs = int(epochs)
        longer = dataclasses.replace(self, config=config, tx=self._optimizer(config))
        object.__setattr__(longer, "_extends", True)  # its checkpoints may come from the shorter run (check_checkpoint)
        return longer

    def extend_history(self, run: RunState) -> RunState:
        """``run`` with its history arrays padded with NaN to ``config.train.epochs`` entries (a run made for
        fewer epochs, continued by ``with_epochs``); a run made for more is refused."""
        length = jax.tree_util.tree_leaves(run.history)[0].shape[-1]
        total = self.num_epochs
        if length == total:
            return run
        if length > total:
            raise ValueError(f"epochs: the run was made for {length} epochs, more than config.train.epochs={total}")
        def pad(h):
            return jnp.concatenate([h, jnp.full((*h.shape[:-1], total - length), jnp.nan, h.dtype)], -1)

        return run._replace(history={k: pad(v) for k, v in run.history.items()})

    # ---- pure per-run functions ---------------------------------------------------------------------

    def init_run(self, key: jax.Array, data_seed: ArrayLike = 0, hparams: dict | None = None) -> RunState:
        """A fresh ``RunState`` from one typed PRNG key (see the module docstring).

        Parameters and ``batch_stats`` come from ``model.init`` with ``split(key)[0]`` (``train=False``, two
        zero examples), the run's key is ``split(key)[1]``; the optimiser state holds ``hparams``' learning
        rate and weight decay (default: the config's); epoch 0, not diverged, every history entry NaN.
        ``data_seed``: the host data source's seed, kept in the state.
        """
        hparams = {**self.default_hparams(), **(hparams or {})}
        init_key, run_key = jax.random.split(key)
        x = jnp.zeros((2, *self.example_shape), jnp.float32)
        rngs = {"params": init_key, "dropout": jax.random.fold_in(init_key, 1)}
        model = self.model.clone(scan=False) if self.packed_unrolled else self.model  # the config's own layout
        variables = model.init(rngs, x, train=False, **self.model_kwargs(hparams))
        if self.packed_depths or self.packed_widths:  # drawn as the run's own network draws them (packing)
            from resjax.train.packing import KINDS, embed, scanned

            field = KINDS[self.config.model.kind]
            top_d, top_w = max(self.packed_depths, default=None), max(self.packed_widths, default=None)
            depth, width = hparams.get("active_depth", top_d), hparams.get("active_width", top_w)
            chosen = variables
            # where a shallower network's draws are a deeper one's first blocks, the largest depth's draws serve
            # every depth (the blocks past a run's depth are never used): one network per width, not per depth
            for d in (None,) if self.packed_prefix else self.packed_depths or (None,):
                for w in self.packed_widths or (None,):
                    if d in (None, top_d) and w in (None, top_w):  # the largest network: drawn above
                        continue
                    sizes = {**({field: d} if d is not None else {}), **({"width": w} if w is not None else {})}
                    alone = model.clone(**sizes).init(rngs, x, train=False)
                    this = (depth == d if d is not None else True) & (width == w if w is not None else True)
                    chosen = jax.tree_util.tree_map(lambda a, c: jnp.where(this, a, c), embed(alone, variables),
                                                    chosen)
            variables = scanned(chosen, top_d) if self.packed_unrolled else chosen
        params = variables["params"]
        opt_state = with_hyperparams(self.tx.init(params), hparams)
        state = ModelState(step=jnp.int32(0), params=params, batch_stats=variables.get("batch_stats", {}),
                           opt_state=opt_state)
        history = {name: jnp.full((self.num_epochs,), jnp.nan, jnp.float32) for name in self.metric_names}
        return RunState(state, run_key, jnp.asarray(data_seed, jnp.int32), jnp.int32(0), jnp.int32(-1), history)

    def train_step(self, run: RunState, batch: tuple[jax.Array, jax.Array],
                   hparams: dict | None = None) -> tuple[RunState, tuple[jax.Array, dict]]:
        """One minibatch ``(x, y)``: ``(run, (loss, metrics))``, ``metrics`` the objective's batch means by name
        (``{'error': ...}`` by default; see the module docstring)."""
        x, y = batch
        ts = run.state
        rng = jax.random.fold_in(run.key, ts.step)
        kwargs = self.model_kwargs(hparams)
        obj = self.obj
        mutable = ["batch_stats", "intermediates"] if obj.needs_intermediates else ["batch_stats"]

        def loss_fn(params):
            variables = {"params": params, **({"batch_stats": ts.batch_stats} if ts.batch_stats else {})}
            outputs, updates = self.model.apply(variables, x, train=True, mutable=mutable,
                                                rngs={"dropout": rng}, **kwargs)
            inter = updates.get("intermediates")
            loss = obj.per_example_loss(outputs, y, inter, hparams).mean()
            return loss, (outputs, updates.get("batch_stats", ts.batch_stats), inter)

        (loss, (outputs, batch_stats, inter)), grads = jax.value_and_grad(loss_fn, has_aux=True)(ts.params)
        ts, diverged_epoch = guarded_step(ts, self.tx, grads, loss, batch_stats, run.diverged_epoch, run.epoch)
        if self.packed_depths:  # the blocks past the run's depth stay as they were (resjax.train.packing)
            from resjax.train.packing import keep_inactive

            ts = keep_inactive(ts, run.state, self.model_kwargs(hparams)["active_depth"])
        metrics = {m: jnp.mean(v) for m, v in obj.per_example_metrics(outputs, y, inter, hparams).items()}
        return run._replace(state=ts, diverged_epoch=diverged_epoch), (loss, metrics)

    def eval_sums(self, run: RunState, x: jax.Array, y: jax.Array, mask: jax.Array | None = None,
                  hparams: dict | None = None) -> tuple[jax.Array, dict]:
        """``(loss sum, {metric: sum})`` over the examples of ``x`` where ``mask`` (evaluation mode)."""
        obj = self.obj
        if obj.needs_intermediates:
            outputs, updates = self.model.apply(run.state.variables(), x, train=False, mutable=["intermediates"],
                                                **self.model_kwargs(hparams))
            inter = updates.get("intermediates")
        else:
            outputs, inter = self.model.apply(run.state.variables(), x, train=False, **self.model_kwargs(hparams)), None

        def total(v):
            v = v.astype(jnp.float32) if v.dtype == jnp.bool_ else v
            return jnp.sum(v) if mask is None else jnp.sum(jnp.where(mask, v, 0.0))

        per = obj.per_example_metrics(outputs, y, inter, hparams)
        return total(obj.per_example_loss(outputs, y, inter, hparams)), {m: total(v) for m, v in per.items()}

    def epoch_learning_rate(self, run: RunState) -> jax.Array:
        """The learning rate of the first step of the run's current epoch (its own base rate); NaN for a
        user's ``GradientTransformation``, whose rate resjax does not know."""
        if self.own_rate:
            return jnp.float32(jnp.nan)
        base = run.state.opt_state.hyperparams["learning_rate"]
        schedule = make_schedule(self.config.train, self.steps_per_epoch, base, self.optim.get("schedule"))
        return schedule(run.epoch * self.steps_per_epoch)

    @property
    def num_epochs(self) -> int:
        """The entries of a run's history: ``config.train.epochs``, or a step run's evaluation periods
        (``resjax.train.config.step_periods``; then every "epoch" of this class is a period of
        ``steps_per_epoch`` steps)."""
        periods = step_periods(self.config.train)
        return self.config.train.epochs if periods is None else periods[0]

    @property
    def is_step_run(self) -> bool:
        """Whether the run is counted in steps (``config.train.steps > 0``)."""
        return step_periods(self.config.train) is not None

    def evaluated(self, epoch: ArrayLike) -> ArrayLike:
        """Whether the run is evaluated after its 1-based ``epoch`` (``config.train.eval_every``): every k-th
        epoch and the last."""
        k = self.config.train.get("eval_every", 1)
        return (epoch % k == 0) | (epoch == self.num_epochs)

    def skip_epoch(self, run: RunState) -> RunState:
        """The epoch of a run that has diverged, without training it: the state stays as it is (as every
        step of a diverged run keeps it) and the history gets the epoch's learning rate and NaN elsewhere,
        so the result equals a trained epoch's bit for bit (``guarded_step``)."""
        return self.end_epoch(run, {"lr": self.epoch_learning_rate(run)})

    def end_epoch(self, run: RunState, metrics: dict) -> RunState:
        """Write ``metrics`` (name -> scalar; missing names NaN) as the epoch's history entry."""
        diverged = run.diverged_epoch >= 0
        history = {}
        for name, h in run.history.items():
            v = jnp.asarray(metrics.get(name, jnp.nan), jnp.float32)
            history[name] = h.at[run.epoch].set(v if name == "lr" else jnp.where(diverged, jnp.nan, v))
        return run._replace(epoch=run.epoch + 1, history=history)

    # ---- host side ----------------------------------------------------------------------------------

    def history(self, run: RunState) -> dict:
        """The run's history so far as numpy arrays (see the module docstring)."""
        epoch, hist, diverged, step = to_host((run.epoch, run.history, run.diverged_epoch, run.state.step))
        done = int(np.max(epoch))
        out = {name: np.asarray(v)[..., :done] for name, v in hist.items()}
        if "test_error" in out:  # an objective with an error metric (the default)
            err = out["test_error"]
            finite = np.isfinite(err)
            # initial=inf: a run stopped inside its first epoch has no epoch yet (saved on a signal; #22)
            out["best_test_error"] = np.where(finite.any(-1), np.min(np.where(finite, err, np.inf), -1,
                                                                     initial=np.inf), np.nan)
            out["final_test_error"] = err[..., -1] if done else np.full(np.shape(diverged), np.nan)
        out.update(divergence(diverged, step))
        out["epochs"] = done
        if self.is_step_run:  # entry i is the period that ends at step (i + 1) * period
            out["steps"] = done * self.steps_per_epoch
        return out

    def checkpoint_step(self, epoch: int, batch: int = 0) -> int:
        """The checkpoint step number of ``batch`` minibatches into epoch ``epoch`` (training steps done)."""
        return int(epoch) * self.steps_per_epoch + int(batch)

    def check_checkpoint(self, ckpt: Checkpoints, step: int, meta: dict, num_seeds: int | None,
                         hparams: dict | None = None) -> None:
        """``ValueError`` naming the directory, the step and what differs when the checkpoint ``step`` (intact)
        was made by another run: other settings, another model, another number of seeds or other per-run
        ``hparams`` (learning rate, weight decay, tau: compared when both the checkpoint and this run record
        them)."""
        where = f"checkpoint_dir: {ckpt.directory}, step {step}"
        saved, ours = resume_config(meta.get("config", {})), resume_config(config_dict(self.config))
        if getattr(self, "_extends", False) and saved.get("train.epochs", 0) < ours.get("train.epochs", 0):
            saved["train.epochs"] = ours["train.epochs"]  # a shorter run, extended by this one (with_epochs)
        if saved != ours:
            changed = sorted(k for k in set(saved) | set(ours) if saved.get(k) != ours.get(k))
            raise ValueError(f"{where}: made with other settings ({', '.join(changed)}); resuming needs the same "
                             "config. Use another directory.")
        model = describe_model(self.model)
        if "model" in meta and not same_model_description(meta["model"], model):
            first = next((f"saved {a.strip()!r}, this run {b.strip()!r}" for a, b in
                          zip(meta["model"].splitlines(), model.splitlines()) if a != b), "the modules differ")
            raise ValueError(f"{where}: made by another model ({first}); resuming needs the same model (a "
                             "checkpoint of an older resjax whose ResNet or MLP listed other branch kinds' settings "
                             "is recognised: any difference left is a real one). Use another directory, or start "
                             "again there (delete it, or --fresh in the experiments).")
        if "objective" in meta and meta["objective"] != self.obj.describe():
            raise ValueError(f"{where}: made with another objective ({meta['objective']}), this run has "
                             f"{self.obj.describe()}; resuming needs the same loss and metrics. Use another directory.")
        if meta.get("num_seeds") != num_seeds:
            raise ValueError(f"{where}: has num_seeds={meta.get('num_seeds')}, this run {num_seeds}")
        saved_hp, our_hp = meta.get("hparams"), _host_hparams(hparams)
        if saved_hp is not None and our_hp is not None:
            for name in sorted(set(saved_hp) | set(our_hp)):
                a, b = saved_hp.get(name), our_hp.get(name)
                if a is None or b is None or not np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32)):
                    raise ValueError(f"{where}: made with hparams.{name}={_fmt(a)}, this run asks for {_fmt(b)}; "
                                     "resuming needs the same hparams. Use another directory.")

    def resume(self, ckpt: Checkpoints, run: RunState, num_seeds: int | None,
               hparams: dict | None = None) -> tuple[RunState, dict | None]:
        """``(run, meta)`` from the newest good checkpoint in ``ckpt`` when it is further along than ``run``
        (``meta`` None when ``run`` is kept).

        A step that cannot be read or fails its checksums (``CheckpointError``) is reported and the next
        older step is tried; once a good one is found the damaged ones are moved to ``DIR/damaged/``. When no
        step is good the problems are raised together (``CheckpointError``) and nothing is moved. A good checkpoint made by other settings, another model or other seeds raises ``ValueError``
        naming what differs (it is not this run's, so no older step is tried)."""
        damaged = []
        ours = (int(np.max(to_host(run.epoch))), 0)
        for step in ckpt.steps():
            try:
                meta = ckpt.meta(step)
                self.check_checkpoint(ckpt, step, meta, num_seeds, hparams)
                if (int(meta["epoch"]), int(meta.get("batch", 0))) <= ours:
                    self._set_aside(ckpt, damaged, "continuing from the state given")
                    return run, None
                saved_epochs = self.num_epochs if self.is_step_run else int(  # a step run is never extended
                    meta.get("config", {}).get("train", {}).get("epochs", self.config.train.epochs))
                shorter = run._replace(history={k: v[..., :saved_epochs] for k, v in run.history.items()})
                restored = self.extend_history(ckpt.restore(shorter, step))
            except CheckpointError as e:
                print(f"resjax: {e}; trying the next older step", file=sys.stderr, flush=True)
                damaged.append(e)
                continue
            same = (np.array_equal(to_host(restored.data_seed), to_host(run.data_seed))
                    and np.array_equal(to_host(jax.random.key_data(restored.key)), to_host(jax.random.key_data(run.key))))
            if not same:
                raise ValueError(f"checkpoint_dir: {ckpt.directory}, step {step}: made from other seeds; "
                                 "use another directory, or resume=False with an empty one")
            self._set_aside(ckpt, damaged, f"resuming from step {step}, the newest good one")
            return restored, meta
        if damaged:
            raise CheckpointError(ckpt.directory, ", ".join(str(e.step) for e in damaged),
                                  "no step in this directory is good (" + "; ".join(f"step {e.step}: {e.problem}" for e in damaged)
                                  + "); move them away to train from the start")
        return run, None

    @staticmethod
    def _set_aside(ckpt: Checkpoints, damaged: list, doing: str) -> None:
        if damaged:
            moved = [ckpt.set_aside(e.step) for e in damaged]
            print(f"resjax: {doing} in {ckpt.directory}; the damaged steps were moved to {', '.join(moved)}",
                  file=sys.stderr, flush=True)

    def save(self, ckpt: Checkpoints, run: RunState, done: int, num_seeds: int | None, batch: int = 0,
             partial: dict | None = None, hparams: dict | None = None) -> int:
        """Checkpoint ``run``: ``done`` epochs completed and ``batch`` minibatches of the next (with the
        epoch's ``partial`` per-batch metrics so far) and the run's ``hparams``. Returns the step number
        written."""
        step = self.checkpoint_step(done, batch)
        meta = {"epoch": done, "batch": batch, "num_seeds": num_seeds,
                "data_seeds": to_host(run.data_seed), "config": config_dict(self.config),
                "model": describe_model(self.model), "objective": self.obj.describe(), "history": self.history(run)}
        if hparams is not None:
            meta["hparams"] = _host_hparams(hparams)
        if partial is not None:
            meta["partial"] = partial
        ckpt.save(step, run, meta)
        return step

    def open_checkpoints(self, checkpoint_dir: str | os.PathLike | None, run: RunState, num_seeds: int | None,
                         resume: bool, hparams: dict | None = None) -> tuple[Checkpoints | None, RunState, dict | None]:
        """``(Checkpoints or None, run, meta)``: the directory locked (``resjax.train.lock``: a directory another
        running process trains into is refused) and opened and, with ``resume``, the run resumed (``meta``: the
        checkpoint's, None when nothing was resumed); ``hparams``: the run's, compared with the checkpoint's. The
        lock is released by the ``Checkpoints``' ``close``."""
        if checkpoint_dir is None:
            return None, run, None
        if str(checkpoint_dir).strip() == "":
            raise ValueError("checkpoint_dir: an empty path (it would mean the current folder); give a directory, "
                             "or None for no checkpoints")
        lock = DirectoryLock(checkpoint_dir).acquire()  # a second run into this directory is refused here (#22)
        try:
            ckpt = Checkpoints(checkpoint_dir, keep=self.config.train.get("checkpoint_keep", 2))
        except BaseException:
            lock.release()
            raise
        ckpt.lock = lock  # released by ckpt.close()
        meta = None
        if is_main_process():  # a full disk named before training, not at the first save after it (#22)
            check_free_space(ckpt.directory, estimated_size(run))
        try:
            ckpt.set_aside_unfinished()  # a save cut off by a kill is no checkpoint: resume from the one before
            if ckpt.latest() is not None:
                if not resume:
                    raise ValueError(f"checkpoint_dir: {ckpt.directory} already holds checkpoints; pass resume=True "
                                     "or use an empty directory")
                run, meta = self.resume(ckpt, run, num_seeds, hparams)
        except BaseException:  # refused: nothing trains, so the directory is closed and its lock given up here
            ckpt.close()
            raise
        return ckpt, run, meta


def _fmt(values: list | None) -> str:
    """float32 values as their shortest decimal form (``[0.1, 0.1]``, not ``[0.10000000149011612, ...]``)."""
    return "none" if values is None else "[" + ", ".join(f"{v:.7g}" for v in np.asarray(values, np.float32)) + "]"


def _host_hparams(hparams: dict | None) -> dict | None:
    """``hparams`` as JSON-ready lists of float32 values (a scalar as one value), or None."""
    if hparams is None:
        return None
    return {k: np.atleast_1d(np.asarray(to_host(v), np.float32)).tolist() for k, v in hparams.items()}


def with_hyperparams(opt_state: Any, hparams: dict) -> Any:
    """``opt_state`` with each of its injected values (``learning_rate``, ``weight_decay`` and the traced
    settings: the names in ``opt_state.hyperparams``) that ``hparams`` holds set from it."""
    for name, value in hparams.items():
        if name in opt_state.hyperparams:
            opt_state.hyperparams[name] = jnp.asarray(value, float_dtype())
    return opt_state


def divergence(diverged_epoch: ArrayLike, step: ArrayLike) -> dict:
    """``diverged_epoch`` and ``diverged_step`` (1-based; -1 if the run never diverged). A diverged state
    is frozen, so its step counter stopped at the last good step."""
    xp = jnp if isinstance(diverged_epoch, jax.Array) else np
    diverged = diverged_epoch >= 0
    return {"diverged_epoch": diverged_epoch, "diverged_step": xp.where(diverged, step + 1, -1)}


def resume_config(config: dict) -> dict:
    """The settings that must match for an exact resume, flattened and JSON-normalised (tuples as lists)."""
    flat = {}

    def walk(d, prefix):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                flat[f"{prefix}{k}"] = v

    walk(_json(dict(config)), "")
    return {k: v for k, v in flat.items() if k not in RESUME_FREE and not (k in ADDED and ADDED[k] == v)}


#: Settings added after checkpoints were first written, with their defaults: at the default they compare as absent,
#: so a checkpoint made before them resumes.
ADDED = {"train.loss": "cross_entropy", "train.label_smoothing": 0.0, "train.steps": 0, "train.eval_every_steps": 0}


def asks_for_seed_axis(key: int | Sequence[int] | np.ndarray | jax.Array) -> bool:
    """Whether ``key``, as ``seed_handles(key, None)`` reads it, gives runs with a leading seed axis (a list of
    seed integers, a 1-d array of keys), worked out without running anything on a device: a caller that has not
    yet opened its ``StopSignals`` runs no program (whose compilation a stop signal would interrupt)."""
    if is_int(key):
        return False
    if isinstance(key, (list, tuple)) or (isinstance(key, np.ndarray) and key.dtype.kind in "iu"):
        return True
    return getattr(key, "ndim", 0) == 1


def seed_handles(key: int | Sequence[int] | np.ndarray | jax.Array | None, num_seeds: int | None,
                 default_seed: int = 0) -> tuple[jax.Array, np.ndarray | np.integer, bool]:
    """``(keys, data_seeds, seeded)`` from a seed integer, a list of them, a typed PRNG key or keys of
    shape ``(S,)`` (see ``ImageTrainer.init``). Seed integer ``s`` gives ``jax.random.key(s)`` and data seed
    ``s``; a key gives a data seed drawn from it."""
    if num_seeds is not None and (not is_int(num_seeds) or num_seeds < 1):
        raise ValueError(f"num_seeds: must be an integer >= 1, got {num_seeds!r}")
    key = default_seed if key is None else key
    if is_int(key) or isinstance(key, (list, tuple)) or (isinstance(key, np.ndarray) and key.dtype.kind in "iu"):
        seeded = num_seeds is not None or asks_for_seed_axis(key)
        if is_int(key):
            ints = [int(key) + i for i in range(num_seeds or 1)]
        else:
            ints = [int(k) for k in np.asarray(key).reshape(-1)]
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
    seeded = asks_for_seed_axis(key)
    draw = lambda k: (jax.random.bits(jax.random.fold_in(k, _DATA_SEED_TAG), (), jnp.uint32) >> 1).astype(jnp.int32)  # noqa: E731
    data_seeds = np.asarray(jax.device_get(jax.vmap(draw)(key) if seeded else draw(key)))
    return key, data_seeds, seeded


def check_run_config(config: ml_collections.ConfigDict) -> None:
    """Raise ``ValueError`` when ``config`` has no nested ``train`` config or a setting of it is bad
    (``check_train_config``)."""
    if "train" not in config:
        raise ValueError("config.train: a run config needs a nested train config (resjax.train.train_config())")
    check_train_config(config.train)


def check_targets(objective: Objective, model: Any, example_shape: tuple, y_train: Any, y_test: Any = None,
                  name: str = "data", hparams: dict | None = None, samples: bool = False,
                  counts: tuple[int, int | None] | None = None) -> None:
    """Check a data set's targets against the run's objective and model, before anything compiles (``ValueError``
    naming the array or the loss): integer targets of a classification objective as class labels (integers
    ``>= 0``, every test label a class of the training split, each below the model's ``num_classes``:
    ``resjax.data.check_labels``); other targets with the same per-example shape and kind in both splits, finite;
    and, for every objective but the built-in cross-entropy on class labels, the loss and metrics on the shapes
    of a batch (``Objective.check``: one value per example, 'mse' targets of the outputs' shape). ``samples``: the
    targets are a few examples of a source that checks its labels as it reads them (TFDS): only their kind and
    shape are checked here. ``counts``: the number of examples of each split's inputs (the targets must match)."""
    from resjax.data.arrays import check_labels
    from resjax.train.objective import LOSSES, METRIC_FUNCTIONS

    yt = np.asarray(y_train)
    ye = None if y_test is None else np.asarray(y_test)
    labels = objective.classes and yt.dtype.kind in "iu"
    if objective.classes and yt.dtype.kind not in "iu" and yt.ndim == 1:  # not soft labels [N, C]: class labels
        raise ValueError(f"{name}.y_train: want integer class labels, got dtype {yt.dtype}"
                         f"{' (convert whole-valued floats with .astype(int))' if yt.dtype.kind == 'f' else ''}")
    n_train, n_test = counts if counts is not None else (len(yt), None if ye is None else len(ye))
    for split, y, n in (("y_train", yt, n_train), ("y_test", ye, n_test)):
        if y is not None and n is not None and len(y) != n:
            raise ValueError(f"{name}.{split}: {len(y)} labels for the {n} examples of {name}.x_{split[2:]}")
    if labels and not samples:
        ye_ = yt[:0] if ye is None else ye
        split = types.SimpleNamespace(x_train=yt, y_train=yt, x_test=ye_, y_test=ye_)  # lengths checked above
        check_labels(split, getattr(model, "num_classes", None), name)
    if labels:
        built_in = (objective.loss is LOSSES["cross_entropy"][0]
                    and all(f is METRIC_FUNCTIONS.get(m) for m, f in objective.metrics.items()))
        if built_in:
            return
    elif ye is not None and (ye.shape[1:] != yt.shape[1:] or (ye.dtype.kind in "iu") != (yt.dtype.kind in "iu")):
        raise ValueError(f"{name}.y_test: targets {ye.dtype}{list(ye.shape[1:])} per example, but {name}.y_train's "
                         f"are {yt.dtype}{list(yt.shape[1:])}; both splits need the same kind and shape")
    if ye is not None and ye.dtype.kind == "f" and len(ye):
        bad = ~np.isfinite(ye.reshape(len(ye), -1)).all(axis=1)
        if bad.any():
            raise ValueError(f"{name}.y_test: example {int(np.argmax(bad))} has a non-finite target")

    def apply_outputs(x):
        keys = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
        variables = model.init(keys, x, train=False)
        outputs, updates = model.apply(variables, x, train=True, mutable=["batch_stats", "intermediates"],
                                       rngs={"dropout": keys["dropout"]})
        return outputs, updates.get("intermediates", {})

    objective.check(apply_outputs, tuple(example_shape), yt, f"{name}.y_train", hparams)
