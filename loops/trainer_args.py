"""Trainer flags from the environment and from the command line.

``PURESTEP_TRAINER_<FLAG>`` environment variables supply defaults for flags not passed
explicitly (explicit arguments win; values are read with ``ast.literal_eval``, so ``3``,
``0.5``, ``None``, ``False`` and ``{0: 2}`` work, and anything literal_eval cannot read
stays a string: ``cpu``, ``bf16-mixed``, ``00:01:00:00``; an empty value is ignored). A
flag typed ``bool`` also takes ``true/false``, ``yes/no``, ``on/off`` and ``1/0`` in any
case (anything else is a ``ValueError`` naming the variable). A ``PURESTEP_TRAINER_*``
variable that names no flag is ignored with a ``UserWarning`` suggesting the closest flag.
``add_argparse_args(parser)`` adds one ``--<flag>`` option per Trainer flag, parsed the same
way, and ``from_argparse_args(cls, args, **overrides)`` builds a Trainer from the result.

An unknown flag name is a ``TypeError``: a Lightning flag this Trainer spells otherwise (or
does not have) names its replacement (``LIGHTNING_FLAGS``); any other name gets the closest
known flag.

Of Lightning's ``plugins=`` only cluster environments are taken
(``Trainer(strategy="ddp", plugins=[hardware.SLURMEnvironment(auto_requeue=False)])``,
``hardware.cluster``): one plugin or a list, at most one cluster environment, handed to the
strategy flag (``hardware.flags.WithCluster``). Any other plugin is refused as before.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import functools
import inspect
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "BOOL_SPELLINGS",
    "ENV_PREFIX",
    "LIGHTNING_FLAGS",
    "add_argparse_args",
    "check_environment",
    "check_flag_names",
    "defaults_from_env",
    "flag_names",
    "from_argparse_args",
    "parse_flag",
    "parse_value",
]

ENV_PREFIX = "PURESTEP_TRAINER_"
# Flags that take Python objects only: no command-line option for them.
_NOT_FROM_COMMAND_LINE = frozenset({"callbacks"})

_NOT_YET = "not available yet"
_DDP = 'strategy="ddp" and one process per device, started by torchrun or hardware.launch'
_APEX = 'not available (no apex): precision="16-mixed" or "bf16-mixed" use torch autocast'
_SAMPLER = (
    "not a flag: the Trainer always re-creates plain loaders on its own deterministic order, "
    "sharded per rank"
)
#: Lightning (1.5 and later) Trainer flags this Trainer spells otherwise or does not have:
#: what to use instead, or that it is not available yet.
LIGHTNING_FLAGS: dict[str, str] = {
    "gpus": f'use accelerator="gpu", devices=N; several devices need {_DDP}',
    "tpu_cores": f"{_NOT_YET}: this Trainer runs on CPU and CUDA devices only",
    "ipus": f"{_NOT_YET}: this Trainer runs on CPU and CUDA devices only",
    "num_processes": f"use devices=N with {_DDP}",
    "num_nodes": (
        'not a flag: start the processes with torchrun --nnodes=N and use strategy="ddp"; '
        "the world size comes from torchrun's environment"
    ),
    "auto_select_gpus": f"{_NOT_YET}; choose a GPU with devices=[index]",
    "resume_from_checkpoint": "use trainer.fit(..., ckpt_path=...)",
    "weights_save_path": "use callbacks=[ModelCheckpoint(dirpath=...)]",
    "checkpoint_callback": "use enable_checkpointing; a ModelCheckpoint goes in callbacks=[...]",
    "progress_bar_refresh_rate": (
        "use enable_progress_bar, 0 -> False; another rate: callbacks=[ProgressBar(refresh_rate=N)]"
    ),
    "process_position": _NOT_YET,
    "weights_summary": (
        "use enable_model_summary, None -> False, or callbacks=[ModelSummary(max_depth=...)], "
        '"full" -> max_depth=-1'
    ),
    "flush_logs_every_n_steps": (
        "use the logger's: logger=CSVLogger(..., flush_logs_every_n_steps=N)"
    ),
    "log_gpu_memory": _NOT_YET,
    "amp_backend": _APEX,
    "amp_level": _APEX,
    "move_metrics_to_cpu": _NOT_YET,
    "replace_sampler_ddp": _SAMPLER,
    "use_distributed_sampler": _SAMPLER,
    "sync_batchnorm": "use strategy=hardware.ddp(sync_batchnorm=True)",
    "distributed_backend": 'use strategy="ddp"',
    "truncated_bptt_steps": _NOT_YET,
    "stochastic_weight_avg": "use callbacks=[StochasticWeightAveraging(swa_lrs=...)]",
    "plugins": (
        f"{_NOT_YET} except cluster environments (hardware.SLURMEnvironment(), ...): pass "
        "precision=... or a hardware strategy value as strategy=..."
    ),
    "reload_dataloaders_every_epoch": "use reload_dataloaders_every_n_epochs=1",
}

_TRUE_WORDS = frozenset({"true", "yes", "on"})
_FALSE_WORDS = frozenset({"false", "no", "off"})
#: What a flag typed ``bool`` accepts as text (any case).
BOOL_SPELLINGS = "true/false, yes/no, on/off, 1/0"


def parse_value(text: str) -> Any:
    """A flag value from text: a Python literal when it is one, else the text itself."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


