"""``Task`` and ``DataModule``: Lightning's shapes for users who prefer classes to functions.

A ``Task`` bundles a module template, its step functions and its optimizer. The steps have
the engine's signature ``fn(apply, batch)`` (``apply`` is the module bound to the state's
tensors) and return a loss, ``(loss, metrics)`` or a dict — they are pure, so the Trainer can
checkpoint, resume and replay them. ``setup(stage)`` / ``teardown(stage)`` are ordinary
methods (download data, build the model). Loop-event handlers (``on_train_epoch_end`` and
the rest) follow the pure callback contract and keep their state under the key ``"task"``.

``Task.wrap(model, loss_fn, optimizer)`` makes a Task out of plain functions, which is what
``Trainer.fit(model, loss_fn, optimizer, ...)`` does: validation and test then use the same
loss function.

A ``DataModule`` groups data preparation and the dataloaders (``prepare_data``, ``setup``,
``train_dataloader``, ``val_dataloader``, ``test_dataloader``, ``predict_dataloader``,
``teardown``), as in Lightning.

Checkpoint hooks, the functional way (Lightning's names). Lightning hands the hooks the
checkpoint dict to mutate; here a hook *returns* plain data and the Trainer stores it in the
checkpoint's metadata (``"hooks"``), through the same safe codec as the rest: tensors,
numbers, strings, ``None``, dicts/lists/tuples of them (``engine.checkpoint.check_plain``);
anything else (a module, a function, an ``@struct`` object) is refused with an error naming
the hook and the node, before the file is written. Saving runs on the primary process
(rank 0) only, once per file written (Lightning calls the save hooks on every rank and
writes on rank 0): a save hook must not call collectives (an ``all_reduce``, an
``all_gather``, a barrier), and if it fails on rank 0 the other ranks wait in the save's
barrier until the collective timeout:

- ``Task.on_save_checkpoint(self) -> data | None`` (None stores nothing);
  ``Task.on_load_checkpoint(self, data)`` gets it back when a run starts from the
  checkpoint (``fit(ckpt_path=...)``, ``validate``/``test``/``predict(ckpt_path=...)``,
  ``Task.load_from_checkpoint``): in ``fit`` after ``setup``, before the dataloaders are
  made (Lightning's order); in an evaluation before the stage's ``prepare_data``/``setup``.
- ``DataModule.state_dict() -> dict`` (an empty one stores nothing) and
  ``DataModule.load_state_dict(d)``, after the task's hook.
- ``Callback.on_save_checkpoint(state, ctx) -> data | None`` and
  ``Callback.on_load_checkpoint(state, data, ctx) -> new state`` (pure: its own state in,
  its new state out), full checkpoints and ``fit`` only, as in Lightning; the callback's
  state itself is in ``TrainState.callbacks`` already.

A load hook is called only when the checkpoint holds data from its save hook. On saving:
callbacks first (in their order), then the task, then the datamodule; on loading: the task,
the datamodule, then the callbacks. The task's ``hparams`` are saved too (also in
weights-only checkpoints), and ``MyTask.load_from_checkpoint(path, **overrides)`` rebuilds
a task from them.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from purestep.engine import checkpoint as ck
from purestep.engine import user_errors
from purestep.engine.state import TrainState

from .callbacks.base import Callback
from .events import EVENTS

__all__ = [
    "DataModule",
    "Task",
    "datamodule_base",
    "is_datamodule",
    "lightning_classes",
    "restore_callback_data",
    "restore_task_data",
    "saved_data",
    "task_callback",
]

StepFn = Callable[[nn.Module, Any], Any]

#: The step methods a Task defines, checked against Lightning's signature.
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


def default_predict(apply: nn.Module, batch: Any) -> Any:
    """``apply(batch)``, or ``apply(batch[0])`` for ``(inputs, targets)`` batches."""
    if isinstance(batch, (tuple, list)) and batch:
        return apply(batch[0])
    return apply(batch)


class Task:
    """Model + step functions + optimizer + hooks. Subclass it, or use ``Task.wrap``.

    Override ``training_step`` (required), ``validation_step`` / ``test_step`` (validation
    and test run only when defined), ``predict_step`` (default: the model on the inputs),
    ``configure_optimizers`` (an ``engine.optim`` transform), ``configure_model`` (the
    template, if not given to ``__init__``), ``setup`` / ``teardown``. ``hparams`` are logged
    as hyper-parameters at fit start and saved in every checkpoint: pass them as
    ``Task(hparams=...)`` or call ``self.save_hyperparameters()`` in ``__init__``.
    ``on_save_checkpoint`` / ``on_load_checkpoint`` add plain data to checkpoints (see the
    module doc). ``load_from_checkpoint`` rebuilds a task with a checkpoint's weights.

    The step methods take ``(self, apply, batch)``; a subclass that defines one Lightning's
    way, ``(self, batch, batch_idx)``, is refused with a ``TypeError`` when it is defined.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in STEP_METHODS:
            attr = cls.__dict__.get(name)
            if isinstance(attr, staticmethod):
                user_errors.check_signature(attr.__func__, name)
            elif isinstance(attr, classmethod):
                user_errors.check_signature(attr.__func__, name, method=True)
            elif inspect.isfunction(attr):  # bound to the instance: skip ``self``
                user_errors.check_signature(attr, name, method=True)
            elif callable(attr):  # a partial or callable object is called as it is
                user_errors.check_signature(attr, name)

    #: The checkpoint's ``TrainState`` after ``load_from_checkpoint`` (None for weights only).
    state: TrainState | None = None

    #: Lightning's flag. True: the Trainer runs the optimizers (with several, the training
    #: step is ``training_step(self, apply, batch, optimizer_idx)``, called once per active
    #: optimizer). False (manual optimization): ``training_step(self, opt, batch)`` gets an
    #: ``OptimizerHandle`` and runs ``opt.step(name, loss_fn, batch)`` itself.
    automatic_optimization: bool = True

    #: Whether the training loss is logged as ``train_loss`` by itself (a Task's rule; a
    #: Lightning-style module logs only what ``self.log`` names)
    log_loss: bool = True

    def __init__(self, model: nn.Module | None = None, hparams: dict[str, Any] | None = None):
        self.model = model
        if hparams is None:  # keep what save_hyperparameters() recorded before this call
            hparams = getattr(self, "hparams", None)
        self.hparams = dict(hparams or {})

    # ------------------------------------------------------------------ hyper-parameters

    def save_hyperparameters(self, *args: Any, ignore: Sequence[str] | str = ()) -> None:
        """Record the calling ``__init__``'s arguments as ``self.hparams`` (Lightning's
        ``save_hyperparameters``): call it from your subclass's ``__init__``, before or
        after ``super().__init__()``. The arguments of every ``__init__`` of this object
        being run are taken (a subclass's win), ``**kwargs`` merged in; ``*args`` are not.
        ``save_hyperparameters("lr", "hidden")`` keeps only those; a single dict argument is
        taken as the hyper-parameters themselves; ``ignore`` leaves names out. Arguments
        that are modules are left out (the checkpoint holds their weights: give them again to
        ``load_from_checkpoint`` as overrides). Every value must be plain data (numbers,
        strings, tensors, containers): anything else is a ``TypeError`` naming it."""
        self.hparams = recorded_hyperparameters(self, inspect.currentframe(), args, ignore)

    @classmethod
    def load_from_checkpoint(
        cls, checkpoint_path: str, *, map_location: Any = None, **overrides: Any
    ) -> Any:
        """A task rebuilt from a checkpoint: ``cls(**hparams, **overrides)``, with the saved
        hyper-parameters the class's ``__init__`` takes (all of them if it takes
        ``**kwargs``; the whole dict as ``hparams=`` if it has an ``hparams`` argument that
        the saved ones do not name, as for a subclass without its own ``__init__``,
        ``M(hparams={...})``). When ``__init__`` takes ``hparams``, an override it does not
        name is merged into that dict, over the saved value (``load_from_checkpoint(p,
        lr=0.5)`` of ``M(hparams={"lr": 0.1})``); one it names goes as a keyword and also
        replaces the saved entry of that name in the whole-dict ``hparams=`` (so a class
        taking both ``lr`` and ``hparams`` sees one ``lr``); ``hparams=`` itself replaces
        the saved dict. Then ``on_load_checkpoint`` with the task's hook data,
        then its ``.model`` set to the trained module: the template (``get_model()``) with
        the checkpoint's parameters and buffers (``engine.to_module``; keys and shapes must
        match, or a ``CheckpointError`` says what differs). ``task.state`` is the
        checkpoint's ``TrainState`` (None for a weights-only file). The class is the
        caller's: nothing in the file names code to run. ``map_location`` (as for
        ``torch.load``) places the tensors; by default the state is read to the CPU and the
        model's tensors land on the template's devices. The module keeps the template's
        train/eval mode."""
        location = "cpu" if map_location is None else map_location
        payload = ck.read(checkpoint_path, map_location=location)
        loaded, meta = ck.load_payload(payload, url=checkpoint_path)
        hparams = meta.get("hparams") or {}
        if not isinstance(hparams, dict):
            raise ck.CheckpointError(f"{checkpoint_path}: its hparams are not a dict")
        ck.check_plain(hparams, "metadata['hparams']", url=checkpoint_path)
        kwargs = _init_kwargs(cls, hparams, overrides)
        try:
            task = cls(**kwargs)
        except TypeError as err:
            raise TypeError(
                f"{cls.__name__}.load_from_checkpoint: {cls.__name__}(**{sorted(kwargs)}) "
                f"failed: {err} (the checkpoint's hparams are {sorted(hparams)}; pass what is "
                "missing as keyword overrides)"
            ) from err
        restore_task_data(meta, task, None, url=checkpoint_path)
        template = task.get_model()
        task.model = ck.files.module_from(
            loaded, template, url=checkpoint_path, to_template=map_location is None
        )
        task.state = loaded if isinstance(loaded, TrainState) else None
        return task

    # ------------------------------------------------------------------ checkpoint hooks

    def on_save_checkpoint(self) -> Any:
        """Plain data to add to every checkpoint (None: nothing); see the module doc.

        Called on rank 0 only, while the other ranks wait in a barrier: it must not call
        collectives, and an error raised here leaves the other ranks waiting until the
        collective timeout. With ``async_checkpoint`` the value is copied when the save is
        queued, so changing it afterwards does not change the file."""
        return None

    def on_load_checkpoint(self, data: Any) -> None:
        """Receive what ``on_save_checkpoint`` returned when a run starts from a checkpoint."""

    # ------------------------------------------------------------------ what users override

    def configure_model(self) -> nn.Module:
        """The module template (called when none was given to ``__init__``)."""
        raise NotImplementedError(
            f"{type(self).__name__} has no model: pass one to Task(model=...) or override "
            "configure_model()"
        )

    def configure_optimizers(self) -> Any:
        """The optimizer(s): an ``engine.optim`` transform, or Lightning's shapes — a dict
        ``{"optimizer": tx, "lr_scheduler": ...}``, a list of optimizers (each a transform or
        such a dict with ``"params"`` naming its parameters), ``([optimizers],
        [schedulers])`` — as ``loops.optimizers`` describes."""
        raise NotImplementedError(
            f"{type(self).__name__} must override configure_optimizers() and return an "
            "engine.optim transform (e.g. optim.adamw(1e-3))"
        )

    def training_step(self, apply: nn.Module, batch: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must override training_step")

    def validation_step(self, apply: nn.Module, batch: Any) -> Any:
        raise NotImplementedError

    def test_step(self, apply: nn.Module, batch: Any) -> Any:
        raise NotImplementedError

    def predict_step(self, apply: nn.Module, batch: Any) -> Any:
        return default_predict(apply, batch)

    def setup(self, stage: str) -> None:
        """Called before a stage runs ("fit", "validate", "test", "predict")."""

    def teardown(self, stage: str) -> None:
        """Called after a stage ran."""

    # ------------------------------------------------------------------ what the Trainer uses

    def get_model(self) -> nn.Module:
        if self.model is None:
            self.model = self.configure_model()
        if not isinstance(self.model, nn.Module):
            raise TypeError(
                f"the task's model must be an nn.Module, got {type(self.model).__name__}"
            )
        return self.model

    def has(self, method: str) -> bool:
        """Whether the task defines ``method`` (validation and test are optional)."""
        return getattr(type(self), method) is not getattr(Task, method)

    @classmethod
    def wrap(
        cls,
        model: nn.Module,
        loss_fn: StepFn,
        optimizer: Any,
        *,
        val_fn: StepFn | None = None,
        test_fn: StepFn | None = None,
        predict_fn: StepFn | None = None,
        hparams: dict[str, Any] | None = None,
    ) -> Task:
        """A Task from plain functions (validation and test default to ``loss_fn``)."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be a function (apply, batch) -> loss, got {loss_fn!r}")
        for what, fn in (
            ("loss_fn", loss_fn),
            ("val_fn", val_fn),
            ("test_fn", test_fn),
            ("predict_fn", predict_fn),
        ):
            if fn is not None:
                user_errors.check_signature(fn, what)
        from .optimizers import parse_optimizers

        # a bad optimizer fails here, naming what is accepted
        parse_optimizers(optimizer, "optimizer")
        return _FunctionTask(model, loss_fn, optimizer, val_fn, test_fn, predict_fn, hparams)


class _FunctionTask(Task):
    """The step methods are the user's functions themselves (instance attributes), so the
    steps call them directly and an error's note names them, not a wrapper."""

    def __init__(self, model, loss_fn, optimizer, val_fn, test_fn, predict_fn, hparams):
        super().__init__(model, hparams)
        self._optimizer = optimizer
        self.training_step = loss_fn
        self.validation_step = val_fn or loss_fn
        self.test_step = test_fn or self.validation_step
        self.predict_step = predict_fn or default_predict

    def has(self, method: str) -> bool:
        return True

    def configure_optimizers(self):
        return self._optimizer


_CB_SAVE = Callback.on_save_checkpoint


def task_callback(task: Task) -> Callback:
    """The task's loop-event handlers presented to the loops as one pure callback ("task").

    Only the events the task defines are handled (the loops skip the rest); its state comes
    from ``task.init_state()`` when defined.
    """
    handled = [
        e for e in EVENTS if e not in ("setup", "teardown") and callable(getattr(task, e, None))
    ]

    def forward(event: str) -> Callable[..., Any]:
        def handler(self: Callback, state: Any, ctx: Any) -> Any:
            return getattr(task, event)(state, ctx)

        handler.__name__ = event
        return handler

    def init(self: Callback) -> Any:
        make = getattr(task, "init_state", None)
        return make() if callable(make) else {}

    namespace: dict[str, Any] = {"name": "task", "init": init}
    namespace.update({e: forward(e) for e in handled})
    return type("TaskHooks", (Callback,), namespace)()


class DataModule:
    """Data preparation and loaders in one place (Lightning's LightningDataModule shape)."""

    def prepare_data(self) -> None:
        """Download or write data once (called before ``setup``)."""

    def setup(self, stage: str) -> None:
        """Build datasets for ``stage`` ("fit", "validate", "test", "predict")."""

    def teardown(self, stage: str) -> None:
        """Release what ``setup`` built."""

    def train_dataloader(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} defines no train_dataloader()")

    def val_dataloader(self) -> Any:
        return None

    def test_dataloader(self) -> Any:
        return None

    def predict_dataloader(self) -> Any:
        return None

    def state_dict(self) -> dict[str, Any]:
        """Plain data saved in checkpoints (an empty dict saves nothing), as in Lightning.
        Called on rank 0 only (see ``Task.on_save_checkpoint``): no collectives here."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (a run starting from a checkpoint)."""


def lightning_classes(name: str) -> tuple[type, ...]:
    """The real Lightning classes ``name`` (``"LightningModule"``, ``"LightningDataModule"``)
    of ``lightning.pytorch`` and the older ``pytorch_lightning``, those already imported (a
    subclass of one can only exist then), so purestep never imports ``lightning`` itself."""
    found = []
    for package in ("lightning.pytorch", "pytorch_lightning"):
        module = sys.modules.get(package)
        if module is not None and hasattr(module, name):
            found.append(getattr(module, name))
    return tuple(found)


def _lightning_datamodule_bases() -> tuple[type, ...]:
    return lightning_classes("LightningDataModule")


def is_datamodule(obj: Any) -> bool:
    """Whether ``obj`` is a data module: a ``DataModule`` or a subclass instance of the real
    ``lightning.pytorch.LightningDataModule`` (the same hooks: ``prepare_data``,
    ``setup(stage)``, the ``*_dataloader`` methods, ``state_dict`` / ``load_state_dict``,
    ``teardown(stage)``)."""
    return isinstance(obj, (DataModule, *_lightning_datamodule_bases()))


def datamodule_base(obj: Any) -> type:
    """The data-module class ``obj`` derives from (its methods are the defaults)."""
    for base in _lightning_datamodule_bases():
        if isinstance(obj, base):
            return base
    return DataModule


# ---------------------------------------------------------------------- checkpoint data

#: The metadata entries the hooks' data and the hyper-parameters are stored under.
HOOKS_KEY = "hooks"
HPARAMS_KEY = "hparams"


def _name(obj: Any) -> str:
    return type(obj).__name__


def saved_data(
    task: Task | None,
    datamodule: DataModule | None,
    callbacks: Sequence[Any],
    state: Any,
    context: Callable[[], Any] | None,
    *,
    weights_only: bool,
) -> dict[str, Any]:
    """The metadata entries a checkpoint of ``state`` gets from the hooks (the module doc):
    ``"hparams"`` and ``"hooks"`` (``{"callbacks": {key: data}, "task": data,
    "datamodule": state_dict}``, each only when there is something). Every value is checked
    to be plain data here, so a bad one fails naming its hook, before anything is written.
    ``context()`` makes the callbacks' ``Context`` (only called if one defines the hook)."""
    hooks: dict[str, Any] = {}
    if not weights_only and isinstance(state, TrainState):
        extras, ctx = {}, None
        for cb in callbacks:
            hook = getattr(cb, "on_save_checkpoint", None)
            if hook is None or getattr(type(cb), "on_save_checkpoint", None) is _CB_SAVE:
                continue
            if ctx is None and context is not None:
                ctx = context()
            data = hook(state.callbacks.get(cb.key), ctx)
            if data is not None:
                extras[cb.key] = ck.check_plain(data, f"{_name(cb)}.on_save_checkpoint()")
        if extras:
            hooks["callbacks"] = extras
    out: dict[str, Any] = {}
    if task is not None:
        data = task.on_save_checkpoint()
        if data is not None:
            hooks["task"] = ck.check_plain(data, f"{_name(task)}.on_save_checkpoint()")
        if task.hparams:
            out[HPARAMS_KEY] = ck.check_plain(dict(task.hparams), f"{_name(task)}.hparams")
    if datamodule is not None:
        sd = datamodule.state_dict()
        if sd:
            hooks["datamodule"] = ck.check_plain(sd, f"{_name(datamodule)}.state_dict()")
    if hooks:
        out[HOOKS_KEY] = hooks
    return out


def _hooks_of(meta: Mapping[str, Any], url: str) -> dict[str, Any]:
    """The checkpoint's hook data, checked to be plain data (a crafted file's ``@struct``
    nodes or other objects are refused before any hook sees them)."""
    hooks = meta.get(HOOKS_KEY) or {}
    if not isinstance(hooks, dict):
        raise ck.CheckpointError(f"{url}: malformed checkpoint: its hook data is not a dict")
    return ck.check_plain(hooks, f"metadata[{HOOKS_KEY!r}]", url=url)


def restore_task_data(
    meta: Mapping[str, Any], task: Task | None, datamodule: DataModule | None, *, url: str
) -> None:
    """Hand a checkpoint's data back: ``task.on_load_checkpoint``, then
    ``datamodule.load_state_dict`` (each only when the checkpoint holds its data)."""
    hooks = _hooks_of(meta, url)
    if task is not None and "task" in hooks:
        task.on_load_checkpoint(hooks["task"])
    if datamodule is not None and "datamodule" in hooks:
        if not isinstance(hooks["datamodule"], dict):
            raise ck.CheckpointError(f"{url}: the datamodule's saved state is not a dict")
        datamodule.load_state_dict(hooks["datamodule"])


def restore_callback_data(
    meta: Mapping[str, Any],
    callbacks: Sequence[Any],
    state: TrainState,
    context: Callable[[TrainState], Any],
    *,
    url: str,
) -> TrainState:
    """``state`` after each callback's ``on_load_checkpoint(own state, data, ctx)`` (in the
    callbacks' order; only those whose data the checkpoint holds): its return value becomes
    the callback's state (its ``init()`` stands in for a state the file does not have)."""
    extras = _hooks_of(meta, url).get("callbacks") or {}
    if not isinstance(extras, dict):
        raise ck.CheckpointError(f"{url}: the callbacks' hook data is not a dict")
    for cb in callbacks:
        key = getattr(cb, "key", None)
        hook = getattr(cb, "on_load_checkpoint", None)
        if key not in extras or hook is None:
            continue
        own = state.callbacks[key] if key in state.callbacks else cb.init()
        new = hook(own, extras[key], context(state))
        state = state.replace(callbacks={**state.callbacks, key: new})
    return state


def recorded_hyperparameters(
    obj: Any, frame: Any, args: Sequence[Any], ignore: Sequence[str] | str | None
) -> dict[str, Any]:
    """What ``save_hyperparameters(*args, ignore=...)`` called in ``frame`` (the method's own)
    records (Lightning's rules, see ``Task.save_hyperparameters``), checked to be plain."""
    ignored = {ignore} if isinstance(ignore, str) else set(ignore or ())
    if len(args) == 1 and isinstance(args[0], Mapping):
        found = dict(args[0])
    else:
        if not all(isinstance(a, str) for a in args):
            raise TypeError(
                "save_hyperparameters() takes argument names (str) or one dict, got "
                f"{[type(a).__name__ for a in args]}"
            )
        found = _init_arguments(obj, frame)
        if args:
            unknown = [a for a in args if a not in found]
            if unknown:
                raise ValueError(
                    f"save_hyperparameters(): {unknown} are not arguments of "
                    f"{type(obj).__name__}.__init__ (it has {sorted(found)})"
                )
            found = {a: found[a] for a in args}
        found = {k: v for k, v in found.items() if not isinstance(v, nn.Module)}
    found = {k: v for k, v in found.items() if k not in ignored}
    for name, value in found.items():
        try:
            ck.check_plain(value, f"hyper-parameter {name!r}")
        except ck.CheckpointError as err:
            raise TypeError(
                f"save_hyperparameters(): {err}; leave it out with ignore=[{name!r}]"
            ) from None
    return found


def _init_arguments(obj: Any, frame: Any) -> dict[str, Any]:
    """The arguments of the ``__init__`` calls of ``obj`` running above ``frame`` (the
    outermost, the subclass's, wins)."""
    found: list[dict[str, Any]] = []
    frame = frame.f_back if frame is not None else None
    while frame is not None:
        info = inspect.getargvalues(frame)
        if frame.f_code.co_name != "__init__" or not info.args:
            break
        if info.locals.get(info.args[0]) is not obj:
            break
        args = {a: info.locals[a] for a in info.args[1:] if a in info.locals}
        if info.keywords and isinstance(info.locals.get(info.keywords), dict):
            args.update(info.locals[info.keywords])
        found.append(args)
        frame = frame.f_back
    if not found:
        raise RuntimeError(
            "save_hyperparameters() records __init__'s arguments: call it inside your Task "
            "subclass's __init__ (or pass the hyper-parameters as a dict)"
        )
    merged: dict[str, Any] = {}
    for args in found:  # innermost first: the outer __init__ calls override
        merged.update(args)
    return merged


def _init_kwargs(
    cls: type, hparams: dict[str, Any], overrides: Mapping[str, Any]
) -> dict[str, Any]:
    """The keyword arguments ``cls(...)`` gets from the saved ``hparams`` and the caller's
    ``overrides`` (see ``Task.load_from_checkpoint``)."""
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return {**hparams, **overrides}
    named = {
        n
        for n, p in params.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    if "hparams" not in named:
        return {**{k: v for k, v in hparams.items() if k in named}, **overrides}
    # Task's own __init__ (a subclass without one) takes its hyper-parameters as the dict
    # ``hparams=`` only: a saved key named like its ``model`` argument is a hyper-parameter.
    own_init = cls.__init__ is Task.__init__
    whole = own_init or "hparams" not in hparams  # the saved dict is what hparams= got
    saved_keywords = {} if own_init else {k: v for k, v in hparams.items() if k in named}
    keywords = {k: v for k, v in overrides.items() if k in named}
    extra = {k: v for k, v in overrides.items() if k not in named}
    if "hparams" in overrides:
        target = overrides["hparams"]
    elif whole:
        target = dict(hparams)
    else:
        target = saved_keywords.get("hparams")
    replaced = {}
    if whole and isinstance(target, Mapping):  # a keyword override also replaces its entry
        replaced = {k: v for k, v in keywords.items() if k in saved_keywords and k in target}
    if extra or replaced:
        if target is None:
            target = {}
        if not isinstance(target, Mapping):
            raise TypeError(
                f"{cls.__name__}.load_from_checkpoint: {cls.__name__}.__init__ does not take "
                f"{sorted(extra)}, and its hparams ({type(target).__name__}) is not a dict to "
                "merge them into"
            )
        target = {**target, **replaced, **extra}
    out = {**saved_keywords, **keywords}
    if whole or "hparams" in out or extra:
        out["hparams"] = target
    return out
