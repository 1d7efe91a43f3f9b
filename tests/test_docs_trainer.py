"""The Trainer pages' own promises: the end-to-end run, the fit-events diagram, and the
torch-scheduler table's native equivalents.

The end-to-end block of ``docs/trainer.md`` runs as written and its test and predictions are
checked against the best checkpoint's weights computed by hand; the mermaid diagram of
``docs/callbacks_and_logging.md`` is parsed and compared with the events a recording callback
sees in a real ``Trainer.fit``, so the drawing cannot drift from the loops.
"""

from __future__ import annotations

import math
import os
import re

import pytest
import torch
import torch.nn.functional as F

from tests.docs_book import PAGE, ROOT

END_TO_END = "from purestep.loops.callbacks import ModelCheckpoint"
CALLBACKS_PAGE = os.path.join(ROOT, "docs", "callbacks_and_logging.md")
TRAINER_PAGE = os.path.join(ROOT, "docs", "trainer.md")


@PAGE.runs(END_TO_END)
def test_the_end_to_end_example_tests_and_predicts_from_the_best_checkpoint(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    PAGE.run(END_TO_END, ns)
    trainer, metrics, logits = ns["trainer"], ns["metrics"], ns["logits"]
    best = trainer.checkpoint_callback.best_model_path
    assert os.path.isfile(best) and "runs/blobs" in best
    out = capsys.readouterr().out
    assert best in out and "torch.Size([200, 2])" in out
    # the best file holds the lowest val_loss of all the epochs' validations
    scores = trainer.checkpoint_callback.best_k_models
    assert list(scores) == [best]
    assert float(trainer.checkpoint_callback.best_model_score) == pytest.approx(
        float(re.search(r"val_loss=([0-9.]+)\.ckpt", best).group(1)), abs=5e-4
    )
    # "the best epoch's weights": test and predict ran from that checkpoint, not the last state
    task = ns["Classifier"].load_from_checkpoint(best)
    model = task.model.eval()
    dm = ns["dm"]
    x = torch.stack([dm.test[i][0] for i in range(len(dm.test))])
    y = torch.stack([dm.test[i][1] for i in range(len(dm.test))])
    with torch.inference_mode():
        want = torch.cat([model(x[i : i + 100]) for i in range(0, len(x), 100)])
    assert logits.shape == (200, 2)
    assert torch.equal(logits, want)
    acc = (want.argmax(1) == y).float().mean()
    assert metrics["test_acc"] == pytest.approx(float(acc))
    assert metrics["test_loss"] == pytest.approx(float(F.cross_entropy(want, y)), rel=1e-5)
    best_epoch = int(re.search(r"epoch=(\d+)", best).group(1))
    if best_epoch != ns["state"].progress.epoch - 1:  # the last weights differ from the best
        final = ns["state"].params
        assert any(not torch.equal(final[k], v) for k, v in task.model.state_dict().items())


def _diagram_hooks(path: str) -> list[str]:
    """The hook names of the page's ``sequenceDiagram``, in order (notes and loops aside)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    (diagram,) = re.findall(r"^```mermaid\n(sequenceDiagram\n.*?)^```", text, re.S | re.M)
    return re.findall(r"^\s*\w+\s*->>\s*\w+\s*:\s*(\w+)\s*$", diagram, re.M)


def test_the_fit_events_diagram_is_the_order_a_callback_sees():
    """One batch per ``loop`` of the diagram: a fit of one epoch with one sanity batch, one
    training batch and one validation batch must announce exactly the diagram's hooks."""
    from torch.utils.data import DataLoader, TensorDataset

    from purestep import Trainer, optim
    from purestep.loops.callbacks import Callback
    from purestep.loops.events import EVENTS, FIT_EVENTS, NOTHING

    drawn = _diagram_hooks(CALLBACKS_PAGE)
    assert set(drawn) == set(FIT_EVENTS), set(drawn) ^ set(FIT_EVENTS)
    seen: list[str] = []

    def record(event):
        def handler(self, state, ctx):
            seen.append(event)
            return state, NOTHING

        return handler

    handlers = {e: record(e) for e in EVENTS if e != "on_exception"}
    recorder = type("Recorder", (Callback,), handlers)()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    data = TensorDataset(x, x.sum(1, keepdim=True))

    def loss_fn(apply, batch):
        return F.mse_loss(apply(batch[0]), batch[1])

    trainer = Trainer(
        max_epochs=1,
        limit_train_batches=1,
        limit_val_batches=1,
        num_sanity_val_steps=1,
        callbacks=[recorder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = DataLoader(data, batch_size=8)
    trainer.fit(torch.nn.Linear(4, 1), loss_fn, optim.sgd(0.1), loader, loader)
    assert seen == drawn


def _torch_rates(make, steps: int, lr: float) -> list[float]:
    """The learning rate of each of ``steps`` optimizer steps under torch's own scheduler."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    scheduler = make(opt)
    rates = []
    for _ in range(steps):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return rates


def _native_pairs(lr: float):
    from torch.optim import lr_scheduler as S

    from purestep.engine.optim import schedules as s

    return {
        "StepLR": (lambda o: S.StepLR(o, 5, 0.5), s.step(lr, 5, 0.5)),
        "MultiStepLR": (lambda o: S.MultiStepLR(o, [5, 12], 0.5), s.multistep(lr, [5, 12], 0.5)),
        "ExponentialLR": (lambda o: S.ExponentialLR(o, 0.9), s.exponential(lr, 0.9)),
        "ConstantLR": (
            lambda o: S.ConstantLR(o, 0.5, 4),
            s.join([s.constant(lr * 0.5), s.constant(lr)], [4]),
        ),
        "LinearLR": (lambda o: S.LinearLR(o, 0.1, 1.0, 10), s.linear(lr * 0.1, lr * 1.0, 10)),
        "PolynomialLR": (lambda o: S.PolynomialLR(o, 10, 1.0), s.linear(lr, 0.0, 10)),
        "CosineAnnealingLR": (
            lambda o: S.CosineAnnealingLR(o, 30, 0.001),
            s.cosine(lr, 30, 0.001),
        ),
        "CosineAnnealingWarmRestarts": (
            lambda o: S.CosineAnnealingWarmRestarts(o, 10),
            s.join([s.cosine(lr, 10)] * 3, [10, 20]),
        ),
        "OneCycleLR": (
            lambda o: S.OneCycleLR(o, lr, total_steps=30, three_phase=True),
            s.one_cycle(lr, 30, three_phase=True),
        ),
        "SequentialLR": (
            lambda o: S.SequentialLR(
                o, [S.LinearLR(o, 0.1, 1.0, 5), S.CosineAnnealingLR(o, 25)], [5]
            ),
            s.warmup_cosine(lr, 5, 30, init_value=lr * 0.1),
        ),
        "LambdaLR": (lambda o: S.LambdaLR(o, lambda k: 0.95**k), lambda k: lr * 0.95**k),
    }


@pytest.mark.parametrize("name", sorted(_native_pairs(0.1)))
def test_the_scheduler_table_s_native_equivalents_agree_with_torch_to_rounding(name):
    make, native = _native_pairs(0.1)[name]
    with open(TRAINER_PAGE, encoding="utf-8") as f:
        assert f"| `{name}" in f.read()  # the table has a row for it
    torch_rates = _torch_rates(make, 30, 0.1)
    native_rates = [native(k) for k in range(30)]
    for k, (a, b) in enumerate(zip(torch_rates, native_rates, strict=True)):
        assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15), (name, k, a, b)


def test_the_scheduler_table_s_as_is_rows_are_translated():
    """Every class the table passes as-is becomes a ``TorchSchedule`` (or the engine's
    ``ReduceLROnPlateau``); ``SWALR`` is refused."""
    from torch.optim import lr_scheduler as S

    from purestep.engine import optim

    for name, (make, _) in _native_pairs(0.1).items():
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        assert isinstance(optim.from_torch_scheduler(make(opt)), optim.TorchSchedule), name
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    plateau = optim.from_torch_scheduler(S.ReduceLROnPlateau(opt, patience=3))
    assert isinstance(plateau, optim.ReduceLROnPlateau) and plateau.patience == 3
    from torch.optim.swa_utils import SWALR

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    with pytest.raises(TypeError):
        optim.from_torch_scheduler(SWALR(opt, swa_lr=0.05))
