"""Experiment scripts: ``python -m experiments.<name> [--quick] [--out DIR] [--<setting> VALUE ...]``.

Each module defines ``NAME``, ``get_config(size)`` (size: ``'quick'``, ``'default'`` or ``'full'``),
``run(config, out_dir) -> metrics`` (which also writes ``out_dir/<NAME>.png``) and ``CLAIMS``, the seed
documents' claims that ``experiments.reproduce`` checks against ``results.json``, and ``check(config)``,
the preflight hook: it raises ``ValueError`` naming the first bad setting of any cell the run would train
(``experiments.common.preflight`` calls it before any training; ``run`` calls it too).

Importing this package changes nothing in the process: the entry points (``common.main``,
``reproduce.main``) call ``common.start()``, which makes every CPU core a JAX device and starts
``jax.distributed`` when the environment asks for several processes.
"""
