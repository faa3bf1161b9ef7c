"""The command line of an experiment: ``[--quick | --full] [--out DIR] [--checkpoint_dir DIR] [--fresh]
[--<setting> VALUE ...]``.

Every leaf of the module's ``get_config(size)`` is a flag (``experiments.settings``) with a help line (its
``HELP`` entry, else ``COMMON_HELP`` or ``TRAIN_HELP``); ``--quick``'s and ``--full``'s help say what they change.
``parse_args`` gives ``(config, out_dir)``, with ``check`` preflighting the run (``experiments.preflight``) so that
a refused value is an argparse error naming its flag (exit status 2). :class:`ArgumentParser` refuses abbreviated
flags and names the closest known flags for an unknown one.
"""

from __future__ import annotations

import argparse
import pathlib
import re

import ml_collections

from experiments import checkpoints
from experiments.preflight import flag_message, preflight
from experiments.settings import SIZES, default_out, flatten, parse_value, set_path, show_value
from resjax.paths import as_path

# ---- help: every flag's meaning, units and allowed values ----------------------------------------------

#: Help for the settings of ``resjax.train.train_config`` (``--train.<setting>``), shared by every experiment
#: that trains; an experiment's own ``HELP`` entry replaces one of these where the experiment reads it otherwise.
TRAIN_HELP = {
    "train.optimizer": "optimiser: 'sgd' (heavy ball when train.momentum > 0), 'momentum', 'nesterov', 'adam' "
                       "(PyTorch's rules) or any optax optimiser by name ('adamw', 'lamb', 'lars', 'lion', 'rmsprop', "
                       "...)",
    "train.optimizer_args": "an optax optimiser's other arguments, a dict such as \"dict(b2=0.95)\"; empty: none",
    "train.learning_rate": "base learning rate (step size), a number >= 0",
    "train.momentum": "SGD momentum in [0, 1): buf = momentum * buf + g (PyTorch's, no dampening); 0 = plain SGD",
    "train.nesterov": "true/false: Nesterov momentum for 'sgd' with train.momentum > 0",
    "train.adam_b1": "Adam's first-moment decay rate beta1 (optimizer 'adam')",
    "train.adam_b2": "Adam's second-moment decay rate beta2 (optimizer 'adam')",
    "train.adam_eps": "Adam's epsilon, added to the root of the second moment (optimizer 'adam')",
    "train.weight_decay": "coupled L2 weight decay: the step uses g + weight_decay * w (PyTorch's weight_decay); "
                          "0 = off",
    "train.weight_decay_on": "which parameters weight decay applies to: 'all' (every parameter, PyTorch's default) or "
                             "'kernels' (Dense/Conv kernels only)",
    "train.scalar_lr_factor": "learning-rate factor for 0-d parameters (Fixup's and SkipInit's scalars, a "
                              "learnable tau)",
    "train.param_groups": "parameter-group rules or preset names ('tau_resnet', 'fixup'), comma-separated: per-group "
                          "learning-rate and weight-decay factors (resjax.train.optim); empty: one group",
    "train.grad_clip_norm": "clip gradients to this global L2 norm; 0 = no clipping",
    "train.loss": "the loss: 'cross_entropy' (on class labels) or 'mse' (on float targets); resjax.train.objective",
    "train.label_smoothing": "label smoothing of the cross-entropy's targets, in [0, 1); 0 = none",
    "train.schedule": "learning-rate schedule: 'constant', 'step' (times train.decay_factor at each of "
                      "train.milestones), 'cosine', or an optax schedule's name with train.schedule_args",
    "train.schedule_args": "an optax schedule's other arguments, a dict such as \"dict(decay_rate=0.5)\"",
    "train.milestones": "epochs at which a 'step' schedule multiplies the learning rate by train.decay_factor, "
                        "e.g. \"(100, 150)\"",
    "train.decay_factor": "factor applied to the learning rate at each milestone of a 'step' schedule",
    "train.warmup_epochs": "epochs of linear learning-rate warm-up from 0 (fractions allowed); 0 = none",
    "train.batch_size": "minibatch size: training examples per SGD step (the last partial batch of an epoch is "
                        "dropped)",
    "train.eval_batch_size": "examples per evaluation batch (host-fed image runs; does not change any result; "
                             "on-device runs evaluate whole sets and refuse another value than 1000)",
    "train.epochs": "training epochs (passes over the training set)",
    "train.eval_every": "evaluate the training and test sets after every k-th epoch and after the last (1: every "
                        "epoch); the other epochs' evaluation entries are NaN, the training is the same",
    "train.steps": "0: the run is train.epochs epochs; > 0: the run is this many minibatch steps instead (a step run; "
                   "its history, checkpoints and metrics.jsonl count periods of "
                   "train.eval_every_steps steps)",
    "train.eval_every_steps": "a step run's evaluation period in steps (it must divide train.steps); 0 = once, "
                              "after the last step",
    "train.augment": "true/false: random crops and flips of the training images (host-fed image runs; on-device "
                     "runs refuse true)",
    "train.shuffle": "true/false: a fresh order of the training set every epoch, or (false) the stored order every "
                     "epoch, the same batches on both feeders",
    "train.checkpoint_every": "epochs between checkpoints (on-device runs: chunks are cut there); 0 = only at "
                              "the end",
    "train.checkpoint_keep": "how many checkpoints to keep (the newest)",
    "train.seed": "the first training seed when seeds are counted from it (an integer in [0, 2**31))",
    "train.seed_axis": "how the host feeder steps several seeds: 'auto', 'vmap', 'unroll' or 'loop' (same results; "
                       "on-device runs always vmap and refuse 'unroll' and 'loop')",
}

