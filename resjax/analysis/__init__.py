"""Analysis tools: pure functions of (module, variables, inputs); no training inside.

What a model of your own needs (any Flax Linen module, an NNX model through the bridge, or a function;
no resjax base class; tested in ``tests/test_analysis_protocol.py``):

- **The call.** A Linen module, applied as ``module.apply(variables, x, **kwargs)``, or a plain function
  ``apply_fn(variables, x, **kwargs)`` with Linen's ``apply`` conventions (it returns ``(output,
  updated_collections)`` when called with ``mutable=[...]``; a bound ``module.apply`` is one). ``variables``
  is a Linen variables dict (``{'params': ...}``, plus ``'batch_stats'`` where there is BatchNorm).
- **``train``.** Passed only to a callee that takes it: a module whose ``__call__`` has a ``train``
  parameter (resjax's do; BatchNorm needs it), or a function with ``**kwargs`` when you give ``train``.
  Giving ``train`` to a model that takes none raises ``ValueError`` naming ``train``.
- **Sows, for variance through depth** (``stream_activations``, ``variance_through_depth``,
  ``branch_variance_ratio``): every residual block's output, ``self.sow('intermediates', 'block_out', h)``
  inside block k's own submodule (``blocks_0``, ``blocks_1``, ... or a list ``blocks``: ordered by their
  numeric suffix) or once under ``nn.scan`` (a leading depth axis); and at the top level the stream's
  start, ``self.sow('intermediates', 'stem_out', h)`` (optional when the inputs themselves are the start;
  ``'stem'``, what ``resjax.nn.ResNet`` sows, is read too). A stream that changes shape (a convolutional
  ResNet's stages) is read per stage: ``variance_through_depth`` gives a ``'stage'`` per depth,
  ``stream_activations(..., by_stage=True)`` one stacked array per stage, ``path_expansion(..., stage=s)``
  one stage's blocks. ``path_expansion``'s ``stream_input`` reads the same ``'stem_out'``.
- **No ``train`` default picks a mode.** The analyses that run a model take ``train`` with no default
  (``block_outputs``, ``block_output_norms``, ``params_loss_fn``, ``weight_loss_fn``, ``gradient_variance``)
  or with ``None``, which passes nothing (the propagation functions): a model with BatchNorm then refuses
  the call with a ``ValueError`` naming ``train``. ``tests/test_analysis_matrix.py`` runs every analysis
  here on every ``build_model`` kind and on a Flax-only model.
- **Shattered gradients** (``input_gradients``, ``input_gradients_many``): a module or ``apply_fn``
  mapping a ``(1, 1)`` input to one number; no sows. Any other model (every ``build_model`` kind) with
  ``embed=`` (a line through its input space, ``lambda t: x0 + t * v``) and ``readout=`` (one number of its
  output, ``lambda y: y[0, c]``); without them it is refused, naming both.
- **Path expansion of your own stack**: ``branch_stack([(f_1, params_1), ..., (f_K, params_K)])``, block k
  being ``x <- x + f_k(params_k, x)`` on one example, then ``path_expansion(stack, x0)`` with the stream
  ``x0`` ``(B, D)`` before block 1; ``terms.sum(1)`` is the stack's Jacobian. (resjax's ``ResidualMLP``
  needs none of this: ``path_expansion(model, variables, inputs)``.)
- **NNX.** An NNX module of your own: wrap its class, ``flax.nnx.bridge.to_linen(MyNet, *args)``, and pass
  that Linen module with its ``init`` variables (NNX ``self.sow(nnx.Intermediate, 'block_out', h)`` becomes
  the ``'intermediates'`` collection). A Linen model held as ``flax.nnx.bridge.ToNNX``: ``from_nnx(model)``
  gives ``(module, variables)``. An NNX module, ``nnx.State`` or NNX variables handed to an analysis are
  refused with a ``TypeError`` saying this.

protocol.py          what a model of your own needs: the call, ``train``, NNX objects (``from_nnx``)
paths.py             block Jacobians, exact expansion by path length, path counts
shattering.py        input gradients on a grid, autocorrelation estimators, half-correlation distance
propagation.py       activation variance and gradient scale through depth
batchnorm.py         BatchNorm by hand, batch noise, running estimates, normalisation axes
scale_invariance.py  the scale-invariance identities of a weight layer followed by BatchNorm
loss_surface.py      loss and gradient variation along the gradient, trainable learning rates, noisy BatchNorm
stability.py         log-space forward norms and per-block gradients of positively homogeneous stacks
taki.py              Taki's gradient-variance curves through depth and their measurement
resnet_signal.py     block-output norms of convolutional ResNets from their sown intermediates (overflow-safe)

What is exported here is what a user runs, grouped by task (``__all__`` in this order); the submodules stay
importable as ``resjax.analysis.paths`` etc. and keep everything else: the helpers of the lecture experiments
(the lecture's guide curves, Taki's mean-field curves, percentile bands, path-count bands, ...), the argument
checks (``check_*``) and the constants. Those are imported from their submodule
(``from resjax.analysis.propagation import doubling_guide``); a name that was exported here before still
resolves from ``resjax.analysis`` with a ``DeprecationWarning`` that names its submodule.

**Signal propagation** (the forward stream and gradient sizes through depth, at initialisation):

- ``variance_through_depth``, ``stream_activations``, ``branch_variance_ratio`` (propagation): the stream's
  variance, the stream itself, and what each block adds, for any module following the protocol above;
- ``gradient_scale`` (propagation): gradient norms through random plain and residual Jacobian products;
- ``gradient_variance`` (taki): per-layer gradient second moments of a ``ResidualStack`` over draws;
- ``block_output_norms``, ``block_outputs`` (resnet_signal): a convolutional ``ResNet``'s block outputs;
- ``log_space_propagation`` (stability): forward and backward norms in log space, overflow-free.

**Gradients / shattering** (how input gradients decorrelate):

- ``input_gradients``, ``input_gradients_many``, ``init_many``: dy/dx on a grid, for one network or many;
- ``autocorrelation``, ``shattering_statistics``, ``half_correlation_distance``: their correlation by lag.

**Paths** (the exact path expansion of a residual stack):

- ``path_expansion`` -> ``PathExpansion``: block Jacobians and the terms by path length;
- ``branch_stack`` -> ``BranchStack`` (your own stack), ``residual_stack_of`` (resjax's), ``stream_input``;
- ``block_jacobians``, ``expand_jvp``, ``expand_vjp``: dense or matrix-free forms;
- ``path_counts``, ``path_length_shares``, ``sampled_path_magnitudes``: how many paths of each length, and
  how large they are.

**BatchNorm** (its statistics, its running estimates, and what it does to the loss and the learning rate):

- ``batchnorm_steps``: BatchNorm by hand, stage by stage; ``example_outputs``: batch noise on one example;
- ``running_update``, ``running_estimate``, ``lag_and_noise``: running estimates, split into lag and noise;
  ``flax_from_torch``, ``torch_from_flax``: BatchNorm momentum between the two conventions;
- ``reduction_axes``, ``statistic_groups``: which values share one mean and variance (batch, layer, group,
  instance);
- ``scale_identities``, ``weight_loss_fn``, ``effective_learning_rate``, ``sgd_step_geometry``,
  ``step_geometry_from_update`` (scale_invariance): a weight followed by BatchNorm is scale-invariant;
- ``params_loss_fn``, ``probe_gradient_direction`` (loss_surface): loss and gradient along the gradient.

**Your own model**: the protocol above; ``from_nnx`` for a Linen model held by ``flax.nnx.bridge.ToNNX``.

Two similar names differ: ``batchnorm.loglog_slope(x, y)`` (log y against log x) and
``stability.log_log_slope(values, start)`` (a curve against its index). No two submodules export the same
name. Importing this package imports JAX and Flax (as the submodules do); SciPy is imported only by
``batchnorm.groups_from_layer``.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from resjax.analysis.batchnorm import (
    batchnorm_steps, example_outputs, flax_from_torch, lag_and_noise, reduction_axes, running_estimate, running_update,
    statistic_groups, torch_from_flax,
)
from resjax.analysis.loss_surface import params_loss_fn, probe_gradient_direction
from resjax.analysis.paths import (
    BranchStack, PathExpansion, block_jacobians, branch_stack, expand_jvp, expand_vjp, path_counts, path_expansion,
    path_length_shares, residual_stack_of, sampled_path_magnitudes, stream_input,
)
from resjax.analysis.propagation import (
    branch_variance_ratio, gradient_scale, stream_activations, variance_through_depth,
)
from resjax.analysis.protocol import from_nnx
from resjax.analysis.resnet_signal import block_output_norms, block_outputs
from resjax.analysis.scale_invariance import (
    effective_learning_rate, scale_identities, sgd_step_geometry, step_geometry_from_update, weight_loss_fn,
)
from resjax.analysis.shattering import (
    autocorrelation, half_correlation_distance, init_many, input_gradients, input_gradients_many,
    shattering_statistics,
)
from resjax.analysis.stability import log_space_propagation
from resjax.analysis.taki import gradient_variance

#: The top level's names by task, in ``__all__``'s order.
GROUPS = {
    "signal propagation": (
        "variance_through_depth", "stream_activations", "branch_variance_ratio", "gradient_scale",
        "gradient_variance", "block_output_norms", "block_outputs", "log_space_propagation",
    ),
    "gradients / shattering": (
        "input_gradients", "input_gradients_many", "init_many", "autocorrelation", "shattering_statistics",
        "half_correlation_distance",
    ),
    "paths": (
        "path_expansion", "PathExpansion", "branch_stack", "BranchStack", "residual_stack_of", "stream_input",
        "block_jacobians", "expand_jvp", "expand_vjp", "path_counts", "path_length_shares",
        "sampled_path_magnitudes",
    ),
    "BatchNorm": (
        "batchnorm_steps", "example_outputs", "running_update", "running_estimate", "lag_and_noise",
        "flax_from_torch", "torch_from_flax", "reduction_axes", "statistic_groups", "scale_identities",
        "weight_loss_fn", "effective_learning_rate", "sgd_step_geometry", "step_geometry_from_update",
        "params_loss_fn", "probe_gradient_direction",
    ),
    "your own model": ("from_nnx",),
}

__all__ = [
    # signal propagation
    "variance_through_depth", "stream_activations", "branch_variance_ratio", "gradient_scale", "gradient_variance",
    "block_output_norms", "block_outputs", "log_space_propagation",
    # gradients / shattering
    "input_gradients", "input_gradients_many", "init_many", "autocorrelation", "shattering_statistics",
    "half_correlation_distance",
    # paths
    "path_expansion", "PathExpansion", "branch_stack", "BranchStack", "residual_stack_of", "stream_input",
    "block_jacobians", "expand_jvp", "expand_vjp", "path_counts", "path_length_shares", "sampled_path_magnitudes",
    # BatchNorm
    "batchnorm_steps", "example_outputs", "running_update", "running_estimate", "lag_and_noise", "flax_from_torch",
    "torch_from_flax", "reduction_axes", "statistic_groups", "scale_identities", "weight_loss_fn",
    "effective_learning_rate", "sgd_step_geometry", "step_geometry_from_update", "params_loss_fn",
    "probe_gradient_direction",
    # your own model
    "from_nnx",
]

#: Names this package exported before they were left to their submodules (issue #24 item 4): each still
#: resolves from ``resjax.analysis`` through ``__getattr__``, with a ``DeprecationWarning``.
MOVED = {
    "batchnorm": (
        "apply_norm", "batch_mean", "batch_variance", "check_flax_momentum", "check_rho", "check_torch_momentum",
        "data_standardised", "delta_method_std", "drifting_mean", "flax_from_rho", "groups_from_layer", "lag_steps",
        "layer_overrides", "loglog_slope", "nchw_to_nhwc", "nhwc_to_nchw", "noise_std", "norm_module",
        "normalise_by_groups", "rho_from_flax", "rho_from_torch", "same_partition", "scale_shift", "standardise",
        "torch_from_rho", "unbiased_from_population",
    ),
    "loss_surface": (
        "NoisyBNMLP", "NoisyBatchNorm", "check_noise", "check_step_sizes", "largest_trainable_learning_rate", "trains",
    ),
    "paths": (
        "central_band", "contributions_by_length", "expand_by_length", "expansion_rel_error", "path_magnitudes",
        "random_path_masks", "share_of_paths", "trajectory",
    ),
    "propagation": (
        "branch_ratio_of_stream", "doubling_guide", "expected_sq_norm_guide", "linear_guide", "log2_growth_per_block",
        "percentile_bands", "product_norms", "random_relu_jacobian", "ratio_guide", "sum_scale",
        "variances_of_stream",
    ),
    "resnet_signal": ("mean_log10_norm",),
    "scale_invariance": (
        "angle_between", "check_learning_rate", "check_scale", "check_weight_decay", "cross_entropy",
        "equivalent_learning_rate", "get_weight", "identity_deviations", "parse_path", "replace_weight",
    ),
    "shattering": ("check_estimator", "make_grid", "scalar_function"),
    "stability": ("direct_norms", "layer_and_params", "log_log_slope"),
    "taki": (
        "backprop_deltas", "bn_curve", "bn_growth_power", "delta_variance", "growth_exponent", "he_curve",
        "log10_mean_square", "make_stack", "mean_over_draws", "scale_kernels", "scaled_fan_in", "seed_bn_curve",
        "taki_bound", "taki_curve", "weight_grad_variance",
    ),
}
_MOVED_FROM = {name: submodule for submodule, names in MOVED.items() for name in names}


def __getattr__(name: str) -> Any:
    """A name this package exported before (``MOVED``), from its submodule, with a ``DeprecationWarning``
    naming the import to use instead; ``AttributeError`` for any other name."""
    submodule = _MOVED_FROM.get(name)
    if submodule is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"resjax.analysis.{name} has moved to its submodule: use "
                  f"`from resjax.analysis.{submodule} import {name}`", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(f"{__name__}.{submodule}"), name)
