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
taki(c=C, L=K)      N(0, c/(fan_in L)), untruncated: Taki (2017), eq. (28), "Var[w] = c/(nL)" for a
                    plain ResNet of L residual blocks (fan-in n, c = O(1)); ``L`` (alias ``K``,
                    ``num_blocks``) is required, ``c`` defaults to 1. Also
                    ``get_initializer('taki', c=C, num_blocks=K)`` or ``taki_init(c, num_blocks)``.
==================  =====================================================================

The parameter-free names are listed in ``INITIALIZERS``; ``taki`` takes parameters (listed in
``PARAMETRISED_INITIALIZERS``), because its variance depends on the depth: a bare ``'taki'`` raises
``ValueError`` rather than silently assume L = 1. The string form (``'taki(c=1, L=100)'``; spaces
ignored) goes wherever a ``kernel_init`` name goes (``ResidualStack(kernel_init='taki(L=100)')``,
config files, ``--kernel_init`` flags). Bad parameters (c <= 0 or not finite, L not an integer >= 1,
an unknown parameter) raise ``ValueError`` naming the setting. Taki's own CIFAR runs drew
1/(8*8*16*100), i.e. c = 1, n = 8*8*16 (an 8x8 convolution on 16 channels), L = 100.

``gain`` multiplies the draw (Fixup scales its branch layers this way). Every initialiser returned here
draws in float32 (or float64) and rounds to a narrower dtype (``drawn_in_float32``): a model built with
``param_dtype='bfloat16'`` starts from its float32 twin's draws, rounded, not from other random numbers. Fan-in
and fan-out are flax's: for a Dense kernel ``(in, out)`` fan_in = in; for a conv kernel ``(h, w, in, out)`` fan_in =
h*w*in.

``get_bias_initializer(name, fan_in)`` returns a bias initialiser. A bias vector does not know its
layer's fan-in, so the layer passes it (the size of the layer's input). Names:

==================  =====================================================================
zeros               all zeros (the default everywhere)
fan_in              N(0, 1/fan_in): the lecture's "weights and biases drawn at variance
                    1/fan-in" (so the input layer of a scalar-input network has variance 1)
