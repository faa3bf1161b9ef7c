"""One process of the multi-process tests (``tests/test_multiprocess.py``): ``python tests/multiprocess_worker.py
STAGES OUT``, alone (one process) or under ``python -m resjax.launch --processes 2 --``.

``STAGES`` is one stage or several, comma-separated, run one after the other in this process (each with a trainer
and data sources of its own, as a process of its own would have): a JAX process costs seconds to start, so the
tests run what they can in one. Each stage writes ``OUT/<stage>-<process index>.npz`` (files are the test's, not
the library's):

  first[:DIR]  a seed sweep of the MNIST-1D trainer (4 seeds, sharded over every device of every process), and
               data-parallel image training (BatchNorm, augmentation) for 2 of 3 epochs with a checkpoint in
               ``OUT/DIR`` (default ``OUT/ckpt``; ``first:none``: no checkpoint); records which examples each
               process read
  resume:DIR   the image run resumed from ``OUT/DIR`` (or the absolute path ``DIR``) to its 3 epochs; writes
               ``OUT/resume-<name of DIR>-<process index>.npz``
  whole        the image run's 3 epochs unbroken
  preempt      the image run with a checkpoint in ``OUT/preempted``; process 1 alone receives SIGTERM at its
               ``SIGTERM_AT_READ``-th training batch of this stage, and every process must save at that epoch's
               end and stop (exit status 143: the last stage)
  die          trains, and process ``DIE`` (default 1) kills itself (``os._exit(3)``) after its second step (the
               last stage)
  copy:A=B     process 0 copies the checkpoint folder ``A`` to ``B`` (paths as for ``resume``), the others wait

A ``DIR`` that is a URL (``gs://bucket/run``: ``tests/test_buckets.py``) is used as it is.
"""

from __future__ import annotations

import os
import signal
import sys

import resjax

resjax.use_every_cpu_core()
from resjax.train.distributed import initialize_if_needed  # noqa: E402

initialize_if_needed()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_disable_most_optimizations", True)  # tiny programs: compile time dominates

from resjax.data import tfds  # noqa: E402
from resjax.train import image_train_config, make_data_mesh, make_image_train, make_train, run_config, train_config  # noqa: E402
from resjax.train.distributed import to_host  # noqa: E402

BATCH, EPOCHS, SEEDS = 16, 3, 4


