"""Zhang et al.'s fully connected ResNet (seed 003, "Stabilize Deep ResNet with A Sharp Scaling Factor tau"),
built from resjax's own modules: ``resjax.nn.tau_resnet`` (the function) and its helpers, all importable from
``resjax.nn``.

The model (the seed's Section 2, which follows the over-parameterised networks of Allen-Zhu, Li & Song,
"A convergence theory for deep learning via over-parameterization", 2019)::

    h_0 = relu(A x)                                   A: (m, p), entries N(0, 2/m)
    h_l = relu(h_(l-1) + tau W_l h_(l-1)),  l = 1..K   W_l: (m, m), entries N(0, 2/m)
    y   = B h_K                                       B: (d, m), entries N(0, 1/d)

no biases in the stem or the blocks, Gaussian (untruncated) draws. ``tau_resnet(kind, width, depth, ...)``
returns a ``resjax.nn.ResidualMLP`` (or, for ``kind='plain'``, a ``resjax.nn.PlainMLP``) with these
settings; every block is a ``resjax.nn.ResidualBlock`` with ``order='post'`` and one linear layer (without its skip
in the plain network), so every addition goes through ``residual_add``. ``scan=True`` (the default) builds the K blocks with ``nn.scan``.

Kinds:

- ``'tau'``: ``scaling='tau'``; ``tau`` is a number or a rule of L (``'1/sqrt(L)'``, ``'1/L'``,
  ``'L^(-1/4)'``, ``'1'``), resolved at L = ``depth``, and can be replaced at call time by a traced value
  (``model.apply(v, x, tau=t)``), so a sweep over tau is a ``vmap``.
- ``'bn'``: the seed's Section 3.4 form ``h_l = relu(h_(l-1) + BN(W_l h_(l-1)))``: BatchNorm after the
  branch's linear layer (``norm='batch'``), no tau (s = 1). BatchNorm has its usual learned scale and
  shift (1 and 0 at initialisation) and PyTorch's constants (``resjax.nn.norms``).
- ``'fixup'``: the seed's description of Fixup *for this model* (Section 3.4): ``W_l = 0`` at
  initialisation, no tau (Fixup's learned branch multiplier starts at 1, "equivalent to set tau = 1"),
  A and B drawn as above. This is deliberately not resjax's ``scaling='fixup'``, which is Fixup's full
  recipe for general networks and also zeroes the classifier B: with B = 0 no gradient reaches any W_l
  at the first step and the seed's one-step argument (every W_l receives the same gradient
  ``dh_(L-1) h_0^T``) does not apply.
- ``'plain'``: the PlainNet of the seed's Section 5.1, "the same architecture as the ResNets without the
  skip connection": ``h_l = relu(W_l h_(l-1))``, the same A, W_l and B draws (``PlainMLP`` with
  ``use_bias=False``; its hidden layers are the K blocks).

Choices where the seed is silent or ambiguous:

- **Block indexing.** The seed indexes the blocks ``l in [L-1]`` (Section 3.4: ``l = [L-1]`` and the Fixup
  product ``prod_(l=1)^(L-1)``), i.e. a "depth L" network has L - 1 residual blocks, while tau is written
  in terms of L. By default resjax builds ``depth`` blocks (K = L; "depth 1000" = 1000 blocks, matching
  resjax's ``'1/sqrt(K)'`` rules); ``seed_indexing=True`` builds ``depth - 1`` blocks and still resolves
  tau at L = ``depth``. The two differ by one block, i.e. tau by a factor sqrt(L/(L-1)) <= 1.054 for
  L >= 10.
- **Initial variances.** Allen-Zhu et al. draw A and W_l at variance 2/m (m = width: for A that is the
  fan-out, ``'he_normal_fan_out'``; for the square W_l fan-in = fan-out) and B at variance 1/d (d = number
  of classes, B's fan-out), for inputs of unit norm (they also fix the last input coordinate to
  1/sqrt(2), a bias substitute; not done here). Inputs are not renormalised: the network is positively
  homogeneous in x (no biases before the head), so the input's scale only scales h_0; MNIST-1D's
  standardised inputs of length 40 have norm about sqrt(40).
- **Head bias.** The head has a bias (zero at initialisation), as every resjax MLP head does; B is the
  only layer with one.
- **Plain network's init.** The same Gaussian draws (variance 2/m), which is also He initialisation for
  the square hidden layers.
"""

from __future__ import annotations

from typing import Any

from jax.nn import initializers

from resjax.nn.mlp import PlainMLP, ResidualMLP
from resjax.nn.residual import check_positive, resolve_tau

KINDS = ("tau", "bn", "fixup", "plain")

#: A: N(0, 2/m) with m the width = the stem's fan-out.
STEM_INIT = "he_normal_fan_out"
#: W_l: N(0, 2/m) (m x m, fan-in = fan-out = m).
BLOCK_INIT = "he_normal"
#: B: N(0, 1/d) with d the number of classes = the head's fan-out.
HEAD_INIT = initializers.variance_scaling(1.0, "fan_out", "normal")


