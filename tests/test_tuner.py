"""The tuner: the learning-rate finder's sweep, results and suggestion (Lightning's
semantics), its purity (the fit after it starts from exactly the state before it), the
batch-size scaler against a model that runs out of CPU memory above a size, and the
Trainer's auto_* flags and tune()."""

from __future__ import annotations

import copy
import functools
import itertools
import math
import os
import signal

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from purestep.engine import optim
from purestep.engine.tree import assert_trees_equal
from purestep.loops import DataModule, Task, Trainer
from purestep.loops.tuning import LRFinder, Tuner, is_oom_error, sweep_lrs

OOM = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1099511627776 bytes."


def data(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


class LRTask(Task):
    def __init__(self, lr=0.1, injected=False, limit=None):
        super().__init__(net())
        self.lr = lr
        self.injected = injected
        self.limit = limit  # batches larger than this "run out of memory"

    def configure_optimizers(self):
        if self.injected:
            return optim.inject_hyperparams(optim.sgd)(lr=self.lr, momentum=0.9)
        return optim.sgd(self.lr, momentum=0.9)

    def training_step(self, apply, batch):
        x, y = batch
        if self.limit is not None and x.shape[0] > self.limit:
            torch.empty(2**50, dtype=torch.uint8)  # 1 PiB: the CPU allocator refuses at once
        return F.cross_entropy(apply(x), y)


class Data(DataModule):
    def __init__(self, batch_size=4, n=64):
        self.batch_size = batch_size
        self.n = n

    def train_dataloader(self):
        return DataLoader(data(self.n), batch_size=self.batch_size)


def trainer(**flags):
    flags.setdefault("enable_progress_bar", False)
    flags.setdefault("enable_model_summary", False)
    flags.setdefault("logger", False)
    flags.setdefault("enable_checkpointing", False)
    return Trainer(**flags)


# --------------------------------------------------------------------------- lr schedule


@settings(max_examples=30, deadline=None)
@given(
    lo=st.floats(1e-8, 1e-2),
    ratio=st.floats(2.0, 1e6),
    n=st.integers(2, 200),
    mode=st.sampled_from(["exponential", "linear"]),
)
def test_sweep_lrs_follow_lightnings_schedule(lo, ratio, n, mode):
    hi = lo * ratio
    lrs = sweep_lrs(lo, hi, n, mode)
    assert len(lrs) == n and lrs[0] == lo
    assert all(a < b for a, b in itertools.pairwise(lrs))  # strictly rising
    assert math.isclose(lrs[-1], hi, rel_tol=1e-9)  # reaches max_lr at the last step
    k = n // 2
    if k > 0:
        r = (k + 1) / n
        want = lo * (hi / lo) ** r if mode == "exponential" else lo + r * (hi - lo)
        assert math.isclose(lrs[k], want, rel_tol=1e-12)


# --------------------------------------------------------------------------- lr_find


def test_lr_find_results_and_smoothing():
    task = LRTask()
    finder = Tuner(trainer()).lr_find(
        task,
        DataLoader(data(), batch_size=4),
        num_training=30,
        early_stop_threshold=None,
        update_attr=False,
    )
    res = finder.results
    assert len(res["lr"]) == len(res["loss"]) == 30
    assert res["lr"] == sweep_lrs(1e-8, 1.0, 30, "exponential")
    # the raw step losses under Lightning's bias-corrected running mean (the recursion
    # itself is checked against a hand-run torch loop below): plausible cross-entropies
    beta, avg, raw = 0.98, 0.0, []
    for step, smoothed in enumerate(res["loss"], start=1):
        loss = (smoothed * (1 - beta ** (step + 1)) - beta * avg) / (1 - beta)
        avg = beta * avg + (1 - beta) * loss
        raw.append(loss)
    assert all(0.0 < x < 5.0 for x in raw)  # 2 classes: about log(2) at the start
    assert task.lr == 0.1  # update_attr=False leaves it


def test_lr_find_losses_are_the_step_losses_at_those_lrs():
    """The sweep's losses equal torch.optim.SGD run by hand at the learning rates it shows
    (the scaled updates are the learning rate itself; a stated tolerance, as the arithmetic
    differs)."""
    loader = DataLoader(data(), batch_size=4)
    finder = Tuner(trainer()).lr_find(
        LRTask(lr=0.1),
        loader,
        num_training=5,
        min_lr=1e-3,
        max_lr=1.0,
        early_stop_threshold=None,
        update_attr=False,
    )
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    beta, avg, want = 0.98, 0.0, []
    for step, ((x, y), lr) in enumerate(zip(loader, finder.results["lr"]), start=1):
        for group in opt.param_groups:
            group["lr"] = lr
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        avg = beta * avg + (1 - beta) * loss.item()
        want.append(avg / (1 - beta ** (step + 1)))
    assert len(want) == 5
    for got, exp in zip(finder.results["loss"], want):
        assert math.isclose(got, exp, rel_tol=1e-5)


@pytest.mark.bitwise
@pytest.mark.parametrize("injected", [False, True])
def test_fit_after_lr_find_is_bitwise_the_fit_without_it(injected):
    loader = DataLoader(data(), batch_size=4)
    plain = trainer(max_epochs=1).fit(LRTask(lr=0.05, injected=injected), train_dataloaders=loader)
    tr = trainer(max_epochs=1)
    task = LRTask(lr=0.05, injected=injected)
    finder = Tuner(tr).lr_find(task, loader, num_training=20, update_attr=False)
    assert finder is not None and tr.train_state is None  # the tuned trainer kept nothing
    after = tr.fit(task, train_dataloaders=loader)
    assert_trees_equal(after.params, plain.params)
    assert_trees_equal(after.opt_state, plain.opt_state)


@pytest.mark.bitwise
def test_lr_find_update_attr_sets_the_suggestion_and_leaves_the_state():
    loader = DataLoader(data(), batch_size=4)
    tr = trainer(max_epochs=1)
    start = tr.fit(LRTask(), train_dataloaders=loader)
    before = {k: v.clone() for k, v in start.params.items()}
    task = LRTask()
    finder = Tuner(trainer(max_epochs=3)).lr_find(
        task, loader, state=start, num_training=25, min_lr=1e-4
    )
    suggested = finder.suggestion()
    assert suggested is not None and task.lr == suggested
    assert_trees_equal(start.params, before)  # the given state is never written
    resumed = trainer(max_epochs=2).fit(task, train_dataloaders=loader, state=start)
    by_hand = trainer(max_epochs=2).fit(LRTask(lr=suggested), train_dataloaders=loader, state=start)
    assert_trees_equal(resumed.params, by_hand.params)


def test_lr_find_says_when_the_given_state_holds_its_own_learning_rate():
    """An injected learning rate lives in the state's optimizer state: update_attr cannot
    change what a fit from that state runs at, and says how to."""
    loader = DataLoader(data(), batch_size=4)
    for injected in (True, False):
        start = trainer(max_epochs=1).fit(LRTask(injected=injected), train_dataloaders=loader)
        messages = []
        tr = trainer(max_epochs=3)
        tr._printer = messages.append
        task = LRTask(injected=injected)
        Tuner(tr).lr_find(task, loader, state=start, num_training=25, min_lr=1e-4)
        assert task.lr != 0.1
        assert any("set_hyperparams" in m for m in messages) == injected


def test_lr_find_stops_early_on_divergence():
    messages = []
    tr = trainer()
    tr._printer = messages.append
    finder = Tuner(tr).lr_find(
        LRTask(),
        DataLoader(data(256), batch_size=4),
        num_training=60,
        min_lr=1e-2,
        max_lr=1e4,
        update_attr=False,
    )
    n = len(finder.results["loss"])
    assert 2 < n < 60
    assert any("stopped early" in m for m in messages)
    last, best = finder.results["loss"][-1], min(finder.results["loss"][:-1])
    assert not last <= 4.0 * best  # the last point crossed the threshold (or is NaN)


def test_suggestion_is_the_steepest_descent():
    f = LRFinder("exponential", 1e-3, 1.0, 8)
    f.results = {
        "lr": [1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2, 6.4e-2, 1.28e-1],
        "loss": [1.0, 0.99, 0.97, 0.5, 0.45, 0.44, float("nan"), 3.0],
    }
    lrs, losses = f.results["lr"], f.results["loss"]
    got = f.suggestion(skip_begin=1, skip_end=1)
    idx = [1, 2, 3, 4, 5]  # NaN (6) dropped, 0 and 7 skipped
    grads = torch.gradient(
        torch.tensor([losses[i] for i in idx], dtype=torch.float64),
        spacing=[torch.tensor([lrs[i] for i in idx], dtype=torch.float64)],
    )[0]
    assert got == lrs[idx[int(torch.argmin(grads))]]
    assert f.suggestion(skip_begin=6, skip_end=1) is None  # one finite point left
    with pytest.raises(ValueError, match="skip_begin"):
        f.suggestion(skip_begin=-1)


def test_plot_draws_the_curve_and_the_suggestion():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    f = LRFinder("exponential", 1e-3, 1.0, 20)
    f.results = {
        "lr": sweep_lrs(1e-3, 1.0, 20, "exponential"),
        "loss": [1.0 - 0.04 * i for i in range(20)],
    }
    fig = f.plot(suggest=True)
    ax = fig.axes[0]
    assert ax.get_xscale() == "log"
    curve, marker = ax.lines
    assert list(curve.get_xdata()) == f.results["lr"]
    assert marker.get_xdata()[0] == f.suggestion()


def test_lr_find_bad_input():
    tuner = Tuner(trainer())
    loader = DataLoader(data(), batch_size=4)
    with pytest.raises(ValueError, match="min_lr"):
        tuner.lr_find(LRTask(), loader, min_lr=1.0, max_lr=0.1)
    with pytest.raises(ValueError, match="mode"):
        tuner.lr_find(LRTask(), loader, mode="cubic")
    with pytest.raises(ValueError, match="num_training"):
        tuner.lr_find(LRTask(), loader, num_training=0)
    with pytest.raises(AttributeError, match="attr_name"):
        tuner.lr_find(LRTask(), loader, attr_name="nope")
    with pytest.raises(AttributeError, match="update_attr=False"):
        tuner.lr_find(
            net(),
            loader,
            loss_fn=lambda a, b: F.cross_entropy(a(b[0]), b[1]),
            optimizer=optim.sgd(0.1),
        )
    with pytest.raises(ValueError, match="learning rate"):  # neither injected nor an attribute
        tuner.lr_find(
            net(),
            loader,
            loss_fn=lambda a, b: F.cross_entropy(a(b[0]), b[1]),
            optimizer=optim.sgd(0.1),
            update_attr=False,
        )
    with pytest.raises(ValueError, match="method"):
        tuner.lr_find(LRTask(), loader, method="validate")
    with pytest.raises(TypeError, match="Trainer"):
        Tuner(object())
    assert Tuner(trainer(fast_dev_run=True)).lr_find(LRTask(), loader) is None


def test_lr_find_plain_module_with_injected_lr():
    finder = Tuner(trainer()).lr_find(
        net(),
        DataLoader(data(), batch_size=4),
        loss_fn=lambda a, b: F.cross_entropy(a(b[0]), b[1]),
        optimizer=optim.inject_hyperparams(optim.adam)(lr=1e-3),
        num_training=12,
        update_attr=False,
        early_stop_threshold=None,
    )
    assert len(finder.results["lr"]) == 12


def test_lr_find_takes_lightnings_optimizer_dict_and_leaves_its_scheduler_out():
    """An optimizer with a scheduler (Lightning's dict): the sweep runs the optimizer alone
    (Lightning swaps the schedulers for its own), exactly as a task without the scheduler."""

    class Scheduled(LRTask):
        def configure_optimizers(self):
            return {
                "optimizer": optim.inject_hyperparams(optim.sgd)(lr=self.lr, momentum=0.9),
                "lr_scheduler": {"scheduler": lambda k: self.lr * 0.5**k, "interval": "step"},
            }

    class Two(LRTask):
        def configure_optimizers(self):
            return [optim.sgd(self.lr), optim.sgd(self.lr)]

    loader = DataLoader(data(), batch_size=4)
    kwargs = {"num_training": 12, "update_attr": False, "early_stop_threshold": None}
    got = Tuner(trainer()).lr_find(Scheduled(), loader, **kwargs)
    want = Tuner(trainer()).lr_find(LRTask(injected=True), loader, **kwargs)
    assert got.results == want.results and len(got.results["lr"]) == 12
    with pytest.raises(ValueError, match="single optimizer"):
        Tuner(trainer()).lr_find(Two(), loader, **kwargs)


def test_a_preemption_signal_during_a_search_writes_no_checkpoint(tmp_path):
    """A SIGTERM during a trial keeps its usual effect (here: the handler installed before
    the search) instead of a preemption ``last.ckpt`` of the trial's state in the run folder,
    which the real fit's ckpt_path="last" would resume from."""

    class Signalling(LRTask):
        calls = 0

        def training_step(self, apply, batch):
            Signalling.calls += 1
            if Signalling.calls == 3:
                os.kill(os.getpid(), signal.SIGTERM)
            return super().training_step(apply, batch)

    heard = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: heard.append(signum))
    try:
        tr = trainer(default_root_dir=str(tmp_path))
        finder = Tuner(tr).lr_find(
            Signalling(), DataLoader(data(), batch_size=4), num_training=6, update_attr=False
        )
        Signalling.calls = 1  # the signal comes in the second trial
        size = Tuner(tr).scale_batch_size(
            Signalling(), datamodule=Data(n=16), steps_per_trial=1, max_trials=2
        )
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert heard == [signal.SIGTERM, signal.SIGTERM]
    assert len(finder.results["lr"]) == 6 and size == 4  # both ran to their end
    assert list(tmp_path.iterdir()) == []  # no checkpoints/last.ckpt


