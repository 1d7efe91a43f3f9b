"""``LightningTask``: a Lightning-style module run as a purestep ``Task``.

The module is the template. Its step methods run on the module bound to the state's
tensors (the engine's ``apply`` is the module itself, its parameters and buffers swapped
for the state's), so ``self(x)``, ``self.layer`` and everything logged come from the state
and a resumed run is bit-exact. Lightning's calling conventions are kept:
``training_step(batch, batch_idx)`` (the batch index of the loop, recorded at
``on_train_batch_start``), ``validation_step`` / ``test_step`` (with ``dataloader_idx``
when there are several dataloaders and the method takes it), ``predict_step``; a loss
tensor or a dict with ``"loss"`` is the training loss. ``self.log`` values are the steps'
metrics (``loops.lightning.logging``); the loss is logged only when the module logs it, as
in Lightning. Hooks run with Lightning's signatures, bound to the state's tensors; what
they log joins the loggers as a callback's values do.

``self.trainer`` is a ``TrainerView``. Python attributes that hooks or steps change on the
module are not in the state: the first change is reported with a warning naming them.
At the end of ``fit`` the trained weights are loaded into the module, which is what a
Lightning user's ``trainer.fit(model)`` followed by ``model.state_dict()`` expects.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from purestep.engine import checkpoint as ck
from purestep.engine import metrics as M
from purestep.engine.bind import Binder
from purestep.engine.step import SKIP, check_unchanged

from ..aggregate import Logged
from ..events import NOTHING, Requests
from ..task import Task
from . import hooks, metric_states
from .attributes import AttributeWatch
from .logging import LogBuffer
from .manual import ManualRun, ManualSchedulers
from .module import MODULE_HOOKS
from .optimizers import convert_optimizers
from .trainer_view import TrainerView

__all__ = ["LightningTask", "adapt"]


class LightningTask(Task):
    """A Lightning-style module as a ``Task`` (see the module doc)."""

    log_loss = False  # Lightning logs what self.log names, the loss only if it is named

    def __init__(self, module: nn.Module) -> None:
        if not hooks.is_lightning_module(module):
            raise TypeError(
                f"LightningTask wraps a LightningModule (purestep's or lightning's), got "
                f"{type(module).__name__}"
            )
        hooks.check_hooks(module)
        super().__init__(module, hparams=self._plain_hparams(module))
        self.module = module
        #: Lightning's flag, read when fit starts (``__init__`` usually sets it)
        self.automatic_optimization = bool(module.automatic_optimization)
        #: the torch optimizers configure_optimizers returned (``on_before_optimizer_step``)
        self.torch_optimizers: list[Any] = []
        self.logs = LogBuffer()
        self.view: TrainerView | None = None
        self._batch_idx = 0
        self._binder = Binder(module)
        #: torchmetrics objects among the submodules, by path (``metric_states``)
        self.metrics = metric_states.register(module)
        self.attributes = AttributeWatch(module, hooks.base_of(module))
        for hook in hooks.DATALOADER_HOOKS:
            if hooks.overrides(module, hook) or (hook in type(module).__dict__):
                setattr(self, hook, self._dataloader_hook(getattr(module, hook)))
        if hooks.overrides(module, "prepare_data"):
            self.prepare_data = module.prepare_data
        #: whether a batch-end hook gets what the steps return (else they keep nothing)
        self._wants_outputs = any(
            hooks.overrides(module, f"on_{stage}_batch_end")
            for stage in ("train", "validation", "test", "predict")
        )
        self._install_event_handlers()

    def _dataloader_hook(self, hook: Callable[[], Any]) -> Callable[[], Any]:
        """``hook`` (the module's ``train_dataloader`` ...) seeing the latest state's
        counters: a reload at an epoch's start reads that epoch, as in Lightning."""

        def call() -> Any:
            if self.view is not None:
                self.view.observe_latest()
            return hook()

        call.__name__ = hook.__name__
        call.__wrapped__ = hook  # type: ignore[attr-defined]
        return call

    @staticmethod
    def _plain_hparams(module: nn.Module) -> dict[str, Any]:
        """The module's ``hparams`` that a checkpoint can hold (plain data)."""
        out = {}
        for name, value in dict(getattr(module, "hparams", {}) or {}).items():
            try:
                out[name] = ck.check_plain(value, name)
            except ck.CheckpointError:
                continue
        return out

    # ------------------------------------------------------------------ attaching

    def attach(self, trainer: Any) -> None:
        """Attach the module to ``trainer`` for a run: ``self.trainer`` is a view of it and
        ``self.log`` writes into this task's buffer."""
        self.view = TrainerView(trainer)
        self.module.trainer = self.view
        self.module.__dict__["log"] = self.logs.log
        self.module.__dict__["log_dict"] = self.logs.log_dict
        self.metrics = metric_states.register(self.module)  # this module's, not another's
        self.attributes.accept()

    def detach(self) -> None:
        """Give the module its own ``log`` back (the trainer stays attached, as in
        Lightning, for ``model.trainer`` after a run)."""
        for name in ("log", "log_dict"):
            self.module.__dict__.pop(name, None)

    def finish_fit(self, state: Any) -> None:
        """Load the trained parameters and buffers into the module (Lightning trains the
        module in place). A state that is no single module's (an ensemble's members, FSDP's
        shards) stays in the returned ``TrainState``; that is said once."""
        from purestep import engine

        try:
            engine.to_module(state, self.module, inplace=True)
        except (TypeError, ValueError, RuntimeError, ck.CheckpointError) as err:
            warnings.warn(
                f"the trained weights are not loaded into {type(self.module).__name__} ({err}); "
                "they are in the TrainState fit returned (engine.to_module, hardware.member)",
                UserWarning,
                stacklevel=3,
            )

    # ------------------------------------------------------------------ steps

    def has(self, method: str) -> bool:
        if method == "training_step":
            return True
        return hooks.overrides(self.module, method)

    def get_model(self) -> nn.Module:
        return self.module

    def _observe(self, counters: bool = True) -> None:
        """Read where the loop is (the driver's ``BatchPosition``): the batch index the step
        methods get and (``counters``) the state's counters ``self.trainer`` shows at the
        batch's start. No event per batch is needed for it, so a module without batch hooks
        costs the loop nothing per batch."""
        view = self.view
        driver = getattr(view._trainer, "_driver", None) if view is not None else None
        position = driver.position if driver is not None else None
        if position is None:
            return
        self._batch_idx = position.batch_idx
        self._dataloader_idx = position.dataloader_idx
        self._several_loaders = position.loaders > 1
        if counters:
            view.observe(position.progress, driver.stage)

    def _run_step(
        self, hook: str, batch: Any, fn: Callable[[], Any]
    ) -> tuple[Any, dict[str, Logged]]:
        metrics = self.metrics
        if metrics:
            metric_states.start_step(metrics, hook)  # each step updates its batch's only
        self.logs.open(hook, batch)
        try:
            out = fn()
        finally:
            logged = self.logs.take()
        self.attributes.check(hook)
        if not metrics and not self.logs.took_metric:  # no torchmetrics: nothing to read
            return out, logged
        return out, self._read_metrics(logged)

    def _read_metrics(self, logged: dict[str, Logged]) -> dict[str, Logged]:
        """Logged torchmetrics objects as their states after the step (``snapshot``), and
        the states of every metric the step touched as kept values (``metric_states``:
        what a hook's ``compute()`` sees; a logged metric's are dropped at the stage's
        epoch end, as Lightning resets it)."""
        logged_paths = set()
        for name, entry in logged.items():
            if isinstance(entry, Logged) and metric_states.is_torchmetric(entry.value):
                key = metric_states.key_of(self.module, entry.value)
                if key is None:
                    raise ValueError(
                        f"self.log({name!r}, metric): the metric must be an attribute of "
                        f"{type(self.module).__name__} (a submodule), as Lightning requires"
                    )
                path = next((p for p, m in self.metrics.items() if m is entry.value), None)
                logged_paths.add(path)
                logged[name] = entry.replace(value=metric_states.snapshot(entry.value, key))
        logged.update(metric_states.end_step(self.module, self.metrics, logged_paths))
        return logged

    def training_step(self, apply: nn.Module, batch: Any) -> Any:
        self._observe()
        if not self.automatic_optimization:  # ``apply`` is the loop's OptimizerHandle
            return self._manual_step(apply, batch)
        out, logged = self._run_step(
            "training_step", batch, lambda: apply.training_step(batch, self._batch_idx)
        )
        if self._wants_outputs:
            self._last_output = _as_outputs(out)
        if isinstance(out, dict):
            if "loss" not in out:
                raise ValueError(
                    f"{type(self.module).__name__}.training_step returned a dict without "
                    "'loss'; automatic optimization needs the loss under 'loss'"
                )
            out = out["loss"]
        if out is None:  # Lightning's way to skip the batch: no gradient, no update
            return SKIP, logged
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"{type(self.module).__name__}.training_step must return the loss tensor or a "
                f"dict with 'loss', got {type(out).__name__}"
            )
        return out, logged  # the loss is logged only if the module logs it (log_loss)

    def _manual_step(self, handle: Any, batch: Any) -> dict[str, Any]:
        """Lightning's manual optimization (``loops.lightning.manual``): the module's
        ``training_step`` runs once, imperatively, its ``opt.step()`` calls pure updates.
        What it logs is the batch's metrics; its return value is ignored, as Lightning's."""
        run = ManualRun(
            self.module,
            self._binder,
            handle,
            batch,
            self.torch_optimizers,
            self.manual_schedulers,
        )
        _, logged = self._run_step(
            "training_step",
            batch,
            lambda: run.run(lambda: self.module.training_step(batch, self._batch_idx)),
        )
        loss = run.losses[-1] if run.losses else torch.tensor(float("nan"))
        return loss, logged

    def _eval_step(self, hook: str, apply: nn.Module, batch: Any) -> dict[str, Any]:
        self._observe()
        method = getattr(apply, hook)
        args = (batch, self._batch_idx)
        if self._several_loaders and hooks.accepts(method, 3):
            args = (*args, self._dataloader_idx)
        out, logged = self._run_step(hook, batch, lambda: method(*args))
        if self._wants_outputs:
            self._last_output = _as_outputs(out, loss=False)
        return dict(logged)

    def validation_step(self, apply: nn.Module, batch: Any) -> dict[str, Any]:
        return self._eval_step("validation_step", apply, batch)

    def test_step(self, apply: nn.Module, batch: Any) -> dict[str, Any]:
        return self._eval_step("test_step", apply, batch)

    def predict_step(self, apply: nn.Module, batch: Any) -> Any:
        self._observe()
        method = apply.predict_step
        args = (batch, self._batch_idx)
        if self._several_loaders and hooks.accepts(method, 3):
            args = (*args, self._dataloader_idx)
        out, _ = self._run_step("predict_step", batch, lambda: method(*args))
        if self._wants_outputs:
            self._last_output = _as_outputs(out, loss=False)
        return out

    _several_loaders = False
    _dataloader_idx = 0
    _last_output: Any = None  # what the last step returned (the batch-end hooks' outputs)

    # ------------------------------------------------------------------ configuration

    #: manual optimization: the schedulers the module steps itself (``self.lr_schedulers()``)
    manual_schedulers: ManualSchedulers | None = None

    def configure_optimizers(self) -> Any:
        output = self.module.configure_optimizers()
        self.torch_optimizers = _torch_optimizers(output)
        if self.automatic_optimization and len(self.torch_optimizers) > 1:
            raise ValueError(
                f"{type(self.module).__name__}.configure_optimizers() returned "
                f"{len(self.torch_optimizers)} optimizers with automatic optimization; as in "
                "Lightning 2, several optimizers need manual optimization: set "
                "self.automatic_optimization = False and step them in training_step"
            )
        if self.automatic_optimization:
            self.manual_schedulers = None
            return convert_optimizers(output, self.module)
        # Lightning 2: with manual optimization the loop steps no scheduler, the module does
        # (self.lr_schedulers() in training_step or a hook: loops.lightning.manual)
        output, self.manual_schedulers, beta1 = ManualSchedulers.split(output)
        return convert_optimizers(output, self.module, beta1=beta1)

    def configured_callbacks(self) -> list[Any]:
        """The module's ``configure_callbacks()``: purestep callbacks (a Lightning callback
        object would run Lightning's machinery, which is not here)."""
        found = self.module.configure_callbacks() or []
        found = [found] if not isinstance(found, (list, tuple)) else list(found)
        for cb in found:
            if not (hasattr(cb, "key") and callable(getattr(cb, "init", None))):
                raise TypeError(
                    f"{type(self.module).__name__}.configure_callbacks() returned a "
                    f"{type(cb).__module__}.{type(cb).__name__}: return purestep callbacks "
                    "(purestep.loops.callbacks: ModelCheckpoint, EarlyStopping, ...)"
                )
        return found

    def setup(self, stage: str) -> None:
        self.module.configure_model()
        self.module.setup(stage)
        # what configure_model and setup build is rebuilt by every run (a resumed one too)
        self.attributes.accept()

    def teardown(self, stage: str) -> None:
        self.module.teardown(stage)

    def on_save_checkpoint(self) -> Any:
        checkpoint: dict[str, Any] = {}
        self.module.on_save_checkpoint(checkpoint)
        return checkpoint or None

    def on_load_checkpoint(self, data: Any) -> None:
        self.module.on_load_checkpoint(dict(data) if isinstance(data, dict) else {})
        self.attributes.accept()  # what the hook restored is the module's own

    # ------------------------------------------------------------------ loop events

    def _before_optimizer_step(self, ctx: Any) -> None:
        """Lightning's ``on_before_optimizer_step(optimizer)``, with the step's gradients in
        the bound parameters' ``.grad`` (so ``grad_norm(self)`` and the like work); the
        optimizer is the torch instance ``configure_optimizers`` returned (its settings; the
        optimizer state itself is in the TrainState)."""
        grads = getattr(ctx.outputs, "grads", None) or {}
        named = dict(self.module.named_parameters())
        touched = []
        try:
            for name, grad in grads.items():
                if name in named:
                    named[name].grad = grad
                    touched.append(named[name])
            index = ctx.extra.get("optimizer_idx", 0) if ctx.extra else 0
            optimizers = self.torch_optimizers
            optimizer = optimizers[index] if index < len(optimizers) else None
            self.module.on_before_optimizer_step(optimizer)
        finally:
            for tensor in touched:
                tensor.grad = None

    def _install_event_handlers(self) -> None:
        """Handlers (purestep's ``(state, ctx) -> (state, Requests)``) for the events whose
        module hook is overridden (the steps read the batch index from the loop's position,
        ``_observe``)."""
        for event, (hook, stage, args) in hooks.EVENT_HOOKS.items():
            if hook in MODULE_HOOKS and hooks.overrides(self.module, hook):
                setattr(self, event, self._handler(event, hook, stage, args))

    def _handler(
        self, event: str, hook: str, stage: str, args: Callable[[Any], tuple]
    ) -> Callable[[Any, Any], tuple[Any, Requests]]:
        indexed = hook in hooks.INDEXED_HOOKS

        def handle(own: Any, ctx: Any) -> tuple[Any, Requests]:
            schedulers = self.manual_schedulers  # manual optimization's self.lr_schedulers()
            if schedulers is None:
                return run(own, ctx)
            return schedulers.run_hook(self.module, event, run, own, ctx)

        def run(own: Any, ctx: Any) -> tuple[Any, Requests]:
            if self.view is not None:
                self.view.observe(ctx.state.progress, ctx.stage)
            if ctx.batch_idx is not None:
                self._observe(counters=False)  # the event's state's counters, seen above
            state = ctx.state
            versions = _versions(state)
            self.logs.open(hook, ctx.batch)
            result = None
            try:
                with (
                    self._binder.bind(state.params, state.buffers, training=stage == "train"),
                    metric_states.in_hook(self.metrics, ctx, hook, self.view) as hooked,
                ):
                    if event == "on_before_optimizer_step":
                        self._before_optimizer_step(ctx)
                    else:
                        call = args(ctx)
                        if event.endswith("_batch_end"):  # what the step returned
                            call = (self._last_output, *call[1:])
                        if indexed and self._several_loaders:
                            call = (*call, ctx.dataloader_idx)
                        result = getattr(self.module, hook)(*call)
            finally:
                logged = self.logs.take()
            _check_versions(state, versions, hook)
            self.attributes.check(hook)
            stop = self.view is not None and self.view.take_stop()
            # Lightning: on_train_batch_start returning -1 skips the rest of the epoch
            end = hook == "on_train_batch_start" and _is_minus_one(result)
            values = {n: e.value if isinstance(e, Logged) else e for n, e in logged.items()}
            # metric objects logged here as their compute(); what the hook reset or updated
            # goes back into the state's kept metric states
            values, kept = hooked.finish(values)
            if kept:
                values = {name: _plain(value) for name, value in values.items()}
                return own, Requests(stop=stop, log=values, end_epoch=end, kept=kept)
            values = {name: _plain(value) for name, value in values.items()}
            if not values and not stop and not end:
                return own, NOTHING
            return own, Requests(stop=stop, log=values, end_epoch=end)

        handle.__name__ = event
        return handle


