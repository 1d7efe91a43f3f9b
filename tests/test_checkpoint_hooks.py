"""Checkpoint hooks (Task, DataModule, Callback), hparams and rebuilding a task from a file.

The hooks return plain data that the Trainer stores in a checkpoint's metadata and hands
back when a run starts from it; ``Task.load_from_checkpoint`` and
``engine.checkpoint.load_module`` rebuild the trained model from a checkpoint.
"""

from __future__ import annotations

import glob
import os
import threading

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import purestep
from purestep import engine
from purestep.engine import checkpoint, optim, tree
from purestep.engine.checkpoint import files
from purestep.engine.state import Progress, TrainState
from purestep.loops import DataModule, Task, Trainer
from purestep.loops.callbacks import Callback, ModelCheckpoint
from purestep.loops.events import NOTHING
from tests.helpers import mlp
from tests.helpers import sign_data as _data
from tests.helpers import sign_loss as _loss


class Classifier(Task):
    """A task whose hyper-parameters are its ``__init__`` arguments and whose hooks log."""

    def __init__(self, hidden=16, lr=1e-2, tag="a"):
        super().__init__()
        self.save_hyperparameters()
        self.log: list = []
        self.restored = None

    def configure_model(self):
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(8, self.hparams["hidden"]), nn.ReLU(), nn.Linear(self.hparams["hidden"], 3)
        )

    def configure_optimizers(self):
        return optim.adam(self.hparams["lr"])

    def training_step(self, apply, batch):
        return _loss(apply, batch)

    def validation_step(self, apply, batch):
        return _loss(apply, batch)

    def on_save_checkpoint(self):
        self.log.append("task.save")
        return {"vocab": ["x", "y"], "scale": torch.tensor([1.5, 2.0]), "pair": (1, None)}

    def on_load_checkpoint(self, data):
        self.log.append("task.load")
        self.restored = data


class Data(DataModule):
    def __init__(self, log):
        self.log = log
        self.position = 0

    def setup(self, stage):
        self.log.append(f"dm.setup:{stage}")

    def train_dataloader(self):
        self.log.append("dm.train_dataloader")
        self.position += 1
        return DataLoader(_data(), batch_size=8, shuffle=True)

    def val_dataloader(self):
        return DataLoader(_data(16, 1), batch_size=8)

    def state_dict(self):
        self.log.append("dm.save")
        return {"position": self.position}

    def load_state_dict(self, state_dict):
        self.log.append(f"dm.load:{state_dict}")
        self.position = state_dict["position"]


class Counter(Callback):
    """Counts training batches in its state and adds the count at save as extra data."""

    def __init__(self, log):
        self.log = log
        self.loaded = []

    def init(self):
        return {"seen": 0}

    def on_train_batch_end(self, state, ctx):
        if not self.log or self.log[-1] != "batch":
            self.log.append("batch")
        return {"seen": state["seen"] + 1}, NOTHING

    def on_save_checkpoint(self, state, ctx):
        self.log.append("cb.save")
        return {"seen_at_save": state["seen"], "step": ctx.state.progress.step}

    def on_load_checkpoint(self, state, data, ctx):
        self.log.append("cb.load")
        self.loaded.append((dict(state), data))
        return dict(state)  # unchanged: the resumed run must equal an uninterrupted one


def _trainer(root, **flags):
    flags.setdefault("enable_progress_bar", False)
    flags.setdefault("enable_model_summary", False)
    flags.setdefault("logger", False)
    return Trainer(default_root_dir=str(root), **flags)


def _run(root, max_epochs, ckpt_path=None, task=None):
    log: list = []
    task = task or Classifier(hidden=12, lr=0.02, tag="run")
    task.log = log
    dm = Data(log)
    cb = Counter(log)
    trainer = _trainer(
        root, max_epochs=max_epochs, callbacks=[cb, ModelCheckpoint(dirpath=str(root / "ck"))]
    )
    state = trainer.fit(task, datamodule=dm, ckpt_path=ckpt_path)
    return state, log, task, dm, cb


