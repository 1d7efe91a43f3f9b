"""Tune the digits MLP with Optuna, K trials at a time trained as one vmapped ensemble.

Run from the repository root (needs the ``optuna`` and ``examples`` extras)::

    python examples/optuna_sweep.py                                 # 2 rounds of 8 trials
    python examples/optuna_sweep.py --storage sqlite:///sweep.db    # a study kept on disk

Each round asks the study for K trials (learning rate, momentum, weight decay) and trains
them together with ``loops.integrations.sweep``: the members of ``hardware.ensemble(K)``,
updated by ``hardware.member_sgd`` (each member's own values, one optimizer call for all).
A member whose trial the median pruner stops is told ``PRUNED`` at that validation; the
others are told their last validation loss. With ``--storage`` the study lives in that
database, so running the script again adds rounds to the same study. The best trial is
printed last.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import optuna
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from purestep.hardware import member_sgd
from purestep.loops.integrations import sweep

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import digits  # the digits data and split

QUIET = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
}


def loss_fn(apply, batch):
    x, y = batch
    return F.cross_entropy(apply(x), y)


def suggest(trial: optuna.trial.Trial) -> dict[str, float]:
    """A trial's hyper-parameters (the ranges stop short of chaotic training)."""
    return {
        "lr": trial.suggest_float("lr", 1e-3, 0.1, log=True),
        "momentum": trial.suggest_float("momentum", 0.5, 0.9),
        "weight_decay": trial.suggest_float("weight_decay", 1e-5, 1e-2, log=True),
    }


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=8, help="trials trained at once")
    parser.add_argument("--rounds", type=int, default=2, help="sweeps of k trials")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--storage", default=None, help="an Optuna RDB URL (sqlite:///x.db)")
    parser.add_argument("--study", default="digits-sweep", help="the study's name")
    args = parser.parse_args(argv)

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    study = optuna.create_study(
        study_name=args.study,
        storage=args.storage,
        load_if_exists=True,
        sampler=optuna.samplers.TPESampler(seed=len(optuna_trials(args))),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=args.k, n_warmup_steps=2),
    )
    train, val, _ = digits.splits(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))  # no dropout
    for r in range(args.rounds):
        result = sweep(
            study,
            args.k,
            suggest,
            net,
            loss_fn,
            member_sgd(),
            DataLoader(train, batch_size=32, shuffle=True),
            DataLoader(val, batch_size=256),
            max_epochs=args.epochs,
            **QUIET,
        )
        pruned = sum(state == optuna.trial.TrialState.PRUNED for state in result.states)
        done = [v for v in result.values if v is not None]
        best_now = f"{min(done):.4f}" if done else "-"  # every trial may have been pruned
        print(f"round {r}: {len(done)} trials told, {pruned} pruned, best {best_now}")
    best = study.best_trial
    values = " ".join(f"{name}={value:.4g}" for name, value in best.params.items())
    print(f"best_val_loss={best.value:.4f} trial={best.number} {values}")
    return best.value


def optuna_trials(args: argparse.Namespace) -> list:
    """The trials the study holds already (none for a new or in-memory study): seeds the
    sampler differently when a stored study is continued."""
    if args.storage is None:
        return []
    try:
        return optuna.load_study(study_name=args.study, storage=args.storage).trials
    except KeyError:  # no such study yet
        return []


if __name__ == "__main__":
    main()