class Recording(tfds.ImageSource):
    """An in-memory CIFAR-10-shaped source that records every example index it reads."""

    def __init__(self, images, labels, split="train", sigterm_at=0):
        super().__init__("cifar10", split, len(images), lambda idx: (images[idx], labels[idx]))
        self.reads, self.sigterm_at = [], sigterm_at

    def read(self, indices):
        self.reads.append(np.asarray(indices, np.int64).reshape(-1))
        if self.split == "train" and len(self.reads) == self.sigterm_at and jax.process_index() == 1:
            print("worker: process 1 sends itself SIGTERM", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
        return super().read(indices)


def sources(sigterm_at=0):
    """The training source (64 examples: 4 batches of 16 an epoch; process 1 sends itself SIGTERM at its
    ``sigterm_at``-th read, 0: never) and the test source (16 examples)."""
    rng = np.random.default_rng(7)
    labels = rng.integers(0, 10, 80).astype(np.int32)
    protos = rng.integers(0, 256, (10, 32, 32, 3))
    noise = rng.integers(-40, 40, (80, 32, 32, 3))
    images = np.clip(protos[labels] + noise, 0, 255).astype(np.uint8)
    train = Recording(images[:64], labels[:64], sigterm_at=sigterm_at)
    return train, Recording(images[64:], labels[64:], "test")  # test: 16 = a short batch of 12 + ...


class SmallCNN(nn.Module):
    """Conv, BatchNorm (batch statistics over the global batch), ReLU, pooling, dense."""

    num_classes: int = 10

    @nn.compact
    def __call__(self, x, train: bool | None = None):
        x = nn.Conv(4, (3, 3), strides=(2, 2))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return nn.Dense(self.num_classes)(nn.relu(x).mean((1, 2)))


def image_trainer(sigterm_at=0):
    train, test = sources(sigterm_at)
    c = image_train_config(batch_size=BATCH, eval_batch_size=12, epochs=EPOCHS, milestones=(2,), checkpoint_every=1,
                           learning_rate=0.05)
    return make_image_train(run_config(train=c), train, test, model=SmallCNN(), mesh=make_data_mesh()), train, test


def sweep():
    """4 seeds x 4 learning rates of a residual MLP with BatchNorm for 2 epochs: one block, as the sharding of
    the seeds is what is compared, and each block adds to every process's compile time."""
    c = run_config(model=dict(kind="residual_mlp", width=16, num_blocks=1, norm="batch"),
                   train=train_config(epochs=2, batch_size=256), data="mnist1d")
    trainer = make_train(c)
    _, metrics = trainer.sweep(list(range(SEEDS)), {"learning_rate": np.linspace(0.01, 0.04, SEEDS)})
    return {f"sweep_{k}": np.asarray(v) for k, v in metrics.items() if np.ndim(v)}


def history(prefix, run, hist):
    out = {f"{prefix}_{k}": np.asarray(v) for k, v in hist.items() if np.ndim(v)}
    flat = jax.tree_util.tree_leaves_with_path(to_host((run.state.params, run.state.batch_stats)))
    out.update({f"{prefix}_leaf{jax.tree_util.keystr(p)}": np.asarray(v) for p, v in flat})
    return out


def _dir(out: str, arg: str) -> str:
    return arg if "://" in arg else os.path.join(out, arg)


def main(stages: str, out: str) -> None:
    for stage in stages.split(","):
        run_stage(stage, out)


def run_stage(stage: str, out: str) -> None:
    """One stage (see the module docstring), with a trainer and data sources of its own."""
    index = jax.process_index()
    if stage.startswith("copy:"):
        from jax.experimental import multihost_utils

        from resjax.paths import filesystem

        source, _, target = stage[len("copy:"):].partition("=")
        if index == 0:
            fs, source = filesystem(_dir(out, source))
            fs.copy(source, filesystem(_dir(out, target))[1], recursive=True)
        multihost_utils.sync_global_devices("copy")
        return
    result = {"process_count": np.asarray(jax.process_count()), "device_count": np.asarray(jax.device_count())}
    stage, _, arg = stage.partition(":")
    trainer, train, test = image_trainer(int(os.environ.get("SIGTERM_AT_READ", 0)) if stage == "preempt" else 0)
    saved_as = stage
    if stage == "first":
        result.update(sweep())
        ckpt = None if arg == "none" else _dir(out, arg or "ckpt")
        run, hist = trainer.fit(0, epochs=2, checkpoint_dir=ckpt)
        result.update(history("image", run, hist))
        for name, src in (("train_reads", train), ("test_reads", test)):
            result[name] = np.concatenate(src.reads)
            result[name + "_sizes"] = np.asarray([len(r) for r in src.reads])
    elif stage == "preempt":
        trainer.fit(0, checkpoint_dir=os.path.join(out, "preempted"))  # raises Preempted (exit status 143)
    elif stage == "resume":
        saved_as = f"resume-{os.path.basename(arg)}"
        run, hist = trainer.fit(0, checkpoint_dir=_dir(out, arg))
        result.update(history("image", run, hist))
    elif stage == "whole":
        run, hist = trainer.fit(0)
        result.update(history("image", run, hist))
    elif stage == "die":
        run = trainer.init(0)
        for step, (x, y) in enumerate(trainer._batches(0, [0], False)):
            if index == int(os.environ.get("DIE", "1")) and step == 2:
                print(f"worker: process {index} dies now", flush=True)
                os._exit(3)
            run, (loss, _) = trainer.step(run, trainer._place(x, False, BATCH), trainer._place(y, False, BATCH))
            float(loss)  # wait for the step
        for _ in range(100):  # the others keep running collective programs, which need the dead process
            float(trainer.evaluate(run)["loss"])
    else:
        raise SystemExit(f"stage: unknown {stage!r}")
    np.savez(os.path.join(out, f"{saved_as}-{index}.npz"), **result)
    print(f"worker: {saved_as} done in process {index} of {jax.process_count()}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
