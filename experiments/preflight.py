"""Preflight: every setting of a run checked before any training, a refusal naming its setting.

``preflight(module, config, out_dir)`` runs the generic checks (``check_finite``: finite floats; ``check_counts``:
settings that count something are integers >= 1; ``check_seeds``), the module's own ``check(config)`` hook (every
cell it will run; it uses ``check_train``, ``check_batch_sizes``, ``load_data``, ``build_models``, each naming the
setting of a library error through ``setting_prefix``) and ``check_out_dir``. ``flag_message`` turns such a
``ValueError`` (``a.b: ...``) into the command line's ``argument --a.b: ...``.
"""

from __future__ import annotations

import contextlib
import math
import pathlib
import re
import tempfile

import ml_collections
import numpy as np

from experiments.files import is_main
from experiments.settings import COUNT_SETTING, flatten, is_int

def check_finite(config: ml_collections.ConfigDict) -> None:
    """Every float setting (and every float inside a tuple setting) is finite: NaN and infinities refused."""
    for name, value in flatten(config).items():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, (float, np.floating)) and not math.isfinite(v):
                raise ValueError(f"{name}: must be a finite number, got {v!r}")


def check_counts(config: ml_collections.ConfigDict) -> None:
    """Every setting that counts something (``num_*``, depths, widths, blocks, batch sizes, epochs, ...,
    by the name's last part; not under ``train``) is an integer >= 1, or a tuple of them."""
    for name, value in flatten(config).items():
        leaf = name.rsplit(".", 1)[-1]
        if name.startswith("train.") or "warmup" in leaf or not COUNT_SETTING.match(leaf):
            continue
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if is_int(v) and v > 2**31 - 1:  # --depths 100000000000: an OverflowError deep inside, once
                raise ValueError(f"{name}: {v} is more than any array size here can be (2**31 - 1)")
            if not is_int(v) or v < 1:
                what = "every entry must be an integer >= 1" if isinstance(value, (tuple, list)) else \
                    "must be an integer >= 1"
                raise ValueError(f"{name}: {what}, got {v!r}")


def check_seeds(config: ml_collections.ConfigDict) -> None:
    """Every setting named ``seed`` (an experiment's, ``train.seed``, ...) is an integer in ``[0, 2**31)``, the
    range of ``jax.random.key`` seeds that resjax accepts (``--seed -1`` used to run)."""
    for name, value in flatten(config).items():
        if name.rsplit(".", 1)[-1] == "seed" and (not is_int(value) or not 0 <= value < 2**31):
            raise ValueError(f"{name}: must be an integer in [0, 2**31), got {value!r}")


def check_out_dir(out_dir) -> None:
    """Create ``out_dir`` and write (then remove) a temporary file in it; ``ValueError`` naming ``out`` else."""
    from resjax.paths import as_path, check_url, is_url

    path = as_path(out_dir, "out")
    if not is_main():  # process 0 writes every file of a multi-process run
        return
    if is_url(path):  # reachable, its bucket there, writable: one ValueError naming out and the URL
        check_url(path, "out")
        return
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".preflight-"):
            pass
    except OSError as err:
        raise ValueError(f"out: cannot write into the output folder {path} ({err.strerror or err})") from None
    from resjax.train.checkpoint import check_free_space

    check_free_space(path, OUT_ROOM, "out", "a run's results, figures and metrics.jsonl")  # a warning (#22)


#: Free space an output folder should have (a warning below it): results.json, figures and metrics.jsonl of a
#: default-size run are up to about 12 MB (degradation); checkpoints are checked per cell as they are opened.
OUT_ROOM = 16 * 2**20


@contextlib.contextmanager
def setting_prefix(prefix: str):
    """Re-raise a ``ValueError`` whose message starts ``name: ...`` as ``prefix.name: ...`` (library checks
    name a setting of the config they see, e.g. ``batch_size`` of ``config.train``)."""
    try:
        yield
    except ValueError as err:
        text = str(err)
        m = re.match(r"([A-Za-z_][\w.]*)\s*:", text)
        if m and m.group(1) != prefix and not m.group(1).startswith(prefix + "."):
            raise ValueError(f"{prefix}.{text}") from None
        raise


def check_train(train, num_examples: int | None = None, prefix: str = "train") -> None:
    """The library's checks of a train config (``resjax.train.config.check_train_config``, errors named
    ``prefix.<setting>``) and its batch size within ``num_examples`` training examples."""
    from resjax.train.config import check_train_config

    with setting_prefix(prefix):
        check_train_config(train)
    if num_examples is not None:
        check_batch_sizes(f"{prefix}.batch_size", train.batch_size, num_examples)
        from resjax.train.config import check_step_count

        with setting_prefix(prefix):
            check_step_count(train.epochs, num_examples // train.batch_size)


def check_batch_sizes(name: str, sizes, num_examples: int, minimum: int = 1) -> None:
    """Every batch size in ``sizes`` (setting ``name``) is an integer in ``[minimum, num_examples]``."""
    for b in sizes if isinstance(sizes, (tuple, list)) else (sizes,):
        if not is_int(b) or not minimum <= b <= num_examples:
            raise ValueError(f"{name}: batch sizes must be integers from {minimum} to {num_examples} (the training "
                             f"examples), got {b!r}")


def load_data(config):
    """The on-device data set ``config.data`` (``resjax.data.load_dataset``: cached, and every value checked
    finite); errors name ``data``."""
    from resjax.data import load_dataset

    with setting_prefix("data"):
        return load_dataset(config.data)


def build_models(models, num_classes: int, prefix: str = "model") -> None:
    """Build every model config in ``models`` (``resjax.nn.build_model`` checks each field as the module is
    constructed; nothing is initialised); errors name ``prefix.<field>``."""
    from resjax.nn import build_model

    for model in models:
        with setting_prefix(prefix):
            build_model(model, num_classes=num_classes)


def preflight(module, config: ml_collections.ConfigDict, out_dir=None) -> None:
    """Validate a run before any training: the generic checks (finite floats, counts), the module's own
    ``check(config)`` (every cell it will run: batch sizes against the data, models built, the library's
    train config checks) and the output folder. Raises ``ValueError`` naming the first bad setting."""
    check_finite(config)
    check_counts(config)
    check_seeds(config)
    if hasattr(module, "check"):
        module.check(config)
    if out_dir is not None:
        check_out_dir(out_dir)


def _flag(setting: str, leaves) -> str | None:
    """The flag of a setting named in an error: itself, the nearest enclosing setting, or the one setting whose
    name ends with it (library checks name ``batch_size`` for ``train.batch_size``)."""
    if setting in ("out", "checkpoint_dir"):  # flags of the command line, not settings of the config
        return setting
    parts = setting.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in leaves:
            return ".".join(parts[:i])
    ends = [name for name in leaves if name.endswith("." + setting)]
    return ends[0] if len(ends) == 1 else None


def flag_message(err: Exception, leaves) -> str:
    """``argument --a.b: <the rest>`` for an error ``a.b: <the rest>`` (``ValueError`` of a preflight), on one
    line; the message as it is when it names no setting."""
    text = " ".join(str(err).split())
    m = re.match(r"([A-Za-z_][\w.]*)\s*:\s*(.*)", text)
    if m:
        flag = _flag(m.group(1), leaves)
        if flag is not None:
            return f"argument --{flag}: {m.group(2)}"
    return text
