"""Convolutional ResNets: CIFAR (depth 6n+2, wide), ImageNet (18/34/50/101/152) and Taki's 8x8 model.

Every block is ``resjax.nn.block.ResidualBlock``, as ``ResNetBlock`` (its conv defaults) or ``TakiBlock``; every
addition goes through ``residual_add`` (a shape mismatch raises ``ValueError``, never broadcasts).

Block (NHWC, ``features`` output channels, ``strides`` on the first 3x3 conv, torchvision's "v1.5"
placement for bottlenecks):

- ``kind='basic'``: 3x3 -> 3x3. ``kind='bottleneck'``: 1x1 to ``features // expansion`` -> 3x3 -> 1x1
  back to ``features`` (expansion 4).
- ``order='post'`` (He et al. 2016a): ``act(skip + s * [conv -> norm (-> act)]*m)``. ``order='pre'``
  (He et al. 2016b): ``p = act(norm(x))``; ``skip + s * [conv -> norm -> act]* ... conv``; nothing after the sum.
- Shortcut, used only when the block changes the shape (an identity otherwise):
  ``'A'`` = subsample by ``strides`` and append zero channels (no parameters; the CIFAR ResNets of He et
  al.), ``'B'`` = strided 1x1 conv (followed by the norm in the post order; in the pre order it reads the
  pre-activated ``p``, as in He et al.'s pre-activation code). Two option-A variants of the peers' code:
  ``option_a_norm=True`` normalises the subsampled input before the zero channels are appended
  (``make_norm(norm)`` named ``shortcut_norm``: the tau-ResNet repository's BN model,
  ``nn.Sequential(nn.AvgPool2d(1, 2), nn.BatchNorm2d(in))``, 2 * in parameters per such block);
  ``option_a_input='conv_input'`` subsamples what the first conv reads (``x + bias_in_0`` under scalar
  biases: the Fixup repository's ``downsample(x + bias1a)``) instead of ``x`` (``'x'``, the default).
- Branch scaling ``s`` exactly as ``resjax.nn.residual.ResidualBlock``: ``none``; ``tau`` (a number, a
  rule of K = ``num_blocks``, or a traced value passed at call time); ``rescale`` (the sum times
  1/sqrt(2)); ``skipinit`` (learned alpha = 0); ``fixup`` (learned multiplier 1, last conv zero, other
  convs times K^(-1/(2m-2)) with m the number of convs in the branch).
- ``scalar_biases``: Fixup's learned scalar biases before every conv (``bias_in_i``), before every
  activation of the branch (``bias_act_i``) and at its end (``bias_out``). On by default for Fixup; the
  tau-ResNet repository uses them with tau and no BatchNorm, where ``bias_out`` sits *inside* the tau
  scaling: ``tau * (branch + bias_out)``; with Fixup it is ``scale * branch + bias_out`` (each as its
  reference code does).

Networks:

- ``ResNet(stage_sizes, stage_widths, stem=...)``: stem (CIFAR: 3x3 conv 16 -> norm -> act; ImageNet:
  7x7/2 conv 64 -> norm -> act -> 3x3/2 max pool; in the pre order the stem has no norm/act and a final
  norm -> act precedes the pool), the stages (stage i > 0 starts with stride 2), global average pool,
  ``Dense(num_classes)``. Convolutions carry no bias unless ``norm='none'`` and no scalar biases are used.
  ``scan=True`` scans the identical blocks of each stage with ``nn.scan`` (a 1202-layer net compiles as
  fast as a 20-layer one); ``scan=False`` unrolls them. Blocks sow ``intermediates/block_out``.
- ``learnable_tau=True``: one tau shared by every block, a parameter ``tau`` initialised at the tau rule's
  value, as in the tau-ResNet repository without BatchNorm. That repository divides tau's gradient by
  the number of blocks (``scale_tau_grad``); resjax does the same inside the model with a stop-gradient
  (``tau/K + stop_gradient(tau - tau/K)``: the value is tau, the gradient is 1/K of the sum over blocks).
- ``stem_head_biases``: the network-level scalar biases ``stem_bias`` (before the stem's activation) and
  ``head_bias`` (before the classifier), Fixup's ``bias1`` / ``bias2``. ``None`` (default) = whenever the
  blocks have scalar biases; ``False`` = blocks only (the tau-ResNet repository's model without BN).
- ``stem_init``: the stem convolution's initialiser (``None`` = ``kernel_init``). The Fixup repository
  leaves its stem at PyTorch's default ``'torch_default'`` (uniform, std 1/sqrt(3 fan_in)); the
  tau-ResNet repository re-draws every conv, the stem included, He fan-out normal.
- ``cifar_resnet(depth, widen_factor=1, ...)``: depth = 6n+2, widths (16, 32, 64) * widen_factor.
  ``cifar_resnet(20)`` / 56 / 110 / 1202 with option A and BatchNorm have 269,722 / 853,018 / 1,727,962 /
  19,421,274 parameters, the published counts.
- ``REPOSITORY_MODELS``: the settings that build the peers' CIFAR models exactly (same functions, same
  parameter names and counts; ``resjax.interop`` converts their ``state_dict`` both ways):

  ====================  ==================================================================  ================
  name                  peer model                                                          ResNet-20 / 110
  ====================  ==================================================================  ================
  ``tau_resnet_bn``     dayu11/tau-ResNet ``cifar/models/resnet_cifar.py`` (fixed ``tau``)  269,818 / 1,728,058
  ``tau_resnet_nobn``   dayu11/tau-ResNet ``cifar/models/resnet_cifar_nobn.py``              268,383 / 1,720,083
  ``fixup``             hongyi-zhang/Fixup ``cifar/models/fixup_resnet_cifar.py``            268,393 / 1,720,138
  ====================  ==================================================================  ================

  ``cifar_resnet(depth, **REPOSITORY_MODELS[name], tau=...)``; the tau-ResNet models take ``tau`` as the
  repository does (a number; its scripts pass 1/sqrt(L)); ResNet-56 with ``tau_resnet_bn`` has 853,114.
- ``imagenet_resnet(depth)``: 18/34 basic, 50/101/152 bottleneck, option B; ``imagenet_resnet(50)`` has
  torchvision's 25,557,032 parameters.
- ``imagenet_tau(stage_sizes, convention)``: the seed (Zhang et al. Section 4.3) takes tau = 1/sqrt(L)
  with L the *average* number of blocks per stage (``'seed'``); the tau-ResNet ImageNet code uses
  2/sqrt(largest stage) (``'official'``). They differ (ResNet-50: 0.516 vs 0.816), so both are named.
- ``taki_resnet(num_blocks=100)``: Taki's model (seed 004): a stem, ``num_blocks`` blocks
  ``x + conv8x8(act(norm(x)))`` at 16 channels, pool, dense. See ``TakiResNet``.
- ``dtype`` (every network and block here): mixed precision, e.g. ``cifar_resnet(56, dtype='bfloat16')``
  computes in bfloat16 with float32 parameters, BatchNorm statistics and logits; see ``resjax.nn.precision``.

Kernels default to He normal with fan-out (std sqrt(2 / (k*k*out))), the initialisation of the
torchvision, Fixup and tau-ResNet code (Fixup's stem excepted: ``stem_init``); the classifier uses
PyTorch's ``nn.Linear`` default (zeros under Fixup, as Fixup prescribes).

``resjax.interop`` converts the PyTorch peers' ``state_dict`` (torchvision, tau-ResNet, Fixup) to these
models' variables and back; ``tests/test_interop.py`` checks the numbers against the peers' own code.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from resjax.nn.block import (BLOCK_KINDS, CONV_KERNEL_INIT, OPTION_A_INPUTS, SHORTCUTS, ConvSettings, ResNetBlock,
                             TakiBlock, accept_moved_settings, resolve_block, setting)
from resjax.nn.init import get_bias_initializer, get_initializer
from resjax.nn.norms import check_norm, make_norm
from resjax.nn.precision import PrecisionRepr, layer_dtypes, resolve_dtype
from resjax.nn.residual import (check_call_tau, check_choice, check_positive, check_remat, resolve_tau,
                                scalar_param_dtype, stack_blocks)

__all__ = ["BLOCK_KINDS", "CIFAR_DEPTHS", "IMAGENET_STAGES", "OPTION_A_INPUTS", "REPOSITORY_MODELS", "SHORTCUTS",
           "TAU_CONVENTIONS", "ResNet", "ResNetBlock", "TakiBlock", "TakiResNet", "cifar_resnet", "imagenet_resnet",
           "imagenet_tau", "taki_resnet"]

STEMS = ("cifar", "imagenet")
DEFAULT_KERNEL_INIT = CONV_KERNEL_INIT
HEAD_INIT = "torch_default"

#: He et al.'s CIFAR ResNet depths; ``cifar_resnet`` takes any depth 6n+2 >= 8.
CIFAR_DEPTHS = (20, 32, 44, 56, 110, 1202)
#: The ImageNet ResNets by depth (``imagenet_resnet``), as depth -> (branch kind, blocks per stage).
IMAGENET_STAGES = {
    18: ("basic", (2, 2, 2, 2)),
    34: ("basic", (3, 4, 6, 3)),
    50: ("bottleneck", (3, 4, 6, 3)),
    101: ("bottleneck", (3, 4, 23, 3)),
    152: ("bottleneck", (3, 8, 36, 3)),
}


def _scalar(module: nn.Module, name: str, h: jax.Array, init: Callable = nn.initializers.zeros) -> jax.Array:
    """A scalar parameter, stored in at least float32 (float32 under a half ``dtype``: mixed precision) and used
    in ``h``'s dtype."""
    return module.param(name, init, (), scalar_param_dtype(module, h)).astype(h.dtype)


