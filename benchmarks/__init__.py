"""Benchmarks of resjax: training throughput, seed-vmap speed-up and compile time (``python -m benchmarks.throughput``)."""
