"""The on-device feeder: ``make_train(config)`` returns a pure ``train(key, hparams) -> (run, metrics)``.

For data sets that fit on the device (MNIST-1D). A run is ``config.train.steps`` minibatch steps in periods of
``config.train.eval_every_steps`` (a step run: every "epoch" below is then one such period, the history has one
entry per period; see ``resjax.train.config``), or ``config.train.epochs`` epochs of
``N // batch_size`` minibatch steps of the core's ``train_step`` (the last partial batch of each epoch is
dropped, so every step has the same shape; each epoch draws a fresh permutation from
``fold_in(run.key, epoch)``, so a run does not depend on how it is chunked; with ``config.train.shuffle=False``
every epoch takes the examples in their stored order, the batches the host feeder makes of the same arrays).
Settings this feeder cannot honour are refused by name (``check_on_device_settings``). Steps and epochs are
``lax.scan``; the whole run is one program:

    trainer = make_train(config)          # config.data, config.model, config.train
    run, metrics = jax.jit(jax.vmap(trainer))(jax.random.split(key, 3))

``hparams`` (``learning_rate``, ``weight_decay`` and, for models with ``scaling='tau'``, ``tau``) are arrays
vmapped like the keys. After every epoch (every ``config.train.eval_every``-th and the last) the whole
training and test sets are evaluated (evaluation mode); the metrics are the core's (``resjax.train.core``).

``trainer.sweep(keys, hparams, chunk_epochs=..., checkpoint_dir=...)`` (and ``trainer.fit``) runs the same
computation as jitted chunks of epochs with a thin host loop between them (progress, ``metrics.jsonl``,
checkpoints, stop signals). By default (``chunk_epochs=None``) the first chunk is two epochs, timed, and
the rest about ``CHUNK_SECONDS`` (2 s) of training each, so progress and ``metrics.jsonl`` come after the
second epoch and every few seconds after (see ``_Chunks``). Chunks of every length are one compiled program
(``train_epochs``: the number of epochs is an argument of the program, not a constant in it), so the chunking
costs no compilation, and the results equal one chunk's bit for bit. (With hooks, whose records have an epoch
axis, each chunk length is a program of its own.) With ``checkpoint_dir`` the run state is
saved every ``config.train.checkpoint_every`` epochs (chunks are cut there) and at the end, and a sweep
started again with the same settings and keys resumes from the newest checkpoint, bit-identical to an
unbroken run. A SIGTERM or SIGINT at any moment of a sweep (from its first second:
``resjax.train.preemption``) stops it with exit status 143/130 and one line saying what was kept: before the
first step (the signal during the compilation: each program is compiled before it runs), nothing; after,
the current chunk finishes and is saved (with ``checkpoint_dir``; ``checkpoint_every`` and the chunk bound
the wait) or said to be lost (without). On the CPU a convolutional model trains many times slower here than
on the host feeder (``make_image_train``), measured in ``SlowFeederWarning``, which says so once.
With more than one device the seeds are sharded across devices (one mesh axis ``'seeds'``; nothing in the
model names it, so BatchNorm never pools statistics across seeds); when the seeds do not divide evenly,
the last run is repeated to fill the devices and dropped from the results. Once every run of a sweep has
diverged, its remaining epochs are not trained (``Core.skip_epoch``: the same result, bit for bit). On a CPU,
``resjax.use_every_cpu_core()`` makes each core a device (the experiment entry points call it).

Measurements from inside the compiled run (as purejaxrl returns metrics out of its scan):
``step_hook(before, after, hparams) -> pytree`` is called on the run state around every step and
``epoch_hook(run, hparams) -> pytree`` after every epoch; their values come back stacked, as
``metrics['step_records']`` (leading axes ``(seeds,) epochs, steps``) and ``metrics['epoch_records']``
(``(seeds,) epochs``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from resjax.data import ArrayData, Dataset, check_finite, load_dataset
from resjax.nn import build_model
from resjax.train.checkpoint import closed_on_error
from resjax.train.config import EVAL_BATCH_SIZE, check_step_count, is_int, step_periods
from resjax.train.core import (Core, asks_for_seed_axis, check_run_config, check_targets, divergence, progress_bar,
                               seed_handles)
from resjax.train.distributed import to_host
from resjax.train.monitor import resolve_log, seed_names
from resjax.train.objective import make_objective
from resjax.train import planning
from resjax.train.optim import make_optimizer
from resjax.train.preemption import StopSignals, stops_cleanly
from resjax.train.state import RunState, first_rows

if TYPE_CHECKING:
    import flax.linen as nn

__all__ = ["CHUNK_SECONDS", "SlowFeederWarning", "Trainer", "check_on_device_settings", "make_train",
           "shard_over_seeds"]


@dataclasses.dataclass(frozen=True, eq=False)
class Trainer(Core):
    """See the module docstring. Build with ``make_train``."""

    data: Dataset = None
    step_hook: Callable | None = None
    epoch_hook: Callable | None = None

    # ---- pure functions (jit/vmap them) ------------------------------------------------------------

    def init(self, key: jax.Array, hparams: dict | None = None) -> RunState:
        """A fresh run from ``key`` (one typed PRNG key)."""
        return self.init_run(key, 0, hparams)

    def evaluate(self, run: RunState, x: jax.Array, y: jax.Array, hparams: dict | None = None) -> dict:
        """``{'loss', <metric>...}`` (``{'loss', 'error'}`` by default): the means over the arrays ``x, y`` in
        evaluation mode, as ``ImageTrainer.evaluate`` gives them."""
        loss, sums = self.eval_sums(run, x, y, None, hparams)
        return {"loss": loss / len(y), **{m: v / len(y) for m, v in sums.items()}}

    def train_epoch(self, run: RunState, hparams: dict | None,
                    evaluate: bool | jax.Array = True) -> tuple[RunState, dict]:
        """One epoch: ``train_step`` (``lax.scan``) over the epoch's minibatches (``_epoch_batches``: of a fresh
        permutation, or with ``shuffle=False`` of the stored order; a step run's period: ``_period_batches``), then,
        when ``evaluate`` (a bool, or a scalar that is not vmapped: a real branch), the whole training and test
        sets in evaluation mode (else those metrics are NaN). Returns ``(run, records)``: the run with the epoch's
        metrics in its history and ``epoch + 1``, and the hooks' values (``step_records``, ``epoch_records``;
        empty without hooks)."""
        batches = self._period_batches(run) if self.is_step_run else self._epoch_batches(run)
        x_train, y_train = jnp.asarray(self.data.x_train), jnp.asarray(self.data.y_train)
        lr = self.epoch_learning_rate(run)

        def step(r, idx):
            after, out = self.train_step(r, (x_train[idx], y_train[idx]), hparams)
            if self.step_hook is not None:
                out = (*out, self.step_hook(r, after, hparams))
            return after, out

        def evaluation(r):  # the training set's metrics (not its loss) and the test set's loss and metrics
            train = self.evaluate(r, x_train, y_train, hparams)
            test = self.evaluate(r, jnp.asarray(self.data.x_test), jnp.asarray(self.data.y_test), hparams)
            return {**{f"train_{m}": v for m, v in train.items() if m != "loss"},
                    **{f"test_{m}": v for m, v in test.items()}}

        run, outs = jax.lax.scan(step, run, batches)
        if evaluate is True:
            evaluated = evaluation(run)
        else:
            nans = jax.tree_util.tree_map(lambda a: jnp.full(a.shape, jnp.nan, a.dtype), jax.eval_shape(evaluation, run))
            evaluated = jax.lax.cond(evaluate, evaluation, lambda r: nans, run)
        metrics = {"train_loss": jnp.mean(outs[0]), **{f"batch_{m}": jnp.mean(v) for m, v in outs[1].items()},
                   **evaluated, "lr": lr}
        run = self.end_epoch(run, metrics)
        records = {}
        if self.step_hook is not None:
            records["step_records"] = outs[2]
        if self.epoch_hook is not None:
            records["epoch_records"] = self.epoch_hook(run, hparams)
        return run, records

    def _epoch_batches(self, run: RunState) -> jax.Array:
        """An epoch run's minibatches of the epoch ``run.epoch``, ``(N // batch_size, batch_size)`` example indices:
        of the permutation ``fold_in(run.key, epoch)`` (``config.train.shuffle``, the default) or, with
        ``shuffle=False``, of the stored order (batch ``b`` is examples ``[b * batch_size, (b + 1) * batch_size)``
        every epoch, as the host feeder batches the same arrays); the last partial batch dropped."""
        n, b = len(self.data.y_train), self.config.train.batch_size
        steps = n // b
        if not self.config.train.get("shuffle", True):
            return jnp.arange(steps * b, dtype=jnp.int32).reshape(steps, b)
        perm = jax.random.permutation(jax.random.fold_in(run.key, run.epoch), n)
        return perm[: steps * b].reshape(steps, b)

    def _period_batches(self, run: RunState) -> jax.Array:
        """A step run's minibatches of the period ``run.epoch`` (its ``steps_per_epoch`` steps), ``(steps, batch)``
        example indices: step ``s`` is batch ``s mod (N // batch_size)`` of data epoch ``s // (N // batch_size)``,
        of that epoch's permutation ``fold_in(run.key, epoch)`` (``config.train.shuffle``) or of the stored order
        (see ``resjax.train.config``)."""
        n, b = len(self.data.y_train), self.config.train.batch_size
        per_epoch = n // b
        s = run.epoch * self.steps_per_epoch + jnp.arange(self.steps_per_epoch)  # the period's global steps
        offsets = (s % per_epoch)[:, None] * b + jnp.arange(b)[None, :]
        if not self.config.train.get("shuffle", True):
            return offsets.astype(jnp.int32)
        # the permutations of the data epochs this period touches: at most ceil(period / per_epoch) + 1 of them
        first = s[0] // per_epoch
        count = -(-self.steps_per_epoch // per_epoch) + 1
        perms = jax.vmap(lambda e: jax.random.permutation(jax.random.fold_in(run.key, e), n))(first + jnp.arange(count))
        return perms[(s // per_epoch - first)[:, None], offsets]

    def run_epochs(self, run: RunState, hparams: dict | None, num_epochs: int,
                   start: int | jax.Array = 0) -> tuple[RunState, dict]:
        """``num_epochs`` epochs as one ``lax.scan``, the first of them epoch ``start + 1`` of the run (it decides
        which are evaluated, ``config.train.eval_every``; under ``vmap`` keep ``start`` unmapped); the hooks'
        records have a leading epoch axis."""
        if self.config.train.get("eval_every", 1) == 1:
            return jax.lax.scan(lambda r, _: self.train_epoch(r, hparams), run, None, length=num_epochs)
        epochs = start + 1 + jnp.arange(num_epochs)
        return jax.lax.scan(lambda r, e: self.train_epoch(r, hparams, self.evaluated(e)), run, epochs)

    def train_epochs(self, run: RunState, hparams: dict | None, num_epochs: int | jax.Array,
                     start: int | jax.Array = 0) -> RunState:
        """``run_epochs`` without the hooks' records, with ``num_epochs`` known only when the program runs (a
        ``lax.fori_loop`` whose trip count is an argument): one compiled program for chunks of every length, epoch
        for epoch the same computation as ``run_epochs``'s scan (keep ``num_epochs`` and ``start`` unmapped under
        ``vmap``)."""
        sparse = self.config.train.get("eval_every", 1) != 1

        def epoch(i, r):
            return self.train_epoch(r, hparams, self.evaluated(start + 1 + i) if sparse else True)[0]

        return jax.lax.fori_loop(0, num_epochs, epoch, run)

    def skip_epochs(self, run: RunState, num_epochs: int | jax.Array) -> RunState:
        """``num_epochs`` epochs of a run that has diverged (``Core.skip_epoch``): equal to training them."""
        return jax.lax.fori_loop(0, num_epochs, lambda _, r: self.skip_epoch(r), run)

    def __call__(self, key: jax.Array, hparams: dict | None = None) -> tuple[RunState, dict]:
        """The whole run as one pure function: ``(run, metrics)``; metrics are the history arrays
        (``(epochs,)`` each), ``diverged_epoch``, ``diverged_step`` and the hooks' records."""
        hparams = self.default_hparams() if hparams is None else hparams
        run, records = self.run_epochs(self.init(key, hparams), hparams, self.num_epochs)
        return run, {**run.history, **divergence(run.diverged_epoch, run.state.step), **records}

    def with_config(self, config: ml_collections.ConfigDict) -> Trainer:
        """This trainer rebuilt by ``make_train`` for ``config`` with the arguments it was made with (data, model,
        hooks, optimiser, schedule, parameter groups), tracing the same settings (``Core.with_traced``)."""
        args = dict(self.make_args)
        if args.get("data") is None and config.get("data") == self.config.get("data"):
            args["data"] = self.data  # the same data set: not loaded again
        return make_train(config, **args).with_traced(self.traced)

    # ---- host loop -----------------------------------------------------------------------------------

    def fit(self, keys: jax.Array | int | Sequence[int] | None = None, *, hparams: dict | None = None,
            epochs: int | None = None, checkpoint_dir: str | os.PathLike | None = None, resume: bool = True,
            progress: bool | str | Callable[[int, dict], None] | None = None,
            callback: Callable[[int, dict], None] | None = None, log: Any = None,
            chunk_epochs: int | None = None) -> tuple[RunState, dict]:
        """The host feeder's call (``ImageTrainer.fit``) on this feeder: ``sweep`` with the same arguments.

        ``keys``: a seed integer (default ``config.train.seed``: one run, no seed axis, as ``ImageTrainer.fit``
        returns it), a list of seed integers or ``(S,)`` PRNG keys (one run each, a leading seed axis).
        ``hparams``, ``epochs``, ``checkpoint_dir``, ``resume``, ``progress``, ``callback``, ``log``,
        ``chunk_epochs``: as ``sweep``'s. Returns ``(run, history)``."""
        keys = self.config.train.get("seed", 0) if keys is None else keys
        seeded = asks_for_seed_axis(keys)  # no program before sweep's StopSignals is open (seed_handles runs some)
        run, metrics = self.sweep(keys, hparams, chunk_epochs, progress, callback, checkpoint_dir, resume,
                                  epochs=epochs, log=log)
        if seeded:
            return run, metrics
        return run.select(0), {k: v[0] if np.ndim(v) else v for k, v in metrics.items()}

    def sweep(self, keys: jax.Array | Sequence[int], hparams: dict | None = None, chunk_epochs: int | None = None,
              progress: bool | str | None = None, callback: Callable[[int, dict], None] | None = None,
              checkpoint_dir: str | os.PathLike | None = None, resume: bool = True,
              epochs: int | None = None, log: Any = None, devices: Sequence[jax.Device] | None = None,
              stop: StopSignals | None = None) -> tuple[RunState, dict]:
        """Every seed (and hparam setting) in one vmapped program, run in jitted chunks of epochs.

        ``keys``: ``(S,)`` PRNG keys (or a list of seed integers). ``hparams``: dict of scalars or ``(S,)``
        arrays (default: the config's). Returns ``(run, metrics)``: the run state with a leading seed axis,
        and ``history(run)`` (numpy, ``(S, epochs)`` per metric, ``(S,)`` for ``diverged_epoch`` and the
        per-run summaries) plus the hooks' records. ``callback(epochs_done, summary)`` or ``progress`` run after
        each chunk. ``chunk_epochs``: epochs per jitted chunk; None (default) chooses from the measured epoch
        time, about ``CHUNK_SECONDS`` of training a chunk after a first two-epoch chunk (see the module
        docstring); the results equal one chunk's. ``checkpoint_dir``: see the module docstring;
        ``resume=False`` refuses a directory that already holds checkpoints, and a checkpoint made with other
        ``hparams`` is refused. ``epochs``: stop once that many epochs are done (default ``config.train.epochs``;
        the schedule is that of ``config.train.epochs``, so a run stopped early and resumed is the unstopped
        run); more than ``config.train.epochs`` extends the runs, from their checkpoint in ``checkpoint_dir``, as
        if they had been made for ``epochs`` epochs (``Core.with_epochs``: exactly so for a constant or step
        schedule).
        ``log``: a directory (or ``resjax.train.monitor.RunLog``) for ``metrics.jsonl`` written after every
        chunk (default: the ``monitor.log_to`` block's, if any; the cell is named by the ``progress`` label).
        ``devices``: where the runs are placed, the seeds sharded over them (default: every device; see the
        module docstring). ``stop``: an open ``StopSignals`` of the caller's to obey instead of the sweep's own
        (``resjax.train.side_by_side``, which runs sweeps in threads, where no handler can be installed).
        """
        total = self.num_epochs  # a step run: its evaluation periods
        epochs = total if epochs is None else epochs
        if self.is_step_run and epochs > total:
            raise ValueError(f"epochs: a step run is train.steps={self.config.train.steps} steps, {total} periods; "
                             f"{epochs} periods would extend it: set train.steps instead")
        if not is_int(epochs) or epochs < 1:
            raise ValueError(f"epochs: must be an integer >= 1, got {epochs!r}")
        if chunk_epochs is not None and (not is_int(chunk_epochs) or chunk_epochs < 1):
            raise ValueError(f"chunk_epochs: must be an integer >= 1 or None (chosen from the measured epoch time), "
                             f"got {chunk_epochs!r}")
        if epochs > total:  # extend: the same runs, made for `epochs` epochs (see Core.with_epochs)
            return self.with_epochs(epochs).sweep(keys, hparams, chunk_epochs, progress, callback, checkpoint_dir,
                                                  resume, epochs=epochs, log=log, devices=devices, stop=stop)
        own = stop is None  # the sweep's own handlers (from the main thread), open from here to the end
        with contextlib.nullcontext(stop) if not own else StopSignals() as stop:
            return self._sweep(keys, hparams, chunk_epochs, progress, callback, checkpoint_dir, resume, epochs, log,
                               devices, stop, own)

    def _sweep(self, keys, hparams, chunk_epochs, progress, callback, checkpoint_dir, resume, epochs, log, devices,
               stop: StopSignals, own: bool) -> tuple[RunState, dict]:
        """``sweep``'s body, under the stop signals ``stop`` (``own``: opened by this sweep)."""
        names = seed_names(keys)
        keys, _, seeded = seed_handles(keys, None)
        if not seeded:
            keys = keys[None]
        num = keys.shape[0]
        hp = self.check_hparams(hparams, num)
        planner = planning.active()
        if planner is not None:  # compile-only (resjax.train.planning): the planner takes the programs
            return planner.sweep(self, keys, hp, epochs, progress if isinstance(progress, str) else None)
        count = jax.device_count() if devices is None else len(devices)
        pad = (-num) % count  # repeat the last run so the seeds split evenly over the devices
        if pad:
            keys, hp = jax.tree_util.tree_map(lambda a: jnp.concatenate([a, jnp.repeat(a[-1:], pad, 0)]), (keys, hp))
        keys, hp = shard_over_seeds((keys, hp), devices)

        hooks = self.step_hook is not None or self.epoch_hook is not None
        chunks = _Chunks(epochs, chunk_epochs, one_program=not hooks)  # without hooks one program runs every length
        every = self.config.train.get("checkpoint_every", 0) if checkpoint_dir is not None else 0
        run = self._init_runs(keys, hp)
        ckpt, run, _ = self.open_checkpoints(checkpoint_dir, run, num + pad, resume, hp)
        stop.saving = stop.saving or ckpt is not None  # (for the message the first signal prints)
        if own and ckpt is not None:
            stop.saved_in = str(ckpt.directory)
        done = int(np.max(to_host(run.epoch)))
        with closed_on_error(ckpt):  # the directory's lock is given up if this fails before training
            if hooks and done:
                raise ValueError(f"checkpoint_dir: {checkpoint_dir} holds a run {done} epochs in; the hooks' records "
                                 "of those epochs were not saved, so a run with hooks cannot resume")
            log, progress = resolve_log(log, progress)
            if log is not None and self.is_step_run:
                log.step_period = self.steps_per_epoch  # its lines carry the step (metrics.jsonl)
            if log is not None:  # a resumed cell's epochs missing from the file are written from its history
                log.start(done, {k: v[:num] for k, v in self.history(run).items() if k in run.history} if done else None)
        records, bar, trained, ready = [], progress_bar(epochs, done, progress), False, set()
        if bar is not None and self.is_step_run:
            bar.step_period = self.steps_per_epoch  # its lines count steps
        if bar is not None:
            bar.run_names = names  # (a run that diverges is named by its seed)
        convolutions = None  # whether the chunk program convolves on a CPU (see SlowFeederWarning)
        label = progress if isinstance(progress, str) else None  # the call's name in a stop's line

        def stopping():  # after a chunk (or, before the first, a compilation): save or say what is lost, and stop
            if not trained:
                if own:
                    stop.hand_on()  # the caller's own handler, if any (nothing of this call to save)
                latest = ckpt.latest() if ckpt is not None else None
                raise stop.untrained(ckpt.directory if latest else None, latest or 0, done, label)
            if ckpt is None:
                if own:
                    stop.hand_on()
                raise stop.lost(f"epoch {done} of {epochs}", self.checkpoint_step(done), label)
            step = self.save(ckpt, run, done, num + pad, hparams=hp)  # saving an epoch already saved does nothing
            raise stop.stop(ckpt.directory, step, f"epoch {done} of {epochs}", label)

        try:
            if stop.agree():  # during the setup (the initialisation's compilation, resuming)
                stopping()
            while done < epochs:
                n = chunks.next(done, every)
                skipping = not hooks and np.all(to_host(run.diverged_epoch) >= 0)  # nothing left to train
                if skipping:
                    program, args = self._skip_fn(), (run, jnp.int32(n))
                elif hooks:  # the records' epoch axis: a program per chunk length
                    program, args = self._chunk_fn(n), (run, hp, jnp.int32(done))
                else:
                    program, args = self._chunk_fn(), (run, hp, jnp.int32(done), jnp.int32(n))
                if program not in ready:  # compiled before it runs, so a signal meanwhile stops before it
                    ready.add(program)
                    compiled = time.perf_counter()
                    lowered = program.lower(*args)
                    try:
                        lowered.compile()  # into the program's own cache: the call below does not compile again
                    except Exception as err:  # noqa: BLE001  (the compiler's out-of-memory refusal, said plainly)
                        said = planning.refused(err, f"the on-device run of {num + pad} runs ({(num + pad) // len(devices)}"
                                                f" a device, the data set on each)", "train fewer runs a call, or lower "
                                                "train.batch_size or the data set's size")
                        if said is err:
                            raise
                        raise said from err
                    chunks.compiled(time.perf_counter() - compiled)
                    if convolutions is None and not skipping:
                        convolutions = _convolutions_on_cpu(lowered, devices)
                    if stop.agree():
                        stopping()
                began = time.perf_counter()
                stop.trained = True  # from here a signal waits for this chunk and saves it (no exit at once)
                out = program(*args)
                run, rec = out if hooks else (out, None)
                if rec is not None:
                    records.append(to_host(rec))
                last, done, trained = done, done + n, True
                if ckpt is not None and (done == epochs or (every and done % every == 0)):
                    self.save(ckpt, run, done, num + pad, hparams=hp)
                if bar is not None or callback is not None or log is not None:
                    full = self.history(run)
                    history = {k: v[:num] for k, v in full.items() if k in run.history}
                    summary = {k: v[:, done - 1] for k, v in history.items()}
                    if log is not None:
                        log.write(last, {k: v[:, last:done] for k, v in history.items()})
                    if bar is not None:
                        bar.update(done, last, summary, {k: full[k][:num] for k in ("diverged_epoch", "diverged_step")})
                    if callback is not None:
                        callback(done, summary)
                else:
                    jax.block_until_ready(run.epoch)
                chunks.ran(n, time.perf_counter() - began, epochs - done)
                if convolutions:
                    convolutions = False  # said once per sweep (and, as a warning, once per process)
                    warnings.warn(SlowFeederWarning.text(chunks.epoch_s), SlowFeederWarning, stacklevel=1)
                if stop.agree():
                    stopping()
        finally:
            if bar is not None:
                bar.close()
            if log is not None:
                log.close()
            if ckpt is not None:
                ckpt.close()
        keep = lambda a: a[:num]  # noqa: E731  (drop the padding runs: numpy here, the run state below)
        metrics = {k: keep(v) if np.ndim(v) else v for k, v in self.history(run).items()}
        for name in ("step_records", "epoch_records"):
            if records and name in records[0]:
                metrics[name] = jax.tree_util.tree_map(lambda *c: keep(np.concatenate(c, axis=1)),
                                                       *[r[name] for r in records])
        return (first_rows(run, num) if pad else run), metrics

    def _init_runs(self, keys: jax.Array, hp: dict) -> RunState:
        """The runs' initial states for ``keys`` and ``hp`` as placed by ``shard_over_seeds``: sharded over the
        seeds as the keys are (see ``_init_fn``)."""
        seeds = keys.sharding if isinstance(keys.sharding, jax.sharding.NamedSharding) else None
        return self._init_fn(seeds)(keys, hp)

    def _init_fn(self, sharding: jax.sharding.Sharding | None = None):
        """``(keys, hparams) -> runs``, jitted. With ``sharding`` (the seeds' over the devices), every leaf of the
        runs is placed so, as the chunk program places its output; the first chunk then runs the program of every
        later one. (Placed as the initialiser's program chose, zero biases and step counts replicated, the first
        chunk compiled a program of its own: one more compilation of the largest program per sweep.)"""
        key = ("init", sharding)
        if key not in self._programs:
            self._programs[key] = jax.jit(jax.vmap(self.init), out_shardings=sharding)
        return self._programs[key]

    @functools.cached_property
    def _programs(self) -> dict:
        """This trainer's jitted chunk programs by ``(kind, epochs)``, living as long as the trainer (a cache on
        the class would keep every trainer's compiled programs, and memory, for the life of the process)."""
        return {}

    def _chunk_fn(self, num_epochs: int | None = None):
        """The chunk program: ``(runs, hparams, start, epochs) -> runs`` for chunks of any length (``train_epochs``);
        with ``num_epochs``, ``(runs, hparams, start) -> (runs, records)`` for chunks of that length (``run_epochs``:
        the hooks' records have an epoch axis)."""
        key = ("chunk",) if num_epochs is None else ("chunk", num_epochs)
        if key not in self._programs:
            if num_epochs is None:
                run = jax.vmap(lambda r, hp, start, n: self.train_epochs(r, hp, n, start), in_axes=(0, 0, None, None))
            else:
                run = jax.vmap(lambda r, hp, start: self.run_epochs(r, hp, num_epochs, start), in_axes=(0, 0, None))
            self._programs[key] = jax.jit(run, donate_argnums=0)
        return self._programs[key]

    def _skip_fn(self):
        """``(runs, epochs) -> runs``: ``skip_epochs`` of runs that have all diverged, for any number of epochs."""
        if ("skip",) not in self._programs:
            self._programs["skip",] = jax.jit(jax.vmap(self.skip_epochs, in_axes=(0, None)), donate_argnums=0)
        return self._programs["skip",]


