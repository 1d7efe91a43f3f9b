"""The functional core of purestep: state pytrees, keys, optimizers and pure step functions.

Every name is imported on first use, as in ``purestep.loops``: ``import purestep.engine``
loads nothing else, and a DataLoader worker, a DDP rank or the command line's ``--help``
pays for the modules it touches (``purestep.engine.state``, say), not for the compiler's,
the checkpoints' and the metrics' as well. ``from purestep.engine import train_step`` and
``purestep.engine.optim`` work as they did with eager imports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy import exports

if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load on first use
    from . import checkpoint, compile, differentiable, metrics, optim, per_sample, rng, tree
    from .bind import Binder, canonical_names
    from .builders import eval_step, predict_step, train_step
    from .differentiable import DifferentiableTrainStep
    from .eval_steps import EvalStep, PredictStep
    from .export import to_module
    from .gradients import owned_gradients
    from .loss_output import SKIP, batch_size
    from .loss_scale import DynamicLossScale, LossScaleState
    from .per_sample import PerSampleStep, per_sample_step
    from .state import Progress, TrainState, init, materialize, trainable_names
    from .step import Gradients, StepOutput, TrainStep
    from .strategy import Local, Precision, Strategy
    from .tree import field, struct

#: Where each name lives: ``name -> (module, attribute)``, the module itself when the
#: attribute is None.
_LAZY: dict[str, tuple[str, str | None]] = {
    # the subpackages and modules named in __all__, and the others an eager import bound
    **{
        name: (f".{name}", None)
        for name in (
            "bind",
            "checkpoint",
            "compile",
            "differentiable",
            "export",
            "loss_scale",
            "metrics",
            "optim",
            "per_sample",
            "rng",
            "state",
            "step",
            "strategy",
            "tree",
            "user_errors",
        )
    },
    **{n: (".bind", n) for n in ("Binder", "canonical_names")},
    "to_module": (".export", "to_module"),
    "DifferentiableTrainStep": (".differentiable", "DifferentiableTrainStep"),
    **{n: (".loss_scale", n) for n in ("DynamicLossScale", "LossScaleState")},
    **{n: (".per_sample", n) for n in ("PerSampleStep", "per_sample_step")},
    **{
        n: (".state", n)
        for n in ("Progress", "TrainState", "init", "materialize", "trainable_names")
    },
    **{n: (".builders", n) for n in ("eval_step", "predict_step", "train_step")},
    **{n: (".eval_steps", n) for n in ("EvalStep", "PredictStep")},
    "owned_gradients": (".gradients", "owned_gradients"),
    **{n: (".loss_output", n) for n in ("SKIP", "batch_size")},
    **{n: (".step", n) for n in ("Gradients", "StepOutput", "TrainStep")},
    **{n: (".strategy", n) for n in ("Local", "Precision", "Strategy")},
    **{n: (".tree", n) for n in ("field", "struct")},
}

__all__ = [
    "Binder",
    "DifferentiableTrainStep",
    "DynamicLossScale",
    "EvalStep",
    "Gradients",
    "Local",
    "LossScaleState",
    "PerSampleStep",
    "Precision",
    "PredictStep",
    "Progress",
    "SKIP",
    "StepOutput",
    "Strategy",
    "TrainState",
    "TrainStep",
    "batch_size",
    "canonical_names",
    "checkpoint",
    "compile",
    "differentiable",
    "eval_step",
    "field",
    "init",
    "materialize",
    "metrics",
    "optim",
    "owned_gradients",
    "per_sample",
    "per_sample_step",
    "predict_step",
    "rng",
    "struct",
    "to_module",
    "train_step",
    "trainable_names",
    "tree",
]


__getattr__, __dir__ = exports(__name__, _LAZY, globals())
