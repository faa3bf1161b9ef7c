"""One process of the multi-process tests (``tests/test_multiprocess.py``): ``python tests/multiprocess_worker.py
STAGE OUT``, alone (one process) or under ``python -m resjax.launch --processes 2 --``.

Stages (each process writes ``OUT/<stage>-<process index>.npz``; files are the test's, not the library's):

  first   a seed sweep of the MNIST-1D trainer (4 seeds, sharded over every device of every process), and
          data-parallel image training (BatchNorm, augmentation) for 2 of 3 epochs with a checkpoint in
          ``OUT/ckpt``; records which examples each process read
  resume  the image run resumed from ``OUT/<ckpt>`` (``RESUME_DIR``) to its 3 epochs
  whole   the image run's 3 epochs unbroken
  preempt the image run with a checkpoint in ``OUT/ckpt``; process 1 alone receives SIGTERM at its
          ``SIGTERM_AT_READ``-th training batch, and every process must save at that epoch's end and stop
  die     trains, and process ``DIE`` (default 1) kills itself (``os._exit``) after its second step
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

    def __init__(self, images, labels, split="train"):
        super().__init__("cifar10", split, len(images), lambda idx: (images[idx], labels[idx]))
        self.reads = []

    def read(self, indices):
        self.reads.append(np.asarray(indices, np.int64).reshape(-1))
        if self.split == "train" and len(self.reads) == int(os.environ.get("SIGTERM_AT_READ", 0)) \
                and jax.process_index() == 1:
            print("worker: process 1 sends itself SIGTERM", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
        return super().read(indices)


def sources():
    rng = np.random.default_rng(7)
    labels = rng.integers(0, 10, 80).astype(np.int32)
    protos = rng.integers(0, 256, (10, 32, 32, 3))
    noise = rng.integers(-40, 40, (80, 32, 32, 3))
    images = np.clip(protos[labels] + noise, 0, 255).astype(np.uint8)
    return Recording(images[:64], labels[:64]), Recording(images[64:], labels[64:], "test")  # test: 16 = a short batch of 12 + ...


class SmallCNN(nn.Module):
    """Conv, BatchNorm (batch statistics over the global batch), ReLU, pooling, dense."""

    num_classes: int = 10

    @nn.compact
    def __call__(self, x, train: bool | None = None):
        x = nn.Conv(4, (3, 3), strides=(2, 2))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return nn.Dense(self.num_classes)(nn.relu(x).mean((1, 2)))


def image_trainer():
    train, test = sources()
    c = image_train_config(batch_size=BATCH, eval_batch_size=12, epochs=EPOCHS, milestones=(2,), checkpoint_every=1,
                           learning_rate=0.05)
    return make_image_train(run_config(train=c), train, test, model=SmallCNN(), mesh=make_data_mesh()), train, test


def sweep():
    c = run_config(model=dict(kind="residual_mlp", width=16, num_blocks=3, norm="batch"), train=train_config(epochs=2, batch_size=256),
                   data="mnist1d")
    trainer = make_train(c)
    _, metrics = trainer.sweep(list(range(SEEDS)), {"learning_rate": np.linspace(0.01, 0.04, SEEDS)})
    return {f"sweep_{k}": np.asarray(v) for k, v in metrics.items() if np.ndim(v)}


def history(prefix, run, hist):
    out = {f"{prefix}_{k}": np.asarray(v) for k, v in hist.items() if np.ndim(v)}
    flat = jax.tree_util.tree_leaves_with_path(to_host((run.state.params, run.state.batch_stats)))
    out.update({f"{prefix}_leaf{jax.tree_util.keystr(p)}": np.asarray(v) for p, v in flat})
    return out


def main(stage: str, out: str) -> None:
    index = jax.process_index()
    result = {"process_count": np.asarray(jax.process_count()), "device_count": np.asarray(jax.device_count())}
    trainer, train, test = image_trainer()
    if stage == "first":
        result.update(sweep())
        run, hist = trainer.fit(0, epochs=2, checkpoint_dir=os.path.join(out, "ckpt"))
        result.update(history("image", run, hist))
        for name, src in (("train_reads", train), ("test_reads", test)):
            result[name] = np.concatenate(src.reads)
            result[name + "_sizes"] = np.asarray([len(r) for r in src.reads])
    elif stage == "preempt":
        trainer.fit(0, checkpoint_dir=os.path.join(out, "ckpt"))  # raises Preempted (exit status 143)
    elif stage == "resume":
        run, hist = trainer.fit(0, checkpoint_dir=os.path.join(out, os.environ["RESUME_DIR"]))
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
        for _ in range(100):  # process 0 keeps running collective programs, which need process 1
            float(trainer.evaluate(run)["loss"])
    else:
        raise SystemExit(f"stage: unknown {stage!r}")
    np.savez(os.path.join(out, f"{stage}-{index}.npz"), **result)
    print(f"worker: {stage} done in process {index} of {jax.process_count()}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