class SlowFeederWarning(UserWarning):
    """The on-device feeder trains a convolutional model on the CPU, where it is many times slower than the host
    feeder. Measured (a depth-8 CIFAR ResNet, 16x16x3 images, batches of 32, XLA:CPU): 8 minibatch steps took
    5.2 s inside the epoch's ``lax.scan`` and 0.08 s as 8 calls of the jitted step, or unrolled in one program
    (the batches gathered from the arrays in both: the gather costs nothing measurable; evaluating the
    training set, 0.08 s): XLA:CPU runs convolutions inside a while loop's body (the scan) about 60 times
    slower than outside one. An epoch took 6.5 s here against the host feeder's 0.5 s. The fix: the host
    feeder, ``make_image_train(config, resjax.data.from_arrays(...))``, which takes the same arrays and steps
    one jitted minibatch at a time (or a GPU/TPU). Shown once per process (Python's default warning filter);
    ``warnings.filterwarnings('ignore', category=SlowFeederWarning)`` silences it."""

    @staticmethod
    def text(epoch_s: float) -> str:
        """The warning's one line, with this run's measured seconds an epoch ``epoch_s``."""
        return (f"resjax: the on-device feeder (make_train) runs this convolutional model slowly on the CPU "
                f"({epoch_s:.2f} s an epoch here): XLA:CPU runs convolutions inside the epoch's scan over "
                "minibatches about 60x slower than in a step compiled alone (measured: 5.2 s against 0.08 s for 8 "
                "steps of a depth-8 CIFAR ResNet). Use the host feeder for it, make_image_train(config, "
                "resjax.data.from_arrays(...)), which takes the same arrays (see SlowFeederWarning).")