#: Help for settings that several experiments share under one name and meaning; an experiment's own ``HELP`` entry
#: replaces one of these.
COMMON_HELP = {
    "seed": "random seed of the experiment, an integer in [0, 2**31): every weight draw, input and data order of the "
            "run derives from it",
    "num_seeds": "independent runs (seeds) per cell; metrics are lists over seeds",
    "data": "data set: 'mnist1d' (MNIST-1D, 4,000 training / 1,000 test sequences of length 40, generated offline)",
    "chunk_epochs": "epochs per compiled chunk of the on-device training loop: progress lines (and checkpoints) come "
                    "once per chunk; does not change any result",
    "data_dir": "TFDS data folder; empty: TFDS's default (~/tensorflow_datasets or $TFDS_DATA_DIR)",
    "synthetic_examples": "CIFAR-shaped random images in the synthetic stand-in data set (data 'synthetic')",
    "width": "hidden width (units per layer)",
    "model.width": "hidden width of every network (units per layer)",
    "checkpoint_dir": "folder for training checkpoints; a rerun with the same settings resumes there",
}


def help_for(module, name: str, config: ml_collections.ConfigDict | None = None) -> str | None:
    """The help line of ``--<name>`` for ``module``: its ``HELP`` entry, else the shared one (``COMMON_HELP``,
    ``TRAIN_HELP``); ``None`` when there is none. ``--train.seed`` of an experiment that has its own ``--seed``
    says that it is not read (the experiment's runs derive their seeds from ``--seed``)."""
    own = getattr(module, "HELP", {})
    if name in own:
        return own[name]
    if name == "train.seed" and config is not None and "seed" in config:
        return "not read by this experiment: its runs' seeds derive from --seed (every train config has this setting)"
    if name == "seed" and config is not None and "train" in config and "seed" in config.train:
        return COMMON_HELP["seed"] + "; --train.seed is not read by this experiment"
    return COMMON_HELP.get(name, TRAIN_HELP.get(name))


def flags_without_help(module) -> list[str]:
    """Every setting of ``module`` (at any size) that has no help line (a test keeps this empty)."""
    names: dict[str, ml_collections.ConfigDict] = {}
    for size in SIZES:
        config = module.get_config(size)
        for name in flatten(config):
            names.setdefault(name, config)
    return [name for name, config in names.items() if not help_for(module, name, config)]


def size_changes(module, size: str) -> list[str]:
    """What ``--<size>`` changes against the default size: ``['train.epochs 300 -> 2', ...]`` (from the configs)."""
    base, other = flatten(module.get_config("default")), flatten(module.get_config(size))
    changes = [f"{k} {show_value(base[k])} -> {show_value(other[k])}" for k in other
               if k in base and base[k] != other[k]]
    return changes + [f"{k} = {show_value(other[k])} (added)" for k in other if k not in base]


