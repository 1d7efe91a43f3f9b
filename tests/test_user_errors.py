"""engine.user_errors: notes on exceptions from the user's step functions, and the refusal of
Lightning-style signatures when a step is built."""

from __future__ import annotations

import functools
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from purestep import engine, hardware
from purestep.engine import optim, user_errors
from purestep.loops import Task, Trainer
from purestep.loops.loggers import MemoryLogger

needs_notes = pytest.mark.skipif(sys.version_info < (3, 11), reason="add_note is 3.11+")


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(8, 3))


def dict_batch(n: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"x": torch.randn(n, 8, generator=g), "y": torch.randint(0, 3, (n,), generator=g)}


def unpacking_loss(apply, batch):
    """The new user's mistake: a dict batch unpacked like a tuple (gives the keys)."""
    x, y = batch
    return F.cross_entropy(apply(x), y)


def good_loss(apply, batch):
    return F.cross_entropy(apply(batch["x"]), batch["y"])


def notes(exc: BaseException) -> list[str]:
    return [n for n in getattr(exc, "__notes__", ()) if n.startswith(user_errors.NOTE_PREFIX)]


def expected_original() -> tuple[type, str]:
    """The exception ``unpacking_loss`` raises when called directly, for comparison."""
    with pytest.raises(Exception) as info:
        unpacking_loss(net(), dict_batch())
    return type(info.value), str(info.value)


def check_note(exc: BaseException, stage: str, *, fn: str = "unpacking_loss", n: int = 4):
    """The user's own exception, with exactly one purestep note naming ``fn``, ``stage``, the
    keys, shapes and dtypes."""
    kind, message = expected_original()
    assert type(exc) is kind and str(exc) == message  # AttributeError: 'str' ... 'flatten'
    (note,) = notes(exc)
    assert fn in note and stage in note
    assert f"dict{{'x': Tensor[{n}, 8] float32, 'y': Tensor[{n}] int64}}" in note
    assert "batch['x']" in note  # the unpacking hint
    return note


# --------------------------------------------------------------------------- the note


@needs_notes
def test_train_step_notes_the_function_the_stage_and_the_batch():
    model = net()
    state = engine.init(model, optim.sgd(0.1))
    for grad in ("autograd", "func"):
        step = engine.train_step(model, unpacking_loss, optim.sgd(0.1), grad=grad)
        with pytest.raises(AttributeError) as info:
            step(state, dict_batch())
        check_note(info.value, "train_step")


@needs_notes
def test_eval_and_predict_steps_note_their_stage():
    model = net()
    state = engine.init(model, optim.sgd(0.1))
    with pytest.raises(AttributeError) as info:
        engine.eval_step(model, unpacking_loss)(state, dict_batch())
    check_note(info.value, "eval_step")

    def predict(apply, batch):
        x, _ = batch
        return apply(x)

    with pytest.raises(AttributeError) as info:
        engine.predict_step(model, predict)(state, dict_batch())
    check_note(info.value, "predict_step", fn="predict")


@needs_notes
def test_per_sample_step_notes_the_one_example_batch():
    model = net()
    state = engine.init(model, optim.sgd(0.1))
    for allow_unused, stage, n in [
        (True, "per_sample_step (one example, under vmap)", 1),
        (False, "per_sample_step", 4),  # the first call's check for unused parameters
    ]:
        step = engine.per_sample_step(
            model,
            unpacking_loss,
            optim.sgd(0.1),
            max_grad_norm=1.0,
            noise_multiplier=0.0,
            allow_unused=allow_unused,
        )
        with pytest.raises(AttributeError) as info:
            step(state, dict_batch())
        check_note(info.value, stage, n=n)


@needs_notes
def test_ensemble_steps_note_once():
    model = net()
    ens = hardware.ensemble(2)
    state = engine.init(model, optim.sgd(0.1), strategy=ens)
    for grad in ("autograd", "func"):
        step = engine.train_step(model, unpacking_loss, optim.sgd(0.1), strategy=ens, grad=grad)
        with pytest.raises(AttributeError) as info:
            step(state, dict_batch())
        check_note(info.value, "train_step (ensemble")
    with pytest.raises(AttributeError) as info:
        engine.eval_step(model, unpacking_loss, strategy=ens)(state, dict_batch())
    check_note(info.value, "eval_step (ensemble")


class DictData(Dataset):
    def __init__(self, n: int = 8):
        self.batch = dict_batch(n)

    def __len__(self) -> int:
        return len(self.batch["y"])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.batch.items()}


def trainer() -> Trainer:
    return Trainer(
        max_steps=2, enable_progress_bar=False, enable_model_summary=False, logger=MemoryLogger()
    )