def _convolutions_on_cpu(lowered: Any, devices: Sequence[jax.Device] | None) -> bool:
    """Whether the lowered program ``lowered`` has a convolution and runs on CPU devices."""
    platform = (devices[0] if devices else jax.devices()[0]).platform
    return platform == "cpu" and "convolution" in lowered.as_text()


#: The on-device feeder's default chunk (``chunk_epochs=None``): about this many seconds of training, measured,
#: between two reports (progress, ``metrics.jsonl``, checkpoints, a stop signal's chance to act).
CHUNK_SECONDS = 2.0


class _Chunks:
    """How many epochs each chunk of a sweep runs. ``chunk_epochs`` given: that many, cut at the checkpoints.
    None: chunks of at least two epochs (with hooks a one-epoch scan, compiled by XLA as a one-trip loop, can
    differ from a longer one in the last bit: measured 6e-8 on a BatchNorm MLP; without hooks every length is
    the same program) unless a stretch between checkpoints is one epoch long. The first chunk is two epochs
    (three when exactly three are left before a cut), timed (the host's share included); the rest are chunks of
    ``size`` epochs, as many as ``CHUNK_SECONDS`` of training at that pace, with chunks of two (or three, for an
    odd rest) before a cut too near for one; when another length would be another program to compile (hooks)
    and the whole rest costs less than that compilation, ``size`` is two (the program already compiled). With
    several processes, process 0's choice is taken by all (they must run the same programs)."""

    def __init__(self, epochs: int, chunk_epochs: int | None, one_program: bool = False) -> None:
        self.epochs, self.fixed, self.one_program = epochs, chunk_epochs, one_program
        self.size: int | None = None  # chosen from the first chunk's time (None: not yet)
        self.compile_s = 0.0
        self.epoch_s = float("nan")  # the measured seconds of one epoch (the first chunk's)

    def next(self, done: int, every: int) -> int:
        """The epochs of the chunk that starts after ``done`` (``every``: the checkpoint period, 0 for none)."""
        limit = min(self.epochs - done, every - done % every if every else self.epochs)  # epochs to the next cut
        if self.fixed is not None:
            return min(self.fixed, limit)
        k = self.size or 2
        if limit == k or limit >= k + 2:
            return k
        return limit if limit <= 3 else 2  # leaves at least two epochs before the cut

    def compiled(self, seconds: float) -> None:
        """A chunk program took ``seconds`` to compile."""
        self.compile_s = max(self.compile_s, seconds)

    def ran(self, epochs: int, seconds: float, left: int) -> None:
        """A chunk of ``epochs`` took ``seconds``; ``left`` epochs remain. The first decides ``size``."""
        if self.size is not None:
            return
        self.epoch_s = seconds / epochs
        if self.fixed is not None:
            self.size = self.fixed
            return
        cheap = not self.one_program and left * self.epoch_s <= self.compile_s  # the rest costs less than a compile
        k = 2 if cheap else int(CHUNK_SECONDS / max(self.epoch_s, 1e-9))
        k = max(2, min(k, left))
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            k = int(multihost_utils.broadcast_one_to_all(np.int32(k)))
        self.size = k