@accept_moved_settings
class ResNet(PrecisionRepr, ConvSettings):
    """A staged convolutional ResNet; see the module docstring. Call as ``model(images, train, tau)``:
    ``tau`` only with ``scaling='tau'`` (else ``ValueError``: it would be ignored); a concrete tau must be
    a finite number > 0 (a traced one cannot be checked by value).

    ``tau_blocks`` is the K of the tau rule and of Fixup's rescaling (default: all blocks, as Zhang et
    al. and Fixup count L for CIFAR); ``imagenet_tau`` gives the ImageNet conventions as numbers.

    Every field is checked at construction (``ValueError`` naming the setting).

    Attributes:
        stage_sizes: the blocks of each stage (integers >= 1), one per entry of ``stage_widths``. Required.
        stage_widths: the output channels of each stage's blocks (integers >= 1). Required.
        num_classes: the classifier's outputs (logits); an integer >= 1. Default 10.
        tau_blocks: K of the tau rule and of Fixup; ``None`` (default): all blocks, ``sum(stage_sizes)``.
        learnable_tau: ``True``: one tau shared by every block is a parameter ``tau``, initialised at the tau
            rule's value (or at a tau passed to ``init``), its gradient 1/K of the sum over the blocks; needs
            ``scaling='tau'``. Default ``False``.
        stem: ``'cifar'`` (default; 3x3 conv) or ``'imagenet'`` (7x7/2 conv and 3x3/2 max pool); ``STEMS``.
        stem_width: the stem's output channels; an integer >= 1. Default 16.
        scan: ``False`` (default): each stage's blocks after the first unrolled (``stage{i}_0`` ...);
            ``True``: one ``nn.scan`` per stage (``stage{i}/block``, leaves with a leading axis).
        remat: with ``scan=True``, rematerialise each stage's scanned blocks in the backward pass, in segments
            (``resjax.nn.residual.stack_blocks``): ``False`` (default): not; ``True``: segments of isqrt(n) of a
            stage's n scanned blocks; an integer S >= 1: segments of S. The same parameters, outputs and
            gradients in less memory (a second forward pass). Needs ``scan=True`` (else ``ValueError``).
        stem_head_biases: the scalar biases ``stem_bias`` and ``head_bias``: ``True``, ``False`` or ``None``
            (default: whenever the blocks have scalar biases).
        stem_init: the stem conv's initialiser; ``None`` (default): ``kernel_init``.
        block: the block (a class, a ``functools.partial`` whose settings win, or a mapping of settings);
            ``None`` (default): ``ResNetBlock``.
        The settings of a conv block (``resjax.nn.block.ConvSettings``), passed to every block, with the conv
        defaults:
        ``kind`` ``'basic'`` or ``'bottleneck'`` (``BLOCK_KINDS``), ``order='post'`` (the pre order also changes
        the stem and adds ``final_norm``), ``norm='batch'`` (also the stem's and the pre order's final norm),
        ``kernel_init='he_normal_fan_out'``; ``scaling='fixup'`` also zeroes the classifier; ``dtype``: the images
        are cast to it at the stem and the logits are returned as float32 (``None`` and ``'float32'`` give
        bit-identical results); ``param_dtype``: every parameter's dtype (``None``: float32). An MLP block's
        settings (``num_layers``, ``bias_init``) and Taki's ``kernel_size`` are not the ResNet's: passed to it,
        they go to the block with a ``DeprecationWarning``.
    """

    stage_sizes: Sequence[int]
    stage_widths: Sequence[int]
    num_classes: int = 10
    tau_blocks: int | None = None
    learnable_tau: bool = False
    stem: str = "cifar"
    stem_width: int = 16
    scan: bool = False
    remat: int | bool = setting(False)  # keyword-only
    stem_head_biases: bool | None = None
    stem_init: str | Callable | None = None
    block: Any = None
    kind: str = setting("basic")
    order: str = setting("post")
    norm: str | Callable = setting("batch")
    kernel_init: str | Callable = setting(DEFAULT_KERNEL_INIT)

    _settings = ConvSettings

    def __post_init__(self):
        resolve_dtype(self.dtype)
        resolve_dtype(self.param_dtype, "param_dtype")
        if not self.stage_sizes or len(self.stage_sizes) != len(self.stage_widths):
            raise ValueError(f"stage_sizes: need one size per stage width, got {tuple(self.stage_sizes)} and "
                             f"stage_widths {tuple(self.stage_widths)}")
        for size in self.stage_sizes:
            check_positive("stage_sizes", size)
        for width in self.stage_widths:
            check_positive("stage_widths", width)
        check_positive("num_classes", self.num_classes)
        check_positive("stem_width", self.stem_width)
        check_choice("stem", self.stem, STEMS)
        check_remat(self.remat, self.scan)
        if self.tau_blocks is not None:
            check_positive("tau_blocks", self.tau_blocks)
        if self.learnable_tau and self.scaling != "tau":
            raise ValueError(f"learnable_tau: needs scaling='tau', got scaling={self.scaling!r}")
        if self.stem_head_biases not in (None, True, False):
            raise ValueError(f"stem_head_biases: must be None, True or False, got {self.stem_head_biases!r}")
        if self.stem_init is not None:
            try:
                get_initializer(self.stem_init)
            except ValueError as err:
                raise ValueError(f"stem_init: {err}") from None
        check_choice("kind", self.kind, BLOCK_KINDS)
        super().__post_init__()
        self._block(0, 1)  # validates every block setting now, before anything is traced

    @property
    def num_blocks(self) -> int:
        """The residual blocks of the whole network, ``sum(stage_sizes)``."""
        return sum(self.stage_sizes)

    @property
    def use_scalar_biases(self) -> bool:
        """Whether the blocks have scalar biases: ``scalar_biases``, or when it is ``None``, ``scaling == 'fixup'``."""
        return self.scaling == "fixup" if self.scalar_biases is None else self.scalar_biases

    @property
    def use_stem_head_biases(self) -> bool:
        """Whether the network has ``stem_bias`` and ``head_bias``: ``stem_head_biases``, or when it is
        ``None``, ``use_scalar_biases``."""
        return self.use_scalar_biases if self.stem_head_biases is None else self.stem_head_biases

    @nn.nowrap
    def _block(self, stage: int, strides: int) -> tuple[Callable[..., nn.Module], dict[str, Any]]:
        """The block of ``stage`` (``block``, default ``ResNetBlock``) and its settings."""
        kwargs = dict(self.block_settings(), features=self.stage_widths[stage], strides=strides,
                      num_blocks=self.tau_blocks or self.num_blocks, learned_tau=self.learnable_tau)
        return resolve_block(self.block, ResNetBlock, kwargs)

    def _bias(self, name: str, h):
        return h + _scalar(self, name, h) if self.use_stem_head_biases else h

    def _tau(self, tau: float | jax.Array | None) -> float | jax.Array | None:
        if self.scaling != "tau" or not self.learnable_tau:
            return tau
        k = self.tau_blocks or self.num_blocks
        init = resolve_tau(self.tau, k) if tau is None else tau
        dtype = jnp.float32 if self.param_dtype is None else jnp.dtype(self.param_dtype)
        t = self.param("tau", lambda _key: jnp.asarray(init, dtype))
        return t / self.num_blocks + jax.lax.stop_gradient(t - t / self.num_blocks)

    @nn.compact
    def __call__(self, x: jax.Array, train: bool | None = None, tau: float | jax.Array | None = None) -> jax.Array:
        """Classify images: stem, the stages, global average pool, ``Dense(num_classes)``.

        Args:
            x: the images, channels-last ``(batch, height, width, channels)``, or 1-D signals ``(batch, length,
                channels)`` (every kernel, stride and pool then on the length axis: ``ResNet1D``).
            train: training or evaluation mode, as ``resjax.nn``'s docstring sets out for every module.
            tau: a scalar branch scale for this call, shared by every block (a number, or a traced value: a
                sweep over tau is a ``vmap``), in place of the ``tau`` field. Only with ``scaling='tau'``;
                ``None`` (default): the field. With ``learnable_tau=True`` the parameter ``tau`` is used: a
                tau passed to ``init`` sets its initial value, one passed to ``apply`` is not used.

        Returns:
            The logits, ``(batch, num_classes)``; float32 also when computed in a half ``dtype``.

        Raises:
            ValueError: ``x`` without 3 or 4 axes (names ``images``); ``train`` missing with BatchNorm; a ``tau``
                passed to a model whose scaling is not ``'tau'``, or a concrete ``tau`` that is not a finite
                number > 0.

        Collections:
            ``batch_stats`` with ``norm='batch'``, as ``resjax.nn``'s docstring sets out.
            ``intermediates``: sows ``stem`` (the stem's output), every block's ``block_out`` (under
            ``stage{i}_first``, and ``stage{i}_k`` or, scanned, ``stage{i}/block`` with a leading axis) and
            ``pre_logits`` (the pooled features, ``(batch, channels)``) when the caller makes it mutable.
        """
        if x.ndim not in (3, 4):
            raise ValueError(f"images: expected NHWC (4 axes) or a 1-D signal (batch, length, channels), got shape "
                             f"{tuple(x.shape)}")
        spatial = x.ndim - 2  # 2: images; 1: signals (every kernel, stride and pool on the length axis alone)
        check_call_tau(self, tau)
        tau = self._tau(tau)
        conv_bias = self.norm == "none" and not self.use_scalar_biases
        kernel_init = get_initializer(self.kernel_init if self.stem_init is None else self.stem_init)
        dtypes = layer_dtypes(self.dtype, self.param_dtype)
        if dtypes["dtype"] is not None:
            x = x.astype(dtypes["dtype"])
        if self.stem == "cifar":
            h = nn.Conv(self.stem_width, (3,) * spatial, padding=[(1, 1)] * spatial, use_bias=conv_bias,
                        kernel_init=kernel_init, name="stem_conv", **dtypes)(x)
        else:
            h = nn.Conv(self.stem_width, (7,) * spatial, strides=2, padding=[(3, 3)] * spatial, use_bias=conv_bias,
                        kernel_init=kernel_init, name="stem_conv", **dtypes)(x)
        if self.order == "post" or self.stem == "imagenet":
            h = make_norm(self.norm, train=train, name="stem_norm", dtype=self.dtype, param_dtype=self.param_dtype)(h)
            h = self.activation(self._bias("stem_bias", h))
        if self.stem == "imagenet":
            h = nn.max_pool(h, (3,) * spatial, strides=(2,) * spatial, padding=[(1, 1)] * spatial)
        self.sow("intermediates", "stem", h)
        for s, size in enumerate(self.stage_sizes):
            block, first = self._block(s, 1 if s == 0 else 2)
            h = block(**first, name=f"stage{s + 1}_first")(h, train, tau)
            h = stack_blocks(*self._block(s, 1), size - 1, h, train, tau, scan=self.scan, name=f"stage{s + 1}",
                             remat=self.remat)
        if self.order == "pre":
            h = self.activation(make_norm(self.norm, train=train, name="final_norm", dtype=self.dtype,
                                          param_dtype=self.param_dtype)(h))
        h = jnp.mean(h, axis=tuple(range(1, 1 + spatial)))
        self.sow("intermediates", "pre_logits", h)
        zero_head = self.scaling == "fixup"
        head_init = get_initializer("zeros" if zero_head else HEAD_INIT)
        bias_init = get_bias_initializer("zeros" if zero_head else "torch_default", h.shape[-1])
        logits = nn.Dense(self.num_classes, kernel_init=head_init, bias_init=bias_init, name="head",
                          **dtypes)(self._bias("head_bias", h))
        return logits.astype(jnp.promote_types(logits.dtype, jnp.float32))  # half -> float32


