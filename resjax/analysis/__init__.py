"""Analysis tools: pure functions of (module, variables, inputs); no training inside.

paths.py             block Jacobians, exact expansion by path length, path counts
shattering.py        input gradients on a grid, autocorrelation estimators, half-correlation distance
propagation.py       activation variance and gradient scale through depth
batchnorm.py         BatchNorm by hand, batch noise, running estimates, normalisation axes
scale_invariance.py  the scale-invariance identities of a weight layer followed by BatchNorm
loss_surface.py      loss and gradient variation along the gradient, trainable learning rates, noisy BatchNorm
stability.py         log-space forward norms and per-block gradients of positively homogeneous stacks
taki.py              Taki's gradient-variance curves through depth and their measurement
resnet_signal.py     block-output norms of convolutional ResNets from their sown intermediates (overflow-safe)
"""