def _only_file(folder):
    found = glob.glob(os.path.join(str(folder), "*.ckpt"))
    assert len(found) == 1, found
    return found[0]


def test_hooks_round_trip_across_a_resume_in_lightnings_order_and_end_bitwise(tmp_path):
    whole, _, _, _, _ = _run(tmp_path / "whole", 2)
    _, log, _, _, _ = _run(tmp_path / "cut", 1)
    path = _only_file(tmp_path / "cut" / "ck")
    # one save (end of the epoch): callbacks, then the task, then the datamodule
    assert [e for e in log if e != "batch"] == [
        "dm.setup:fit",
        "dm.train_dataloader",
        "cb.save",
        "task.save",
        "dm.save",
    ]
    _, meta = checkpoint.load(path)
    hooks = meta["hooks"]
    assert hooks["callbacks"] == {"Counter": {"seen_at_save": 4, "step": 4}}
    assert hooks["datamodule"] == {"position": 1}
    assert hooks["task"]["vocab"] == ["x", "y"] and hooks["task"]["pair"] == (1, None)
    assert torch.equal(hooks["task"]["scale"], torch.tensor([1.5, 2.0]))
    assert meta["hparams"] == {"hidden": 12, "lr": 0.02, "tag": "run"}

    resumed, log, task, dm, cb = _run(tmp_path / "cut", 2, ckpt_path=path)
    # restored after setup and before the dataloaders: task, datamodule, then callbacks
    assert log[:5] == [
        "dm.setup:fit",
        "task.load",
        "dm.load:{'position': 1}",
        "cb.load",
        "dm.train_dataloader",
    ]
    assert log.count("task.load") == 1 and log.count("cb.load") == 1
    assert task.restored["vocab"] == ["x", "y"]
    assert torch.equal(task.restored["scale"], torch.tensor([1.5, 2.0]))
    assert dm.position == 2  # restored to 1, then one more train_dataloader()
    assert cb.loaded == [({"seen": 4}, {"seen_at_save": 4, "step": 4})]
    assert resumed.callbacks["Counter"] == {"seen": 8}
    tree.assert_trees_equal(resumed, whole)  # bit for bit, as if never interrupted


def test_evaluation_with_ckpt_path_hands_the_data_back(tmp_path):
    _run(tmp_path, 1)
    path = _only_file(tmp_path / "ck")
    log: list = []
    task = Classifier(hidden=12)
    task.log = log
    dm = Data(log)
    trainer = _trainer(tmp_path)
    trainer.validate(task, datamodule=dm, ckpt_path=path, verbose=False)
    assert log[:3] == ["task.load", "dm.load:{'position': 1}", "dm.setup:validate"]
    assert task.restored["vocab"] == ["x", "y"] and dm.position == 1
    log.clear()
    trainer.predict(task, DataLoader(_data(8), batch_size=8), ckpt_path=path)
    assert log == ["task.load"]


def test_a_run_without_hook_data_calls_no_load_hook(tmp_path):
    class Plain(Classifier):
        def on_save_checkpoint(self):
            return None

    _run(tmp_path, 1, task=Plain(hidden=12))
    path = _only_file(tmp_path / "ck")
    _, meta = checkpoint.load(path)
    assert "task" not in meta["hooks"]
    _, log, task, _, _ = _run(tmp_path, 2, ckpt_path=path, task=Plain(hidden=12))
    assert "task.load" not in log and task.restored is None


class _Opaque:
    pass


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        (lambda: 0, "function"),
        (nn.Linear(1, 1), "Linear"),
        (_Opaque(), "_Opaque"),
        (Progress(), "Progress"),  # an @struct: the codec could carry it, hook data may not
    ],
)
def test_hook_data_that_is_not_plain_is_refused_naming_the_hook(tmp_path, value, kind):
    class Bad(Classifier):
        def on_save_checkpoint(self):
            return {"ok": 1, "bad": [value]}

    with pytest.raises(checkpoint.CheckpointError) as err:
        _run(tmp_path, 1, task=Bad())
    message = str(err.value)
    assert f"cannot save Bad.on_save_checkpoint()['bad'][0]: a {kind} is not plain data" in message
    assert not glob.glob(str(tmp_path / "ck" / "*.ckpt"))