def _is_minus_one(value: Any) -> bool:
    """Whether a hook returned -1, as Lightning's ``response == -1`` reads it: an int, a
    one-element tensor or a numpy number (not a bool, not a container)."""
    if value is None or isinstance(value, bool):
        return False
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and bool(value.reshape(()) == -1)
    if isinstance(value, numbers.Number) or hasattr(value, "dtype"):  # numpy scalars too
        try:
            return bool(value == -1)
        except (TypeError, ValueError):
            return False
    return False


def _torch_optimizers(output: Any) -> list[Any]:
    """The torch optimizer instances in a ``configure_optimizers`` output, in order."""
    from torch.optim import Optimizer

    found: list[Any] = []

    def walk(value: Any) -> None:
        if isinstance(value, Optimizer):
            found.append(value)
        elif isinstance(value, dict):
            walk(value.get("optimizer"))
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    walk(
        output[0]
        if isinstance(output, (list, tuple))
        and len(output) == 2
        and isinstance(output[0], (list, tuple))
        else output
    )
    return found


def _as_outputs(out: Any, loss: bool = True) -> Any:
    """A step's return value as Lightning hands it to the batch-end hooks: detached, and a
    training step's bare loss as ``{"loss": loss}``."""
    if isinstance(out, torch.Tensor):
        out = out.detach()
        return {"loss": out} if loss else out
    if isinstance(out, dict):
        return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in out.items()}
    return out


