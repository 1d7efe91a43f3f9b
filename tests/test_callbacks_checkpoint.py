import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from purestep import engine
from purestep.engine import optim
from purestep.loops.callbacks import ModelCheckpoint, init_states
from purestep.loops.config import LoopConfig
from purestep.loops.events import Context, dispatch
from tests.helpers import mlp


class Run:
    """Drives one ModelCheckpoint through events like the fit loop would."""

    def __init__(self, cb, *, config=None, existing=(), val_batches=1):
        self.cb = cb
        self.config = config or LoopConfig.create(max_epochs=10)
        self.files = set(existing)
        self.state = init_states([cb], engine.init(mlp(), optim.sgd(0.1)))
        self.val_batches = val_batches
        self.saved, self.removed, self.linked = [], [], []

    def fire(
        self, event, *, epoch=0, step=0, metrics=None, stage="train", fn="fit", num_batches=None
    ):
        progress = self.state.progress.replace(epoch=epoch, step=step)
        self.state = self.state.replace(progress=progress)
        ctx = Context(
            stage=stage,
            fn=fn,
            state=self.state,
            metrics={k: torch.tensor(v) for k, v in (metrics or {}).items()},
            config=self.config,
            log_dir="/runs/v0",
            exists=self.files.__contains__,
            extra={"num_val_batches": self.val_batches},
            num_batches=num_batches,
        )
        self.state, req = dispatch(event, [self.cb], self.state, ctx)
        for path in (*req.save, *req.save_weights):
            self.files.add(path)
            self.saved.append(path)
        for target, link in req.link:
            self.linked.append((target, link))
            self.files.add(link)
        for path in req.remove:
            self.files.discard(path)
            self.removed.append(path)
        return req

    @property
    def cb_state(self):
        return self.state.callbacks[self.cb.key]


def _names(paths):
    return [p.rsplit("/", 1)[-1] for p in paths]


def test_default_saves_at_epoch_end_keeps_the_latest_and_names_by_epoch_and_step():
    run = Run(ModelCheckpoint())
    run.fire("on_fit_start")
    for epoch in range(3):
        run.fire("on_train_epoch_end", epoch=epoch, step=(epoch + 1) * 4)
    assert _names(run.saved) == [
        "epoch=0-step=4.ckpt",
        "epoch=1-step=8.ckpt",
        "epoch=2-step=12.ckpt",
    ]
    assert _names(run.removed) == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"]
    assert run.saved[0].startswith("/runs/v0/checkpoints/")
    assert run.cb_state["best_model_path"].endswith("epoch=2-step=12.ckpt")


def test_top_k_keeps_the_best_scores_as_lightning_does():
    # the notes' example: values 5, 3, 4, 2, 6 with top-2 in min mode keep 3 and 2
    run = Run(ModelCheckpoint(monitor="val_loss", save_top_k=2, filename="{epoch}-{val_loss:.2f}"))
    run.fire("on_fit_start")
    for epoch, value in enumerate([5.0, 3.0, 4.0, 2.0, 6.0]):
        run.fire("on_train_epoch_end", epoch=epoch, step=epoch + 1, metrics={"val_loss": value})
    assert sorted(_names(run.files)) == ["epoch=1-val_loss=3.00.ckpt", "epoch=3-val_loss=2.00.ckpt"]
    state = run.cb_state
    assert state["best_model_path"].endswith("epoch=3-val_loss=2.00.ckpt")
    assert state["best_model_score"] == 2.0
    assert state["kth_value"] == 3.0


