"""resjax: residual-network research in JAX/Flax.

Subpackages:
  nn        Flax linen modules (residual contract, MLPs, norms, initialisers)
  train     seed-vmapped training loops (``make_train``)
  data      data sets (MNIST-1D generated offline; TFDS loaders)
  analysis  pure functions of (module, variables, inputs)
"""

__version__ = "0.1.0"
