"""purestep inside other frameworks: Ray Train and Tune, Optuna, Hugging Face.

Each module here wraps one outside library, which is an optional extra (``ray``, ``optuna``,
``hf``): importing ``purestep`` or ``purestep.loops.integrations`` imports none of them, and
a name here loads its library on first use. When that library is missing, the error says
which extra to install instead of only naming the module Python could not find.
"""

from __future__ import annotations

from typing import Any

from purestep.engine.lazy import exports

#: each module's public names
_NAMES: dict[str, tuple[str, ...]] = {
    ".ray_train": (
        "CHECKPOINT_FILE",
        "RayReporter",
        "RayTrainReport",
        "SaveForReport",
        "ckpt_path_from",
        "ray_ckpt_path",
        "ray_train_report",
    ),
    ".ray_tune": ("TuneReportCheckpoint", "tune_ckpt_path", "tune_report"),
    ".optuna_pruning": ("OptunaPruning", "original_trial_number", "resume_path", "trial_run_dir"),
    ".vmapped_sweep": ("MemberPruning", "SweepResult", "prune_members", "sweep"),
    ".hf_models": ("HFTask", "block_classes", "hf_loss", "save_pretrained"),
    ".hf_datasets": ("HFRows", "HFStream", "HFStreamData", "hf_loader"),
}

#: ``name -> (module, attribute)``.
_LAZY: dict[str, tuple[str, str | None]] = {
    name: (module, name) for module, names in _NAMES.items() for name in names
}

#: the extra each module's outside libraries come with (``pip install "purestep[extra]"``)
EXTRAS: dict[str, str] = {
    ".ray_train": "ray",
    ".ray_tune": "ray",
    ".optuna_pruning": "optuna",
    ".vmapped_sweep": "optuna",
    ".hf_models": "hf",
    ".hf_datasets": "hf",
}

#: the top-level packages of the extras' libraries
_OUTSIDE = {"ray", "optuna", "optuna_integration", "transformers", "datasets", "sqlalchemy"}

__all__: list[str] = sorted(_LAZY)

_load, __dir__ = exports(__name__, _LAZY, globals())


def __getattr__(name: str) -> Any:
    try:
        return _load(name)
    except ModuleNotFoundError as err:
        missing = (err.name or "").split(".", 1)[0]
        if missing not in _OUTSIDE:
            raise
        extra = EXTRAS[_LAZY[name][0]]
        raise ModuleNotFoundError(
            f"purestep.loops.integrations.{name} needs {missing!r}, which is not installed: "
            f'pip install "purestep[{extra}]"',
            name=err.name,
        ) from err