@given(
    st.lists(st.floats(-10, 10, allow_nan=False, width=32), min_size=1, max_size=12),
    st.sampled_from([-1, 1, 2, 3]),
    st.sampled_from(["min", "max"]),
)
def test_top_k_files_are_the_k_best_scores(values, k, mode):
    run = Run(ModelCheckpoint(monitor="m", save_top_k=k, mode=mode, filename="{epoch}"))
    run.fire("on_fit_start")
    for epoch, value in enumerate(values):
        run.fire("on_train_epoch_end", epoch=epoch, step=epoch + 1, metrics={"m": value})
    kept = sorted(int(n.removesuffix(".ckpt").split("=")[1]) for n in _names(run.files))
    # Brute force over an insertion-ordered list: a new value enters while fewer than k
    # are kept, or when strictly better than the worst kept one (the first of equal worst
    # ones leaves).
    best: list[tuple[int, float]] = []
    for epoch, value in enumerate(values):
        if k == -1 or len(best) < k:
            best.append((epoch, value))
            continue
        worst = max(v for _, v in best) if mode == "min" else min(v for _, v in best)
        if (value < worst) if mode == "min" else (value > worst):
            best.remove(next(item for item in best if item[1] == worst))
            best.append((epoch, value))
    assert kept == sorted(e for e, _ in best)


def test_never_twice_at_one_step_never_before_the_first_step_and_not_in_sanity():
    run = Run(ModelCheckpoint(every_n_train_steps=1))
    run.fire("on_fit_start")
    run.fire("on_train_batch_end", step=0)
    run.fire("on_train_batch_end", step=1)
    run.fire("on_train_batch_end", step=1)
    run.fire("on_train_batch_end", step=2, stage="sanity_check")
    run.fire("on_train_batch_end", step=2, fn="validate")
    assert _names(run.saved) == ["epoch=0-step=1.ckpt"]


def test_every_n_train_steps_and_save_last():
    run = Run(ModelCheckpoint(every_n_train_steps=3, save_top_k=-1, save_last=True))
    run.fire("on_fit_start")
    for step in range(1, 10):
        run.fire("on_train_batch_end", step=step, epoch=(step - 1) // 2)
    names = _names(run.saved)
    assert names == [
        "epoch=1-step=3.ckpt",
        "last.ckpt",
        "epoch=2-step=6.ckpt",
        "last.ckpt",
        "epoch=4-step=9.ckpt",
        "last.ckpt",
    ]
    assert run.removed == []  # last.ckpt is replaced in place, top-k keeps all
    assert run.cb_state["last_model_path"].endswith("last.ckpt")


def test_save_last_link_points_at_the_latest_save():
    run = Run(ModelCheckpoint(every_n_train_steps=1, save_last="link"))
    run.fire("on_fit_start")
    run.fire("on_train_batch_end", step=1)
    assert _names(run.saved) == ["epoch=0-step=1.ckpt"]
    assert [(t.rsplit("/", 1)[-1], link.rsplit("/", 1)[-1]) for t, link in run.linked] == [
        ("epoch=0-step=1.ckpt", "last.ckpt")
    ]


def test_existing_files_get_version_suffixes():
    existing = {
        "/runs/v0/checkpoints/epoch=0-step=2.ckpt",
        "/runs/v0/checkpoints/epoch=0-step=2-v1.ckpt",
    }
    run = Run(ModelCheckpoint(), existing=existing)
    run.fire("on_fit_start")
    run.fire("on_train_epoch_end", step=2)
    assert _names(run.saved) == ["epoch=0-step=2-v2.ckpt"]


def test_filename_templates_follow_lightning():
    cb = ModelCheckpoint(filename="{epoch}-{val_loss:.2f}-{missing}")
    assert cb.format_name({"epoch": 3, "val_loss": 0.1234}) == "epoch=3-val_loss=0.12-missing=0"
    cb = ModelCheckpoint(filename="{epoch:03d}_{epoch_test}")
    assert cb.format_name({"epoch": 5, "epoch_test": 7}) == "epoch=005_epoch_test=7"
    cb = ModelCheckpoint(filename="{epoch}-{val_loss:.1f}", auto_insert_metric_name=False)
    assert cb.format_name({"epoch": 3, "val_loss": 2.0}) == "3-2.0"


def test_validation_end_saves_when_validation_is_not_once_per_epoch():
    config = LoopConfig.create(max_epochs=3, val_check_interval=0.5)
    run = Run(ModelCheckpoint(monitor="val_loss"), config=config)
    run.fire("on_fit_start")
    run.fire("on_train_epoch_end", step=4, metrics={"val_loss": 1.0})
    assert run.saved == []
    run.fire("on_validation_end", step=2, metrics={"val_loss": 1.0})
    run.fire("on_validation_end", step=4, metrics={"val_loss": 0.5})
    assert _names(run.saved) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]