def test_datamodule_and_callback_data_are_checked_too(tmp_path):
    class BadData(Data):
        def state_dict(self):
            return {"loader": DataLoader(_data(), batch_size=8)}

    class BadCounter(Counter):
        def on_save_checkpoint(self, state, ctx):
            return {"ctx": ctx}

    trainer = _trainer(tmp_path, max_epochs=1)
    with pytest.raises(checkpoint.CheckpointError, match=r"BadData.state_dict\(\)\['loader'\]"):
        trainer.fit(Classifier(), datamodule=BadData([]))
    trainer = _trainer(tmp_path, max_epochs=1, callbacks=[BadCounter([])])
    with pytest.raises(checkpoint.CheckpointError, match=r"BadCounter.on_save_checkpoint"):
        trainer.fit(Classifier(), datamodule=Data([]))


def _rewrite_hooks(path, out, hooks):
    """A copy of checkpoint ``path`` whose metadata's hook data is ``hooks`` (raw nodes)."""
    payload = files.read(path)
    meta = checkpoint.decode(payload["metadata"], "metadata")
    encoded = checkpoint.encode(meta, "metadata")
    items = [kv for kv in encoded["items"] if kv[0] != "hooks"]
    encoded["items"] = [*items, ["hooks", hooks]]
    payload["metadata"] = encoded
    files.write_payload(payload, str(out))
    return str(out)


class _Bomb:
    built = False

    def __setstate__(self, state):
        _Bomb.built = True


def test_a_crafted_checkpoints_hook_data_cannot_construct_objects(tmp_path):
    _run(tmp_path / "run", 1)
    path = _only_file(tmp_path / "run" / "ck")
    struct = checkpoint.encode({"task": Progress(step=3)})  # a registered @struct
    crafted = _rewrite_hooks(path, tmp_path / "struct.ckpt", struct)
    with pytest.raises(checkpoint.CheckpointError, match=r"holds a Progress, not plain data"):
        _run(tmp_path / "a", 2, ckpt_path=crafted)
    with pytest.raises(checkpoint.CheckpointError, match=r"holds a Progress, not plain data"):
        Classifier.load_from_checkpoint(crafted)
    foreign = {
        "__kind__": "dict",
        "items": [["task", {"__kind__": "struct", "type": "os:system", "data": {}, "static": {}}]],
    }
    crafted = _rewrite_hooks(path, tmp_path / "foreign.ckpt", foreign)
    with pytest.raises(checkpoint.CheckpointError, match="no such @struct class"):
        _run(tmp_path / "b", 2, ckpt_path=crafted)
    pickled = _rewrite_hooks(path, tmp_path / "pickle.ckpt", {"task": _Bomb()})
    with pytest.raises(checkpoint.CheckpointError, match="refusing to load"):
        _run(tmp_path / "c", 2, ckpt_path=pickled)
    assert not _Bomb.built
    # a hyper-parameter that is an object is refused the same way by load_from_checkpoint
    payload = files.read(path)
    meta = checkpoint.decode(payload["metadata"], "metadata")
    meta["hparams"] = {"hidden": Progress()}
    payload["metadata"] = checkpoint.encode(meta, "metadata")
    files.write_payload(payload, str(tmp_path / "hparams.ckpt"))
    with pytest.raises(checkpoint.CheckpointError, match=r"\['hidden'\] holds a Progress"):
        Classifier.load_from_checkpoint(str(tmp_path / "hparams.ckpt"))


