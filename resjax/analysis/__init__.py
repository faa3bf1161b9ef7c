"""Analysis tools: pure functions of (module, variables, inputs); no training inside.

paths.py        block Jacobians, exact expansion by path length, path counts
shattering.py   input gradients on a grid, autocorrelation estimators, half-correlation distance
propagation.py  activation variance and gradient scale through depth
"""
