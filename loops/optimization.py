"""What a fit trains with, from ``configure_optimizers``: the optimizer state's factory, the
train step and the learning-rate schedulers.

One optimizer in automatic mode is the plain path: the task's transform (behind the
Trainer's clipping) and an ``engine.train_step``, so its state and checkpoints are exactly
those of a run without this module. Several optimizers, or manual optimization, go through
``loops.multi_optim`` (a ``MultiOptState`` and a ``MultiStep``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torch import nn

from purestep import engine
from purestep.engine.state import trainable_names

from .multi_optim import MultiOptimizer, MultiStep
from .optimizers import (
    OptimizerConfig,
    SchedulerConfig,
    parse_optimizers,
    resolve_params,
    with_clipping,
)

__all__ = ["Optimization", "optimization"]


@dataclasses.dataclass
class Optimization:
    """``optimizer``: what ``engine.init`` takes (a transform, or a ``MultiOptimizer``);
    ``configs``: ``(config, transform with clipping, parameter names)`` per optimizer;
    ``manual``: manual optimization; ``schedulers``: every optimizer's scheduler."""

    optimizer: Any
    configs: list[tuple[OptimizerConfig, Any, list[str]]]
    manual: bool
    schedulers: list[SchedulerConfig]

    @property
    def multi(self) -> bool:
        """Whether the state holds a ``MultiOptState`` (several optimizers, or manual)."""
        return isinstance(self.optimizer, MultiOptimizer)

    @property
    def names(self) -> list[str]:
        return [cfg.name for cfg, _, _ in self.configs]

    def train_step(
        self,
        net: nn.Module,
        training_step: Callable[..., Any],
        *,
        strategy: Any,
        accumulate: int | Callable[[Any], int],
    ) -> Any:
        """The step fit runs: an ``engine.train_step`` (one optimizer) or a ``MultiStep``."""
        if not self.multi:
            return engine.train_step(
                net,
                training_step,
                self.optimizer,
                strategy=strategy,
                accumulate=accumulate,
                grad_norm=False,  # nothing in the loops reads it; callbacks see the gradients
            )
        return MultiStep(
            net,
            training_step,
            self.configs,
            strategy=strategy,
            manual=self.manual,
            accumulate=accumulate,
        )


def _named(task: Any, net: nn.Module) -> list[tuple[str, Any]]:
    """What names the parameters of a torch optimizer instance (one that comes with its
    torch scheduler): the trained module's, and the task's template's where the strategy
    converted it into another module with the same names."""
    pairs = list(net.named_parameters())
    model = getattr(task, "model", None)
    if isinstance(model, nn.Module) and model is not net:
        pairs += list(model.named_parameters())
    return pairs


def optimization(task: Any, net: nn.Module, config: Any) -> Optimization:
    """Read ``task.configure_optimizers()`` for a fit of ``net`` under ``config``."""
    manual = getattr(task, "automatic_optimization", True) is False
    entries = parse_optimizers(task.configure_optimizers(), params=_named(task, net))
    trainable = trainable_names(net)
    resolved = resolve_params(entries, trainable)
    configs = []
    for cfg, names in resolved:
        clip = config.gradient_clip_val if cfg.gradient_clip_val is None else cfg.gradient_clip_val
        algorithm = cfg.gradient_clip_algorithm or config.gradient_clip_algorithm
        configs.append((cfg, with_clipping(cfg.optimizer, clip, algorithm), names))
    schedulers = [cfg.scheduler for cfg, _, _ in configs if cfg.scheduler is not None]
    if len(configs) == 1 and not manual:
        cfg, tx, names = configs[0]
        if cfg.frequency is not None or cfg.accumulate != 1:
            raise ValueError(
                "configure_optimizers(): 'frequency' and 'accumulate' are options of several "
                "optimizers / manual optimization; with one optimizer use the Trainer's "
                "accumulate_grad_batches"
            )
        if names != trainable:
            raise ValueError(
                f"configure_optimizers(): optimizer {cfg.name!r} updates {len(names)} of the "
                f"{len(trainable)} trainable parameters; freeze the others on the template "
                "(requires_grad_(False)) or give them an optimizer"
            )
        return Optimization(tx, configs, False, schedulers)
    if not manual and any(cfg.accumulate != 1 for cfg, _, _ in configs):
        raise ValueError(
            "'accumulate' per optimizer is for manual optimization "
            "(automatic_optimization = False); automatic mode uses accumulate_grad_batches"
        )
    return Optimization(MultiOptimizer(configs), configs, manual, schedulers)
