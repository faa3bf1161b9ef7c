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
  start, ``self.sow('intermediates', 'stem_out', h)`` (optional when the inputs themselves are the start).
  ``path_expansion``'s ``stream_input`` reads the same ``'stem_out'``.
- **Shattered gradients** (``input_gradients``, ``input_gradients_many``): a module or ``apply_fn``
  mapping a ``(1, 1)`` input to one number; no sows.
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

Every function and class a submodule exports (its ``__all__``) is importable from ``resjax.analysis`` itself
(``from resjax.analysis import path_expansion, PathExpansion``), and the submodules stay importable as
``resjax.analysis.paths`` etc. No two submodules export the same name. Left at their submodules, since
their names only make sense there: the constants (``shattering.ESTIMATORS``, ``propagation.KINDS``,
``batchnorm.LAYOUTS`` and ``AXIS_KINDS``, ``scale_invariance.COLLECTIONS``, ``taki.NORMS``,
``taki.ACTIVATIONS`` and ``taki.MOMENTS``), ``taki.identity`` (the identity activation) and
``loss_surface.summarise`` (one probe's summaries). Two similar names differ: ``loglog_slope(x, y)``
(batchnorm: log y against log x) and ``log_log_slope(values, start)`` (stability: a curve against its index).
Importing this package imports JAX and Flax (as the submodules do); SciPy is imported only by
``groups_from_layer``.
"""

from __future__ import annotations

from resjax.analysis.batchnorm import (
    apply_norm, batch_mean, batch_variance, batchnorm_steps, check_flax_momentum, check_rho, check_torch_momentum,
    data_standardised, delta_method_std, drifting_mean, example_outputs, flax_from_rho, flax_from_torch,
    groups_from_layer, lag_and_noise, lag_steps, layer_overrides, loglog_slope, nchw_to_nhwc, nhwc_to_nchw,
    noise_std, norm_module, normalise_by_groups, reduction_axes, rho_from_flax, rho_from_torch, running_estimate,
    running_update, same_partition, scale_shift, standardise, statistic_groups, torch_from_flax, torch_from_rho,
    unbiased_from_population,
)
from resjax.analysis.loss_surface import (
    NoisyBatchNorm, NoisyBNMLP, check_noise, check_step_sizes, largest_trainable_learning_rate, params_loss_fn,
    probe_gradient_direction, trains,
)
from resjax.analysis.paths import (
    BranchStack, PathExpansion, block_jacobians, branch_stack, central_band, contributions_by_length, expand_by_length,
    expand_jvp, expand_vjp, expansion_rel_error, path_counts, path_expansion, path_length_shares, path_magnitudes,
    random_path_masks, residual_stack_of, sampled_path_magnitudes, share_of_paths, stream_input, trajectory,
)
from resjax.analysis.propagation import (
    branch_ratio_of_stream, branch_variance_ratio, doubling_guide, expected_sq_norm_guide, gradient_scale,
    linear_guide, log2_growth_per_block, percentile_bands, product_norms, random_relu_jacobian, ratio_guide,
    stream_activations, sum_scale, variance_through_depth, variances_of_stream,
)
from resjax.analysis.protocol import from_nnx
from resjax.analysis.resnet_signal import block_output_norms, block_outputs, mean_log10_norm
from resjax.analysis.scale_invariance import (
    angle_between, check_learning_rate, check_scale, check_weight_decay, cross_entropy, effective_learning_rate,
    equivalent_learning_rate, get_weight, identity_deviations, parse_path, replace_weight, scale_identities,
    sgd_step_geometry, step_geometry_from_update, weight_loss_fn,
)
from resjax.analysis.shattering import (
    autocorrelation, check_estimator, half_correlation_distance, init_many, input_gradients, input_gradients_many,
    make_grid, scalar_function, shattering_statistics,
)
from resjax.analysis.stability import direct_norms, layer_and_params, log_log_slope, log_space_propagation
from resjax.analysis.taki import (
    backprop_deltas, bn_curve, bn_growth_power, delta_variance, gradient_variance, growth_exponent, he_curve,
    log10_mean_square, make_stack, mean_over_draws, scale_kernels, scaled_fan_in, seed_bn_curve, taki_bound,
    taki_curve, weight_grad_variance,
)

__all__ = [
    "BranchStack", "NoisyBNMLP", "NoisyBatchNorm", "PathExpansion", "angle_between", "apply_norm",
    "autocorrelation", "backprop_deltas", "batch_mean", "batch_variance", "batchnorm_steps", "block_jacobians",
    "block_output_norms", "block_outputs", "bn_curve", "branch_stack", "bn_growth_power", "branch_ratio_of_stream",
    "branch_variance_ratio", "central_band", "check_estimator", "check_flax_momentum", "check_learning_rate",
    "check_noise", "check_rho", "check_scale", "check_step_sizes", "check_torch_momentum", "check_weight_decay",
    "contributions_by_length", "cross_entropy", "data_standardised", "delta_method_std", "delta_variance",
    "direct_norms", "doubling_guide", "drifting_mean", "effective_learning_rate", "equivalent_learning_rate",
    "example_outputs", "expand_by_length", "expand_jvp", "expand_vjp", "expansion_rel_error",
    "expected_sq_norm_guide", "flax_from_rho", "flax_from_torch", "from_nnx", "get_weight", "gradient_scale",
    "gradient_variance", "groups_from_layer", "growth_exponent", "half_correlation_distance", "he_curve",
    "identity_deviations", "init_many", "input_gradients", "input_gradients_many", "lag_and_noise", "lag_steps",
    "largest_trainable_learning_rate", "layer_and_params", "layer_overrides", "linear_guide", "log10_mean_square",
    "log2_growth_per_block", "log_log_slope", "log_space_propagation", "loglog_slope", "make_grid", "make_stack",
    "mean_log10_norm", "mean_over_draws", "nchw_to_nhwc", "nhwc_to_nchw", "noise_std", "norm_module",
    "normalise_by_groups", "params_loss_fn", "parse_path", "path_counts", "path_expansion", "path_length_shares",
    "path_magnitudes", "percentile_bands", "probe_gradient_direction", "product_norms", "random_path_masks",
    "random_relu_jacobian", "ratio_guide", "reduction_axes", "replace_weight", "residual_stack_of", "rho_from_flax",
    "rho_from_torch", "running_estimate", "running_update", "same_partition", "sampled_path_magnitudes",
    "scalar_function", "scale_identities", "scale_kernels", "scale_shift", "scaled_fan_in", "seed_bn_curve",
    "sgd_step_geometry", "share_of_paths", "shattering_statistics", "standardise", "statistic_groups",
    "step_geometry_from_update", "stream_activations", "stream_input", "sum_scale", "taki_bound", "taki_curve",
    "torch_from_flax", "torch_from_rho", "trains", "trajectory", "unbiased_from_population",
    "variance_through_depth", "variances_of_stream", "weight_grad_variance", "weight_loss_fn",
]