def test_a_missing_monitor_saves_nothing_and_says_so():
    run = Run(ModelCheckpoint(monitor="val_acc"))
    run.fire("on_fit_start")
    req = run.fire("on_train_epoch_end", step=1, metrics={"val_loss": 1.0})
    assert run.saved == []
    assert "found no such metric" in req.messages[0]


def test_nan_scores_rank_last():
    run = Run(ModelCheckpoint(monitor="m", save_top_k=1))
    run.fire("on_fit_start")
    run.fire("on_train_epoch_end", step=1, metrics={"m": float("nan")})
    assert run.cb_state["best_model_score"] == math.inf
    run.fire("on_train_epoch_end", step=2, epoch=1, metrics={"m": 3.0})
    assert run.cb_state["best_model_score"] == 3.0


def test_weights_only_and_on_exception_and_train_end():
    run = Run(
        ModelCheckpoint(
            save_weights_only=True, save_on_exception=True, save_last=True, every_n_epochs=5
        )
    )
    run.fire("on_fit_start")
    req = run.fire("on_exception", step=3)
    assert req.save_weights and not req.save
    run2 = Run(ModelCheckpoint(save_last=True, every_n_epochs=5))
    run2.fire("on_fit_start")
    run2.fire("on_train_end", step=4)
    assert _names(run2.saved) == ["last.ckpt"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "avg"}, "mode must be"),
        ({"save_top_k": -2}, "save_top_k"),
        ({"save_top_k": 3}, "needs a monitor"),
        ({"every_n_train_steps": 2, "every_n_epochs": 1}, "mutually exclusive"),
        ({"save_last": "yes"}, "save_last"),
        ({"train_time_interval": "soon"}, "train_time_interval"),
    ],
)
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelCheckpoint(**kwargs)


def test_state_round_trips_through_a_safe_load(tmp_path):
    run = Run(ModelCheckpoint(monitor="m", save_top_k=2))
    run.fire("on_fit_start")
    run.fire("on_train_epoch_end", step=1, metrics={"m": 1.0})
    path = tmp_path / "s.pt"
    torch.save(run.cb_state, path)
    assert torch.load(path, weights_only=True) == run.cb_state


def test_save_on_exception_saves_whatever_the_score():
    run = Run(ModelCheckpoint(monitor="m", save_on_exception=True, save_top_k=1))
    run.fire("on_fit_start")
    run.fire("on_train_epoch_end", step=1, metrics={"m": 0.1})
    run.fire("on_exception", step=2, metrics={"m": 9.0})  # worse than the best: saved anyway
    assert _names(run.saved) == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"]
    assert run.cb_state["best_model_score"] == pytest.approx(0.1)  # top-k left alone


def test_the_state_names_files_relative_to_the_folder():
    run = Run(ModelCheckpoint(monitor="m", save_top_k=2, save_last=True))
    run.fire("on_fit_start")
    run.fire("on_train_epoch_end", step=1, metrics={"m": 1.0})
    state = run.cb_state
    assert "dirpath" not in state
    assert state["best_k_models"] == {"epoch=0-step=1.ckpt": 1.0}
    assert state["best_model_path"] == "epoch=0-step=1.ckpt"
    assert state["last_model_path"] == "last.ckpt"
    assert run.saved == [
        "/runs/v0/checkpoints/epoch=0-step=1.ckpt",
        "/runs/v0/checkpoints/last.ckpt",
    ]
    assert run.cb.full_path(state["best_model_path"], "/runs/v0") == run.saved[0]


