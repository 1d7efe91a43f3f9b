"""``cli``: a config-file command line in the spirit of Lightning's ``LightningCLI``.

``purestep.cli(MyTask, MyDataModule)`` in a script, or ``python -m purestep`` with the
classes named on the command line, parses::

    script.py fit --config run.yaml --trainer.max_epochs 5 --model.hidden 64 --ckpt_path last

- subcommands ``fit``, ``validate``, ``test`` and ``predict``, each taking that Trainer
  method's own arguments (``--ckpt_path``, ``--verbose``, ``--return_predictions``);
- ``--seed_everything`` (default 0, Lightning's name), taken by every subcommand so that one
  printed config serves them all: ``seed_everything(seed)`` runs before the model, the data
  module and the trainer are built (their initial weights and any random data come from
  the seeded global generators, as with LightningCLI), and fit builds its state with it
  (``Trainer.fit``'s ``seed``: the run key behind every draw of the run);
- ``--trainer.*``: the ``Trainer``'s flags, from ``Trainer.__init__``'s signature and type
  hints (``--trainer.callbacks`` and ``--trainer.logger`` take ``class_path`` /
  ``init_args``, as in Lightning); ``--model.*`` / ``--data.*``: the ``__init__`` arguments
  of the task and the data module;
- subclass mode: when no class is fixed (or with ``subclass_mode_model`` /
  ``subclass_mode_data``), ``--model`` / ``--data`` take ``class_path`` + ``init_args``, a
  ``Task`` / ``DataModule`` subclass the user names (``--model.class_path mypkg.MyTask``);
  the model is then required, the data module optional;
- ``--config file.yaml`` (several allowed, later ones win; the command line is read in
  order, so options after a ``--config`` override it), ``--print_config`` (prints the
  resolved YAML and exits; a saved one is a valid ``--config``);
- ``PURESTEP_TRAINER_<FLAG>`` environment variables still apply, under the explicit values:
  signature default < ``trainer_defaults`` < environment < config files < command line;
- the resolved config (the subcommand's section) is written to ``<log_dir>/config.yaml`` by
  rank 0 when the run starts (its ``setup`` event: after the arguments, the data module's
  ``prepare_data`` / ``setup``, the model and the optimizer are in place), as Lightning's
  ``SaveConfigCallback`` writes it in its ``setup`` hook: the record of a run that
  started, so a run refused before (bad data, a failing ``setup``) leaves no run folder
  with a config behind. An existing file with other contents is an error before the run
  starts, unless ``save_config_kwargs={"overwrite": True}`` (an identical one is left as it
  is, so relaunching the same command is fine). A fit resuming from ``--ckpt_path``
  continues the run folder its checkpoint recorded, known only once the run started, so
  it keeps a file already there (with a warning if it differs);
- a Trainer flag value the Trainer refuses (``--trainer.max_epochs -5``) is a parser
  error naming the option and the reason (exit code 2, no traceback), as a value of the
  wrong type is; without a model class the error says how to name one
  (``--model.class_path``, or ``model:`` in a ``--config`` file);
- an unknown key, in a config file or on the command line, is an error naming it and the
  closest valid key ("did you mean ...?"); options are never abbreviated.

The parsing is jsonargparse's (the ``cli`` extra: ``pip install "purestep[cli]"``); it is
imported when ``cli`` is called, never by ``import purestep``.
"""

from __future__ import annotations

import difflib
import inspect
import os
import re
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from .seeding import seed_everything
from .task import DataModule, Task
from .trainer import Trainer
from .trainer_args import ENV_PREFIX, flag_names, parse_flag

__all__ = ["CLI", "SUBCOMMANDS", "cli"]

#: The subcommands and the Trainer method each runs.
SUBCOMMANDS = ("fit", "validate", "test", "predict")
# Trainer-method arguments the CLI passes itself (objects, not configuration).
_NOT_FROM_CONFIG = frozenset(
    {
        "model",
        "loss_fn",
        "optimizer",
        "train_dataloaders",
        "val_dataloaders",
        "dataloaders",
        "datamodule",
        "state",
        "fn",
    }
)
_INSTALL_HINT = 'purestep.cli needs jsonargparse: pip install "purestep[cli]"'


def _jsonargparse() -> Any:
    try:
        import jsonargparse
    except ImportError as e:
        raise ImportError(_INSTALL_HINT) from e
    return jsonargparse


