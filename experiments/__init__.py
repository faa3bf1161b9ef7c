"""Experiment scripts: ``python -m experiments.<name> [--quick] [--out DIR] [--<setting> VALUE ...]``.

Each module defines ``NAME``, ``get_config(size)`` (size: ``'quick'``, ``'default'`` or ``'full'``),
``run(config, out_dir) -> metrics`` (which also writes ``out_dir/<NAME>.png``) and ``CLAIMS``, the seed
documents' claims that ``experiments.reproduce`` checks against ``results.json``.
"""

import resjax

resjax.use_every_cpu_core()  # seed sweeps shard across CPU cores (see resjax.use_every_cpu_core)

from resjax.train.distributed import initialize_if_needed  # noqa: E402

initialize_if_needed()  # several hosts: jax.distributed.initialize() when the environment asks for it