def test_a_resumed_run_with_a_new_folder_starts_its_bookkeeping_afresh():
    first = Run(ModelCheckpoint(dirpath="/a"))
    first.fire("on_fit_start")
    first.fire("on_train_epoch_end", step=2)
    second = Run(ModelCheckpoint(dirpath="/b"))
    second.state = second.state.replace(callbacks=first.state.callbacks)
    req = second.fire("on_fit_start")
    assert "starting its bookkeeping afresh" in req.messages[0]
    state = second.cb_state
    assert state == second.cb.init()
    second.fire("on_train_epoch_end", epoch=1, step=4)
    assert second.removed == []  # nothing of /a's is deleted


def test_a_resumed_run_whose_files_are_in_its_folder_keeps_its_bookkeeping():
    first = Run(ModelCheckpoint(dirpath="/a"))
    first.fire("on_fit_start")
    first.fire("on_train_epoch_end", step=2)
    moved = {p.replace("/a/", "/b/") for p in first.files}
    second = Run(ModelCheckpoint(dirpath="/b"), existing=moved)
    second.state = second.state.replace(callbacks=first.state.callbacks)
    assert second.fire("on_fit_start").messages == ()
    second.fire("on_train_epoch_end", epoch=1, step=4)
    assert second.removed == ["/b/epoch=0-step=2.ckpt"]


def test_save_last_link_needs_a_local_folder():
    run = Run(ModelCheckpoint(dirpath="memory://x", save_last="link"))
    with pytest.raises(ValueError, match="needs a local folder"):
        run.fire("on_fit_start")


def test_own_names_follow_the_template_and_stay_in_the_folder():
    cb = ModelCheckpoint(filename="{epoch:03d}-{val_loss:.2f}")
    assert cb.owns("epoch=003-val_loss=0.51.ckpt") and cb.owns("epoch=003-val_loss=0.51-v2.ckpt")
    assert cb.owns("last.ckpt") and cb.owns("last-v1.ckpt")
    for bad in (
        "epoch=1-step=2.ckpt",
        "/abs/last.ckpt",
        "../last.ckpt",
        "x/last.ckpt",
        "epoch=../../x-val_loss=1.ckpt",
        ".last.ckpt",
        "last.ckpt\x00",
        "",
        3,
    ):
        assert not cb.owns(bad), bad


def test_a_state_with_full_paths_from_before_is_read_as_names():
    run = Run(
        ModelCheckpoint(monitor="m", save_top_k=1),
        existing={"/runs/v0/checkpoints/epoch=0-step=1.ckpt"},
    )
    old = {
        **run.cb.init(),
        "dirpath": "/runs/v0/checkpoints",
        "best_k_models": {"/runs/v0/checkpoints/epoch=0-step=1.ckpt": 2.0},
        "kth_best_model_path": "/runs/v0/checkpoints/epoch=0-step=1.ckpt",
        "kth_value": 2.0,
        "best_model_path": "/runs/v0/checkpoints/epoch=0-step=1.ckpt",
        "best_model_score": 2.0,
    }
    run.state = run.state.replace(callbacks={**run.state.callbacks, run.cb.key: old})
    assert run.fire("on_fit_start").messages == ()
    assert run.cb_state["best_k_models"] == {"epoch=0-step=1.ckpt": 2.0}
    assert "dirpath" not in run.cb_state
    run.fire("on_train_epoch_end", epoch=1, step=2, metrics={"m": 1.0})
    assert run.removed == ["/runs/v0/checkpoints/epoch=0-step=1.ckpt"]