def _versions(state: Any) -> tuple[list[int], list[int]]:
    return [p._version for p in state.params.values()], [b._version for b in state.buffers.values()]


def _check_versions(state: Any, versions: tuple[list[int], list[int]], hook: str) -> None:
    """A hook runs on the module bound to the state's own tensors: writing them in place
    (``p.clamp_()``, a train-mode forward updating BatchNorm statistics) would change a state
    the loop and its checkpoints hold. Refused, as the steps refuse it."""
    try:
        check_unchanged(state.params, versions[0], state.buffers, versions[1], where=hook)
    except RuntimeError as err:
        raise RuntimeError(
            f"{hook} wrote the module's parameters or buffers in place: {err}. Under "
            "purestep.Trainer the weights change only through the optimizer (a clamp after "
            "each update belongs in the optimizer: engine.optim transforms compose)"
        ) from None


def _plain(value: Any) -> Any:
    """A hook's logged value as the number callbacks' requests carry."""
    return value.compute() if isinstance(value, M.Metric) else value


def adapt(model: Any, trainer: Any) -> Any:
    """``model`` as the Trainer runs it: a Lightning-style module becomes a ``LightningTask``
    attached to ``trainer`` (the same task for the same module, so a second call reuses
    it); anything else is returned as it is."""
    if isinstance(model, LightningTask):
        model.attach(trainer)
        return model
    if not hooks.is_lightning_module(model):
        return model
    tasks = trainer.__dict__.setdefault("_lightning_tasks", {})
    task = tasks.get(id(model))
    if task is None or task.module is not model:
        task = tasks[id(model)] = LightningTask(model)
    task.attach(trainer)
    return task
