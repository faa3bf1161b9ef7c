"""How closely a seed trained inside a vmapped sweep matches the same seed trained alone, per precision.

    python tools/seed_agreement.py

For each setting (model, batch size, ``jax.default_matmul_precision``): three seeds through
``Trainer.sweep`` (sharded over the CPU cores as the experiments run it) and each seed alone through
``jax.jit(trainer)``; prints the largest relative difference of the per-epoch train and test losses and
whether the final parameters are bit-identical. The README's precision paragraph quotes its output.
"""

from __future__ import annotations

import resjax

resjax.use_every_cpu_core()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from resjax.train import make_train, run_config, train_config  # noqa: E402

MODELS = (dict(kind="residual_mlp", width=8, num_blocks=3, norm="batch"),
          dict(kind="residual_mlp", width=64, num_blocks=8, norm="batch"),
          dict(kind="plain_mlp", width=64, depth=32))


def main() -> None:
    """Print one line per setting; see the module docstring."""
    print(f"devices: {jax.devices()}")
    for model in MODELS:
        for batch_size in (16, 64):
            for precision in ("highest", "default"):
                with jax.default_matmul_precision(precision):
                    trainer = make_train(run_config(model, train_config(learning_rate=0.05, epochs=3,
                                                                        batch_size=batch_size), data="mnist1d"))
                    keys = jax.random.split(jax.random.key(1), 3)
                    swept, together = trainer.sweep(keys, progress=False)
                    worst, identical = 0.0, True
                    for i in range(len(keys)):
                        run, alone = jax.jit(trainer)(keys[i])
                        for name in ("train_loss", "test_loss"):
                            a, b = np.asarray(together[name][i]), np.asarray(alone[name])
                            worst = max(worst, float(np.max(np.abs(a - b) / np.abs(b))))
                        identical &= all(np.array_equal(np.asarray(x[i]), np.asarray(y)) for x, y in zip(
                            jax.tree_util.tree_leaves(swept.state.params), jax.tree_util.tree_leaves(run.state.params)))
                size = model.get("num_blocks", model.get("depth"))
                print(f"{model['kind']:13s} width {model['width']:3d} x {size:2d}  batch {batch_size:3d}  {precision:8s}"
                      f"  loss max rel diff {worst:.2g}  params bit-identical: {identical}", flush=True)


if __name__ == "__main__":
    main()
