"""Sweeps as one vmapped run: K Optuna trials trained as the members of one ensemble.

Each trial's result is compared with a single ``Trainer`` run with that trial's
hyper-parameters, to the ensemble's stated tolerance (``docs/strategies.md``: every floating
tensor within ``1e-5 * max|b| + 1e-6``, losses to ``rtol=1e-5``; vmapped kernels do not
promise the accumulation order of separate ones). Pruning runs against real Optuna pruners.
"""

from __future__ import annotations

import math
import os

import optuna
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from purestep import hardware
from purestep.engine import optim, tree
from purestep.hardware import member_sgd
from purestep.loops import Trainer
from purestep.loops.callbacks.base import Callback
from purestep.loops.events import NOTHING
from purestep.loops.integrations import prune_members, sweep
from tests.docs_book import PAGE
from tests.helpers import mlp, sign_data, sign_loss

optuna.logging.set_verbosity(optuna.logging.WARNING)
TrialState = optuna.trial.TrialState
QUIET = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}
EPOCHS = 3


def _data():
    return (
        DataLoader(sign_data(48, 0), batch_size=16, shuffle=True),
        DataLoader(sign_data(32, 1), batch_size=16),
    )


def _sgd():
    return optim.inject_hyperparams(optim.sgd)(lr=0.1, momentum=0.9, weight_decay=1e-4)


def suggest(trial):
    return {
        "lr": trial.suggest_float("lr", 1e-4, 0.3, log=True),
        "momentum": trial.suggest_float("momentum", 0.5, 0.95),
        "weight_decay": trial.suggest_float("weight_decay", 1e-5, 1e-2, log=True),
    }


def _study(pruner=None, params=()):
    study = optuna.create_study(
        sampler=optuna.samplers.RandomSampler(seed=0), pruner=pruner or optuna.pruners.NopPruner()
    )
    for p in params:
        study.enqueue_trial(p)
    return study


def test_member_sgd_mixes_trials_with_and_without_momentum():
    params = [
        {"lr": 0.1, "momentum": 0.0, "weight_decay": 0.0},
        {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3},
    ]

    def space(trial):
        return {
            "lr": trial.suggest_float("lr", 1e-3, 0.3),
            "momentum": trial.suggest_float("momentum", 0.0, 0.95),
            "weight_decay": trial.suggest_float("weight_decay", 0.0, 1e-2),
        }

    study = _study(params=params)
    result = sweep(
        study, 2, space, mlp(), sign_loss, member_sgd(), *_data(), max_epochs=EPOCHS, **QUIET
    )
    for i, hparams in enumerate(params):
        state, seen = _single(hparams)
        assert result.values[i] == pytest.approx(seen[-1], rel=1e-5)
        for name, want in state.params.items():
            assert _close(result.member(i).params[name], want), (i, name)


def test_member_sgd_refuses_bad_values_and_other_hyperparameters():
    with pytest.raises(ValueError, match=r"member_sgd\(lr=-1\) must be a finite number >= 0"):
        member_sgd(lr=-1)
    with pytest.raises(ValueError, match=r"does not keep \['betas'\].*member_sgd\(\)"):
        _sweep(_study(), opt=member_sgd(), fn=lambda trial: {"betas": 0.9})


def _single(hparams: dict, seed: int = 0):
    """One plain Trainer run with these hyper-parameters: (final state, trainer, val values)."""
    from purestep.loops.callbacks import Callback
    from purestep.loops.events import NOTHING, Stage

    seen = []

    class Record(Callback):
        def on_validation_end(self, state, ctx):
            if ctx.stage != Stage.SANITY_CHECK:
                seen.append(float(ctx.metrics["val_loss"]))
            return state, NOTHING

    trainer = Trainer(max_epochs=EPOCHS, callbacks=[Record()], **QUIET)
    train, val = _data()
    opt = optim.inject_hyperparams(optim.sgd)(**hparams)
    state = trainer.fit(mlp(), sign_loss, opt, train, val, seed=seed)
    return state, seen


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The ensemble's stated bound: ``|a - b| <= 1e-5 * max|b| + 1e-6``."""
    return bool((a - b).abs().max() <= 1e-5 * b.abs().max() + 1e-6)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("opt", ["injected", "member_sgd"])