@needs_notes
def test_a_trainer_fit_reports_the_note_once():
    loader = DataLoader(DictData(), batch_size=4)
    with pytest.raises(AttributeError) as info:
        trainer().fit(net(), unpacking_loss, optim.sgd(0.1), loader)
    check_note(info.value, "train_step")  # names the user's function, not a Task wrapper


@needs_notes
def test_a_trainer_validate_with_a_task_names_the_method():
    class Classifier(Task):
        def training_step(self, apply, batch):
            return good_loss(apply, batch)

        def validation_step(self, apply, batch):
            return unpacking_loss(apply, batch)

        def configure_optimizers(self):
            return optim.sgd(0.1)

    task = Classifier(net())
    loader = DataLoader(DictData(), batch_size=4)
    t = trainer()
    t.fit(task, train_dataloaders=loader)
    with pytest.raises(AttributeError) as info:
        t.validate(task, loader, verbose=False)
    check_note(info.value, "eval_step", fn="Classifier.validation_step")


@needs_notes
def test_errors_outside_the_users_function_get_no_note():
    model = net()
    state = engine.init(model, optim.sgd(0.1))
    step = engine.train_step(model, lambda apply, batch: "not a loss", optim.sgd(0.1))
    with pytest.raises(TypeError, match="must return a scalar loss") as info:
        step(state, dict_batch())
    assert notes(info.value) == []


def test_annotate_adds_one_note_and_never_raises():
    exc = ValueError("mine")
    user_errors.annotate(exc, good_loss, "train_step", (torch.zeros(2, 3), [1, "a"]))
    user_errors.annotate(exc, good_loss, "eval_step", None)  # already annotated: unchanged
    assert type(exc) is ValueError and str(exc) == "mine"
    (note,) = notes(exc)
    assert "good_loss" in note and "train_step" in note
    assert "batch: tuple(Tensor[2, 3] float32, list[int, str[1]])" in note

    class Frozen(Exception):
        def __setattr__(self, name, value):
            raise AttributeError("read-only")

        def add_note(self, note):
            raise RuntimeError("no notes")

    user_errors.annotate(Frozen(), good_loss, "train_step", object())  # does not raise


def test_summaries_are_bounded():
    many = {f"key{i}": torch.zeros(i + 1) for i in range(1000)}
    text = user_errors.summarize(many)
    assert text.startswith("dict{'key0': Tensor[1] float32") and "(994 more)" in text
    deep: list = [torch.zeros(1)]
    for _ in range(100):
        deep = [deep]
    assert len(user_errors.summarize([many] * 1000)) <= 400
    assert user_errors.summarize(deep).endswith("list(...)]]]")


def test_summary_of_various_leaves():
    from collections import namedtuple

    Pair = namedtuple("Pair", "x y")
    text = user_errors.summarize(Pair(torch.zeros(2, dtype=torch.bfloat16), 3.0))
    assert text == "Pair(x=Tensor[2] bfloat16, y=float)"
    assert user_errors.summarize(torch.tensor(1)) == "Tensor[] int64"


# --------------------------------------------------------------------------- signatures


def lightning_loss(batch, batch_idx):
    return batch


def lightning_index(apply, batch_nb):
    return apply


@pytest.mark.parametrize("fn", [lightning_loss, lightning_index, lambda batch: batch])
def test_builders_refuse_lightning_signatures(fn):
    model = net()
    builders = {
        "loss_fn": lambda: engine.train_step(model, fn, optim.sgd(0.1)),
        "per_sample": lambda: engine.per_sample_step(
            model, fn, optim.sgd(0.1), max_grad_norm=1.0, noise_multiplier=0.0
        ),
        "ensemble": lambda: engine.train_step(
            model, fn, optim.sgd(0.1), strategy=hardware.ensemble(2)
        ),
        "eval_step fn": lambda: engine.eval_step(model, fn),
        "predict_step fn": lambda: engine.predict_step(model, fn),
        "ensemble eval": lambda: engine.eval_step(model, fn, strategy=hardware.ensemble(2)),
        "wrap": lambda: Task.wrap(model, good_loss, optim.sgd(0.1), test_fn=fn),
    }
    for name, build in builders.items():
        with pytest.raises(TypeError, match=r"Lightning's step signature") as info:
            build()
        message = str(info.value)
        assert "(apply, batch)" in message and "apply is the model bound" in message, name
        assert "For example: def " in message, name


def test_a_task_subclass_with_lightning_methods_is_refused():
    with pytest.raises(TypeError, match=r"LitModel.training_step\(self, batch, batch_idx\)") as e:

        class LitModel(Task):
            def training_step(self, batch, batch_idx):
                return batch

    assert "training_step(self, apply, batch)" in str(e.value)
    with pytest.raises(TypeError, match="validation_step"):

        class LitEval(Task):
            def training_step(self, apply, batch):
                return batch

            def validation_step(self, batch, batch_idx, dataloader_idx=0):
                return batch

    with pytest.raises(TypeError, match="predict_step"):

        class LitPredict(Task):
            @staticmethod
            def predict_step(batch, batch_idx):
                return batch


