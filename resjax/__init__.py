"""resjax: residual-network research in JAX/Flax.

Subpackages:
  nn        Flax linen modules (residual contract, MLPs, norms, initialisers)
  train     one training core and two feeders: on-device (``make_train``, seed-vmapped lax.scan runs) and
            host (``make_image_train``, batches from a data source)
  data      data sets (MNIST-1D generated offline; TFDS loaders)
  analysis  pure functions of (module, variables, inputs)
  interop   weights from and to the peers' PyTorch models (torchvision, tau-ResNet, Fixup)

``resjax.analysis``, ``resjax.train`` and ``resjax.data`` (and each of their modules) list their public
names in ``__all__``, the packages re-exporting the main ones of their submodules. Importing ``resjax``
itself imports no subpackage (and no JAX).
"""

from __future__ import annotations

import os

__all__ = ["use_every_cpu_core"]

__version__ = "0.1.0"


def use_every_cpu_core() -> None:
    """Make every CPU core its own JAX host device, so that seed sweeps shard across cores.

    XLA:CPU runs one small-matmul program on one core about as fast as on two (and a seed-vmapped
    program slower), while one program per core scales with the cores; ``Trainer.sweep`` shards its
    seeds across devices. This sets ``--xla_force_host_platform_device_count`` in ``XLA_FLAGS`` and only
    takes effect before JAX's first computation; it does nothing when ``XLA_FLAGS`` already sets the
    count. ``RESJAX_CPU_DEVICES`` overrides the count (1 turns it off). Accelerator backends are
    unaffected.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in flags:
        return
    count = int(os.environ.get("RESJAX_CPU_DEVICES", os.cpu_count() or 1))
    if count > 1:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
