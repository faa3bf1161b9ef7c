"""Every initialiser by name.

``get_initializer(name, gain=1.0)`` returns a ``jax.nn.initializers`` function. Names:

==================  =====================================================================
he_normal_fan_in    N(0, 2/fan_in)   (alias ``he_normal``; untruncated, so the variance is exact)
he_normal_fan_out   N(0, 2/fan_out)  (He et al.'s "fan_out" mode, the conv ResNets' choice)
he_uniform_fan_in   U(+-sqrt(6/fan_in)), variance 2/fan_in (alias ``he_uniform``; PyTorch's
                    ``nn.init.kaiming_uniform_`` with its defaults, as the udlbook notebooks use)
he_uniform_fan_out  U(+-sqrt(6/fan_out))
fan_in              N(0, 1/fan_in)   (alias ``lecun_normal``; the lecture's 1/fan-in draws)
torch_default       U(+-1/sqrt(fan_in)), variance 1/(3 fan_in): PyTorch's ``nn.Linear`` default
zeros               all zeros
==================  =====================================================================

``gain`` multiplies the draw (Fixup scales its branch layers this way). Fan-in and fan-out are
flax's: for a Dense kernel ``(in, out)`` fan_in = in; for a conv kernel ``(h, w, in, out)`` fan_in =
h*w*in.

``get_bias_initializer(name, fan_in)`` returns a bias initialiser. A bias vector does not know its
layer's fan-in, so the layer passes it (the size of the layer's input). Names:

==================  =====================================================================
zeros               all zeros (the default everywhere)
fan_in              N(0, 1/fan_in): the lecture's "weights and biases drawn at variance
                    1/fan-in" (so the input layer of a scalar-input network has variance 1)
==================  =====================================================================
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
from jax.nn import initializers

Initializer = Callable

_BASE = {
    "he_normal_fan_in": lambda: initializers.variance_scaling(2.0, "fan_in", "normal"),
    "he_normal_fan_out": lambda: initializers.variance_scaling(2.0, "fan_out", "normal"),
    "he_uniform_fan_in": lambda: initializers.variance_scaling(2.0, "fan_in", "uniform"),
    "he_uniform_fan_out": lambda: initializers.variance_scaling(2.0, "fan_out", "uniform"),
    "fan_in": lambda: initializers.variance_scaling(1.0, "fan_in", "normal"),
    "torch_default": lambda: initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform"),
    "zeros": lambda: initializers.zeros,
}
_ALIASES = {"he_normal": "he_normal_fan_in", "he_uniform": "he_uniform_fan_in", "lecun_normal": "fan_in"}

INITIALIZERS = tuple(sorted(_BASE)) + tuple(sorted(_ALIASES))


def get_initializer(name: str | Initializer, gain: float = 1.0) -> Initializer:
    """The initialiser called ``name`` (or ``name`` itself if it is already a function), times ``gain``."""
    if callable(name):
        base = name
    else:
        key = _ALIASES.get(name, name)
        if key not in _BASE:
            raise ValueError(f"kernel_init: unknown initialiser {name!r}; choose one of {INITIALIZERS}")
        base = _BASE[key]()
    if gain == 1.0:
        return base

    def scaled(key, shape, dtype=jnp.float32):
        return gain * base(key, shape, dtype)

    return scaled


_BIAS = {
    "zeros": lambda fan_in: initializers.zeros,
    "fan_in": lambda fan_in: initializers.normal(stddev=(1.0 / fan_in) ** 0.5),
}
BIAS_INITIALIZERS = tuple(_BIAS)


def get_bias_initializer(name: str | Initializer, fan_in: int) -> Initializer:
    """The bias initialiser called ``name`` for a layer whose input has ``fan_in`` features (or ``name``
    itself if it is already a function, called as ``init(key, shape, dtype)``)."""
    if callable(name):
        return name
    if name not in _BIAS:
        raise ValueError(f"bias_init: unknown initialiser {name!r}; choose one of {BIAS_INITIALIZERS}")
    if not isinstance(fan_in, int) or isinstance(fan_in, bool) or fan_in < 1:
        raise ValueError(f"bias_init: fan_in must be an integer >= 1, got {fan_in!r}")
    return _BIAS[name](fan_in)
