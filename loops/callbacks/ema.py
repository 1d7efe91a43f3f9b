"""An exponential moving average of the weights (Lightning 2.x's ``EMAWeightAveraging``).

After every ``every_n_steps``-th optimizer step from ``start_step`` on, the average moves
towards the parameters: ``average = decay * average + (1 - decay) * params`` (the first
update copies them), with ``torch.optim.swa_utils.get_ema_multi_avg_fn``'s arithmetic, so
it **equals** ``AveragedModel(multi_avg_fn=get_ema_multi_avg_fn(decay))`` fed the same
parameters. ``warmup=True`` uses ``min(decay, (1 + n) / (10 + n))`` at the ``n``-th update
(TensorFlow's ``num_updates`` rule), so early averages do not lag behind the first,
untrained weights. ``use_buffers`` averages the buffers too (else the buffers stay the
model's, as ``AveragedModel(use_buffers=False)``).

``evaluate_with_average=True``: validation (in fit and ``trainer.validate``) and
``trainer.test`` run with the averaged weights, swapped in at ``on_validation_start`` /
``on_test_start`` and back at the stage's end (``Requests(weights=...)``). ``apply_at_end``:
the state ``fit`` returns carries the averaged weights (as Lightning's weight averaging
does at ``on_train_end``).

The average is the callback's state in ``TrainState.callbacks``, so it is checkpointed and
a resumed run (a SIGKILLed one too) continues it bitwise.
"""

from __future__ import annotations

from typing import Any

from torch.optim import swa_utils

from ..events import NOTHING, Context, Requests, Stage
from .base import Callback
from .swa import average_update, conform

__all__ = ["EMA"]


class EMA(Callback):
    """The moving average of the weights; see the module doc for the arguments."""

    def __init__(
        self,
        decay: float = 0.999,
        every_n_steps: int = 1,
        start_step: int = 0,
        warmup: bool = False,
        use_buffers: bool = False,
        evaluate_with_average: bool = True,
        apply_at_end: bool = True,
        *,
        name: str | None = None,
    ) -> None:
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 <= decay <= 1:
            raise ValueError(f"decay must be a number in [0, 1], got {decay!r}")
        for what, value, low in (
            ("every_n_steps", every_n_steps, 1),
            ("start_step", start_step, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{what} must be an int >= {low}, got {value!r}")
        for what, value in (
            ("warmup", warmup),
            ("use_buffers", use_buffers),
            ("evaluate_with_average", evaluate_with_average),
            ("apply_at_end", apply_at_end),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"{what} must be a bool, got {value!r}")
        self.decay = float(decay)
        self.every_n_steps = every_n_steps
        self.start_step = start_step
        self.warmup = warmup
        self.use_buffers = use_buffers
        self.evaluate_with_average = evaluate_with_average
        self.apply_at_end = apply_at_end
        if name is not None:
            self.name = name

    def init(self) -> dict[str, Any]:
        return {"average": None, "n_averaged": 0, "stash": None}

    def decay_at(self, n_averaged: int) -> float:
        """The decay of the update after ``n_averaged`` earlier ones."""
        if self.warmup:
            return min(self.decay, (1 + n_averaged) / (10 + n_averaged))
        return self.decay

    def should_update(self, step_idx: int) -> bool:
        """Whether the optimizer step ``step_idx`` (0-based) updates the average."""
        return step_idx >= self.start_step and step_idx % self.every_n_steps == 0

    def _weights(self, state: Any) -> dict[str, Any]:
        if not self.use_buffers:
            return dict(state.params)
        return {
            **{("p", k): v for k, v in state.params.items()},
            **{("b", k): v for k, v in state.buffers.items()},
        }

    def _keyed(self, stored: dict[str, Any] | None) -> dict[Any, Any] | None:
        """The stored average with its ``(kind, name)`` keys back (buffers averaged too;
        else the keys are the parameters' names as they are)."""
        return _keyed(stored) if self.use_buffers else stored

    def _as_request(self, average: dict[Any, Any], state: Any) -> dict[str, Any]:
        average = conform(average, self._weights(state))  # as a sharded checkpoint left it
        if not self.use_buffers:
            return {"params": average}
        return {
            "params": {k: v for (kind, k), v in average.items() if kind == "p"},
            "buffers": {k: v for (kind, k), v in average.items() if kind == "b"},
        }

    # ------------------------------------------------------------------ events

    def on_train_batch_end(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        out = ctx.outputs
        if out is not None and not getattr(out, "stepped", True):
            return state, NOTHING
        if not self.should_update(ctx.global_step - 1):
            return state, NOTHING
        n = state["n_averaged"]
        average = average_update(
            self._keyed(state["average"]),
            self._weights(ctx.state),
            n,
            multi_avg_fn=swa_utils.get_ema_multi_avg_fn(self.decay_at(n)),
        )
        return {**state, "average": _stored(average), "n_averaged": n + 1}, NOTHING

    def _swap_in(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        if not self.evaluate_with_average or state["average"] is None:
            return state, NOTHING
        current = self._as_request(self._weights(ctx.state), ctx.state)
        return (
            {**state, "stash": current},
            Requests(weights=self._as_request(self._keyed(state["average"]), ctx.state)),
        )

    def _swap_out(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        if state["stash"] is None:
            return state, NOTHING
        return {**state, "stash": None}, Requests(weights=state["stash"])

    def on_validation_start(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return self._swap_in(state, ctx)

    def on_validation_end(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return self._swap_out(state, ctx)

    def on_test_start(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return self._swap_in(state, ctx)

    def on_test_end(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        return self._swap_out(state, ctx)

    def on_train_end(self, state: Any, ctx: Context) -> tuple[Any, Requests]:
        if not self.apply_at_end or state["average"] is None or ctx.stage == Stage.SANITY_CHECK:
            return state, NOTHING
        return state, Requests(weights=self._as_request(self._keyed(state["average"]), ctx.state))


# The state keeps string keys (checkpoints store plain dicts): ("p", name) <-> "p:name".


def _stored(average: dict[Any, Any]) -> dict[str, Any]:
    return {(f"{k[0]}:{k[1]}" if isinstance(k, tuple) else k): v for k, v in average.items()}


def _keyed(stored: dict[str, Any] | None) -> dict[Any, Any] | None:
    if stored is None:
        return None
    out: dict[Any, Any] = {}
    for k, v in stored.items():
        kind, sep, name = k.partition(":")
        out[(kind, name) if sep and kind in ("p", "b") else k] = v
    return out