def test_load_from_checkpoint_rebuilds_the_task_with_overrides_and_equal_weights(tmp_path):
    state, _, _, _, _ = _run(tmp_path, 1)
    path = _only_file(tmp_path / "ck")
    task = Classifier.load_from_checkpoint(path, tag="served")
    assert type(task) is Classifier
    assert task.hparams == {"hidden": 12, "lr": 0.02, "tag": "served"}
    assert task.restored["vocab"] == ["x", "y"]  # on_load_checkpoint ran
    assert isinstance(task.state, TrainState)
    tree.assert_trees_equal(task.state, state)
    template = Classifier(hidden=12).get_model()
    for name, p in task.model.named_parameters():
        assert torch.equal(p, state.params[name]) and p.data_ptr() != state.params[name].data_ptr()
    x = _data(16, 3).tensors[0]
    with torch.no_grad():
        out = task.model(x)
    assert torch.equal(out, engine.predict_step(template)(state, x))
    assert torch.equal(out, engine.predict_step(template)(task.state, x))
    # the same through map_location, and a wrong architecture is one clear error
    on_cpu = Classifier.load_from_checkpoint(path, map_location="cpu")
    assert all(p.device.type == "cpu" for p in on_cpu.model.parameters())
    with pytest.raises(checkpoint.CheckpointError, match=r"do not fit the module: shapes differ"):
        Classifier.load_from_checkpoint(path, hidden=5)
    with pytest.raises(TypeError, match=r"hparams are \['hidden', 'lr', 'tag'\]; pass what"):
        Classifier.load_from_checkpoint(path, width=5)


def test_hparams_are_in_weights_only_files_and_hparams_argument_tasks_rebuild(tmp_path):
    class ByDict(Classifier):
        def __init__(self, hparams=None):
            Task.__init__(self, hparams=hparams)
            self.log, self.restored = [], None

    task = ByDict({"hidden": 6, "lr": 0.1, "tag": "d"})
    trainer = _trainer(tmp_path, max_epochs=1, enable_checkpointing=False)
    state = trainer.fit(task, datamodule=Data([]))
    trainer.save_checkpoint(str(tmp_path / "w.ckpt"), weights_only=True)
    _, meta = checkpoint.load(str(tmp_path / "w.ckpt"))
    assert meta["weights_only"] and meta["hparams"] == {"hidden": 6, "lr": 0.1, "tag": "d"}
    assert "callbacks" not in meta["hooks"] and "task" in meta["hooks"]
    again = ByDict.load_from_checkpoint(str(tmp_path / "w.ckpt"))
    assert again.hparams == {"hidden": 6, "lr": 0.1, "tag": "d"} and again.state is None
    tree.assert_trees_equal(dict(again.model.named_parameters()), state.params)


def test_save_hyperparameters_selects_ignores_and_refuses_objects():
    class Base(Task):
        def __init__(self, width, depth=2, **extra):
            super().__init__()
            self.save_hyperparameters(ignore="depth")

    class Child(Base):
        def __init__(self, width=4, net=None, scale=1.0):
            super().__init__(width * 2, depth=3, flag=True)

    assert Base(3, 5, flag=False).hparams == {"width": 3, "flag": False}
    # every __init__ running for the object: the subclass's arguments win; modules are left out
    child = Child(net=nn.Linear(1, 1))
    assert child.hparams == {"width": 4, "flag": True, "scale": 1.0}

    class Some(Task):
        def __init__(self, a=1, b=2):
            self.save_hyperparameters("b")  # before super().__init__(): kept
            super().__init__()

    assert Some().hparams == {"b": 2}

    class Fn(Task):
        def __init__(self, loss=_loss):
            super().__init__()
            self.save_hyperparameters()

    with pytest.raises(TypeError, match=r"hyper-parameter 'loss'.*ignore=\['loss'\]"):
        Fn()
    with pytest.raises(RuntimeError, match="inside your Task subclass's __init__"):
        Task().save_hyperparameters()
    explicit = Task()
    explicit.save_hyperparameters({"lr": 0.5})
    assert explicit.hparams == {"lr": 0.5}