def test_a_crafted_kth_entry_is_recomputed_from_the_kept_ones():
    run = Run(ModelCheckpoint(monitor="m", save_top_k=1), existing={"/runs/v0/checkpoints/a.ckpt"})
    crafted = {
        **run.cb.init(),
        "best_k_models": {"epoch=0-step=1.ckpt": 2.0, "/etc/passwd": 9.0},
        "kth_best_model_path": "/etc/passwd",
        "kth_value": 9.0,
        "best_model_path": "/etc/passwd",
    }
    run.files.add("/runs/v0/checkpoints/epoch=0-step=1.ckpt")
    run.state = run.state.replace(callbacks={**run.state.callbacks, run.cb.key: crafted})
    req = run.fire("on_fit_start")
    assert "ignoring 1 restored path(s)" in req.messages[0] and "/etc/passwd" in req.messages[0]
    state = run.cb_state
    assert state["kth_best_model_path"] == state["best_model_path"] == "epoch=0-step=1.ckpt"
    assert state["kth_value"] == state["best_model_score"] == 2.0


def test_a_missing_monitor_is_an_error_once_a_validation_has_run():
    """Lightning's rule: before any validation a missing monitor is said once per fit;
    after a validation that ran batches (not the sanity check) it is an error listing the
    available metrics."""
    run = Run(ModelCheckpoint(monitor="val_accuracy"))
    run.fire("on_fit_start")
    first = run.fire("on_train_epoch_end", step=1, metrics={"train_loss": 1.0})
    again = run.fire("on_train_epoch_end", step=2, epoch=1, metrics={"train_loss": 1.0})
    assert len(first.messages) == 1 and not again.messages and run.saved == []
    val = {"metrics": {"val_loss": 1.0}, "num_batches": [2]}
    run.fire("on_validation_end", step=2, stage="sanity_check", **val)
    run.fire("on_validation_end", step=3, stage="validate", metrics=val["metrics"], num_batches=[0])
    run.fire("on_train_epoch_end", step=3, epoch=2, metrics={"val_loss": 1.0})  # no error yet
    run.fire("on_validation_end", step=4, stage="validate", **val)
    with pytest.raises(RuntimeError, match=r"val_accuracy.*\['epoch', 'step', 'val_loss'\]"):
        run.fire("on_train_epoch_end", step=4, epoch=3, metrics={"val_loss": 1.0})


def test_epoch_and_step_are_monitor_candidates():
    run = Run(ModelCheckpoint(monitor="step", mode="max", save_top_k=2))
    run.fire("on_fit_start")
    for step in (1, 2, 3):
        run.fire("on_train_epoch_end", step=step, epoch=step - 1)
    assert sorted(run.cb_state["best_k_models"].values()) == [2.0, 3.0]


def test_the_bookkeeping_attributes_read_the_bound_view_only():
    cb = ModelCheckpoint(monitor="val_loss", save_top_k=2, save_last=True)
    assert (cb.best_model_path, cb.best_model_score, cb.best_k_models) == ("", None, {})
    assert (cb.last_model_path, cb.kth_best_model_path, cb.current_score) == ("", "", None)
    assert cb.kth_value == torch.tensor(math.inf)
    run = Run(cb)
    run.fire("on_fit_start")
    for step, loss in ((1, 3.0), (2, 1.0), (3, 2.0)):
        run.fire("on_train_epoch_end", step=step, epoch=step - 1, metrics={"val_loss": loss})
    assert cb.best_model_path == ""  # nothing bound: the run's state is not read
    cb.bind_view(lambda: (run.cb_state, "/runs/v0"))
    folder = "/runs/v0/checkpoints/"
    assert cb.best_model_path == folder + "epoch=1-step=2.ckpt"
    assert cb.best_model_score == torch.tensor(1.0) and isinstance(
        cb.best_model_score, torch.Tensor
    )
    assert cb.best_k_models == {
        folder + "epoch=1-step=2.ckpt": torch.tensor(1.0),
        folder + "epoch=2-step=3.ckpt": torch.tensor(2.0),
    }
    assert cb.kth_best_model_path == folder + "epoch=2-step=3.ckpt"
    assert cb.kth_value == torch.tensor(2.0) and cb.current_score == torch.tensor(2.0)
    assert cb.last_model_path == folder + "last.ckpt"
    with pytest.raises(AttributeError):
        cb.best_model_path = "/elsewhere.ckpt"  # a view, never an input