def test_each_trial_is_the_single_run_with_its_hyperparameters(opt):
    """Both optimizers a sweep takes: ``inject_hyperparams(optim.sgd)`` (one call per
    trial) and ``member_sgd`` (one broadcasting call); the single runs use ``optim.sgd``."""
    k = 4
    study = _study()
    tx = _sgd() if opt == "injected" else member_sgd()
    result = sweep(
        study, k, suggest, mlp(), sign_loss, tx, *_data(), max_epochs=EPOCHS, seed=3, **QUIET
    )
    assert result.states == (TrialState.COMPLETE,) * k
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * k
    assert len({t.params["lr"] for t in study.trials}) == k
    for i, frozen in enumerate(study.trials):
        hparams = {n: v[i] for n, v in result.hparams.items()}
        assert hparams == pytest.approx(frozen.params)
        state, seen = _single(hparams, seed=3)
        assert list(frozen.intermediate_values) == list(range(EPOCHS))
        assert list(frozen.intermediate_values.values()) == pytest.approx(seen, rel=1e-5)
        assert frozen.value == result.values[i] == pytest.approx(seen[-1], rel=1e-5)
        member = result.member(i)
        assert tree.trees_equal(member.progress, state.progress)
        for name, want in state.params.items():
            assert _close(member.params[name], want), (i, name)


@pytest.mark.timeout(60)
def test_members_are_pruned_mid_run_and_the_rest_complete():
    """A threshold pruner: the members whose learning rate is too small to move the loss
    below 1.0 by epoch 1 are pruned there; the others train on and are told their value."""
    slow = {"lr": 1e-4, "momentum": 0.5, "weight_decay": 1e-5}
    fast = {"lr": 0.3, "momentum": 0.9, "weight_decay": 1e-5}
    pruner = optuna.pruners.ThresholdPruner(upper=1.0, n_warmup_steps=1)
    study = _study(pruner, [slow, fast, slow, fast])
    result = sweep(
        study, 4, suggest, mlp(), sign_loss, _sgd(), *_data(), max_epochs=EPOCHS, **QUIET
    )
    want = (TrialState.PRUNED, TrialState.COMPLETE) * 2
    assert result.states == want
    assert tuple(t.state for t in study.trials) == want
    for i, frozen in enumerate(study.trials):
        if i % 2 == 0:
            assert list(frozen.intermediate_values) == [0, 1]  # pruned at epoch 1
            assert result.values[i] is None
            # Optuna gives a pruned trial its last intermediate value
            assert frozen.value == frozen.intermediate_values[1] > 1.0
        else:
            assert list(frozen.intermediate_values) == list(range(EPOCHS))
            assert frozen.value == result.values[i] == frozen.intermediate_values[EPOCHS - 1]
            assert frozen.value < 1.0
    # the pruned members trained on (ignored, not frozen): their results are just not used
    assert result.state.progress.epoch == EPOCHS


def test_the_fit_stops_when_every_member_is_pruned():
    pruner = optuna.pruners.ThresholdPruner(upper=0.0)  # every loss is above 0
    study = _study(pruner)
    result = sweep(study, 2, suggest, mlp(), sign_loss, _sgd(), *_data(), max_epochs=5, **QUIET)
    assert result.states == (TrialState.PRUNED,) * 2
    assert [list(t.intermediate_values) for t in study.trials] == [[0], [0]]
    assert result.state.progress.epoch == 1  # stopped after the first validation


def test_trials_asked_beforehand_and_a_one_member_sweep():
    study = _study()
    (trial,) = [study.ask()]
    result = sweep(
        study, 1, suggest, mlp(), sign_loss, _sgd(), *_data(), trials=[trial], max_epochs=1, **QUIET
    )
    assert result.trials == (trial,)
    assert study.trials[0].state == TrialState.COMPLETE
    assert study.trials[0].value == result.values[0]


# --------------------------------------------------------------------------- errors


def _sweep(study, k=2, opt=None, fn=suggest, **kwargs):
    flags = {"max_epochs": 1, **QUIET, **kwargs}
    return sweep(study, k, fn, mlp(), sign_loss, opt or _sgd(), *_data(), **flags)


def test_a_hyperparameter_the_optimizer_does_not_keep_is_an_error_and_fails_the_trials():
    study = _study()
    missing = r"does not keep \['momentum', 'weight_decay'\].*inject_hyperparams"
    with pytest.raises(ValueError, match=missing):
        _sweep(study, opt=optim.inject_hyperparams(optim.adam)(lr=1e-3))
    assert [t.state for t in study.trials] == [TrialState.FAIL] * 2
    with pytest.raises(ValueError, match=r"does not keep \['lr', 'momentum', 'weight_decay'\]"):
        _sweep(_study(), opt=optim.sgd(0.1, momentum=0.9))