def test_load_module_gives_the_trained_module_of_a_checkpoint(tmp_path):
    net = mlp(batchnorm=True)
    opt = optim.adamw(1e-2)
    state = engine.init(net, opt, seed=0)
    step = engine.train_step(net, _loss, opt)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        batch = (torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g))
        state, _ = step(state, batch)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    checkpoint.save(state, str(tmp_path / "a.ckpt"))
    module = purestep.checkpoint.load_module(str(tmp_path / "a.ckpt"), net)
    assert module is not net
    tree.assert_trees_equal({k: v for k, v in net.state_dict().items()}, before)  # untouched
    x = torch.randn(8, 8)
    with torch.no_grad():
        assert torch.equal(module.eval()(x), engine.predict_step(net)(state, x))
    # a weights-only payload, a meta-device template and map_location work the same
    weights = {"weights_only": True, "params": state.params, "buffers": state.buffers}
    checkpoint.save(weights, str(tmp_path / "w.ckpt"))
    with torch.device("meta"):
        meta_net = mlp(batchnorm=True)
    from_weights = checkpoint.load_module(str(tmp_path / "w.ckpt"), meta_net, map_location="cpu")
    with torch.no_grad():
        assert torch.equal(from_weights.eval()(x), module(x))
    # a template that does not fit is one error naming the file
    with pytest.raises(checkpoint.CheckpointError, match=r"a\.ckpt: its weights do not fit"):
        checkpoint.load_module(str(tmp_path / "a.ckpt"), mlp())
    checkpoint.save({"x": 1}, str(tmp_path / "other.ckpt"))
    with pytest.raises(checkpoint.CheckpointError, match="not a training state or weights"):
        checkpoint.load_module(str(tmp_path / "other.ckpt"), net)


class Recording(Task):
    """Returns live objects from its save hook: a list and a tensor it keeps changing."""

    def __init__(self):
        super().__init__(hparams={"lr": 0.05, "names": ["a"]})
        self.calls: list = []
        self.count = torch.zeros(1)

    def configure_model(self):
        torch.manual_seed(0)
        return mlp()

    def configure_optimizers(self):
        return optim.sgd(self.hparams["lr"])

    def training_step(self, apply, batch):
        return _loss(apply, batch)

    def on_save_checkpoint(self):
        return {"calls": self.calls, "count": self.count}


def test_async_checkpoints_hold_the_hook_data_of_their_save(tmp_path, monkeypatch):
    """With ``async_checkpoint=True`` each file holds the hook data (and hparams) as they
    were at its save, although the task changes them before the background write runs."""
    from purestep.engine.checkpoint import background

    released = threading.Semaphore(0)
    serialize = background.serialize

    def held(*args, **kwargs):  # each write waits until the task has changed its data
        released.acquire(timeout=10)
        return serialize(*args, **kwargs)

    monkeypatch.setattr(background, "serialize", held)
    task = Recording()
    trainer = _trainer(
        tmp_path,
        max_steps=6,
        async_checkpoint=True,
        callbacks=[
            ModelCheckpoint(dirpath=str(tmp_path / "ck"), save_top_k=-1, every_n_train_steps=2)
        ],
    )
    save = trainer.checkpointing.save

    def then_change(state, path, driver):  # what the task does right after a save returns
        save(state, path, driver)
        task.calls.append(os.path.basename(path))
        task.count.add_(1)  # in place
        task.hparams["names"].append(os.path.basename(path))
        released.release()

    trainer.checkpointing.save = then_change
    trainer.fit(task, train_dataloaders=DataLoader(_data(64), batch_size=8))
    paths = sorted(glob.glob(str(tmp_path / "ck" / "*.ckpt")))
    names = [os.path.basename(p) for p in paths]
    assert names == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt"]
    for i, path in enumerate(paths):
        _, meta = checkpoint.load(path)
        assert meta["hooks"]["task"]["calls"] == names[:i]
        assert torch.equal(meta["hooks"]["task"]["count"], torch.tensor([float(i)]))
        assert meta["hparams"] == {"lr": 0.05, "names": ["a", *names[:i]]}


