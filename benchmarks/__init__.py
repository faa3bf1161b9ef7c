"""Benchmarks of resjax: training throughput, seed-vmap speed-up and compile time (``python -m benchmarks.throughput``)."""

import resjax

resjax.use_every_cpu_core()  # as the experiments run: one JAX device per CPU core
