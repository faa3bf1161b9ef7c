"""A run of ``tests/test_buckets.py`` in a process of its own, as on a VM: ``python tests/bucket_child.py FEEDER URL
[STOP_AFTER]``. Trains two seeds (the on-device feeder: a residual MLP on small arrays; the host feeder: a small CNN
on in-memory images), checkpointing into the bucket folder URL and logging there; with STOP_AFTER, sends itself
SIGTERM after that epoch (as a preempted VM is told to stop). Prints the history as one JSON line, ``history {...}``.
"""

import json
import os
import signal
import sys

import numpy as np


def main(feeder: str, url: str, stop_after: int | None) -> None:
    import jax

    jax.config.update("jax_disable_most_optimizations", True)

    def stop(done, summary):
        if stop_after is not None and done == stop_after:
            os.kill(os.getpid(), signal.SIGTERM)

    if feeder == "ondevice":
        from resjax.data import from_arrays
        from resjax.train import make_train, run_config, train_config
        from tests.small_data import separable_arrays

        config = run_config(dict(kind="residual_mlp", width=8, num_blocks=2, norm="batch"),
                            train_config(batch_size=16, epochs=3, checkpoint_every=1, momentum=0.9))
        _, history = make_train(config, from_arrays(*separable_arrays(64, (6,)))).fit(
            [0, 1], checkpoint_dir=url, log=url, callback=stop, chunk_epochs=1, progress=False)
    else:
        from tests.test_faults import CONFIG, TEST, TRAIN, ActCNN, trainer_for

        c = CONFIG.copy_and_resolve_references()
        c.epochs = 3
        _, history = trainer_for(c, ActCNN(), TRAIN, TEST).fit([0, 1], checkpoint_dir=url, log=url, callback=stop,
                                                              progress=False)
    print("history", json.dumps({k: np.asarray(v).tolist() for k, v in history.items()}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None)
