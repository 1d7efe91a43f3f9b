"""A Lightning-style ``configure_optimizers``: torch optimizers bound to ``self.parameters()``.

Lightning users build ``torch.optim.Adam(self.parameters(), lr=...)``. Such an instance is
bound to the module's parameter objects; the engine needs a pure transform over named
tensors. ``convert_optimizers`` walks every shape Lightning accepts (one optimizer, a list,
``([optimizers], [schedulers])``, dicts with ``"optimizer"``) and replaces each instance by
``optim.from_torch`` of its class with the instance's parameter groups, named through the
module (``engine.optim.torch_instances.from_instance``: the constructor arguments as they
are after any scheduler was built on it). An optimizer over a part of the
module's trainable parameters gets the entry's ``"params"``. Schedulers are left in place
(``loops.optimizers`` reads them). What cannot be represented is refused, naming why.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.optim import Optimizer

from purestep.engine.optim import GradientTransformation
from purestep.engine.optim.torch_instances import from_instance

__all__ = ["convert_optimizers"]


def convert_optimizers(
    output: Any, module: nn.Module, where: str = "configure_optimizers()"
) -> Any:
    """``output`` with every torch optimizer instance replaced (see the module doc)."""
    named = list(module.named_parameters())
    trainable = [n for n, p in named if p.requires_grad]

    def convert(opt: Optimizer, at: str) -> Any:
        if any(opt.state.values()):
            raise ValueError(
                f"{at}: the {type(opt).__name__} has already stepped (it holds optimizer "
                "state); configure_optimizers must return a fresh optimizer"
            )
        tx, covered = from_instance(opt, named, what=at)
        if covered is None or sorted(covered) == sorted(trainable):
            return tx, None
        return tx, covered

    def entry(value: Any, at: str) -> Any:
        if isinstance(value, Optimizer):
            tx, params = convert(value, at)
            return tx if params is None else {"optimizer": tx, "params": params}
        if isinstance(value, Mapping) and isinstance(value.get("optimizer"), Optimizer):
            tx, params = convert(value["optimizer"], f"{at}['optimizer']")
            out = {**value, "optimizer": tx}
            if params is not None and "params" not in value:
                out["params"] = params
            return out
        return value

    if isinstance(output, GradientTransformation):  # a NamedTuple, not a list of optimizers
        return output
    if (
        isinstance(output, (list, tuple))
        and len(output) == 2
        and isinstance(output[0], (list, tuple))
    ):
        optimizers, schedulers = output
        return [entry(o, f"{where}[0][{i}]") for i, o in enumerate(optimizers)], schedulers
    if isinstance(output, (list, tuple)):
        return [entry(o, f"{where}[{i}]") for i, o in enumerate(output)]
    return entry(output, where)