def size_help(module, size: str) -> str:
    """The help line of ``--quick`` / ``--full``: what the size is for and every setting it changes."""
    what = {"quick": "small, fast sizes (seconds to a minute; what the tests run): a pipeline check, NOT expected to "
                     "reproduce the seed documents' numbers",
            "full": "paper-scale sizes (more seeds, draws or epochs; meant for an accelerator)"}[size]
    changes = size_changes(module, size)
    if not changes:
        return f"the same settings as the default size in this experiment ({size} changes nothing)"
    return f"{what}. Changes: {'; '.join(changes)}"


def _abbreviates(short: str, words: list[str], every_word: bool) -> bool:
    """Whether ``short`` is made of non-empty prefixes of ``words`` in order (``lr``: Learning_Rate, ``bs``:
    Batch_Size, ``lrate``, ``wdecay``): of every word (``every_word``), or of some of them, the others skipped
    (``seeds``: num_SEEDS)."""
    if not short:
        return not every_word or not words
    if not words:
        return False
    first, rest = words[0], words[1:]
    for k in range(min(len(first), len(short)), 0, -1):
        if short[:k] == first[:k] and _abbreviates(short[k:], rest, every_word):
            return True
    return not every_word and _abbreviates(short, rest, every_word)


def _is_subsequence(short: str, name: str) -> bool:
    """Whether the letters of ``short`` come in ``name`` in the same order (``lerning_rate``, ``epocs``)."""
    letters = iter(name)
    return all(c in letters for c in short)


def _closeness(argv_flag: str, flag: str) -> tuple[int, int, float]:
    """How well the unknown ``argv_flag`` names the known ``flag``, larger is closer: ``(kind, same group, text
    similarity)``. Kinds, by the last dotted part (``--train.lr``: ``lr``): 4 the same name in another group
    (``--learning_rate``), 3 a prefix or an abbreviation by every word (``learn``, ``lr``, ``wd``, ``bs``),
    2 an abbreviation of some of the words (``seeds``), 1 the letters in order (``lerning_rate``), 0 only a
    similar text (``difflib``: a typo, ``learnign_rate``)."""
    import difflib

    group, _, leaf = argv_flag.lstrip("-").lower().rpartition(".")
    known_group, _, known = flag.lstrip("-").lower().rpartition(".")
    short, words = leaf.replace("_", "").replace("-", ""), [w for w in re.split(r"[_-]", known) if w]
    if leaf == known:
        kind = 4
    elif known.startswith(leaf) or _abbreviates(short, words, every_word=True):
        kind = 3
    elif len(short) > 1 and _abbreviates(short, words, every_word=False):
        kind = 2
    elif len(short) > 1 and _is_subsequence(leaf, known):
        kind = 1
    else:
        kind = 0
    similar = difflib.SequenceMatcher(None, argv_flag.lower(), flag.lower()).ratio()
    return kind, int(group == known_group), similar


def closest_flags(argv_flag: str, known: list[str], n: int = 3) -> list[str]:
    """The known flags that ``argv_flag`` most likely meant, closest first (at most ``n``): those of the closest
    kind of :func:`_closeness` (a common abbreviation, ``--train.lr`` -> ``--train.learning_rate``, before names
    that only look alike, ``--train.loss``), text similarity deciding within a kind and alone for a typo
    (at least 0.6, as ``difflib.get_close_matches``, and within 0.1 of the most similar); none when nothing is
    close."""
    scored = [(_closeness(argv_flag, flag), flag) for flag in known]
    scored = [(score, flag) for score, flag in scored if score[0] > 0 or score[2] >= 0.6]
    if not scored:
        return []
    best = max(score for score, _ in scored)
    # of the best kind; a typo's (kind 0): only the names about as similar as the most similar one
    near = [(score, flag) for score, flag in scored if score[0] == best[0] and (best[0] or score[2] >= best[2] - 0.1)]
    return [flag for _, flag in sorted(near, key=lambda s: s[0], reverse=True)[:n]]