def test_a_monitor_never_logged_is_an_error_and_fails_the_trials():
    study = _study()
    with pytest.raises(RuntimeError, match=r"logged no 'val_acc/0'.*val_loss"):
        _sweep(study, monitor="val_acc")
    assert [t.state for t in study.trials] == [TrialState.FAIL] * 2


class RaiseAt(Callback):
    """Raises ``error`` when training epoch ``epoch`` starts."""

    def __init__(self, epoch: int, error: BaseException) -> None:
        self.epoch, self.error = epoch, error

    def on_train_epoch_start(self, state, ctx):
        if ctx.epoch == self.epoch:
            raise self.error
        return state, NOTHING


def test_an_error_after_a_member_was_pruned_fails_the_others_and_is_raised():
    slow = {"lr": 1e-4, "momentum": 0.5, "weight_decay": 1e-5}
    fast = {"lr": 0.3, "momentum": 0.9, "weight_decay": 1e-5}
    pruner = optuna.pruners.ThresholdPruner(upper=1.0, n_warmup_steps=1)
    study = _study(pruner, [slow, fast])
    boom = RaiseAt(2, RuntimeError("boom in epoch 2"))  # after epoch 1's pruning
    with pytest.raises(RuntimeError, match="boom in epoch 2"):
        _sweep(study, max_epochs=EPOCHS, callbacks=[boom])
    assert [t.state for t in study.trials] == [TrialState.PRUNED, TrialState.FAIL]


def test_an_interrupted_sweep_fails_its_open_trials_instead_of_telling_partial_values():
    study = _study()
    with pytest.raises(KeyboardInterrupt):
        _sweep(study, max_epochs=EPOCHS, callbacks=[RaiseAt(1, KeyboardInterrupt())])
    assert [t.state for t in study.trials] == [TrialState.FAIL] * 2


def test_a_nan_value_is_what_optuna_stores_fail():
    def explode(trial):
        return {"lr": 1e9, "momentum": 0.9, "weight_decay": 0.0}

    study = _study()
    with pytest.warns(UserWarning, match="nan"):
        result = _sweep(study, fn=explode, max_epochs=2)
    assert result.states == (TrialState.FAIL,) * 2 == tuple(t.state for t in study.trials)
    assert result.values == (None, None)


def test_several_validation_loaders_monitor_one_of_them():
    train, val = _data()
    other = DataLoader(sign_data(32, 2), batch_size=16)
    study = _study()
    result = sweep(
        study,
        2,
        suggest,
        mlp(),
        sign_loss,
        _sgd(),
        train,
        [val, other],
        monitor="val_loss/dataloader_idx_1",
        max_epochs=1,
        **QUIET,
    )
    logged = result.trainer.callback_metrics
    assert result.values == tuple(float(logged[f"val_loss/{i}/dataloader_idx_1"]) for i in (0, 1))
    assert result.values != tuple(float(logged[f"val_loss/{i}/dataloader_idx_0"]) for i in (0, 1))


def test_the_base_strategy_sets_the_members_precision():
    result = _sweep(_study(), base=hardware.single_device("cpu", "64-true"))
    assert result.member(0).params["0.weight"].dtype == torch.float64
    assert result.states == (TrialState.COMPLETE,) * 2


def test_an_injected_sgd_built_without_momentum_cannot_take_suggested_momenta():
    study = _study()
    with pytest.raises(ValueError, match="built with momentum=0"):
        _sweep(
            study, opt=optim.inject_hyperparams(optim.sgd)(lr=0.1, momentum=0.0, weight_decay=0.0)
        )
    assert [t.state for t in study.trials] == [TrialState.FAIL] * 2


def test_bad_arguments_are_clear_errors():
    study = _study()
    with pytest.raises(ValueError, match="trials holds 1 trials for a sweep of k=2"):
        _sweep(study, trials=[study.ask()])
    with pytest.raises(ValueError, match="must be an int >= 1"):
        _sweep(study, k=0)
    with pytest.raises(TypeError, match="builds the ensemble strategy itself"):
        _sweep(study, strategy="ddp")
    with pytest.raises(TypeError, match="must be an optuna.Study"):
        _sweep("study")
    with pytest.raises(ValueError, match="one objective"):
        _sweep(optuna.create_study(directions=["minimize", "maximize"]))


def test_bad_suggestions_are_clear_errors():
    with pytest.raises(TypeError, match="must return a non-empty dict"):
        _sweep(_study(), fn=lambda trial: None)
    numbers = iter([{"lr": 0.1}, {"lr": 0.1, "momentum": 0.5}])
    with pytest.raises(ValueError, match="every member of one ensemble needs the same"):
        _sweep(_study(), fn=lambda trial: next(numbers))
    with pytest.raises(ValueError, match="lr=nan; it must be a finite number"):
        _sweep(_study(), fn=lambda trial: {"lr": math.nan})
    momenta = iter([0.0, 0.9])
    with pytest.raises(ValueError, match="momentum 0 to some trials"):
        _sweep(_study(), fn=lambda trial: {"momentum": next(momenta)})