def _weights_file(task, path, hparams):
    """A weights-only checkpoint of ``task``'s model with ``hparams`` in its metadata."""
    state = engine.init(task.get_model(), optim.sgd(0.1), seed=0)
    weights = {"weights_only": True, "params": state.params, "buffers": state.buffers}
    checkpoint.save(weights, path, metadata={"hparams": hparams})
    return state


def test_load_from_checkpoint_overrides_reach_a_task_without_an_init(tmp_path):
    """The README's style, ``M(hparams={...})``: overrides merge into the saved dict."""

    class M(Task):
        def configure_model(self):
            torch.manual_seed(0)
            return nn.Linear(3, 1)

    path = str(tmp_path / "m.ckpt")
    saved = {"lr": 0.1, "model": "linear", "sizes": [3, 1]}
    state = _weights_file(M(hparams=saved), path, saved)
    assert M.load_from_checkpoint(path).hparams == saved
    again = M.load_from_checkpoint(path, lr=0.5, extra=1)
    assert again.hparams == {"lr": 0.5, "model": "linear", "sizes": [3, 1], "extra": 1}
    tree.assert_trees_equal(dict(again.model.named_parameters()), state.params)
    # hparams= replaces the saved dict; other overrides still merge into it
    given = M.load_from_checkpoint(path, hparams={"lr": 0.3}, wd=0.0)
    assert given.hparams == {"lr": 0.3, "wd": 0.0}
    # a saved key named like Task.__init__'s ``model`` stays a hyper-parameter; a model
    # override is the template, not an entry of the hparams
    template = nn.Linear(3, 1)
    with_model = M.load_from_checkpoint(path, model=template)
    assert with_model.hparams == saved
    assert isinstance(with_model.model, nn.Linear) and with_model.model is not template


def test_load_from_checkpoint_overrides_with_both_keywords_and_hparams(tmp_path):
    """A class naming ``lr`` and taking ``hparams``: an ``lr`` override is the keyword and
    the dict's entry, so a dict that wins over the keyword cannot cancel it; unnamed
    overrides merge into the dict."""

    class Both(Task):
        def __init__(self, lr=0.01, hparams=None):
            super().__init__(hparams={"lr": lr, **(hparams or {})})  # the dict wins
            self.lr = lr

        def configure_model(self):
            torch.manual_seed(0)
            return nn.Linear(3, 1)

    path = str(tmp_path / "both.ckpt")
    original = Both(lr=0.1, hparams={"wd": 0.0})
    _weights_file(original, path, original.hparams)
    plain = Both.load_from_checkpoint(path)
    assert plain.lr == 0.1 and plain.hparams == {"lr": 0.1, "wd": 0.0}
    over = Both.load_from_checkpoint(path, lr=0.5, momentum=0.9)
    assert over.lr == 0.5 and over.hparams == {"lr": 0.5, "wd": 0.0, "momentum": 0.9}

    class Recorded(Task):  # save_hyperparameters() of an ``hparams`` argument: a nested dict
        def __init__(self, width=2, hparams=None):
            super().__init__()
            self.save_hyperparameters()

        def configure_model(self):
            torch.manual_seed(0)
            return nn.Linear(3, 1)

    path = str(tmp_path / "recorded.ckpt")
    rec = Recorded(width=3, hparams={"a": 1})
    _weights_file(rec, path, rec.hparams)
    again = Recorded.load_from_checkpoint(path, b=2, width=4)
    assert again.hparams == {"width": 4, "hparams": {"a": 1, "b": 2}}
    # with no dict to merge into, an unknown override is a clear error
    bad = str(tmp_path / "bad.ckpt")
    _weights_file(rec, bad, {"width": 3, "hparams": 7})
    with pytest.raises(TypeError, match=r"does not take \['b'\].*not a dict to merge"):
        Recorded.load_from_checkpoint(bad, b=2)
