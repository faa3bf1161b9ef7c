"""The host feeder: ``make_image_train(config, train_source, test_source)`` trains on batches a host
data source yields (``resjax.data.tfds`` sources, or anything with their interface).

Image data sets do not fit in a program, so epochs run on the host: each minibatch of
``train_source.epoch(...)`` goes through one jitted, state-donating step of the core's ``train_step``
(``resjax.train.core``); after every epoch (every ``config.train.eval_every``-th and the last) the model is
evaluated on ``test_source`` (evaluation mode,
running BatchNorm statistics) and, every ``config.train.checkpoint_every`` epochs, the whole run state is
checkpointed::

    trainer = make_image_train(config, train_source, test_source)      # config.model, config.train
    run, history = trainer.fit(0)                                      # one run, seed 0
    run, history = trainer.fit([0, 1, 2], checkpoint_dir="ckpt")       # three seeds, one state with a seed axis

Seeds. ``init``/``fit`` take a seed integer, a list of them (a leading seed axis), a PRNG key, or keys of
shape ``(S,)`` (``resjax.train.core.seed_handles``). Seed ``s`` initialises from ``jax.random.key(s)`` and
reads the data in the order of ``source.epoch(epoch, ..., seed=s)``. Several seeds are trained together,
one state with a leading seed axis, over ``source.stacked_epoch`` batches (row ``s`` is seed ``s``'s own
data order): one ``jax.vmap``-ed step on accelerators, the single-seed step per seed on the CPU
(``config.train.seed_axis``, ``seed_axis_mode``); nothing names the seed axis, so BatchNorm never pools
across seeds.

Determinism and exact resume. Every random number is a function of the run state (the core's), the data
order and augmentation are the loader's pure function of ``(seed, epoch)``, and the learning rate is the
schedule of the optimiser's step count over ``config.train.epochs`` (not over the ``epochs`` a ``fit``
call stops at), so a run stopped after ``k`` epochs and resumed from its checkpoint is bit-identical to an
unstopped one.

Preemption. While ``fit`` runs with a ``checkpoint_dir``, SIGTERM and SIGINT let the current minibatch
step finish; the run is then saved inside its epoch (the checkpoint holds the minibatches done and the
epoch's per-minibatch metrics so far), the command that resumes is printed and
``resjax.train.preemption.Preempted`` is raised (exit status 143/130). Run again, ``fit`` skips the
minibatches already trained on and ends bit-identical to an unbroken run. With several processes the
stop is agreed (``StopSignals.agree``) at the end of the epoch, where every process saves. From the first
second of ``fit`` (``resjax.train.preemption``): a signal before the first step (the data checks of the first
batch, the step's compilation: it is compiled before it runs) stops at once with "nothing was trained yet";
without a ``checkpoint_dir`` one after a step stops there, saying the training is lost; either way exit
status 130/143 and one line, never a traceback.

Step runs (``config.train.steps``, ``resjax.train.config``): every "epoch" above is then a period of
``config.train.eval_every_steps`` steps, whose batches are taken from the data epochs it touches (``_batches``).

Divergence: the core's freeze; ``fit`` stops early once every seed has diverged.

Data parallelism. With ``mesh`` (``make_data_mesh()``: axis ``'data'``), each batch's example axis is
sharded over the devices and the state replicated; jit + GSPMD make BatchNorm's batch statistics and the
loss means global (see ``resjax.train.distributed``, also for several hosts). ``batch_size`` and
``eval_batch_size`` must be multiples of the mesh size.

History (``fit``'s second value, ``history(run)``): the core's metrics (``resjax.train.core.METRICS``):
``train_loss`` and ``batch_error`` over the epoch's minibatches, ``test_loss`` and ``test_error`` on the
whole test set (NaN without ``test_source``), ``lr``; ``train_error`` is NaN (the training set is not
re-read in evaluation mode). Arrays have a leading seed axis when the state has one.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import math
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import Mesh

from resjax.train import distributed, planning
from resjax.train.config import SEED_AXIS_MODES, check_step_count, image_train_config, is_int, step_periods
from resjax.train.checkpoint import closed_on_error
from resjax.train.core import Core, check_run_config, check_targets, divergence, progress_bar, seed_handles
from resjax.train.distributed import make_data_mesh, to_host
from resjax.train.monitor import resolve_log, seed_names
from resjax.train.objective import make_objective
from resjax.train.optim import make_optimizer
from resjax.train.preemption import StopSignals, stops_cleanly
from resjax.train.state import RunState, take_row

if TYPE_CHECKING:
    import flax.linen as nn


@dataclasses.dataclass(frozen=True, eq=False)
class ImageTrainer(Core):
    """See the module docstring. Build with ``make_image_train``."""

    train_source: Any = None
    test_source: Any = None
    mesh: Any = None
    data_steps: int = 0  # a step run's full batches per data epoch (its periods are ``steps_per_epoch`` steps)

    def _step_one(self, run: RunState, images, labels, hparams=None):
        return self.train_step(run, (images, labels), hparams)

    def _eval_one(self, run: RunState, hparams, images, labels, mask):
        return self.eval_sums(run, images, labels, mask, hparams)

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
            def vmapped(*args):
                return jax.vmap(fn, in_axes=(0,) * (len(args) - shared) + (None,) * shared)(*args)

            return self._jit(vmapped, donate=name == "step")

        def per_seed_calls(one, *args):
            seeded, common_args = args[:len(args) - shared], args[len(args) - shared:]
            num_seeds = jax.tree_util.tree_leaves(seeded[0])[0].shape[0]
            outs = [one(*(take_row(a, i) for a in seeded), *common_args) for i in range(num_seeds)]
            return outs

        if mode == "unroll":
            return self._jit(lambda *args: _stack(*per_seed_calls(fn, *args)), donate=name == "step")
        one = self._compiled(name, False)
        return lambda *args: _stack_jit(*per_seed_calls(one, *args))

    @functools.cache
    def _compiled(self, name: str, seeded: bool):
        if name == "init":
            fn = jax.vmap(self.init_run) if seeded else self.init_run
            return self._jit(fn, donate=False)
        if name == "step":
            return self._over_seeds(name, self._step_one) if seeded else self._jit(self._step_one, donate=True)
        if name == "eval":
            return (self._over_seeds(name, self._eval_one, shared=3) if seeded
                    else self._jit(self._eval_one, donate=False))
        if name == "end_epoch":
            return self._jit(jax.vmap(self.end_epoch) if seeded else self.end_epoch, donate=True)
        if name == "lr":
            return self._jit(jax.vmap(self.epoch_learning_rate) if seeded else self.epoch_learning_rate, donate=False)
        raise KeyError(name)

    # ---- public API -------------------------------------------------------------------------------

    def with_config(self, config: ml_collections.ConfigDict) -> ImageTrainer:
        """This trainer rebuilt by ``make_image_train`` for ``config`` with the arguments it was made with (sources,
        model, mesh, optimiser, schedule, parameter groups), tracing the same settings (``Core.with_traced``)."""
        return make_image_train(config, **self.make_args).with_traced(self.traced)

    def init(self, key: int | Sequence[int] | jax.Array | None = None, num_seeds: int | None = None,
             hparams: dict | None = None) -> RunState:
        """A fresh state. ``key``: a seed integer (default ``config.seed``), a list of seed integers, a
        PRNG key or PRNG keys of shape ``(S,)``. With ``num_seeds`` (or a list / ``(S,)`` keys) every leaf
        has a leading seed axis: seed integers ``key, key+1, ...``, or ``jax.random.split(key, num_seeds)``.
        ``hparams``: the learning rate and weight decay the optimiser state starts with (scalars, or one per
        run), as in the on-device feeder."""
        keys, data_seeds, seeded = seed_handles(key, num_seeds, self.config.train.get("seed", 0))
        hp = self.check_hparams(hparams, keys.shape[0] if seeded else None)
        return self._compiled("init", seeded)(keys, jnp.asarray(data_seeds, jnp.int32), hp)

    def step(self, run: RunState, images: jax.Array, labels: jax.Array,
             hparams: dict | None = None) -> tuple[RunState, tuple[jax.Array, dict]]:
        """One donated, jitted step on a placed batch; returns ``(run, (loss, metrics))`` (``metrics``: the
        objective's batch means by name, ``{'error': ...}`` by default). ``hparams``: the traced values the model
        and the loss are called with (``tau``, ``label_smoothing``; per run with a seed axis); the learning rate and
        weight decay are the state's own."""
        return self._compiled("step", _seeded(run))(run, images, labels, self._call_hparams(hparams))

    def _call_hparams(self, hparams: dict | None) -> dict:
        """The part of ``hparams`` the model's call and the loss take (``tau``, ``label_smoothing``, a packed
        program's ``active_depth``; not the optimiser's, which live in its state); ``{}`` when none."""
        keep = ({"tau"} if self.uses_tau else set()) | {"label_smoothing"} | (
            {"active_depth"} if self.packed_depths else set())
        return {k: v for k, v in (hparams or {}).items() if k in keep}

    def evaluate(self, state: RunState, source: Any = None, batch_size: int | None = None,
                 hparams: dict | None = None) -> dict:
        """``{'loss', <metric>...}`` (``{'loss', 'error'}`` by default) over the whole of ``source`` (default:
        ``test_source``) in evaluation mode
        (running BatchNorm statistics, no augmentation); one value per seed. The last partial batch is
        padded to ``batch_size`` (default ``config.eval_batch_size``) and masked, so one program serves.
        ``hparams``: as for ``step`` (the ``tau`` of each run)."""
        source = self.test_source if source is None else source
        if source is None:
            raise ValueError("source: no test_source to evaluate on")
        batch_size = self.config.train.eval_batch_size if batch_size is None else batch_size
        if not is_int(batch_size) or batch_size < 1:
            raise ValueError(f"batch_size: must be an integer >= 1, got {batch_size!r}")
        _check_divides("batch_size", batch_size, self.mesh)
        fn = self._compiled("eval", _seeded(state))
        call_hp = self._call_hparams(hparams)
        loss_sum, sums, count = 0.0, {}, 0
        rows = distributed.process_block(batch_size) if self.mesh is not None else slice(0, batch_size)
        size = rows.stop - rows.start
        kw = {"seed": 0, "shuffle": False, "augment": False, "drop_remainder": False}
        for b, (images, labels) in enumerate(_blocks(source, 0, batch_size, kw, self.mesh is not None)):
            images, labels = np.asarray(images, np.float32), _targets(labels)
            n = min(batch_size, source.num_examples - b * batch_size)  # examples in the whole (global) batch
            mask = np.arange(rows.start, rows.stop) < n
            if len(labels) < size:  # pad to the block's size; the padding is masked out
                images = np.concatenate([images, np.zeros((size - len(labels), *self.example_shape), np.float32)])
                labels = np.concatenate([labels, np.zeros((size - len(labels), *labels.shape[1:]), labels.dtype)])
            l, c = fn(state, call_hp, *(self._place(a, False, batch_size) for a in (images, labels, mask)))
            loss_sum, count = loss_sum + l, count + n
            sums = {m: sums.get(m, 0.0) + v for m, v in c.items()}
        if count == 0:
            raise ValueError("source: the evaluation source yielded no examples")
        return {"loss": loss_sum / count, **{m: v / count for m, v in sums.items()}}

    def fit(self, keys_or_state: RunState | int | Sequence[int] | jax.Array | None = None, *,
            hparams: dict | None = None, epochs: int | None = None, checkpoint_dir: str | os.PathLike | None = None,
            resume: bool = True, progress: bool | str | Callable[[int, dict], None] | None = None,
            callback: Callable[[int, dict], None] | None = None, log: Any = None) -> tuple[RunState, dict]:
        """Train until ``epochs`` (default ``config.train.epochs``) epochs are done; returns ``(run, history)``.
        The same call as the on-device feeder's ``Trainer.fit``.

        ``keys_or_state``: what ``init`` takes (a seed, a list of seeds: one run each, stepped together), or a
        ``RunState`` to continue. ``epochs`` past ``config.train.epochs`` extends the run (from the state given or
        its checkpoint in ``checkpoint_dir``) as if it had been made for ``epochs`` epochs (``Core.with_epochs``:
        exactly so for a constant or step schedule). ``hparams``: per-run values that do not change shapes
        (``learning_rate``, ``weight_decay``, and ``tau`` for a model with ``scaling='tau'``; scalars or one per
        run), so a grid of seeds x hyperparameters is one program (``resjax.train.grid``); a state continued keeps
        its learning rate and weight decay. ``checkpoint_dir``: save every ``config.train.checkpoint_every`` epochs
        and when the call ends; with ``resume`` and a checkpoint there, continue from the newest one (when it is
        further along than the state given; it must come from the same seeds, settings and ``hparams``).
        ``resume=False`` refuses a directory that already holds checkpoints. ``progress``: True or a label for a
        tqdm bar, or a callable; ``callback(epochs_done, summary)`` (the epoch's metrics as numpy arrays, per run)
        after every epoch. ``log``: a directory (or ``resjax.train.monitor.RunLog``) for ``metrics.jsonl``,
        a line per run after every epoch (default: the ``monitor.log_to`` block's, if any; the cell is named by
        the ``progress`` label). A state passed in is consumed: the first step donates its buffers.
        """
        total = self.num_epochs  # a step run: its evaluation periods
        epochs = total if epochs is None else epochs
        if not is_int(epochs) or epochs < 1:
            raise ValueError(f"epochs: must be an integer >= 1, got {epochs!r}")
        if self.is_step_run and epochs > total:
            raise ValueError(f"epochs: a step run is train.steps={self.config.train.steps} steps, {total} periods; "
                             f"{epochs} periods would extend it: set train.steps instead")
        if epochs > total:  # extend: the same run, made for `epochs` epochs (see Core.with_epochs)
            return self.with_epochs(epochs).fit(keys_or_state, hparams=hparams, epochs=epochs,
                                                checkpoint_dir=checkpoint_dir, resume=resume, progress=progress,
                                                callback=callback, log=log)
        with StopSignals() as stop:  # from here to the end (resjax.train.preemption: from the first second)
            return self._fit(keys_or_state, hparams, epochs, checkpoint_dir, resume, progress, callback, log, stop)

    def _fit(self, keys_or_state, hparams, epochs, checkpoint_dir, resume, progress, callback, log,
             stop: StopSignals) -> tuple[RunState, dict]:
        """``fit``'s body, under its open stop signals ``stop``."""
        planner = planning.active()
        if planner is not None:  # compile-only (resjax.train.planning): the planner takes the programs
            return planner.fit(self, keys_or_state, hparams, epochs, progress if isinstance(progress, str) else None)
        run = keys_or_state if isinstance(keys_or_state, RunState) else self.init(keys_or_state, hparams=hparams)
        run = self.extend_history(run)
        hp = self.run_hparams(run, hparams)
        seeded = _seeded(run)
        num_seeds = int(run.epoch.shape[0]) if seeded else None
        ckpt, run, meta = self.open_checkpoints(checkpoint_dir, run, num_seeds, resume, hp)
        skip, partial = (int(meta.get("batch", 0)), meta.get("partial")) if meta else (0, None)
        data_seeds = np.atleast_1d(to_host(run.data_seed)).tolist()
        done = int(np.max(to_host(run.epoch)))
        every = self.config.train.get("checkpoint_every", 0)
        with closed_on_error(ckpt):  # the directory's lock is given up if this fails before training
            log, progress = resolve_log(log, progress)
            if log is not None and self.is_step_run:
                log.step_period = self.steps_per_epoch  # its lines carry the step (metrics.jsonl)
            if log is not None:  # a resumed run's epochs missing from the file are written from its history
                logged = [m for m in self.metric_names if not m.startswith("train_") or m == "train_loss"]
                log.start(done, {k: v for k, v in self.history(run).items() if k in logged} if done else None)
        stop.saving = ckpt is not None
        stop.saved_in = None if ckpt is None else str(ckpt.directory)
        bar = progress_bar(epochs, done, progress)
        if bar is not None and self.is_step_run:
            bar.step_period = self.steps_per_epoch  # its lines count steps
        if bar is not None:
            bar.run_names = seed_names(keys_or_state)  # (a run that diverges is named by its seed)
        end_epoch, lr = self._compiled("end_epoch", seeded), self._compiled("lr", seeded)
        trained = [0]  # steps of this call; before the first, a stop signal stops at once with nothing to save
        stepper = self  # the trainer that steps: on a TPU, laid out for the chip before the first step
        label = progress if isinstance(progress, str) else None  # the call's name in a stop's line

        def stopping(batch: int = 0):  # save (or say what is lost) and stop, `batch` minibatches into epoch done + 1
            if not trained[0]:
                stop.hand_on()  # the caller's own handler, if any (nothing of this call to save)
                latest = ckpt.latest() if ckpt is not None else None
                return stop.untrained(ckpt.directory if latest else None, latest or 0, done, label)
            where = (f"step {batch} of {self.steps_per_epoch} in epoch {done + 1}" if batch
                     else f"epoch {done} of {epochs}")
            if ckpt is None:
                stop.hand_on()
                return stop.lost(where, self.checkpoint_step(done, batch), label)
            step = self.save(ckpt, run, done, num_seeds, batch=batch, hparams=hp,
                             partial=_pack_partial(losses, batch_metrics) if batch else None)
            return stop.stop(ckpt.directory, step, where, label)

        try:
            if stop.agree():  # during the setup (resuming, the first programs' compilation)
                raise stopping()
            while done < epochs and not np.all(to_host(run.diverged_epoch) >= 0):
                losses, batch_metrics = _unpack_partial(partial, self.obj.metrics) if skip else ([], [])
                for i, (images, labels) in enumerate(self._batches(done, data_seeds, seeded)):
                    if i < skip:  # resumed inside this epoch: these minibatches were trained on
                        continue
                    b = self.config.train.batch_size
                    images, labels = self._place(images, seeded, b), self._place(labels, seeded, b)
                    if not trained[0]:  # compiled before it runs: a signal until now (the data checks, the
                        if stop.agree():  # compilation) stops with nothing trained
                            raise stopping()
                        stepper = self._compile_step(run, images, labels, hp)
                        if stop.agree():
                            raise stopping()
                    stop.trained = True  # from here a signal waits for this step and saves it (no exit at once)
                    run, (loss, batch) = stepper.step(run, images, labels, hp)
                    if len(losses) >= IN_FLIGHT:  # at most IN_FLIGHT steps queued (see IN_FLIGHT)
                        losses[-IN_FLIGHT].block_until_ready()
                    trained[0] += 1
                    losses.append(loss)
                    batch_metrics.append(batch)
                    # at the last one, finish the epoch; several processes agree on stopping at epoch ends only
                    if stop.requested and i + 1 < self.steps_per_epoch and jax.process_count() == 1:
                        raise stopping(i + 1)
                skip = 0
                if not losses:
                    raise ValueError("batch_size: the training source yielded no full batch")
                metrics = {"train_loss": jnp.mean(jnp.stack(losses), 0), "lr": lr(run),
                           **{f"batch_{m}": jnp.mean(jnp.stack([bm[m] for bm in batch_metrics]), 0)
                              for m in self.obj.metrics}}
                if self.test_source is not None and self.evaluated(done + 1):
                    metrics.update({f"test_{m}": v for m, v in stepper.evaluate(run, hparams=hp).items()})
                run = end_epoch(run, metrics)
                done += 1
                if ckpt is not None and every and done % every == 0:
                    self.save(ckpt, run, done, num_seeds, hparams=hp)
                if bar is not None or callback is not None or log is not None:
                    summary = to_host(metrics)
                    for m in ("test_loss", *(f"test_{m}" for m in self.obj.metrics)):
                        summary.setdefault(m, np.full(np.shape(summary["train_loss"]), np.nan))
                    if log is not None:
                        log.write(done - 1, summary)
                    if bar is not None:
                        bar.update(done, done - 1, summary, divergence(*to_host((run.diverged_epoch, run.state.step))))
                    if callback is not None:
                        callback(done, summary)
                if stop.agree():  # saving an epoch already saved above does nothing
                    raise stopping()
            if ckpt is not None and ckpt.latest() != self.checkpoint_step(done):
                self.save(ckpt, run, done, num_seeds, hparams=hp)
        finally:
            if bar is not None:
                bar.close()
            if log is not None:
                log.close()
            if ckpt is not None:
                ckpt.close()
        return run, self.history(run)

    def _compile_step(self, run: RunState, images: jax.Array, labels: jax.Array, hparams: dict | None) -> ImageTrainer:
        """Compile the step ``step(run, images, labels, hparams)`` calls (into the jitted function's own cache,
        so that call does not compile again) without running it: the single-seed program when the seeds are
        stepped one by one (``seed_axis='loop'``). Returns the trainer to step with: ``self``, or on a TPU with
        ``seed_axis='auto'`` and several seeds, ``self`` with the layout of the seeds chosen from the compiled
        programs (``laid_out``). On an accelerator, a step or an evaluation that does not fit the device's memory is
        refused here, before training (``planning.NoLayoutFits``, naming the settings to change)."""
        args = (run, images, labels, self._call_hparams(hparams))
        device = (self.mesh.devices.flat[0] if self.mesh is not None else
                  next(iter(getattr(images, "devices", lambda: jax.devices()[:1])())))
        if device.platform == "cpu":
            seeded = _seeded(run)
            if seeded and seed_axis_mode(self.config) == "loop":
                args, seeded = tuple(take_row(a, 0) for a in args), False
            self._compiled("step", seeded).lower(*args).compile()
            return self
        return self.laid_out(args, device)

    def laid_out(self, args: tuple, device: Any, say: Callable[[str], None] | None = print,
                 costs: dict | None = None) -> ImageTrainer:
        """The trainer whose programs fit ``device`` for the step arguments ``args`` (``(run, images, labels,
        call hparams)``: arrays, or ``jax.ShapeDtypeStruct`` placed on the device's mesh), each program compiled and
        costed (``planning.compiled_cost``). With several seeds and ``seed_axis='auto'`` on a TPU, the vmapped and
        the looped seeds are both compiled and the cheaper layout that fits is taken (``planning.choose_layout``;
        the line ``say`` prints says which, and why; ``costs``, a dict, receives each layout's ``LayoutCost``). Raises
        ``planning.NoLayoutFits`` when the training step or the evaluation step (at ``eval_batch_size``) fits in no
        layout."""
        run, seeded = args[0], _seeded(args[0])
        num = int(np.shape(run.epoch)[0]) if seeded else 1
        fix = ("lower train.batch_size" + (", or train fewer seeds a call" if seeded else "")
               + (", or use a TPU with more HBM (resjax.train.planning.CHIPS)" if device.platform == "tpu" else ""))
        mode = seed_axis_mode(self.config) if seeded else "one seed"
        auto = seeded and self.config.train.get("seed_axis", "auto") == "auto" and device.platform == "tpu"
        costs = {} if costs is None else costs
        costs.update({m: self._layout(m).step_cost(args, device, num) for m in (("vmap", "loop") if auto else (mode,))})
        chosen = planning.choose_layout(costs, f"the training step ({num} seed{'s' if num > 1 else ''}, batch "
                                               f"{self.config.train.batch_size})", fix)
        trainer = self._layout(chosen)
        if auto and say is not None:
            say(f"seed_axis='auto': {num} seeds {'vmapped' if chosen == 'vmap' else 'looped'} on "
                f"{getattr(device, 'device_kind', device.platform)} ("
                + "; ".join(f"{m}: {c.needed / 2**30:.2f} GiB"
                            + (f", {1e3 * c.step_seconds:.3g} ms a step" if c.fits else " does not fit")
                            for m, c in costs.items()) + ", from the compiled programs)")
        if self.test_source is not None:
            trainer.eval_cost(args, device, chosen, fix.replace("train.batch_size", "train.eval_batch_size"))
        return trainer

    def _layout(self, mode: str) -> ImageTrainer:
        """This trainer with its seeds stepped as ``mode`` says ('one seed': itself)."""
        if mode in ("one seed", self.config.train.get("seed_axis", "auto")):
            return self
        config = ml_collections.ConfigDict(self.config.to_dict())
        config.train.seed_axis = mode
        return dataclasses.replace(self, config=config)

    def step_cost(self, args: tuple, device: Any, num: int) -> planning.LayoutCost:
        """The compiled training step's ``LayoutCost`` on ``device`` (its seed axis as the config says)."""
        seeded = _seeded(args[0])
        calls, resident = 1, 0
        if seeded and seed_axis_mode(self.config) == "loop":
            args, seeded, calls = tuple(_row(a) for a in args), False, num
            resident = (num - 1) * _nbytes(args[0])  # the other seeds' states wait in device memory meanwhile
        return _costed(self._compiled("step", seeded), args, device, calls, resident)

    def eval_cost(self, args: tuple, device: Any, mode: str, fix: str) -> planning.LayoutCost:
        """The compiled evaluation step's ``LayoutCost`` at ``eval_batch_size``; ``planning.NoLayoutFits`` if it does
        not fit."""
        run, images, labels, hp = args
        lead = 1 if _seeded(run) else 0  # the seed axis of the arguments
        seeds = int(np.shape(run.epoch)[0]) if lead else 1
        seeded = mode not in ("one seed", "loop")
        resident = 0
        if mode == "loop":
            run, hp = _row(run), _row(hp)
            resident = (seeds - 1) * _nbytes(run)  # the other seeds' states wait in device memory meanwhile
        e = self.config.train.eval_batch_size
        sharding = (distributed.batch_sharding(self.mesh, False) if self.mesh is not None
                    else jax.sharding.SingleDeviceSharding(device))

        def batch(a, dtype, features=True):  # the evaluation batch of examples like ``a``'s (no seed axis)
            return jax.ShapeDtypeStruct((e, *(np.shape(a)[lead + 1:] if features else ())), dtype, sharding=sharding)

        mask = batch(labels, jnp.bool_, features=False)
        cost = _costed(self._compiled("eval", seeded), (run, hp, batch(images, jnp.float32),
                                                        batch(labels, labels.dtype), mask), device, 1, resident)
        planning.choose_layout({mode: cost}, f"the evaluation step (batch {e}, {seeds} seed{'s' if seeds > 1 else ''}"
                                             f"{'' if seeds == 1 else ' vmapped' if seeded else ' looped'})", fix)
        return cost

    def _batches(self, epoch: int, data_seeds: list, seeded: bool):
        """The epoch's batches; with a mesh, this process's block of each (see ``_blocks``). In a step run, ``epoch``
        is a period of ``steps_per_epoch`` steps: step ``s`` is batch ``s mod data_steps`` of data epoch
        ``s // data_steps`` (the source's own order of that epoch: shuffled per ``(seed, epoch)``, or the stored
        order with ``shuffle=False``), read from the data epochs the period touches."""
        if not self.is_step_run:
            yield from self._epoch_batches(epoch, data_seeds, seeded)
            return
        first, last = epoch * self.steps_per_epoch, (epoch + 1) * self.steps_per_epoch  # global steps [first, last)
        for data_epoch in range(first // self.data_steps, -(-last // self.data_steps)):
            start = data_epoch * self.data_steps  # its batches from first - start to last - start (no read past)
            yield from itertools.islice(self._epoch_batches(data_epoch, data_seeds, seeded), max(0, first - start),
                                        min(self.data_steps, last - start))

    def _epoch_batches(self, epoch: int, data_seeds: list, seeded: bool):
        """The data epoch's batches; with a mesh, this process's block of each (see ``_blocks``)."""
        kw = {"shuffle": bool(self.config.train.get("shuffle", True)), "augment": bool(self.config.train.get("augment", False)),
              "drop_remainder": True}
        b, src, sharded = self.config.train.batch_size, self.train_source, self.mesh is not None
        if not seeded:
            yield from _blocks(src, epoch, b, {**kw, "seed": int(data_seeds[0])}, sharded)
            return
        if not hasattr(src, "stacked_epoch"):  # one loader per seed, stacked here
            for batch in zip(*(_blocks(src, epoch, b, {**kw, "seed": int(s)}, sharded) for s in data_seeds)):
                yield np.stack([x for x, _ in batch]), np.stack([y for _, y in batch])
            return
        cut = sharded and jax.process_count() > 1
        if cut and _takes_part(src):
            kw["part"], cut = distributed.process_part(), False
        for images, labels in self._stacked(src, epoch, b, data_seeds, kw):
            if cut:  # a source that cannot read one block: cut this process's block from the whole batch
                rows = distributed.process_block(b)
                images, labels = images[:, rows], labels[:, rows]
            yield images, labels

    @staticmethod
    def _stacked(src, epoch: int, b: int, data_seeds: list, kw: dict):
        out = src.stacked_epoch(epoch, b, [int(s) for s in data_seeds], **kw)
        if isinstance(out, tuple) and len(out) == 2 and np.ndim(out[0]) in (5, 6):  # the whole epoch at once
            images, labels = np.asarray(out[0]), np.asarray(out[1])
            if images.ndim == 5:  # [S, steps * B, H, W, C]
                steps = images.shape[1] // b
                images = images[:, : steps * b].reshape(images.shape[0], steps, b, *images.shape[2:])
                labels = labels[:, : steps * b].reshape(labels.shape[0], steps, b, *labels.shape[2:])
            for i in range(images.shape[1]):
                yield images[:, i], labels[:, i]
            return
        yield from out

    def _place(self, x, seeded: bool, batch_size: int | None = None):
        """A host batch as a device array: without a mesh the whole batch as it is; with one, ``x`` is this
        process's block and the global batch of ``batch_size`` examples is sharded over the mesh's 'data'
        axis (example axis)."""
        x = np.asarray(x)
        if self.mesh is None:
            return jnp.asarray(x)
        axis = 1 if seeded else 0
        if batch_size is None:  # x is the whole global batch: keep this process's block
            batch_size, x = x.shape[axis], distributed.host_block(x, axis)
        shape = (*x.shape[:axis], batch_size, *x.shape[axis + 1:])
        return distributed.global_batch(x, distributed.batch_sharding(self.mesh, seeded), shape)


#: Steps dispatched ahead of the device (the host waits for the step this many before the newest). Enough to keep
#: an accelerator busy while the host places the next batch; bounded because XLA:CPU's devices share one thread
#: pool, and an unbounded queue of steps with cross-device collectives in them (data-parallel BatchNorm, the
#: gradients' mean) can leave a collective's rendezvous waiting until XLA aborts the process.
IN_FLIGHT = 2


def _blocks(source: Any, epoch: int, batch_size: int, kw: dict, sharded: bool):
    """``source.epoch(epoch, batch_size, **kw)``; when ``sharded`` over several processes, this process's
    block of each batch only: read alone when the source takes ``part`` (``ImageSource`` does), else cut
    from the whole batch (``distributed.process_block``)."""
    if not sharded or jax.process_count() == 1:
        yield from source.epoch(epoch, batch_size, **kw)
    elif _takes_part(source):
        yield from source.epoch(epoch, batch_size, part=distributed.process_part(), **kw)
    else:
        rows = distributed.process_block(batch_size)
        for images, labels in source.epoch(epoch, batch_size, **kw):
            yield images[rows], labels[rows]


def _takes_part(source: Any) -> bool:
    """Whether ``source.epoch`` can read one process's block alone (a ``part`` argument)."""
    return "part" in inspect.signature(source.epoch).parameters


def _targets(labels: Any) -> np.ndarray:
    """A batch's targets for the step: integer labels as int32, other targets as float32."""
    labels = np.asarray(labels)
    return labels.astype(np.int32) if labels.dtype.kind in "iu" else labels.astype(np.float32)


def _pack_partial(losses: list, metrics: list) -> dict:
    """The epoch's per-minibatch loss and metrics so far, for a checkpoint taken inside an epoch (exact float32
    values): ``losses`` and, per metric ``m``, ``metric.m`` (the default objective's error as ``errors``, the
    name checkpoints made before objectives existed use)."""
    out = {"losses": np.asarray(to_host(jnp.stack(losses)), np.float32)}
    for m in metrics[0] if metrics else ():
        key = "errors" if m == "error" else f"metric.{m}"
        out[key] = np.asarray(to_host(jnp.stack([b[m] for b in metrics])), np.float32)
    return out


def _unpack_partial(partial: dict, names: Any) -> tuple[list, list]:
    rows = lambda key: [jnp.asarray(r) for r in np.array(partial[key], dtype=np.float32)]  # noqa: E731
    losses = rows("losses")
    columns = {m: rows("errors" if m == "error" else f"metric.{m}") for m in names}
    return losses, [{m: columns[m][i] for m in names} for i in range(len(losses))]


def seed_axis_mode(config: ml_collections.ConfigDict) -> str:
    """How a seed axis runs the training and evaluation steps: ``config.train.seed_axis`` 'vmap', 'unroll',
    'loop' or 'auto' = 'loop' on the CPU, 'vmap' elsewhere (see ``ImageTrainer._over_seeds``).

    Vmapping a convolution over seeds makes one grouped convolution (each seed its own kernels), which
    XLA:CPU runs about 4x slower than the seeds one after another; unrolling the seeds into one program
    runs at the sequential speed but multiplies the compile time by the number of seeds (``benchmarks.resnet``
    measures all three: ResNet-56, 4 seeds, 2-core CPU). On accelerators the vmapped program is the one to
    use. All modes give the same numbers to float tolerance (tested)."""
    mode = config.train.get("seed_axis", "auto")
    if mode not in SEED_AXIS_MODES:
        raise ValueError(f"seed_axis: unknown value {mode!r}; choose one of {SEED_AXIS_MODES}")
    if mode == "auto":
        return "loop" if planning.backend() == "cpu" else "vmap"
    return mode


def _row(tree: Any) -> Any:
    """Row 0 of every leaf (a seed's slice): of arrays, or of ``jax.ShapeDtypeStruct`` (a named sharding loses its
    first, seed, entry)."""
    def row(a):
        if not isinstance(a, jax.ShapeDtypeStruct):
            return a[0]
        sharding = getattr(a, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):
            sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec[1:]))
        return jax.ShapeDtypeStruct(a.shape[1:], a.dtype, sharding=sharding)

    return jax.tree_util.tree_map(row, tree)