def cifar_resnet(depth: int = 20, num_classes: int = 10, widen_factor: int = 1, **kwargs: Any) -> ResNet:
    """He et al.'s CIFAR ResNet of depth 6n+2 (n basic blocks per stage, widths 16/32/64 * widen_factor).

    Defaults: post-activation, option A shortcuts, BatchNorm, He fan-out normal kernels. A wide ResNet
    (Zagoruyko & Komodakis) is ``cifar_resnet(6n+2, widen_factor=k, order='pre', shortcut='B')`` (WRN
    counts depth as 6n+4, adding its projection convs; resjax keeps He et al.'s 6n+2).
    Any ``ResNet`` field can be overridden (``norm``, ``scaling``, ``tau``, ``scan``, ...).
    """
    if not isinstance(depth, int) or depth < 8 or (depth - 2) % 6:
        raise ValueError(f"depth: a CIFAR ResNet has depth 6n+2 with n >= 1 (20, 32, 44, 56, 110, 1202), got {depth!r}")
    check_positive("widen_factor", widen_factor)
    n = (depth - 2) // 6
    widths = tuple(w * widen_factor for w in (16, 32, 64))
    kwargs = {"kind": "basic", "stem": "cifar", "stem_width": 16, **kwargs}
    return ResNet(stage_sizes=(n, n, n), stage_widths=widths, num_classes=num_classes, **kwargs)


