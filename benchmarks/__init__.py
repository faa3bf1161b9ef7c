"""Benchmarks of resjax: training throughput, seed-vmap speed-up and compile time (``python -m benchmarks.throughput``).

Importing this package changes nothing in the process; each benchmark's ``main`` first makes every CPU core
a JAX device (``resjax.use_every_cpu_core``), as the experiments run.
"""