torch_default       U(+-1/sqrt(fan_in)): PyTorch's ``nn.Linear`` bias default
==================  =====================================================================
"""

from __future__ import annotations

import re
from typing import Any, Callable

import jax
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

#: The parameter-free initialisers by name (``kernel_init``, ``get_initializer``; the module's table says what each
#: draws).
INITIALIZERS = tuple(sorted(_BASE)) + tuple(sorted(_ALIASES))
#: The initialisers that take parameters, as ``'taki(c=1, L=100)'`` (a bare ``'taki'`` is refused).
PARAMETRISED_INITIALIZERS = ("taki",)

_TAKI_PARAMS = {"c": "c", "L": "num_blocks", "K": "num_blocks", "num_blocks": "num_blocks"}


def taki_init(c: float = 1.0, num_blocks: int | None = None) -> Initializer:
    """Taki (2017) eq. (28): N(0, c / (fan_in * L)), untruncated, L = ``num_blocks`` residual blocks.

    Raises ``ValueError`` naming the setting for c <= 0 (or not finite) and L not an integer >= 1.
    """
    import math
    import numbers

    if isinstance(c, bool) or not isinstance(c, numbers.Real) or not math.isfinite(float(c)) or c <= 0:
        raise ValueError(f"kernel_init: taki's c must be a finite number > 0, got {c!r}")
    if num_blocks is None:
        raise ValueError("kernel_init: taki needs the number of residual blocks L: use 'taki(L=100)', "
                         "get_initializer('taki', num_blocks=100) or taki_init(c, num_blocks)")
    if isinstance(num_blocks, numbers.Real) and not isinstance(num_blocks, bool) and float(num_blocks).is_integer():
        num_blocks = int(num_blocks)
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
        raise ValueError(f"kernel_init: taki's L (num_blocks) must be an integer >= 1, got {num_blocks!r}")
    return initializers.variance_scaling(float(c) / num_blocks, "fan_in", "normal")


def _parse_taki(name: str, params: dict) -> Initializer:
    """``'taki'`` / ``'taki(c=1, L=100)'`` plus keyword parameters -> ``taki_init``."""
    text = re.sub(r"\s+", "", name)
    m = re.fullmatch(r"taki(?:\((.*)\))?", text)
    if m is None:
        raise ValueError(f"kernel_init: cannot read {name!r}; write e.g. 'taki(c=1, L=100)'")
    kwargs: dict = {}
    items = [i for i in (m.group(1) or "").split(",") if i]
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in _TAKI_PARAMS:
            raise ValueError(f"kernel_init: unknown taki parameter {item!r} in {name!r}; use c=..., L=...")
        try:
            kwargs[_TAKI_PARAMS[key]] = float(value)
        except ValueError:
            raise ValueError(f"kernel_init: taki parameter {key}={value!r} is not a number") from None
    for key, value in params.items():
        if key not in _TAKI_PARAMS:
            raise ValueError(f"kernel_init: unknown taki parameter {key!r}; use c and num_blocks (or L)")
        kwargs[_TAKI_PARAMS[key]] = value
    return taki_init(**kwargs)


def get_initializer(name: str | Initializer, gain: float = 1.0, **params: Any) -> Initializer:
    """The initialiser called ``name`` (or ``name`` itself if it is already a function), times ``gain``.

    ``params`` are the parameters of a parametrised initialiser (``'taki'``: ``c``, ``num_blocks``/``L``);
    the parameter-free names take none. Unknown names and bad parameters raise ``ValueError`` naming
    ``kernel_init``. The result is called as ``init(key, shape, dtype)``.
    """
    if callable(name):
        if params:
            raise ValueError(f"kernel_init: parameters {sorted(params)} only go with a parametrised name")
        base = name
    elif isinstance(name, str) and re.match(r"\s*taki\b", name):
        base = _parse_taki(name, params)
    else:
        if params:
            raise ValueError(f"kernel_init: initialiser {name!r} takes no parameters, got {sorted(params)}")
        key = _ALIASES.get(name, name)
        if key not in _BASE:
            raise ValueError(f"kernel_init: unknown initialiser {name!r}; choose one of "
                             f"{INITIALIZERS + PARAMETRISED_INITIALIZERS}")
        base = _BASE[key]()
    if gain == 1.0:
        return drawn_in_float32(base)

    def scaled(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
        return gain * base(key, shape, dtype)

    return drawn_in_float32(scaled)


def drawn_in_float32(init: Initializer) -> Initializer:
    """``init`` drawing at least float32 and rounding to a narrower ``dtype``: a bfloat16 or float16
    parameter gets the float32 draw's rounded value, so ``param_dtype`` does not change a model's initial
    draws (``jax.random`` draws different numbers in bfloat16). Float32 and float64 draws are ``init``'s own,
    unchanged."""
    if getattr(init, "_draws_in_float32", False):
        return init

    def wrapped(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
        """The wrapped initialiser's draw in at least float32, rounded to ``dtype``."""
        dtype = jnp.dtype(dtype)
        wide = jnp.promote_types(dtype, jnp.float32)
        return init(key, shape, dtype) if wide == dtype else init(key, shape, wide).astype(dtype)

    wrapped._draws_in_float32 = True  # type: ignore[attr-defined]
    return wrapped


#: flax's own default kernel initialiser (``lecun_normal``: truncated normal, variance 1/fan_in), drawn in float32
#: (``drawn_in_float32``): for the layers that keep flax's default (DenseNet's classifier, UNet, the hourglass).
FLAX_DEFAULT_KERNEL_INIT = drawn_in_float32(initializers.lecun_normal())


def _torch_bias(fan_in: int) -> Initializer:
    bound = fan_in ** -0.5

    def init(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


_BIAS = {
    "zeros": lambda fan_in: initializers.zeros,
    "fan_in": lambda fan_in: initializers.normal(stddev=(1.0 / fan_in) ** 0.5),
    # PyTorch's nn.Linear / nn.Conv2d bias: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    "torch_default": lambda fan_in: _torch_bias(fan_in),
}
#: The bias initialisers by name (``bias_init``, ``get_bias_initializer``), which draw zeros, N(0, 1/fan_in) or
#: PyTorch's default U(+-1/sqrt(fan_in)).
BIAS_INITIALIZERS = tuple(_BIAS)


def get_bias_initializer(name: str | Initializer, fan_in: int) -> Initializer:
    """The bias initialiser called ``name`` for a layer whose input has ``fan_in`` features (or ``name``
    itself if it is already a function, called as ``init(key, shape, dtype)``)."""
    if callable(name):
        return drawn_in_float32(name)
    if name not in _BIAS:
        raise ValueError(f"bias_init: unknown initialiser {name!r}; choose one of {BIAS_INITIALIZERS}")
    if not isinstance(fan_in, int) or isinstance(fan_in, bool) or fan_in < 1:
        raise ValueError(f"bias_init: fan_in must be an integer >= 1, got {fan_in!r}")
    return drawn_in_float32(_BIAS[name](fan_in))