#: The peers' CIFAR ResNets as ``ResNet`` settings, by name (``repository_settings`` in ``resjax.interop``),
#: ``'tau_resnet_bn'`` and ``'tau_resnet_nobn'`` (Zhang et al.'s repository) and ``'fixup'`` (Fixup's).
#:
#: :meta hide-value:
REPOSITORY_MODELS = {
    # dayu11/tau-ResNet cifar/models/resnet_cifar.py: BN, fixed tau on bn2's output, AvgPool2d(1, 2) + BN shortcut
    "tau_resnet_bn": {"norm": "batch", "scaling": "tau", "option_a_norm": True},
    # dayu11/tau-ResNet cifar/models/resnet_cifar_nobn.py: bias1a/1b/2a/2b in every block, (conv2 + bias2b) * tau,
    # one learnable tau (gradient averaged over the blocks), no stem or head bias, plain x on the shortcut
    "tau_resnet_nobn": {"norm": "none", "scaling": "tau", "scalar_biases": True, "stem_head_biases": False,
                        "learnable_tau": True},
    # hongyi-zhang/Fixup cifar/models/fixup_resnet_cifar.py: downsample(x + bias1a), stem at PyTorch's default
    "fixup": {"norm": "none", "scaling": "fixup", "option_a_input": "conv_input", "stem_init": "torch_default"},
}


