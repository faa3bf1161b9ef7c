"""Checkpoints in a bucket against a local disk, on this machine: a CIFAR ResNet-56 training state saved and
restored through ``resjax.train.checkpoint.Checkpoints`` (Orbax, with resjax's checksums) into a local folder and
into ``gs://`` on a local GCS server (the tests' ``tests/gcs_server.py``: the ``gcp-storage-emulator`` package, in
memory, on 127.0.0.1, started and ended here).

Run from the project root::

    python -m benchmarks.buckets [--depth 56] [--repeats 3]

Prints one table (seconds of a save and of a restore, the median of ``--repeats``; files or objects and bytes one
checkpoint writes) and nothing is asserted. The state is what ``make_image_train`` checkpoints for one seed
(parameters, BatchNorm statistics, SGD momentum, step, key, history). A local server measures the client's work
(Orbax, TensorStore, resjax's checksums and listing) and a loopback HTTP server's, not a real bucket's latency or
bandwidth: on a VM in the bucket's region each request adds its round trip (tens of ms), so the number of objects
matters more there than here.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time


def _server():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.TemporaryFile("w+")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    process = subprocess.Popen([sys.executable, os.path.join(root, "tests", "gcs_server.py"), "127.0.0.1", str(port),
                                "bench"], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.1)
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(STORAGE_EMULATOR_HOST=endpoint, TENSORSTORE_GCS_HTTP_URL=endpoint,
                      GCE_METADATA_HOST="127.0.0.1:1", GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false")
    return process


def _state(depth: int):
    from resjax.data import synthetic_image_dataset
    from resjax.nn import cifar_resnet
    from resjax.train import image_train_config, make_image_train, run_config

    train = synthetic_image_dataset("cifar10", 64, seed=0)
    trainer = make_image_train(run_config(train=image_train_config(batch_size=32, epochs=1)), train,
                               model=cifar_resnet(depth))
    return trainer.init(0)


def _count(directory: str) -> tuple[int, int]:
    from resjax.paths import filesystem

    fs, inner = filesystem(directory) if "://" in directory else (None, directory)
    if fs is None:
        sizes = [os.path.getsize(os.path.join(d, f)) for d, _, fs_ in os.walk(directory) for f in fs_]
    else:
        sizes = [info["size"] for info in fs.find(inner, detail=True).values()]
    return len(sizes), sum(sizes)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", type=int, default=56)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    server = _server()
    try:
        import jax

        from resjax.train.checkpoint import Checkpoints

        state = _state(args.depth)
        rows = []
        local_root = tempfile.mkdtemp(prefix="resjax-bench-")
        for where, root in (("local disk", local_root), ("gs:// (local server)", "gs://bench/ckpt")):
            saves, restores = [], []
            for r in range(args.repeats):
                directory = f"{root}/{r}"
                with Checkpoints(directory, keep=1) as ckpt:
                    t = time.perf_counter()
                    ckpt.save(1, state, {"note": "benchmark"})
                    saves.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    jax.block_until_ready(ckpt.restore(state))
                    restores.append(time.perf_counter() - t)
            files, size = _count(f"{root}/0/1")
            rows.append((where, statistics.median(saves), statistics.median(restores), files, size))
        params = sum(x.size for x in jax.tree_util.tree_leaves(state.state.params))
        print(f"CIFAR ResNet-{args.depth} training state ({params:,} parameters), one seed; median of "
              f"{args.repeats}; {os.cpu_count()} CPU cores")
        print("| where | save (s) | restore (s) | files or objects per checkpoint | bytes |")
        print("|---|---|---|---|---|")
        for where, save, restore, files, size in rows:
            print(f"| {where} | {save:.2f} | {restore:.2f} | {files} | {size / 2**20:.1f} MB |")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