def _types(annotation: Any) -> set[str]:
    """The names in a flag's annotation (``"bool | None"`` -> ``{"bool", "None"}``)."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    return {part.strip() for part in str(text).split("|")}


def parse_flag(text: str, annotation: Any, source: str = "the value") -> Any:
    """A flag value from text, read for the flag's type: ``parse_value``, except that a flag
    typed ``bool`` takes the usual boolean spellings (``source`` names the text in errors)."""
    types = _types(annotation)
    if "bool" not in types:
        return parse_value(text)
    word = text.strip().lower()
    only_bool = types <= {"bool", "None"}
    digits_are_bools = "int" not in types  # fast_dev_run (int | bool): 1 means one batch
    if word in _TRUE_WORDS or (digits_are_bools and word == "1"):
        return True
    if word in _FALSE_WORDS or (digits_are_bools and word == "0"):
        return False
    if word == "none" and "None" in types:
        return None
    if not only_bool:  # e.g. fast_dev_run (int | bool), deterministic (bool | str | None)
        return parse_value(text)
    accepted = BOOL_SPELLINGS + (", None" if "None" in types else "")
    raise ValueError(f"{source}={text!r} is not a boolean; accepted (any case): {accepted}")


def flag_names(init: Callable[..., Any]) -> list[str]:
    """The keyword flags of a Trainer ``__init__`` (everything but ``self``)."""
    params = inspect.signature(init).parameters.values()
    return [
        p.name
        for p in params
        if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]


def check_flag_names(given: Any, known: list[str], owner: str = "Trainer") -> None:
    """Refuse names that are not flags, suggesting the closest known flag for each."""
    unknown = [name for name in given if name not in known]
    if not unknown:
        return
    parts = []
    for name in unknown:
        if name in LIGHTNING_FLAGS:
            parts.append(f"`{name}` (a Lightning flag: {LIGHTNING_FLAGS[name]})")
            continue
        close = difflib.get_close_matches(str(name), known, n=1)
        parts.append(f"`{name}`" + (f" (did you mean `{close[0]}`?)" if close else ""))
    raise TypeError(f"{owner} got unknown flag(s): {', '.join(parts)}")


def check_environment(names: list[str], environ: Mapping[str, str] | None = None) -> None:
    """Warn about ``PURESTEP_TRAINER_*`` variables that name no flag (they are ignored)."""
    environ = os.environ if environ is None else environ
    known = {ENV_PREFIX + name.upper() for name in names}
    for var in environ:
        if not var.startswith(ENV_PREFIX) or var in known:
            continue
        flag = var[len(ENV_PREFIX) :].lower()
        close = difflib.get_close_matches(flag, names, n=1)
        hint = f"; did you mean {ENV_PREFIX}{close[0].upper()}?" if close else ""
        if flag in LIGHTNING_FLAGS:
            hint = f" ({flag} is a Lightning flag: {LIGHTNING_FLAGS[flag]})"
        warnings.warn(
            f"{var} names no Trainer flag and is ignored{hint}", UserWarning, stacklevel=3
        )


def defaults_from_env(init: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate ``__init__`` so unset flags take ``PURESTEP_TRAINER_<FLAG>`` values."""
    signature = inspect.signature(init)
    names = flag_names(init)
    annotations = {name: signature.parameters[name].annotation for name in names}

    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        cluster = _take_cluster_plugin(kwargs)
        check_flag_names(kwargs, names, type(self).__name__)
        check_environment(names)
        bound = signature.bind_partial(self, *args, **kwargs)
        from_env: list[str] = []
        for name in names:
            if name in bound.arguments:
                continue
            var = ENV_PREFIX + name.upper()
            text = os.environ.get(var)
            if text:
                kwargs[name] = parse_flag(text, annotations[name], var)
                from_env.append(f"{var}={text!r}")
        if cluster is not None:
            from purestep.hardware.flags import WithCluster

            kwargs["strategy"] = WithCluster(kwargs.get("strategy", "auto"), cluster)
        try:
            init(self, *args, **kwargs)
        except (TypeError, ValueError) as e:
            if from_env and hasattr(e, "add_note"):  # Python 3.11+
                e.add_note(f"Flags from the environment: {', '.join(from_env)}")
            raise

    return wrapper