def cli(
    model_class: type[Task] | None = None,
    datamodule_class: type[DataModule] | None = None,
    *,
    args: Sequence[str] | None = None,
    run: bool = True,
    subclass_mode_model: bool = False,
    subclass_mode_data: bool = False,
    trainer_defaults: Mapping[str, Any] | None = None,
    save_config: bool = True,
    save_config_kwargs: Mapping[str, Any] | None = None,
    parser_kwargs: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> CLI:
    """Parse the command line (``args``, default ``sys.argv[1:]``), build the trainer, the
    task and the data module, and run the subcommand (see the module docstring).

    ``run=False``: no subcommand; the options are the trainer's, the model's and the
    data's only (and ``--seed_everything``), and nothing runs (call
    ``result.trainer.fit(result.model, seed=result.config.seed_everything, ...)`` yourself,
    and ``result.save_config()`` to write the config). ``trainer_defaults``: defaults for
    Trainer flags (``{"max_epochs": 10}``). ``save_config_kwargs``: ``overwrite`` (replace a
    different existing file) and ``config_filename`` (default ``"config.yaml"``);
    ``save_config=False`` writes nothing. ``parser_kwargs``: passed to jsonargparse's
    ``ArgumentParser`` (e.g. ``{"exit_on_error": False}``, ``{"prog": "train"}``). ``env``:
    where ``PURESTEP_TRAINER_*`` values are read (default ``os.environ``).

    Returns a ``CLI`` with ``parser``, ``subcommand``, ``config`` (the resolved Namespace of
    the run), ``trainer``, ``model``, ``datamodule`` and ``result`` (what the subcommand's
    Trainer method returned; None with ``run=False``).
    """
    return CLI(
        model_class,
        datamodule_class,
        args=args,
        run=run,
        subclass_mode_model=subclass_mode_model,
        subclass_mode_data=subclass_mode_data,
        trainer_defaults=trainer_defaults,
        save_config=save_config,
        save_config_kwargs=save_config_kwargs,
        parser_kwargs=parser_kwargs,
        env=env,
    )


class CLI:
    """What ``cli`` parsed, built and ran (``cli`` is the way to make one)."""

    def __init__(
        self,
        model_class: type[Task] | None = None,
        datamodule_class: type[DataModule] | None = None,
        *,
        args: Sequence[str] | None = None,
        run: bool = True,
        subclass_mode_model: bool = False,
        subclass_mode_data: bool = False,
        trainer_defaults: Mapping[str, Any] | None = None,
        save_config: bool = True,
        save_config_kwargs: Mapping[str, Any] | None = None,
        parser_kwargs: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        jsonargparse = _jsonargparse()
        self._model_class = model_class
        self._datamodule_class = datamodule_class
        self._subclass_model = subclass_mode_model or model_class is None
        self._subclass_data = subclass_mode_data or datamodule_class is None
        self._data_required = datamodule_class is not None
        self._trainer_defaults = dict(trainer_defaults or {})
        self._env = os.environ if env is None else env
        kwargs = dict(save_config_kwargs or {})
        unknown = set(kwargs) - {"overwrite", "config_filename"}
        if unknown:
            raise TypeError(
                f"save_config_kwargs takes 'overwrite' and 'config_filename', got {sorted(unknown)}"
            )
        self._save = save_config
        self._overwrite = bool(kwargs.get("overwrite", False))
        self._filename = str(kwargs.get("config_filename", "config.yaml"))

        parser_class = _parser_class(jsonargparse)
        # no abbreviations: "--seed" is no prefix of "--seed_everything" (jsonargparse 5's
        # default); a misspelt key gets "did you mean" instead
        self.parser = parser_class(**{"allow_abbrev": False, **dict(parser_kwargs or {})})
        self._parsers: dict[str | None, Any] = {}
        if run:
            subcommands = self.parser.add_subcommands(required=True, dest="subcommand")
            chosen = _chosen_subcommand(sys.argv[1:] if args is None else args)
            for name in SUBCOMMANDS:
                sub = parser_class(allow_abbrev=False)
                if chosen in (None, name):  # the others' options are never read (it saves time)
                    self._add_arguments(sub, name)
                summary = inspect.getdoc(getattr(Trainer, name)) or ""
                subcommands.add_subcommand(name, sub, help=summary.split("\n")[0])
                self._parsers[name] = sub
        else:
            self._add_arguments(self.parser, None)
            self._parsers[None] = self.parser

        parsed = self.parser.parse_args(None if args is None else list(args))
        self.subcommand: str | None = parsed.get("subcommand") if run else None
        self.config = parsed[self.subcommand] if self.subcommand else parsed
        # before anything is built, as LightningCLI does: the model's initial weights and
        # whatever the data module draws come from the seeded global generators
        self.seed = seed_everything(self.config.seed_everything, verbose=False)
        instantiate = getattr(self.parser, "instantiate", None) or self.parser.instantiate_classes
        built = instantiate(parsed)
        built = built[self.subcommand] if self.subcommand else built
        self.model: Task = built.get("model")
        self.datamodule: DataModule | None = built.get("data")
        self.trainer = self._build_trainer(vars(built.get("trainer")))
        self.result: Any = None
        self._saved: str | None = None
        if self.subcommand is not None:
            self.result = self._run(self.subcommand)

    # ------------------------------------------------------------------ the parser

    def _add_arguments(self, parser: Any, subcommand: str | None) -> None:
        jsonargparse = _jsonargparse()
        Callback, ProgressBarBase, Logger = _plugin_bases()

        parser.add_argument(
            "-c", "--config", action=jsonargparse.ActionConfigFile, help="A YAML config file."
        )
        parser.add_class_arguments(
            Trainer,
            "trainer",
            fail_untyped=False,
            instantiate=False,
            skip={"callbacks", "logger"},
        )
        # The Trainer takes these as Any; typed here so they take class_path / init_args.
        parser.add_argument(
            "--trainer.callbacks",
            type=list[Callback | ProgressBarBase] | Callback | ProgressBarBase | None,
            default=None,
            help="Callbacks: a class_path / init_args mapping or a list of them.",
        )
        parser.add_argument(
            "--trainer.logger",
            type=bool | Logger | list[Logger] | None,
            default=None,
            help="True (a TensorBoardLogger), False, a Logger or a list of Loggers.",
        )
        if self._subclass_model:
            parser.add_subclass_arguments(self._model_class or Task, "model", required=True)
        else:
            parser.add_class_arguments(self._model_class, "model")
        if self._subclass_data:
            parser.add_subclass_arguments(
                self._datamodule_class or DataModule, "data", required=self._data_required
            )
        else:
            parser.add_class_arguments(self._datamodule_class, "data")
        parser.add_argument(
            "--seed_everything",
            type=int,
            default=0,
            help="The run's seed: the global generators before anything is built; fit's seed.",
        )
        if subcommand is not None:
            skip = set(_NOT_FROM_CONFIG) | ({"seed"} if subcommand == "fit" else set())
            parser.add_method_arguments(Trainer, subcommand, skip=skip)
        defaults = {f"trainer.{k}": v for k, v in self._trainer_defaults.items()}
        names = flag_names(Trainer.__init__)
        unknown = [k for k in self._trainer_defaults if k not in names]
        if unknown:
            close = difflib.get_close_matches(unknown[0], names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"trainer_defaults names no Trainer flag: {unknown}{hint}")
        defaults.update(_env_defaults(self._env))
        if defaults:
            parser.set_defaults(defaults)

    def _build_trainer(self, flags: Mapping[str, Any]) -> Trainer:
        """The Trainer; a flag value it refuses is a parser error naming the option."""
        try:
            return Trainer(**flags)
        except (TypeError, ValueError) as err:
            parser = self._parsers.get(self.subcommand, self.parser)
            parser.error(_flag_error(str(err), flags))
            raise  # an error() that returns (it never does)

    # ------------------------------------------------------------------ running

    def _run(self, subcommand: str) -> Any:
        method = getattr(self.trainer, subcommand)
        params = inspect.signature(getattr(Trainer, subcommand)).parameters
        kwargs = {
            name: self.config[name]
            for name in params
            if name not in _NOT_FROM_CONFIG and name != "self" and name in self.config
        }
        if subcommand == "fit":  # the top-level seed, so every subcommand takes one config
            kwargs["seed"] = self.config.seed_everything
        # a resumed fit adopts its checkpoint's run folder, known once its run started
        resuming = subcommand == "fit" and kwargs.get("ckpt_path") is not None
        observers = self.trainer._observers
        writer = _ConfigWriter(self, keep_existing=resuming)
        if self._save:
            if not resuming:
                self.check_config()  # a conflicting file is refused before the run
            observers.append(writer)
        try:
            return method(self.model, datamodule=self.datamodule, **kwargs)
        finally:
            if writer in observers:
                observers.remove(writer)

    def config_yaml(self) -> str:
        """The resolved config of the run as YAML (what ``--print_config`` prints)."""
        parser = self._parsers[self.subcommand]
        try:  # None values shown; jsonargparse 4.49 renamed skip_none to skip_unset
            return parser.dump(self.config, skip_unset=False)
        except (TypeError, ValueError):
            return parser.dump(self.config, skip_none=False)

    def check_config(self, overwrite: bool | None = None) -> None:
        """Refuse now what ``save_config`` would refuse: a different config already at
        ``<trainer.log_dir>/config.yaml`` (unless ``overwrite``); writes nothing."""
        if self.trainer.is_global_zero:
            self._existing(overwrite, keep_existing=False)

    def _existing(self, overwrite: bool | None, *, keep_existing: bool) -> tuple[str, bool]:
        """``(path, whether to leave the file as it is)``; a different existing file is an
        error unless ``overwrite`` or ``keep_existing`` (a warning then). A link planted at
        the file is refused either way (``loggers.run_files``): it is never read nor
        written through."""
        from .loggers.folders import join

        overwrite = self._overwrite if overwrite is None else overwrite
        path = join(self.trainer.log_dir, self._filename)
        files = self._config_files()
        files.check(self._filename)
        if overwrite or not files.exists(self._filename):
            return path, False
        if files.read(self._filename) == self.config_yaml().encode("utf-8"):
            return path, True
        message = (
            f"{path} exists and holds another config; not overwriting the record of "
            "a previous run. Delete it, choose another default_root_dir / logger "
            "version, or pass save_config_kwargs={'overwrite': True} (save_config=False "
            "writes none)"
        )
        if keep_existing:
            warnings.warn(message, UserWarning, stacklevel=4)
            return path, True
        raise RuntimeError(message)

    def _config_files(self) -> Any:
        """The run folder's files (``loggers.run_files.RunFiles``): ``config.yaml`` is
        written there atomically, never through a link planted in the folder."""
        from .loggers.run_files import RunFiles

        log_dir = self.trainer.log_dir
        return RunFiles(log_dir, log_dir)

    def save_config(self, overwrite: bool | None = None, *, keep_existing: bool = False) -> str:
        """Write the resolved config to ``<trainer.log_dir>/config.yaml`` on rank 0 and
        return its path ("" on other ranks). A different existing file is an error unless
        ``overwrite`` (default: the ``save_config_kwargs`` one); ``keep_existing`` keeps it
        with a warning instead. (A subcommand calls it when its run starts.)"""
        if not self.trainer.is_global_zero:
            return ""
        path, leave = self._existing(overwrite, keep_existing=keep_existing)
        if leave:
            self._saved = path
            return path
        self._config_files().write(self._filename, self.config_yaml().encode("utf-8"))
        self._saved = path
        return path


def _plugin_bases() -> tuple[type, type, type]:
    """``(Callback, ProgressBarBase, Logger)``, with every built-in callback and logger
    imported: jsonargparse knows a base's subclasses by the classes imported so far, and
    lists them in ``--help`` and resolves a bare class name (``class_path: CSVLogger``)
    among them. (The packages import their modules lazily, so ``import purestep.loops``
    alone does not.)"""
    from . import callbacks, loggers

    for package in (callbacks, loggers):
        for name in package.__all__:
            getattr(package, name)
    return callbacks.Callback, callbacks.ProgressBarBase, loggers.Logger


def _chosen_subcommand(args: Sequence[str]) -> str | None:
    """The subcommand the command line names: its first word that is not an option (the
    top-level parser has no options taking a value); None if there is none."""
    for arg in args:
        if not str(arg).startswith("-"):
            return str(arg) if arg in SUBCOMMANDS else None
    return None


class _ConfigWriter:
    """An observer of the run's events that writes the CLI's config at the run's start
    (``setup``), as Lightning's ``SaveConfigCallback`` does in its ``setup`` hook."""

    events = frozenset({"setup"})

    def __init__(self, owner: CLI, *, keep_existing: bool) -> None:
        self.owner = owner
        self.keep_existing = keep_existing
        self.written = False

    def uses_run_folder(self, fn: str) -> bool:
        """It writes ``config.yaml`` into the run folder: a run that would leave the default
        logger out (``trainer_run.run_logs``) gets a version folder for it instead of
        writing into ``default_root_dir``."""
        return True

    def on_event(self, event: str, ctx: Any) -> None:
        if not self.written:
            self.written = True
            self.owner.save_config(keep_existing=self.keep_existing)


def _flag_error(message: str, flags: Mapping[str, Any]) -> str:
    """A Trainer's refusal as a parser error: ``--trainer.<flag>=<value>: <reason>``, the
    flag being the first one the reason names (``--trainer: <reason>`` if none)."""
    named = [
        (match.start(), name)
        for name in flags
        if (match := re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", message))
    ]
    if not named:
        return f"--trainer: {message}"
    name = min(named)[1]
    return f"--trainer.{name}={flags[name]!r} is refused: {message}"


def _env_defaults(environ: Mapping[str, str]) -> dict[str, Any]:
    """``{"trainer.<flag>": value}`` for each ``PURESTEP_TRAINER_<FLAG>`` set, read as the
    Trainer reads them (``loops.trainer_args.parse_flag``)."""
    parameters = inspect.signature(Trainer.__init__).parameters
    out: dict[str, Any] = {}
    for name in flag_names(Trainer.__init__):
        var = ENV_PREFIX + name.upper()
        text = environ.get(var)
        if text:
            out[f"trainer.{name}"] = parse_flag(text, parameters[name].annotation, var)
    return out


# ---------------------------------------------------------------------- "did you mean"

_REFUSED = (
    # "Subcommand 'fit' does not accept option 'trainer.max_epohcs'" (config files, too)
    re.compile(
        r"(?P<kind>Group|Subcommand) '(?P<group>[^']*)' does not accept option '(?P<key>[^']+)'"
    ),
    # "unrecognized arguments: --trainer.max_epohcs 3"
    re.compile(r"nrecognized arguments: (?P<args>.*)"),
    # subclass mode: "Problem with given class_path 'pkg.Task':\n  Option 'hiden' is not ..."
    re.compile(
        r"class_path '(?P<class_path>[^']+)':\s*(?:Option|Key) '(?P<key>[^']+)' is not",
    ),
)


def _parser_class(jsonargparse: Any) -> type:
    """jsonargparse's parser, with "did you mean" added to its unknown-key errors."""
    cached = getattr(_parser_class, "cached", None)
    if cached is not None and cached[0] is jsonargparse:
        return cached[1]

    class Parser(jsonargparse.ArgumentParser):
        def error(self, message: str, ex: Exception | None = None) -> Any:
            return super().error(_with_suggestions(self, message), ex)

    _parser_class.cached = (jsonargparse, Parser)  # type: ignore[attr-defined]
    return Parser


def _keys(parser: Any) -> list[str]:
    """Every option key of ``parser`` and of its subcommands (``trainer.max_epochs``)."""
    import argparse

    keys: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                keys.extend(_keys(sub))
        for option in action.option_strings:
            if option.startswith("--"):
                keys.append(option[2:])
    return keys


def _closest(key: str, known: Sequence[str]) -> str | None:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if close:
        return close[0]
    # compare the last part among the keys of the same group ("trainer.max_epohcs")
    head, _, last = key.rpartition(".")
    same = [k.rpartition(".")[2] for k in known if k.rpartition(".")[0] == head]
    close = difflib.get_close_matches(last, same, n=1, cutoff=0.6)
    return f"{head}.{close[0]}" if close and head else (close[0] if close else None)


def _init_names(class_path: str) -> list[str]:
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(sys.modules.get(module) or __import__(module, fromlist=[name]), name)
        params = inspect.signature(cls.__init__).parameters
    except Exception:  # not importable, no signature: no suggestion
        return []
    return [p for p in params if p != "self"]


_REQUIRED = re.compile(r"arguments are required: (?P<names>.*)")
_HOW_TO_NAME = {
    "model": (
        "name the Task class: --model.class_path mypkg.MyTask (its arguments: "
        "--model.init_args.<name>), or in a --config file: model: {class_path: mypkg.MyTask}"
    ),
    "data": (
        "name the DataModule class: --data.class_path mypkg.MyData, or in a --config "
        "file: data: {class_path: mypkg.MyData}"
    ),
}


def _required_hints(message: str) -> list[str]:
    """How to give the model or the data module a "required" error names."""
    match = _REQUIRED.search(message)
    if match is None:
        return []
    names = {n.strip().rpartition(".")[2] for n in match["names"].split(",")}
    return [hint for key, hint in _HOW_TO_NAME.items() if key in names]


def _with_suggestions(parser: Any, message: str) -> str:
    known = _keys(parser)
    hints: list[str] = _required_hints(message)
    for pattern in _REFUSED:
        for match in pattern.finditer(message):
            found = match.groupdict()
            if found.get("args") is not None:
                keys = [a[2:].split("=")[0] for a in found["args"].split() if a.startswith("--")]
                candidates = known
            elif found.get("class_path") is not None:
                keys = [found["key"]]
                candidates = _init_names(found["class_path"])
            else:
                # a group's option is named within the group, a subcommand's in its parser
                key = found["key"]
                keys = [f"{found['group']}.{key}" if found["kind"] == "Group" else key]
                candidates = known
            for key in keys:
                close = _closest(key, candidates)
                if close and close != key:
                    hints.append(f"'{key}': did you mean '{close}'?")
    if not hints:
        return message
    return f"{message}\n  " + "\n  ".join(dict.fromkeys(hints))