# --------------------------------------------------------------------------- bookkeeping


@given(st.lists(st.lists(st.booleans(), min_size=3, max_size=3), min_size=1, max_size=6))
def test_pruning_bookkeeping(rounds):
    """Over any sequence of per-member decisions: a member is pruned at the first round its
    trial says so while it runs, stays pruned, is announced exactly once, and the fit stops
    exactly when every member is pruned."""
    pruned = (False,) * 3
    announced: list[int] = []
    for decisions in rounds:
        before = pruned
        pruned, now, stop = prune_members(pruned, decisions)
        assert all(a or not b for a, b in zip(pruned, before))  # stays pruned
        assert set(now) == {i for i in range(3) if decisions[i] and not before[i]}
        assert stop == all(pruned)
        announced += now
    assert sorted(announced) == [i for i in range(3) if pruned[i]]
    assert len(announced) == len(set(announced))
    first = {i: next((r for r, d in enumerate(rounds) if d[i]), None) for i in range(3)}
    assert pruned == tuple(first[i] is not None for i in range(3))


def test_pruning_bookkeeping_checks_its_lengths():
    with pytest.raises(ValueError, match="2 decisions for 3 members"):
        prune_members((False,) * 3, (True, False))


# --------------------------------------------------------------------------- the docs page

PRUNING_BLOCK = "# Optuna pruning: one trial is one Trainer.fit"
RESTART_BLOCK = "# A study that survives being killed"
SWEEP_BLOCK = "# A sweep: K trials as one vmapped run"


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.xdist_group("processes")
@PAGE.runs(PRUNING_BLOCK, RESTART_BLOCK, SWEEP_BLOCK)
def test_the_hyperparameter_search_page_runs(capsys):
    """The page's three blocks in order (each builds on the names of the ones before)."""
    ns: dict = {}
    PAGE.run(PRUNING_BLOCK, ns)
    study = ns["study"]
    assert len(study.trials) == 6
    for trial in study.trials:
        assert trial.state in (TrialState.COMPLETE, TrialState.PRUNED)
        steps = list(trial.intermediate_values)
        assert steps == list(range(len(steps)))
        if trial.state == TrialState.COMPLETE:
            assert steps == [0, 1, 2, 3] and trial.value == trial.intermediate_values[3]
    assert str(study.best_params) in capsys.readouterr().out

    PAGE.run(RESTART_BLOCK, ns)
    restartable = optuna.load_study(study_name="search", storage="sqlite:///study.db")
    assert [t.state for t in restartable.trials] == [TrialState.COMPLETE] * 2
    assert os.path.isdir("runs/study/trial_0") and os.path.isdir("runs/study/trial_1")

    PAGE.run(SWEEP_BLOCK, ns)
    result, study = ns["result"], ns["study"]
    assert len(study.trials) == 8
    assert result.states == tuple(t.state for t in study.trials)
    for i, trial in enumerate(study.trials):
        if trial.state == TrialState.COMPLETE:
            assert result.values[i] == trial.value == trial.intermediate_values[3]
        else:
            assert result.values[i] is None and list(trial.intermediate_values)[-1] >= 1


def test_the_example_continues_its_stored_study_and_prints_the_best_trial(
    monkeypatch, tmp_path, capsys
):
    """examples/optuna_sweep.py over an sqlite study, run twice: the second run adds its
    trials to the same study, every trial ends told or pruned, and the line printed last
    is the study's best trial."""
    pytest.importorskip("sklearn")
    import runpy

    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
    monkeypatch.syspath_prepend(examples)
    main = runpy.run_path(os.path.join(examples, "optuna_sweep.py"))["main"]
    storage = f"sqlite:///{tmp_path / 'sweep.db'}"
    args = ["--k", "4", "--rounds", "1", "--epochs", "3", "--storage", storage]
    main(args)
    best = main(args)
    study = optuna.load_study(study_name="digits-sweep", storage=storage)
    assert len(study.trials) == 8
    assert {t.state for t in study.trials} <= {TrialState.COMPLETE, TrialState.PRUNED}
    assert best == study.best_value < math.log(10)  # below chance (ten classes)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(f"best_val_loss={best:.4f} trial={study.best_trial.number} lr=")