def num_blocks_for(depth: int, seed_indexing: bool = False) -> int:
    """K, the number of residual blocks of a depth-L network: L, or L - 1 with the seed's ``l in [L-1]``."""
    check_positive("depth", depth)
    k = depth - 1 if seed_indexing else depth
    if k < 1:
        raise ValueError(f"depth: seed_indexing builds depth - 1 blocks, so depth must be >= 2, got {depth!r}")
    return k


def tau_value(tau: float | str, depth: int) -> float:
    """tau as a number: a rule of L (``'1/sqrt(L)'`` ...) evaluated at L = ``depth``; ``ValueError`` unless > 0."""
    check_positive("depth", depth)
    return resolve_tau(tau, depth)


def tau_resnet(kind: str, width: int, depth: int, num_classes: int = 10, *, tau: float | str = "1/sqrt(L)",
               seed_indexing: bool = False, scan: bool = True, remat: int | bool = False,
               param_dtype: Any = None) -> PlainMLP | ResidualMLP:
    """The seed's fully connected network of ``kind`` in ``KINDS``; see the module docstring.

    ``depth`` = L; ``tau`` is used by ``kind='tau'`` only (a number or a rule of L, resolved at L =
    ``depth``; the module's ``tau`` field holds the number, and a traced ``tau`` at call time replaces it).
    ``param_dtype``: every parameter's dtype (``None``: float32), as the models' field.
    ``remat``: rematerialise the scanned blocks in segments in the backward pass, as the models' field (``False``,
    the default; ``True``: segments of isqrt(K) blocks; an integer: the segment length): the same parameters and
    numbers in less memory.
    Every bad setting raises ``ValueError`` naming it before anything is traced.
    """
    if kind not in KINDS:
        raise ValueError(f"kind: unknown tau_resnet kind {kind!r}; choose one of {KINDS}")
    check_positive("width", width)
    check_positive("num_classes", num_classes)
    k = num_blocks_for(depth, seed_indexing)
    if kind == "plain":
        return PlainMLP(width=width, depth=k, num_classes=num_classes, kernel_init=BLOCK_INIT, stem_init=STEM_INIT,
                        head_init=HEAD_INIT, use_bias=False, scan=scan, remat=remat, param_dtype=param_dtype)
    common = dict(width=width, num_blocks=k, num_classes=num_classes, num_layers=1, order="post",
                  stem_init=STEM_INIT, head_init=HEAD_INIT, use_bias=False, scan=scan, remat=remat,
                  param_dtype=param_dtype)
    if kind == "tau":
        return ResidualMLP(**common, scaling="tau", tau=tau_value(tau, depth), kernel_init=BLOCK_INIT)
    if kind == "bn":
        return ResidualMLP(**common, norm="batch", scaling="none", kernel_init=BLOCK_INIT)
    return ResidualMLP(**common, scaling="none", kernel_init="zeros")  # fixup: W_l = 0


def tau_resnet_config(kind: str, width: int, depth: int, **kwargs: Any) -> dict[str, Any]:
    """``config.model`` for ``resjax.train.make_train``: ``{'kind': 'tau_resnet', 'variant': kind, ...}``.

    ``resjax.nn.build_model(**config)`` calls ``tau_resnet(variant, ...)``; all values are plain numbers
    and strings, so the dict goes into a ``ml_collections.ConfigDict`` and ``results.json`` as it is.
    """
    return {"kind": "tau_resnet", "variant": kind, "width": width, "depth": depth, **kwargs}


def plain_params_from_residual(params: dict[str, Any]) -> dict[str, Any]:
    """The parameters of the ``'plain'`` network with the same A, W_l and B as a residual one.

    ``tau``/``fixup`` (``ResidualMLP``) -> ``plain`` (``PlainMLP``, the same ``scan``): the plain network's blocks
    are the residual ones without their skips and name their parameters alike, so this checks that the residual
    blocks hold W_l alone and returns the same tree; a comparison of the two networks uses common random numbers.
    """
    blocks = {k: v for k, v in params.items() if k == "blocks" or k.startswith("blocks_")}
    inner = [b.get("block", b) if isinstance(b, dict) else None for b in blocks.values()]
    if not blocks or any(not isinstance(b, dict) or "linear_0" not in b for b in inner):
        raise ValueError("params: expected a tau_resnet's params (blocks/block/linear_0/kernel or blocks_k/linear_0)")
    if any(set(b) != {"linear_0"} or set(b["linear_0"]) != {"kernel"} for b in inner):
        raise ValueError("params: the residual blocks have parameters beyond W_l (a 'bn' model?); only 'tau' and "
                         "'fixup' share the plain network's layout")
    return dict(params)
