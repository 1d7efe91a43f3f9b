"""Hardware strategies: placement, precision and collectives as values a step receives."""

from . import cluster, slurm
from .cluster import (
    ClusterEnvironment,
    EnvironmentVariables,
    KubeflowEnvironment,
    LSFEnvironment,
    MPIEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)
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
from .tensor_parallel import DATA_PARALLEL_MODES, TensorParallel, tensor_parallel

__all__ = [
    "ClusterEnvironment",
    "EnvironmentVariables",
    "KubeflowEnvironment",
    "LSFEnvironment",
    "MPIEnvironment",
    "SLURMEnvironment",
    "TorchElasticEnvironment",
    "cluster",
    "slurm",
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
    "DATA_PARALLEL_MODES",
    "TensorParallel",
    "tensor_parallel",
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