# --------------------------------------------------------------------------- batch size


def test_is_oom_error():
    assert is_oom_error(RuntimeError(OOM))
    with pytest.raises(RuntimeError) as real:  # the CPU allocator's own error
        torch.empty(2**50, dtype=torch.uint8)
    assert is_oom_error(real.value)
    assert is_oom_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert is_oom_error(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert not is_oom_error(RuntimeError("shape mismatch"))
    assert not is_oom_error(ValueError(OOM))
    try:
        try:
            raise RuntimeError(OOM)
        except RuntimeError as inner:
            raise ValueError("wrapped") from inner
    except ValueError as outer:
        assert is_oom_error(outer)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_real_cuda_out_of_memory_error_is_recognised():
    try:
        torch.empty(2**50, device="cuda")
    except Exception as exc:  # torch.OutOfMemoryError
        assert is_oom_error(exc)
    else:
        pytest.fail("allocating 1 PiB on the GPU did not fail")


@settings(max_examples=5, deadline=None)
@given(
    limit=st.integers(1, 20), init=st.integers(1, 5), mode=st.sampled_from(["power", "binsearch"])
)
def test_scale_batch_size_settles_on_what_fits(limit, init, mode):
    n = 16  # a batch never holds more than the dataset: sizes from n up all "fit"
    task, dm = LRTask(limit=limit), Data(batch_size=1, n=n)
    tr = trainer()
    size = Tuner(tr).scale_batch_size(
        task, datamodule=dm, mode=mode, init_val=init, steps_per_trial=1, max_trials=25
    )
    assert dm.batch_size == size
    if limit >= n:
        assert size == n  # grew until the batch covered the dataset, capped at its length
    elif mode == "binsearch":
        assert size == limit
    else:  # power: doubling (after halving, if init_val failed) until a failure
        assert size <= limit < 2 * size
    assert tr.train_state is None


@pytest.mark.parametrize("mode", ["power", "binsearch"])
def test_scale_batch_size_is_capped_at_the_dataset_length(mode):
    messages = []
    tr = trainer()
    tr._printer = messages.append
    dm = Data(batch_size=1, n=12)
    assert Tuner(tr).scale_batch_size(LRTask(), datamodule=dm, mode=mode, steps_per_trial=1) == 12
    assert dm.batch_size == 12
    tried = [int(m.split()[2]) for m in messages if m.startswith("Batch size")]
    assert tried == [2, 4, 8, 12]  # 16 would hold no more than the 12 samples
    assert any("greater or equal than the length" in m for m in messages)
    dm = Data(batch_size=1, n=12)
    assert Tuner(tr).scale_batch_size(LRTask(), datamodule=dm, init_val=50, mode=mode) == 12


def test_scale_batch_size_sets_task_hparams_and_reraises_other_errors():
    class HTask(LRTask):
        def __init__(self):
            super().__init__(limit=10)
            self.hparams = {"batch_size": 2}

    class FromTask(Data):
        def __init__(self, task):
            super().__init__()
            self.task = task

        def train_dataloader(self):
            return DataLoader(data(self.n), batch_size=self.task.hparams["batch_size"])

    task = HTask()
    assert (
        Tuner(trainer()).scale_batch_size(task, datamodule=FromTask(task), steps_per_trial=1) == 8
    )
    assert task.hparams["batch_size"] == 8

    class Broken(LRTask):
        def training_step(self, apply, batch):
            raise RuntimeError("not a memory problem")

    with pytest.raises(RuntimeError, match="not a memory problem"):
        Tuner(trainer()).scale_batch_size(Broken(), datamodule=Data())
    with pytest.raises(RuntimeError, match="no batch size"):
        Tuner(trainer()).scale_batch_size(LRTask(limit=0), datamodule=Data())
    with pytest.raises(ValueError, match="passed directly"):
        Tuner(trainer()).scale_batch_size(LRTask(), DataLoader(data()), datamodule=Data())
    with pytest.raises(AttributeError, match="not found"):
        Tuner(trainer()).scale_batch_size(LRTask(), datamodule=Data(), batch_arg_name="bs")
    with pytest.raises(ValueError, match="mode"):
        Tuner(trainer()).scale_batch_size(LRTask(), datamodule=Data(), mode="linear")


@pytest.mark.bitwise
def test_fit_after_scale_batch_size_is_the_fit_at_that_size():
    task, dm = LRTask(limit=16), Data(batch_size=2)
    tr = trainer(max_epochs=1)
    assert Tuner(tr).scale_batch_size(task, datamodule=dm, steps_per_trial=2) == 16
    after = tr.fit(task, datamodule=dm)
    plain = trainer(max_epochs=1).fit(LRTask(limit=16), datamodule=Data(batch_size=16))
    assert_trees_equal(after.params, plain.params)


# --------------------------------------------------------------------------- flags, tune()


def test_tune_follows_the_auto_flags():
    task, dm = LRTask(limit=8), Data(batch_size=2, n=32)
    tr = trainer(auto_lr_find=True, auto_scale_batch_size="binsearch")
    result = tr.tune(
        task,
        datamodule=dm,
        scale_batch_size_kwargs={"steps_per_trial": 1},
        lr_find_kwargs={"num_training": 15, "min_lr": 1e-4},
    )
    assert result["scale_batch_size"] == 8 == dm.batch_size
    assert isinstance(result["lr_find"], LRFinder)
    assert task.lr == result["lr_find"].suggestion()
    assert trainer().tune(LRTask(), datamodule=Data()) == {}


def test_auto_lr_find_names_the_attribute_and_flags_are_checked():
    class Named(LRTask):
        def __init__(self):
            super().__init__()
            self.my_lr = 0.1

        def configure_optimizers(self):
            return optim.sgd(self.my_lr)

    task = Named()
    res = trainer(auto_lr_find="my_lr").tune(
        task,
        train_dataloaders=DataLoader(data(), batch_size=4),
        lr_find_kwargs={"num_training": 20},
    )
    assert task.my_lr == res["lr_find"].suggestion()
    with pytest.raises(ValueError, match="auto_scale_batch_size"):
        trainer(auto_scale_batch_size="linear")
    with pytest.raises(TypeError, match="auto_lr_find"):
        trainer(auto_lr_find=3)


def test_update_attr_without_a_suggestion_leaves_the_attribute():
    messages = []
    tr = trainer()
    tr._printer = messages.append
    task = LRTask(lr=0.1)
    finder = Tuner(tr).lr_find(task, DataLoader(data(8), batch_size=4), num_training=5)
    assert finder.suggestion() is None and task.lr == 0.1  # 5 points, 10 skipped
    assert "Failed to compute a learning-rate suggestion" in messages[-1]


def _lightning_curve(model, optimizer, loader, root, **kwargs):
    """Lightning's own lr_find on a LightningModule around ``model`` (a copy)."""
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.tuner import Tuner as LightningTuner

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = copy.deepcopy(model)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return optimizer(self.parameters())

    quiet = {
        "enable_checkpointing": False,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    tuner = LightningTuner(pl.Trainer(default_root_dir=str(root), **quiet))
    return tuner.lr_find(Module(), train_dataloaders=loader, update_attr=False, **kwargs)


@pytest.mark.bitwise
@pytest.mark.parametrize(
    ("torch_optimizer", "ours"),
    [
        (  # a torch optimizer class: from_torch, whose lr is injected
            functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
            functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
        ),
        (  # the project's Adam, injected (torch's arithmetic)
            functools.partial(torch.optim.Adam, lr=1e-3),
            optim.inject_hyperparams(optim.adam)(lr=1e-3),
        ),
    ],
)
@pytest.mark.parametrize("mode", ["exponential", "linear"])
def test_lr_find_curve_is_lightnings_bitwise(torch_optimizer, ours, mode, tmp_path):
    """The same model, initial weights, data order and optimizer under Lightning's
    ``Tuner.lr_find`` and ours: the sweep sets the learning rate itself (the optimizer's
    injected lr) at each step, as Lightning's scheduler sets ``param_group["lr"]``, so the
    (lr, loss) curves are equal, not only close."""
    loader = DataLoader(data(128), batch_size=4)  # in order: 32 batches
    model = net()
    # from 1e-4: enough steps move the weights for a rounding difference to show in the losses
    kwargs = {"num_training": 20, "early_stop_threshold": None, "mode": mode, "min_lr": 1e-4}
    want = _lightning_curve(model, torch_optimizer, loader, tmp_path, **kwargs)

    class Same(Task):
        def configure_optimizers(self):
            return ours

        def training_step(self, apply, batch):
            x, y = batch
            return F.cross_entropy(apply(x), y)

    got = Tuner(trainer()).lr_find(Same(copy.deepcopy(model)), loader, update_attr=False, **kwargs)
    assert len(got.results["lr"]) == 20
    assert got.results["lr"] == want.results["lr"]
    assert got.results["loss"] == want.results["loss"]


def test_lr_find_refuses_an_injected_lr_schedule_that_overrides_the_sweep():
    class Scheduled(LRTask):
        def configure_optimizers(self):
            return optim.inject_hyperparams(optim.sgd)(lr=lambda count: 0.1)

    with pytest.raises(ValueError, match="is a schedule"):
        Tuner(trainer()).lr_find(
            Scheduled(), DataLoader(data(), batch_size=4), num_training=5, update_attr=False
        )


def test_trials_run_on_a_plain_trainer_when_the_tuner_is_given_a_subclass():
    """A Trainer subclass may take other arguments and add its own callbacks: the trials are
    plain Trainers with the given one's flags, so the subclass's ``__init__`` is not called
    again, and the result is the plain Trainer's."""
    built = []

    class Named(Trainer):
        def __init__(self, name, **flags):
            built.append(name)
            super().__init__(**flags)

    flags = dict(enable_progress_bar=False, enable_model_summary=False, logger=False)
    flags.update(enable_checkpointing=False)
    run = dict(num_training=12, early_stop_threshold=None, update_attr=False)
    loader = DataLoader(data(), batch_size=4)
    ours = Tuner(Named("mine", **flags)).lr_find(LRTask(), loader, **run)
    plain = Tuner(trainer()).lr_find(LRTask(), loader, **run)
    assert built == ["mine"]
    assert ours.results == plain.results
    with pytest.raises(TypeError, match="needs a purestep Trainer"):
        from purestep.loops.tuning.trial import trial_trainer

        trial_trainer(object())