def imagenet_resnet(depth: int = 50, num_classes: int = 1000, **kwargs: Any) -> ResNet:
    """ResNet-18/34 (basic) and -50/101/152 (bottleneck, stride on the 3x3: torchvision's v1.5) with
    option B projection shortcuts where the shape changes. ``imagenet_resnet(50)`` has 25,557,032
    parameters, torchvision's count."""
    if depth not in IMAGENET_STAGES:
        raise ValueError(f"depth: ImageNet ResNets have depth {tuple(IMAGENET_STAGES)}, got {depth!r}")
    kind, sizes = IMAGENET_STAGES[depth]
    mult = 4 if kind == "bottleneck" else 1
    kwargs = {"shortcut": "B", **kwargs}
    return ResNet(stage_sizes=sizes, stage_widths=tuple(w * mult for w in (64, 128, 256, 512)),
                  num_classes=num_classes, kind=kind, stem="imagenet", stem_width=64, **kwargs)


#: How ``imagenet_tau`` sets tau from the stage sizes, ``'seed'`` 1/sqrt(mean blocks per stage) (the paper's
#: Section 4.3) or ``'official'`` 2/sqrt(largest stage) (its code).
TAU_CONVENTIONS = ("seed", "official")


def imagenet_tau(stage_sizes: Sequence[int], convention: str = "seed") -> float:
    """tau for a staged network: ``'seed'`` = 1/sqrt(mean blocks per stage) (Zhang et al. Sec. 4.3: the
    average, since a BN sits on each stage's output), ``'official'`` = 2/sqrt(largest stage) (their code)."""
    check_choice("tau_convention", convention, TAU_CONVENTIONS)
    if convention == "seed":
        return 1.0 / math.sqrt(sum(stage_sizes) / len(stage_sizes))
    return 2.0 / math.sqrt(max(stage_sizes))


