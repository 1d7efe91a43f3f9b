"""``TrainState.loop``: the loops' state is a field, and checkpoints from before it still resume.

A checkpoint written before the field existed holds a ``TrainState`` with no ``loop`` field
and the loop state in ``extra["loop"]``. The tests build such a file from a checkpoint of
today's run (the encoded state with the field removed and the loop state moved back into
``extra``), and check that it decodes, that the loops move the loop state to its place, and
that a run resumed from it ends bitwise like the uninterrupted run.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from purestep.engine import checkpoint, optim, tree
from purestep.engine.checkpoint import files
from purestep.loops import LoopState, Trainer, aggregate, loop_state
from purestep.loops.callbacks import ModelCheckpoint
from purestep.loops.driver import Driver
from purestep.loops.events import Requests
from tests.helpers import mlp
from tests.helpers import sign_data as _data

pytestmark = pytest.mark.bitwise

#: The parts of a state that a resumed run must end with bit for bit (the callbacks' states
#: hold the checkpoint folder's paths, which differ between the two runs).
_COMPARED = ("params", "buffers", "opt_state", "progress", "rng", "grad_accum", "loop")


def _loss(apply, batch):
    """Cross-entropy, and the accuracy averaged over the epoch (so that a checkpoint cut
    mid-epoch holds epoch accumulators)."""
    x, y = batch
    logits = apply(x)
    acc = (logits.argmax(-1) == y).float().mean()
    return F.cross_entropy(logits, y), {"acc": aggregate.log(acc, on_step=False, on_epoch=True)}


def _fit(root, *, ckpt_path=None, max_epochs=3):
    saver = ModelCheckpoint(dirpath=str(root), every_n_train_steps=3, save_top_k=-1)
    trainer = Trainer(
        max_epochs=max_epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[saver],
        default_root_dir=str(root),
    )
    train = DataLoader(_data(), batch_size=8, shuffle=True)
    val = DataLoader(_data(16, 1), batch_size=8)
    state = trainer.fit(mlp(), _loss, optim.adam(1e-2), train, val, ckpt_path=ckpt_path)
    return trainer, state


def _as_written_before_the_field(state, metadata, path, *, prefix: bool = True):
    """Write ``state`` as a checkpoint from before ``TrainState.loop``: the loop state in
    ``extra["loop"]`` and no ``loop`` field in the encoded ``TrainState`` (``prefix=False``:
    classes named as before the package was called purestep, ``loops.loop_state:...``)."""
    old = state.replace(loop=None, extra={**state.extra, "loop": state.loop})
    payload = files.serialize(old, metadata)
    encoded = payload["state"]
    assert encoded["type"] == "purestep.engine.state:TrainState"
    del encoded["data"]["loop"]
    if not prefix:
        _strip_prefix(encoded)
    files.write_payload(payload, str(path))


def _strip_prefix(node):
    if isinstance(node, dict):
        if node.get("__kind__") == "struct":
            node["type"] = node["type"].removeprefix("purestep.")
        for value in node.values():
            _strip_prefix(value)
    elif isinstance(node, list):
        for value in node:
            _strip_prefix(value)


def _assert_same_run(a, b):
    for name in _COMPARED:
        tree.assert_trees_equal(getattr(a, name), getattr(b, name))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    _, state = _fit(root)
    return root, state


def test_a_fresh_state_has_no_loop_state_until_a_loop_fills_it_in():
    from purestep import engine

    state = engine.init(mlp(), optim.adam(1e-2))
    assert state.loop is None
    ready = loop_state.ready(state)
    assert isinstance(ready.loop, LoopState) and ready.extra == {}
    assert loop_state.ready(ready) is ready  # already in place: the same state
    driver = Driver(fn="fit")
    stopped = driver.carry_out(state, Requests(stop=True))
    assert stopped.loop.should_stop and state.loop is None


def test_a_finished_run_keeps_its_loop_state_in_the_field(uninterrupted):
    _, state = uninterrupted
    assert isinstance(state.loop, LoopState) and "loop" not in state.extra
    assert {"train_acc", "val_loss"} <= set(state.loop.callback_metrics)


@pytest.mark.parametrize("prefix", [True, False], ids=["purestep", "before-the-package-name"])
def test_a_checkpoint_from_before_the_field_decodes_with_its_loop_state_in_extra(
    tmp_path, uninterrupted, prefix
):
    root, _ = uninterrupted
    state, meta = checkpoint.load(str(root / "epoch=1-step=6.ckpt"))
    assert state.progress.batch_in_epoch == 2  # cut mid-epoch: accumulators are open
    assert state.loop.train_epoch and state.loop.train_specs
    legacy = tmp_path / "legacy.ckpt"
    _as_written_before_the_field(state, meta, legacy, prefix=prefix)
    loaded, _ = checkpoint.load(str(legacy))
    assert loaded.loop is None  # the missing field takes its default
    assert isinstance(loaded.extra["loop"], LoopState)
    moved = loop_state.ready(loaded)
    assert "loop" not in moved.extra
    tree.assert_trees_equal(moved.loop, state.loop)


def test_a_run_resumed_from_a_checkpoint_from_before_the_field_ends_bitwise_the_same(
    tmp_path, uninterrupted
):
    root, expected = uninterrupted
    state, meta = checkpoint.load(str(root / "epoch=1-step=6.ckpt"))
    legacy = tmp_path / "legacy.ckpt"
    _as_written_before_the_field(state, meta, legacy)
    trainer, resumed = _fit(tmp_path / "resumed", ckpt_path=str(legacy))
    _assert_same_run(resumed, expected)
    assert "loop" not in resumed.extra
    assert trainer.callback_metrics.keys() == expected.loop.callback_metrics.keys()


def test_a_stop_requested_before_the_field_existed_is_still_honoured(tmp_path, uninterrupted):
    """A checkpoint whose loop state asked to stop: resumed from today's layout and from the
    old one, the run does the same (it finishes the cut epoch, then stops)."""
    root, _ = uninterrupted
    state, meta = checkpoint.load(str(root / "epoch=1-step=6.ckpt"))
    stopping = state.replace(loop=state.loop.replace(should_stop=True))
    today, legacy = tmp_path / "today.ckpt", tmp_path / "legacy.ckpt"
    checkpoint.save(stopping, str(today), metadata=meta)
    _as_written_before_the_field(stopping, meta, legacy)
    _, from_today = _fit(tmp_path / "a", ckpt_path=str(today))
    _, from_legacy = _fit(tmp_path / "b", ckpt_path=str(legacy))
    assert from_legacy.loop.should_stop
    assert from_legacy.progress.epoch < 3  # it stopped before max_epochs
    _assert_same_run(from_legacy, from_today)


def test_the_deprecated_get_and_put_still_work():
    from purestep import engine

    state = engine.init(mlp(), optim.adam(1e-2))
    with pytest.deprecated_call():
        loop = loop_state.get(state)
    with pytest.deprecated_call():
        state = loop_state.put(state, loop.replace(callback_metrics={"x": torch.tensor(1.0)}))
    assert float(state.loop.callback_metrics["x"]) == 1.0


def test_the_field_comes_last_so_positional_construction_keeps_its_meaning():
    from purestep.engine.state import Progress, TrainState

    state = TrainState({}, {}, None, Progress(), 0, {}, None, None, {"k": 1})
    assert state.extra == {"k": 1} and state.loop is None


def test_a_ddp_save_of_a_state_no_loop_has_run_on_gathers_empty_accumulators():
    """``Trainer.save_checkpoint`` may meet a state straight from ``engine.init`` (a fit that
    failed before its loop ran): under several processes the rank accumulators of a fresh
    loop state are gathered, not an error."""
    from types import SimpleNamespace

    from purestep.engine import init
    from purestep.loops.resume import RANK_ACCUMULATORS, Checkpointing

    strategy = SimpleNamespace(
        world_size=2, is_primary=True, all_gather_object=lambda obj: [obj, obj]
    )
    saver = Checkpointing(strategy=strategy, loggers=(), config=None, root_dir=".")
    state = init(mlp(), optim.sgd(0.1), seed=0)
    assert state.loop is None
    saved = saver._with_rank_accumulators(state)
    assert saved.extra[RANK_ACCUMULATORS] == {"world_size": 2, "train_epoch": [{}, {}]}