def _take_cluster_plugin(kwargs: dict[str, Any]) -> Any:
    """Take ``plugins`` out of ``kwargs`` if it holds only cluster environments (Lightning's
    ``plugins=[SLURMEnvironment()]``); return the one it holds (None for none). Any other
    plugin is left in place for ``check_flag_names`` to refuse."""
    if "plugins" not in kwargs:
        return None
    from purestep.hardware.cluster import ClusterEnvironment

    given = kwargs["plugins"]
    items = list(given) if isinstance(given, (list, tuple)) else [given]
    if not all(isinstance(item, ClusterEnvironment) for item in items):
        return None
    if len(items) > 1:
        raise ValueError(
            f"plugins= holds {len(items)} cluster environments "
            f"({', '.join(map(repr, items))}); pass one"
        )
    del kwargs["plugins"]
    return items[0] if items else None


def add_argparse_args(
    init: Callable[..., Any], parser: argparse.ArgumentParser
) -> argparse.ArgumentParser:
    """Add ``--<flag>`` for every flag of ``init`` that can be given as text."""
    group = parser.add_argument_group("Trainer")
    parameters = inspect.signature(init).parameters
    for name in flag_names(init):
        if name in _NOT_FROM_COMMAND_LINE:
            continue
        default = parameters[name].default
        group.add_argument(
            f"--{name}",
            dest=name,
            type=_option_parser(name, parameters[name].annotation),
            default=argparse.SUPPRESS,
            help=f"Trainer flag {name} (default: {default!r})",
        )
    return parser


def _option_parser(name: str, annotation: Any) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return parse_flag(text, annotation, f"--{name}")
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = name  # argparse names the type in its own messages
    return parse


def from_argparse_args(
    cls: type, args: argparse.Namespace | Mapping[str, Any], **overrides: Any
) -> Any:
    """A ``cls`` built from parsed arguments (keys that are not flags are ignored, so the
    namespace may hold the script's own options; ``overrides`` win and must be flags)."""
    given = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    names = flag_names(cls.__init__)
    cluster = _take_cluster_plugin(overrides)
    check_flag_names(overrides, names, cls.__name__)
    flags = {k: v for k, v in given.items() if k in names}
    flags.update(overrides)
    if cluster is not None:
        flags["plugins"] = [cluster]
    return cls(**flags)