def _nbytes(tree: Any) -> int:
    """Bytes of the leaves of ``tree`` (arrays or ``jax.ShapeDtypeStruct``), whole."""
    return sum(math.prod(np.shape(a)) * np.dtype(a.dtype).itemsize for a in jax.tree_util.tree_leaves(tree)
               if not jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key))


def _costed(fn, args: tuple, device: Any, calls: int, resident: int = 0) -> planning.LayoutCost:
    """``fn`` compiled for ``args`` and costed on ``device``, ``resident`` more bytes held in its memory meanwhile; a
    compilation refused for want of memory costs what the compiler said it needed (the program does not fit)."""
    try:
        compiled = fn.lower(*args).compile()
    except Exception as err:  # noqa: BLE001  (only the compiler's out-of-memory refusal is a cost; others raise)
        sizes = planning.out_of_memory(err)
        if sizes is None:
            raise
        return planning.LayoutCost(sizes[0] + resident, sizes[1], math.inf, calls)
    cost = planning.compiled_cost(compiled, device, calls)
    return dataclasses.replace(cost, needed=cost.needed + resident)


def _stack(*trees):
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *trees)


_stack_jit = jax.jit(_stack)


def _seeded(run: RunState) -> bool:
    return np.ndim(run.epoch) == 1


def _check_divides(name: str, value: int, mesh) -> None:
    n = distributed.data_size(mesh)
    if value % n:
        raise ValueError(f"{name}: {value} does not split evenly over the {n} devices of the mesh's 'data' axis")