class CallableLoss:
    def __call__(self, apply, batch):
        return good_loss(apply, batch)


def three(apply, batch, scale):
    return good_loss(apply, batch) * scale


@pytest.mark.parametrize(
    "fn",
    [
        good_loss,
        lambda model, data: good_loss(model, data),
        lambda *args: good_loss(*args),
        lambda apply, *rest: good_loss(apply, *rest),
        functools.partial(three, scale=2.0),
        CallableLoss(),
        lambda apply, batch, batch_idx=0: good_loss(apply, batch),  # extra defaulted: fine
    ],
)
def test_valid_unusual_callables_are_accepted_and_run(fn):
    model = net()
    state = engine.init(model, optim.sgd(0.1))
    _, out = engine.train_step(model, fn, optim.sgd(0.1))(state, dict_batch())
    assert out.loss.dim() == 0
    assert "loss" in engine.eval_step(model, fn)(state, dict_batch())


def test_builtins_without_a_signature_are_accepted():
    engine.predict_step(net(), max)  # signature not readable: accepted
    user_errors.check_signature(print, "fn")

    class Fine(Task):
        def training_step(self, apply, batch):
            return good_loss(apply, batch)

        def predict_step(self, *args):
            return args

    assert Fine().has("predict_step")


def test_describe_function_names_partials_and_objects():
    assert user_errors.describe_function(good_loss) == "good_loss"
    assert user_errors.describe_function(functools.partial(three, scale=1)) == (
        "functools.partial(three)"
    )
    assert user_errors.describe_function(CallableLoss()) == "CallableLoss.__call__"


def test_swapped_parameters_are_named_as_such():
    with pytest.raises(TypeError, match=r"parameters look swapped") as info:
        engine.train_step(net(), lambda batch, model: batch, optim.sgd(0.1))
    assert "(apply, batch)" in str(info.value)


def swapped_scale(scale, apply, batch):
    return good_loss(apply, batch) * scale


def test_task_attributes_that_are_not_functions_are_checked_as_called():
    """A partial or callable object on the class is not bound to the instance, so it is
    called as ``(apply, batch)`` and checked so (not as a method whose ``self`` comes first)."""

    class WithPartial(Task):
        training_step = functools.partial(swapped_scale, 2.0)

    class WithObject(Task):
        training_step = CallableLoss()

    model = net()
    for cls in (WithPartial, WithObject):
        task = cls(model)
        state = engine.init(model, optim.sgd(0.1))
        _, out = engine.train_step(model, task.training_step, optim.sgd(0.1))(state, dict_batch())
        assert out.loss.dim() == 0
    with pytest.raises(TypeError, match="Lightning's step signature"):

        class WithLightningPartial(Task):
            training_step = functools.partial(lightning_loss)

    with pytest.raises(TypeError, match="Lightning's step signature"):

        class WithLightningObject(Task):
            training_step = type("L", (), {"__call__": lambda self, batch, batch_idx: 0})()


def test_an_evaluation_fn_with_a_lightning_signature_is_named_as_such():
    from purestep import Trainer

    def my_predict(batch, batch_idx):
        return batch

    with pytest.raises(TypeError, match=r"predict") as info:
        Trainer(enable_progress_bar=False, logger=False).predict(
            net(), [dict_batch()], fn=my_predict
        )
    assert "loss_fn" not in str(info.value)


def test_check_call_names_the_hook_its_signature_and_the_expected_one():
    class Hooks:
        def right(self, state, ctx):
            pass

        def wrong(self, state):
            pass

        def lightning(self, trainer, pl_module):
            pass

    hooks = Hooks()
    user_errors.check_call(hooks.right, ("state", "ctx"), "Hooks.right", "right(...)", "")
    user_errors.check_call(print, ("state", "ctx"), "print", "print(...)", "")  # no signature
    user_errors.check_call(functools.partial(hooks.wrong), ("s",), "p", "p(s)", "")
    with pytest.raises(TypeError, match=r"^Hooks\.wrong\(self, state\) does not take .*"):
        user_errors.check_call(hooks.wrong, ("a", "b"), "Hooks.wrong", "wrong(self, a, b)", "x")
    with pytest.raises(
        TypeError,
        match=r"\(self, trainer, pl_module\) has a PyTorch Lightning.*lightning\(s, c\): why",
    ):
        user_errors.check_call(hooks.lightning, ("s", "c"), "H.lightning", "lightning(s, c)", "why")