def _describe_flags(parser: argparse.ArgumentParser, argv_flag: str) -> str:
    """The unknown ``argv_flag``'s error: the closest known flag names (:func:`closest_flags`)."""
    known = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
    close = closest_flags(argv_flag, known)
    hint = f"; did you mean {' or '.join(close)}?" if close else "; --help lists every flag"
    cells = [o for o in known if o.endswith("cells")]
    if cells and re.search(r"depth|blocks|layers|kind|norm|order|model\.", argv_flag):
        hint += f" (the networks, their kinds and depths, are {' and '.join(cells)})"
    return f"unrecognized argument {argv_flag}{hint}"


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` that refuses abbreviated flags (``allow_abbrev=False``: ``--train.learn 0.01`` is
    an error, not ``--train.learning_rate``) and names the closest known flags for an unknown one."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            flags = [e for e in extras if e.startswith("-")]
            self.error(_describe_flags(self, flags[0].split("=", 1)[0]) if flags
                       else f"unrecognized arguments: {' '.join(extras)}")
        return parsed


def build_parser(module, argv):
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    size = pre.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true")
    size.add_argument("--full", action="store_true")
    known, _ = pre.parse_known_args(argv)
    size_name = "quick" if known.quick else "full" if known.full else "default"
    config = module.get_config(size_name)
    epilog = ("Values: numbers, true/false, text; tuples as \"(16, 32)\" or 16,32, and a leading + adds to a tuple's "
              "default (--sweep_batch_sizes +256). Every setting is checked before any work (exit status 2 naming "
              "the flag). Results: OUT/results.json = {experiment, config, metrics, seconds} and OUT/"
              f"{module.NAME}.png; compare runs with python -m experiments.compare RUN_A RUN_B.")
    parser = ArgumentParser(prog=f"python -m experiments.{module.NAME}",
                            usage="%(prog)s [--quick | --full] [--out DIR] [--<setting> VALUE ...]",
                            description=(module.__doc__ or "").split("\n\n")[0], epilog=epilog)
    sizes = parser.add_mutually_exclusive_group()
    for name in ("quick", "full"):
        sizes.add_argument(f"--{name}", action="store_true", help=size_help(module, name))
    parser.add_argument("--out", default=None, metavar="DIR",
                        help=f"output folder (default: {default_out(module.NAME, 'default')}; with --quick "
                             f"{default_out(module.NAME, 'quick')}, so a quick check never replaces a real run)")
    parser.add_argument("--checkpoint_dir", default=None, metavar="DIR",
                        help="where each training cell checkpoints, so that the same command run again resumes: "
                             f"finished cells load, the interrupted one goes on (default: OUT/checkpoints; 'none': "
                             "no checkpoints)")
    parser.add_argument("--fresh", action="store_true",
                        help="train every cell from its start, ignoring (and replacing) its checkpoints")
    for name, default in flatten(config).items():
        text = help_for(module, name, config) or "(no help yet)"
        parser.add_argument(f"--{name}", dest=name, default=None, metavar="VALUE",
                            help=f"{text} (default: {show_value(default)})".replace("%", "%%"))
    return parser, config, size_name


def parse_args(module, argv=None, check: bool = False,
               options: dict | None = None) -> tuple[ml_collections.ConfigDict, pathlib.Path]:
    """``(config, out_dir)`` from the command line. A value that does not parse is an argparse error (exit
    status 2, naming the flag). With ``check``, the run is also preflighted (:func:`preflight`: every cell,
    every setting, the output folder, the checkpoint folder) and a refused setting is an argparse error naming
    its flag. ``options``, a dict, receives ``checkpoint_dir`` (the ``--checkpoint_dir`` text, None when not
    given) and ``fresh``."""
    parser, config, size_name = build_parser(module, argv)
    args = vars(parser.parse_args(argv))
    leaves = flatten(config)
    for name, default in leaves.items():
        if args.get(name) is not None:
            try:
                text = args[name]
                if isinstance(default, (tuple, list)) and text.startswith("+"):  # --cells +residual_bn:16
                    value = tuple(default) + tuple(parse_value(text[1:], default))
                else:
                    value = parse_value(text, default)
            except ValueError as err:
                parser.error(f"argument --{name}: {err}")
            set_path(config, name, value)
    # a local folder or a bucket URL (resjax.paths: gs://, s3://); a URL is checked before anything compiles
    out_dir = as_path(args["out"], "out") if args["out"] else default_out(module.NAME, size_name)
    if options is not None:
        options.update(checkpoint_dir=args["checkpoint_dir"], fresh=args["fresh"])
    if check:
        from resjax.data import DataNotPreparedError

        try:
            checkpoints.check_root(checkpoints.resolve(args["checkpoint_dir"], out_dir))
            preflight(module, config, out_dir)
        except ValueError as err:
            parser.error(flag_message(err, leaves))
        except DataNotPreparedError as err:
            parser.exit(2, f"{parser.prog}: error: {err}\n")
    return config, out_dir