def shard_over_seeds(tree: Any, devices: Sequence[jax.Device] | None = None) -> Any:
    """Place arrays whose leading axis is the seed axis across ``devices`` (default: all devices, of every
    process; with one device the tree is left where it is, uncommitted).

    Only when the number of seeds divides evenly over the devices; otherwise the tree is returned as is.
    """
    explicit = devices is not None
    devices = list(jax.devices() if devices is None else devices)
    leaves = jax.tree_util.tree_leaves(tree)
    if not leaves or leaves[0].shape[0] % len(devices):
        return tree
    if len(devices) == 1:
        return jax.device_put(tree, devices[0]) if explicit else tree
    mesh = jax.sharding.Mesh(np.asarray(devices), ("seeds",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("seeds"))
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)

    def place(a):  # several processes: each places its own seeds' rows (every process holds the whole tree)
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(place(jax.random.key_data(a)), impl=jax.random.key_impl(a))
        host = np.asarray(a)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
    return jax.tree_util.tree_map(place, tree)


def check_on_device_settings(t: ml_collections.ConfigDict) -> None:
    """``ValueError`` naming the first training setting this feeder cannot honour, with what to use instead (see
    ``resjax.train.config``, "Which feeder honours what"): every other setting of ``train_config`` means the same
    on both feeders. ``augment``: the arrays are trained on as they are (augmenting is the host data source's
    work); ``seed_axis`` 'unroll' or 'loop': the seeds of a sweep are always one vmapped program here;
    ``eval_batch_size`` other than its default: the whole training and test sets are evaluated at once, in no
    batches."""
    feeder, host = "the on-device feeder (make_train)", "the host feeder, make_image_train(config, data)"
    if t.get("augment", False):
        raise ValueError(f"train.augment: {t.augment!r}, but {feeder} trains on the arrays as they are and cannot "
                         f"augment them; set train.augment=False, or train with {host} on "
                         "resjax.data.from_arrays(..., augment='flip' or 'crop_flip')")
    mode = t.get("seed_axis", "auto")
    if mode not in ("auto", "vmap"):
        raise ValueError(f"train.seed_axis: {mode!r} is how the host feeder steps several seeds; {feeder} always "
                         f"steps them as one vmapped program: set train.seed_axis='auto' (or 'vmap'), or train with "
                         f"{host}")
    size = t.get("eval_batch_size", EVAL_BATCH_SIZE)
    if size != EVAL_BATCH_SIZE:
        raise ValueError(f"train.eval_batch_size: {size!r}, but {feeder} evaluates the whole training and test sets "
                         f"at once, in no batches; leave train.eval_batch_size at its default ({EVAL_BATCH_SIZE}), "
                         f"or train with {host} to evaluate in batches")