@stops_cleanly
def make_image_train(config: ml_collections.ConfigDict, train_source: Any, test_source: Any = None, *,
                     model: nn.Module | None = None, mesh: Mesh | None = None, optimizer: Any = None,
                     schedule: Callable | None = None, param_groups: Any = None, loss: str | Callable | None = None,
                     metrics: Any = None) -> ImageTrainer:
    """An ``ImageTrainer`` for the run config ``config`` (``config.train``, and ``config.model`` unless
    ``model``, a module, is given) on ``train_source`` (see the module docstring). ``mesh``: a
    ``jax.sharding.Mesh`` with axis ``'data'`` (``make_data_mesh()``) for data parallelism, or None for one
    device. ``train_source`` may also be a user's arrays (``resjax.data.from_arrays``): its ``source('train')``
    is trained on and, unless ``test_source`` is given, its ``source('test')`` evaluated. Validates every
    setting (``ValueError`` naming it) before anything is traced. ``optimizer``, ``schedule``, ``param_groups``: your own optax transformation (or a factory
    of the learning rate), learning-rate multiplier and parameter-group rules (``resjax.train.optim``). ``loss``,
    ``metrics``: the objective (see ``resjax.train.objective``), checked against the data's targets here."""
    from resjax.data import ArrayData, ArraySource

    make_args = dict(train_source=train_source, test_source=test_source, model=model, mesh=mesh, optimizer=optimizer,
                     schedule=schedule, param_groups=param_groups, loss=loss, metrics=metrics)
    if train_source is None:
        raise ValueError("train_source: make_image_train needs data: a source (resjax.data.load_image_dataset, "
                         "synthetic_image_dataset) or a user's arrays (resjax.data.from_arrays)")
    if isinstance(train_source, ArrayData):
        data, train_source = train_source, train_source.source("train")
        test_source = data.source("test") if test_source is None else test_source
    check_run_config(config)
    objective = make_objective(config.train, loss, metrics)
    t = config.train
    if mesh is not None and distributed.DATA_AXIS not in mesh.shape:
        raise ValueError(f"mesh: needs an axis named {distributed.DATA_AXIS!r}, got axes {tuple(mesh.shape)}")
    owners = [d.process_index for d in np.asarray(mesh.devices).flat] if mesh is not None else []
    if owners != sorted(owners):  # process p feeds rows [p*B/P, (p+1)*B/P): its devices must be the p-th block
        raise ValueError(f"mesh: its devices must be ordered by process (as make_data_mesh() orders them), got "
                         f"the processes {owners}")
    if t.batch_size > train_source.num_examples:
        raise ValueError(f"batch_size: {t.batch_size} exceeds the {train_source.num_examples} training examples")
    _check_divides("batch_size", t.batch_size, mesh)
    _check_divides("eval_batch_size", t.eval_batch_size, mesh)
    if model is None:
        if "model" not in config:
            raise ValueError("config.model: no model config and no model given")
        from resjax.nn import build_model

        kind, shape = config.model.get("kind"), tuple(train_source.image_shape)
        if kind in VECTOR_MODELS and len(shape) > 1:  # its Dense layers would act on the last axis alone
            raise ValueError(f"model.kind: {kind!r} takes vectors, and the examples are {'x'.join(map(str, shape))} "
                             f"arrays: flatten them (from_arrays(x.reshape(len(x), -1), y)), or use a convolutional "
                             f"model (cifar_resnet)")
        model = build_model(config.model, num_classes=train_source.num_classes)
    y_train, y_test = _source_targets(train_source), None if test_source is None else _source_targets(test_source)
    if y_train is not None:
        check_targets(objective, model, tuple(train_source.image_shape), y_train, y_test, "data",
                      {"label_smoothing": 0.0} if t.get("label_smoothing", 0.0) else None,
                      samples=not isinstance(train_source, ArraySource))
    steps = data_steps = int(train_source.num_batches(t.batch_size, drop_remainder=True))
    periods = step_periods(t)
    if periods is None:
        check_step_count(t.epochs, int(steps))
    else:  # a step run: the "epochs" of the machinery are its evaluation periods (resjax.train.config)
        steps = periods[1]
    x = jax.ShapeDtypeStruct((2, *train_source.image_shape), jnp.float32)
    params = jax.eval_shape(lambda k, x: model.init(k, x, train=False)["params"], jax.random.key(0), x)  # traced, not compiled
    optim = {k: v for k, v in dict(optimizer=optimizer, schedule=schedule, param_groups=param_groups).items()
             if v is not None}
    tx = make_optimizer(t, params, steps, warn=False, **optim)
    return ImageTrainer(config=config, model=model, tx=tx, example_shape=tuple(train_source.image_shape), optim=optim,
                        objective=objective,
                        uses_tau=getattr(model, "scaling", None) == "tau", steps_per_epoch=int(steps),
                        train_source=train_source, data_steps=data_steps,
                        test_source=test_source, mesh=mesh, make_args=make_args)


#: The models built by name (``config.model.kind``) that take one vector per example (their Dense layers act on the
#: last axis): the host feeder refuses examples of more axes for them, naming the shape.
VECTOR_MODELS = ("plain_mlp", "residual_mlp", "residual_stack", "tau_resnet")


def _source_targets(source: Any) -> np.ndarray | None:
    """A source's targets for the checks: all of a user's arrays (``ArraySource``); for another source (TFDS:
    integer class labels, checked as it reads them) two zero labels standing for their kind and shape, so that
    nothing is read here (each process reads only its block); None for a source without classes."""
    from resjax.data import ArraySource

    if isinstance(source, ArraySource):
        return np.asarray(source.data.y_train if source.split == "train" else source.data.y_test)
    return np.zeros(2, np.int32) if getattr(source, "num_classes", None) else None


__all__ = ["ImageTrainer", "image_train_config", "make_data_mesh", "make_image_train", "seed_axis_mode"]