class TakiResNet(PrecisionRepr, nn.Module):
    """Taki's 100-block convolutional ResNet (seed 004, Section 4 and Fig. 1).

    The seed: "residual block consists of 8x8 convolution layer with 16 channels and ReLU", with BatchNorm
    "inserted before residual connection" in Fig. 1b, and the weights drawn from N(0, 1/(8*8*16*100))
    (``kernel_init='taki'``: c/(n L) with n = 8*8*16 the fan-in, c = 1, L = ``num_blocks``).
    The block is ``x + conv8x8(act(N(x)))`` (N = ``norm``, the identity when ``'none'``): the order of
    ``resjax.analysis.taki`` (pre-activation, one layer, nothing after the sum, no bias).

    Choices the seed leaves open (documented, not tuned):
    - the even 8x8 kernel is padded 'SAME' as XLA does it: 3 rows/columns before, 4 after, so the map
      stays 32x32;
    - the stem is a 3x3 convolution from 3 to 16 channels (He fan-in normal), the head a global average
      pool and a dense layer with PyTorch's default initialisation.

    Every field is checked at construction (``ValueError`` naming the setting).

    Attributes:
        num_blocks: L, the residual blocks (also the L of ``kernel_init='taki'``); an integer >= 1. Default 100.
        features: the channels of the stem's output and of every block; an integer >= 1. Default 16.
        kernel_size: the blocks' square kernel size; an integer >= 1. Default 8.
        num_classes: the classifier's outputs (logits); an integer >= 1. Default 10.
        norm: the blocks' normalisation, a name in ``NORMS`` (``'none'``, the default, ``'batch'``, ...) or a
            callable for ``make_norm``.
        kernel_init: the blocks' initialiser: ``'taki'`` (default; N(0, 1/(k*k*C*num_blocks))), or any
            ``resjax.nn.init`` name or function (e.g. ``'he_normal'``).
        scan: ``True`` (default): the blocks as one ``nn.scan`` (``blocks/block``); ``False``: unrolled
            (``blocks_0`` ...).
        remat: with ``scan=True``, rematerialise the blocks in the backward pass in segments
            (``resjax.nn.residual.stack_blocks``): ``False`` (default), ``True`` (segments of isqrt(num_blocks))
            or a segment length S >= 1. The same parameters, outputs and gradients in less memory.
        activation: the activation function. Default ``flax.linen.relu``.
        dtype: the computation dtype, as ``ResNet``'s: ``None`` (default; float32), ``'float32'``,
            ``'bfloat16'`` or ``'float16'``; parameters and ``batch_stats`` stay float32, the logits are
            float32 (``resjax.nn.precision``).
        param_dtype: every parameter's dtype, as flax's: ``None`` (default; float32) or one of ``DTYPES``.
    """

    num_blocks: int = 100
    features: int = 16
    kernel_size: int = 8
    num_classes: int = 10
    norm: str | Callable = "none"
    kernel_init: str | Callable = "taki"
    scan: bool = True
    remat: int | bool = setting(False)  # keyword-only
    activation: Callable = nn.relu
    dtype: Any = None
    block: Any = None
    param_dtype: Any = None

    def __post_init__(self):
        resolve_dtype(self.dtype)
        resolve_dtype(self.param_dtype, "param_dtype")
        check_positive("num_blocks", self.num_blocks)
        check_positive("features", self.features)
        check_positive("kernel_size", self.kernel_size)
        check_remat(self.remat, self.scan)
        check_positive("num_classes", self.num_classes)
        check_norm(self.norm)
        self._block()  # raises on an unknown initialiser
        super().__post_init__()

    @nn.nowrap
    def _block(self) -> tuple[Callable[..., nn.Module], dict[str, Any]]:
        """The block (``block``, default ``TakiBlock``) and its settings."""
        kwargs = dict(features=self.features, kernel_size=self.kernel_size, norm=self.norm,
                      kernel_init=self.kernel_init, num_blocks=self.num_blocks, activation=self.activation,
                      dtype=self.dtype, param_dtype=self.param_dtype)
        return resolve_block(self.block, TakiBlock, kwargs)

    @nn.compact
    def __call__(self, x: jax.Array, train: bool | None = None) -> jax.Array:
        """Classify images: stem, ``num_blocks`` blocks, global average pool, dense head.

        Args:
            x: the images, channels-last ``(batch, height, width, channels)``.
            train: training or evaluation mode, as ``resjax.nn``'s docstring sets out for every module.

        Returns:
            The logits, ``(batch, num_classes)``; float32 also when computed in a half ``dtype``.

        Raises:
            ValueError: ``x`` without 4 axes (names ``images``); ``train`` missing with BatchNorm.

        Collections:
            ``batch_stats`` with ``norm='batch'``, as ``resjax.nn``'s docstring sets out.
            ``intermediates``: sows ``stem_out`` (the stem's output, the stream's start) and every block's
            ``block_out`` (scanned: under ``blocks/block`` with a leading axis of size ``num_blocks``; unrolled:
            under ``blocks_k``) when the caller makes it mutable.
        """
        if x.ndim != 4:
            raise ValueError(f"images: expected NHWC (4 axes), got shape {tuple(x.shape)}")
        dtypes = layer_dtypes(self.dtype, self.param_dtype)
        if dtypes["dtype"] is not None:
            x = x.astype(dtypes["dtype"])
        h = nn.Conv(self.features, (3, 3), padding="SAME", use_bias=False,
                    kernel_init=get_initializer("he_normal_fan_in"), name="stem_conv", **dtypes)(x)
        self.sow("intermediates", "stem_out", h)  # the stream's start (resjax.analysis: variance through depth)
        h = stack_blocks(*self._block(), self.num_blocks, h, train, scan=self.scan, remat=self.remat)
        h = jnp.mean(h, axis=(1, 2))
        logits = nn.Dense(self.num_classes, kernel_init=get_initializer(HEAD_INIT),
                          bias_init=get_bias_initializer("torch_default", h.shape[-1]), name="head", **dtypes)(h)
        return logits.astype(jnp.promote_types(logits.dtype, jnp.float32))  # half -> float32


def taki_resnet(num_blocks: int = 100, norm: str = "none", kernel_init: str = "taki", **kwargs: Any) -> TakiResNet:
    """Taki's model: ``norm='none', kernel_init='taki'`` (his initialisation), ``kernel_init='he_normal'``
    (He's), or ``norm='batch', kernel_init='he_normal'`` (He's with BatchNorm, his Fig. 1b)."""
    return TakiResNet(num_blocks=num_blocks, norm=norm, kernel_init=kernel_init, **kwargs)