@stops_cleanly
def make_train(config: ml_collections.ConfigDict, data: Dataset | ArrayData | None = None, *,
               model: nn.Module | None = None, step_hook: Callable | None = None,
               epoch_hook: Callable | None = None, optimizer: Any = None, schedule: Callable | None = None,
               param_groups: Any = None, loss: str | Callable | None = None,
               metrics: Mapping[str, str | Callable] | Sequence[str] | None = None) -> Trainer:
    """A ``Trainer`` for the run config ``config`` (``config.data``, ``config.model``, ``config.train``;
    ``resjax.train.run_config``). ``data`` overrides ``config.data``; ``model`` (a module) overrides
    ``build_model(config.model)``. Validates every setting (``ValueError`` naming it) before anything is
    traced. ``data`` may be a user's arrays (``resjax.data.from_arrays``; without augmentation: this feeder
    trains on the arrays as they are). ``optimizer``, ``schedule``, ``param_groups``: your own optax transformation (or a factory
    of the learning rate), learning-rate multiplier and parameter-group rules (``resjax.train.optim``). ``loss``,
    ``metrics``: the objective (a built-in's name, default ``config.train.loss``, or your functions; see
    ``resjax.train.objective``): the data's targets are checked against it and the model's outputs here."""
    make_args = dict(data=data, model=model, step_hook=step_hook, epoch_hook=epoch_hook, optimizer=optimizer,
                     schedule=schedule, param_groups=param_groups, loss=loss,
                     metrics=metrics)
    check_run_config(config)
    check_on_device_settings(config.train)
    objective = make_objective(config.train, loss, metrics)
    if isinstance(data, ArrayData) and data.augment != "none":
        raise ValueError(f"augment: {data.augment!r} is for the host feeder (make_image_train); the on-device "
                         "feeder trains on the arrays as they are (from_arrays(..., augment='none'))")
    if data is None and "data" not in config:
        raise ValueError("data: make_train needs data: pass data= (resjax.data.from_arrays(x, y, ...) or a "
                         "resjax.data.Dataset) or name a data set in config.data (e.g. 'mnist1d')")
    data = load_dataset(config.data) if data is None else check_finite(data)  # refuses NaN or inf examples
    t = config.train
    if t.batch_size > len(data.y_train):
        raise ValueError(f"batch_size: {t.batch_size} exceeds the {len(data.y_train)} training examples")
    if model is None:
        if "model" not in config:
            raise ValueError("config.model: no model config and no model given")
        model = build_model(config.model, num_classes=data.num_classes)
    check_targets(objective, model, data.x_train.shape[1:], data.y_train, data.y_test, "data",
                  {"label_smoothing": 0.0} if t.get("label_smoothing", 0.0) else None,
                  counts=(len(data.x_train), len(data.x_test)))
    steps = len(data.y_train) // t.batch_size
    periods = step_periods(t)
    if periods is None:
        check_step_count(t.epochs, steps)
    else:  # a step run: the "epochs" of the machinery are its evaluation periods (resjax.train.config)
        steps = periods[1]
    x = jax.ShapeDtypeStruct((2, *data.x_train.shape[1:]), jnp.float32)
    uses_tau = getattr(model, "scaling", None) == "tau"
    params = jax.eval_shape(lambda k, x: model.init(k, x, train=False)["params"], jax.random.key(0), x)
    optim = {k: v for k, v in dict(optimizer=optimizer, schedule=schedule, param_groups=param_groups).items()
             if v is not None}
    tx = make_optimizer(t, params, steps, warn=False, **optim)
    return Trainer(config=config, model=model, tx=tx, optim=optim, objective=objective,
                   example_shape=tuple(data.x_train.shape[1:]), uses_tau=uses_tau, steps_per_epoch=steps, data=data,
                   step_hook=step_hook, epoch_hook=epoch_hook, make_args=make_args)
