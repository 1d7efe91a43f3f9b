"""Hardware strategies: placement, precision and collectives as values a step receives."""

from .collectives import REDUCE_OPS, CollectiveError, all_reduce_tree, broadcast_tree
from .ddp import BUFFER_MODES, DDP, DDPTrainStep, ddp
from .ensemble import (
    Ensemble,
    EnsembleEvalStep,
    EnsemblePredictStep,
    EnsembleStepOutput,
    EnsembleTrainStep,
    ensemble,
)
from .flags import from_flags
from .fsdp import FSDP, FSDPEvalStep, FSDPPredictStep, FSDPTrainStep, fsdp
from .launch import LaunchError, LaunchTimeout, free_port, launch
from .member_sgd import MemberSGDState, member_sgd
from .members import EnsembleInfo, is_ensemble, member, stack
from .precision import PRECISIONS, MixedPrecision, TruePrecision, precision
from .process_env import ProcessEnv
from .single import SingleDevice, single_device

__all__ = [
    "BUFFER_MODES",
    "DDP",
    "REDUCE_OPS",
    "CollectiveError",
    "DDPTrainStep",
    "LaunchError",
    "LaunchTimeout",
    "ProcessEnv",
    "all_reduce_tree",
    "broadcast_tree",
    "ddp",
    "free_port",
    "launch",
    "PRECISIONS",
    "MixedPrecision",
    "SingleDevice",
    "TruePrecision",
    "from_flags",
    "precision",
    "single_device",
    "Ensemble",
    "EnsembleEvalStep",
    "EnsembleInfo",
    "EnsemblePredictStep",
    "EnsembleStepOutput",
    "EnsembleTrainStep",
    "ensemble",
    "FSDP",
    "FSDPEvalStep",
    "FSDPPredictStep",
    "FSDPTrainStep",
    "fsdp",
    "is_ensemble",
    "member",
    "MemberSGDState",
    "member_sgd",
    "stack",
]
