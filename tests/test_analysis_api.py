"""``resjax.analysis``'s top level (issue #24 item 4): the user-facing analyses, grouped by task in ``__all__``;
experiment helpers and checks left in their submodules, a name exported here before still resolving, with a
``DeprecationWarning`` that names its submodule."""

from __future__ import annotations

import importlib
import warnings

import pytest

import resjax.analysis as analysis

SUBMODULES = ("batchnorm", "loss_surface", "paths", "propagation", "protocol", "resnet_signal", "scale_invariance",
              "shattering", "stability", "taki")


def test_all_is_the_grouped_list():
    assert list(analysis.GROUPS) == ["signal propagation", "gradients / shattering", "paths", "BatchNorm",
                                     "your own model"]
    assert analysis.__all__ == [name for names in analysis.GROUPS.values() for name in names]
    assert len(set(analysis.__all__)) == len(analysis.__all__)
    expected = {
        "signal propagation": {"variance_through_depth", "stream_activations", "branch_variance_ratio",
                               "gradient_scale", "block_output_norms", "log_space_propagation"},
        "gradients / shattering": {"input_gradients", "input_gradients_many", "autocorrelation",
                                   "shattering_statistics"},
        "paths": {"path_expansion", "PathExpansion", "branch_stack", "BranchStack", "residual_stack_of",
                  "stream_input", "block_jacobians", "path_counts"},
        "BatchNorm": {"batchnorm_steps", "example_outputs", "running_estimate", "lag_and_noise", "scale_identities",
                      "reduction_axes"},
        "your own model": {"from_nnx"},
    }
    for group, names in expected.items():
        assert names <= set(analysis.GROUPS[group]), (group, names - set(analysis.GROUPS[group]))
    for name in analysis.__all__:
        assert not name.startswith("check_") and not name.endswith("_guide"), name
        obj = getattr(analysis, name)
        # each is its submodule's own object, and named in that submodule's __all__
        module = importlib.import_module(obj.__module__)
        assert obj.__module__.rsplit(".", 1)[-1] in SUBMODULES and name in module.__all__, name
    # every name is named in the docstring, which lists the groups
    for name in analysis.__all__:
        assert f"``{name}``" in analysis.__doc__, name


def test_helpers_stay_in_their_submodules_and_moved_names_resolve_with_a_warning():
    exported = set(analysis.__all__)
    for submodule, names in analysis.MOVED.items():
        module = importlib.import_module(f"resjax.analysis.{submodule}")
        for name in names:
            assert name in module.__all__ and name not in exported, name
            assert name not in vars(analysis), name  # only through __getattr__
            with pytest.warns(DeprecationWarning, match=rf"from resjax\.analysis\.{submodule} import {name}`"):
                assert getattr(analysis, name) is getattr(module, name)
    # the experiment helpers named in the issue, and every check, are among them
    moved = {name for names in analysis.MOVED.values() for name in names}
    assert {"doubling_guide", "percentile_bands", "linear_guide", "ratio_guide", "central_band"} <= moved
    public = {name for sub in SUBMODULES for name in importlib.import_module(f"resjax.analysis.{sub}").__all__}
    assert {name for name in public if name.startswith("check_")} <= moved
    # the old top level was every submodule name but the constants, taki.identity and loss_surface.summarise
    left_out = public - exported - moved
    assert left_out == {"ESTIMATORS", "KINDS", "LAYOUTS", "AXIS_KINDS", "COLLECTIONS", "NORMS", "ACTIVATIONS",
                        "MOMENTS", "identity", "summarise"}, left_out


def test_from_import_of_a_moved_name_warns_and_unknown_names_raise():
    with pytest.warns(DeprecationWarning, match="resjax.analysis.propagation import doubling_guide"):
        from resjax.analysis import doubling_guide
    from resjax.analysis.propagation import doubling_guide as direct
    assert doubling_guide is direct
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the grouped names themselves never warn
        from resjax.analysis import path_expansion, variance_through_depth  # noqa: F401
    with pytest.raises(AttributeError, match="no attribute 'no_such_analysis'"):
        analysis.no_such_analysis  # noqa: B018
    with pytest.raises(ImportError):
        from resjax.analysis import ESTIMATORS  # noqa: F401  (never exported here: shattering.ESTIMATORS)
