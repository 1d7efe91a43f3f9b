"""A 16-trial Optuna sweep as one vmapped run (``integrations.sweep()``) against 16 Trainer runs.

Run from the repository root::

    .venv/bin/python benchmarks/sweep.py           # full run, about a minute and a half
    .venv/bin/python benchmarks/sweep.py --quick   # smoke run, a few seconds

The digits model of ``examples/digits.py`` (an MLP 64-128-10 on scikit-learn's 8x8 digits,
its 60 / 20 % train / validation split, batch 32) without its dropout layer (an ensemble
draws dropout masks differently from a single run, so with dropout the trials would agree
only statistically), SGD with the three hyper-parameters Optuna picks per trial (learning
rate, momentum, weight decay), ``EPOCHS`` epochs, validation at every epoch end. The 16
parameter sets come from one ``RandomSampler(seed=0)`` study over learning rates 1e-3..0.1
(log), momenta 0.5..0.9 and weight decays 1e-5..1e-2 (log); each side runs them on a fresh
study of its own (``study.enqueue_trial``). The space stops short of chaotic training: with
learning rates up to 0.3 one trial (0.22, momentum 0.73) amplified the rounding differences
between vmapped and separate kernels to 95 times the tolerance below within 5 epochs, while
the others stayed under 3 % of it.

* sequential: ``study.optimize`` over 16 trials, each one ``Trainer.fit`` with
  ``optim.inject_hyperparams(optim.sgd)`` and ``OptunaPruning`` (a ``NopPruner``: nothing
  is pruned, so every side trains everything);
* ensemble: one ``sweep(study, 16, ..., member_sgd(), ...)``: the 16 trials as the members
  of ``hardware.ensemble(16)`` in one ``Trainer.fit``, SGD applied to all members in one
  broadcasting call;
* ensemble_grouped (informative): the same sweep with ``inject_hyperparams(optim.sgd)``
  (``hardware.ensemble(16, hparams=...)``), whose optimizer the ensemble runs once per
  distinct set of hyper-parameters (``hardware.member_optim.step``: 16 calls here).

Every side starts every trial from the same weights and data order. After the timed calls
each ensemble side's told values and final parameters are compared with the sequential
runs: they must agree to the ensemble's stated tolerance (values to ``rtol=1e-5``; each
parameter tensor within ``1e-5 * max|b| + 1e-6``), and the largest differences are printed.
Threads: ``torch.set_num_threads(1)`` as the other benchmarks. Timing:
``_harness.interleaved_calls`` (one whole sweep per side per round, the sides alternating; a
warm-up call of each first: the first vmapped cross-entropy imports sympy, about half a
second). The last line is ``speedup=<sequential / ensemble>
speedup_grouped=<sequential / ensemble_grouped>``, each the median over rounds of the ratio
of the two sides' whole-sweep times in that round (``_harness.paired``: a round a background
job slowed down slows every side of it), on a shared machine steadier than the ratio of the
medians, which is printed too.

What limits the speedup on a CPU (see ``benchmarks/ensemble.py`` for the step itself): a
plain digits step costs about 0.3 ms, almost all of it per-op overhead, and the vmapped
forward and backward of 16 members about 2 ms, so the ensemble saves the Trainer's per-run
costs (setup, data loading, validation and logging once instead of 16 times) and part of
the forward and backward passes. The grouped optimizer costs what the 16 separate runs'
optimizers cost (about two thirds of that side's time): ``member_sgd`` exists for that.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import optuna
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from purestep.engine import optim
from purestep.hardware import member_sgd
from purestep.loops import Trainer
from purestep.loops.integrations import sweep
from purestep.loops.integrations.optuna_pruning import OptunaPruning

try:
    import _harness
except ImportError:  # run as ``python -m benchmarks.sweep``
    from benchmarks import _harness

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
)
import digits
import optuna_sweep

K = 16
BATCH = 32
FULL = (10, 5)  # epochs, timed rounds
QUICK = (1, 1)
# the example's trainer flags, loss and search space
QUIET = {**optuna_sweep.QUIET}
loss_fn = optuna_sweep.loss_fn
suggest = optuna_sweep.suggest


def parameter_sets() -> list[dict[str, float]]:
    """The 16 trials' hyper-parameters (a seeded random sampler)."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    return [suggest(study.ask()) for _ in range(K)]


def fresh_study(params: list[dict[str, float]]) -> optuna.Study:
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    for p in params:
        study.enqueue_trial(p)
    return study


class Sides:
    """Both sides over the same model template, data and trials."""

    def __init__(self, epochs: int) -> None:
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        (tx, ty), (vx, vy), _ = digits.load(0)
        self.train = TensorDataset(tx, ty)
        self.val = TensorDataset(vx, vy)
        self.epochs = epochs
        self.params = parameter_sets()
        self.results: dict[str, tuple[list[float], list[dict]]] = {}

    def loaders(self) -> tuple[DataLoader, DataLoader]:
        return DataLoader(self.train, batch_size=BATCH, shuffle=True), DataLoader(
            self.val, batch_size=256
        )

    def sequential(self, study: optuna.Study) -> None:
        finals: list[dict] = []

        def objective(trial: optuna.trial.Trial) -> float:
            opt = optim.inject_hyperparams(optim.sgd)(**suggest(trial))
            trainer = Trainer(max_epochs=self.epochs, callbacks=[OptunaPruning(trial)], **QUIET)
            state = trainer.fit(self.net, loss_fn, opt, *self.loaders(), seed=0)
            finals.append(dict(state.params))
            return float(trainer.callback_metrics["val_loss"])

        study.optimize(objective, n_trials=K)
        self.results["sequential"] = ([t.value for t in study.trials], finals)

    def ensemble(self, study: optuna.Study) -> None:
        """One sweep with ``member_sgd``: one optimizer call for all members."""
        self._sweep("ensemble", study, member_sgd())

    def ensemble_grouped(self, study: optuna.Study) -> None:
        """One sweep with ``inject_hyperparams(optim.sgd)``: one optimizer call per trial."""
        opt = optim.inject_hyperparams(optim.sgd)(lr=0.1, momentum=0.9, weight_decay=1e-4)
        self._sweep("ensemble_grouped", study, opt)

    def _sweep(self, name: str, study: optuna.Study, opt: optim.GradientTransformation) -> None:
        result = sweep(
            study,
            K,
            suggest,
            self.net,
            loss_fn,
            opt,
            *self.loaders(),
            max_epochs=self.epochs,
            **QUIET,
        )
        finals = [dict(result.member(i).params) for i in range(K)]
        self.results[name] = (list(result.values), finals)


def compare(results: dict, side: str) -> tuple[float, float]:
    """The largest relative differences between ``side`` and the sequential runs, of the told
    values (``|a - b| / |b|``) and of the final parameters (``max|a - b| / max|b|`` per
    tensor), after checking the stated bounds."""
    seq_values, seq_params = results["sequential"]
    ens_values, ens_params = results[side]
    worst_value = max(abs(a - b) / abs(b) for a, b in zip(ens_values, seq_values))
    worst_param = 0.0
    for i in range(K):
        for name, want in seq_params[i].items():
            got = ens_params[i][name]
            diff = float((got - want).abs().max())
            bound = 1e-5 * float(want.abs().max()) + 1e-6
            if diff > bound:
                raise AssertionError(
                    f"{side}, trial {i}: {name} differs by {diff:.3g} from the sequential run "
                    f"(bound {bound:.3g})"
                )
            worst_param = max(worst_param, diff / float(want.abs().max()))
    if worst_value > 1e-5:
        raise AssertionError(f"{side}: the told values differ by up to {worst_value:.3g}")
    return worst_value, worst_param


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one epoch, one round (smoke run)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    args = parser.parse_args()
    epochs, rounds = QUICK if args.quick else FULL
    torch.set_num_threads(args.threads)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    t0 = time.perf_counter()
    sides = Sides(epochs)
    calls = {
        name: (lambda: fresh_study(sides.params), getattr(sides, name))
        for name in ("sequential", "ensemble", "ensemble_grouped")
    }
    for prepare, run in calls.values():  # warm-up (imports, first vmapped kernels)
        run(prepare())
    samples = _harness.interleaved_calls(calls, rounds)
    worst = {side: compare(sides.results, side) for side in ("ensemble", "ensemble_grouped")}
    steps = epochs * -(-len(sides.train) // BATCH)
    print(
        f"torch {torch.__version__}, optuna {optuna.__version__}, {torch.get_num_threads()} "
        f"thread(s); K={K} trials of the digits MLP 64-128-10, SGD (lr, momentum, weight "
        f"decay per trial), batch {BATCH}, {epochs} epoch(s) = {steps} steps per trial, "
        f"validation every epoch; {rounds} round(s)"
    )
    med = {name: statistics.median(v) for name, v in samples.items()}
    for name, v in samples.items():
        print(
            f"  {name:18s} {med[name]:7.3f} s per sweep of {K} trials  "
            f"({med[name] / (K * steps) * 1e3:6.3f} ms per trial-step; min {min(v):.3f} "
            f"max {max(v):.3f})"
        )
    for side, (worst_value, worst_param) in worst.items():
        print(
            f"  per trial, {side} vs sequential: told values differ by at most "
            f"{worst_value:.2e} (relative), final parameters by at most {worst_param:.2e} "
            "(relative to max|p|)"
        )
    print(f"total {time.perf_counter() - t0:.0f} s")
    if args.quick:
        print("--quick: a smoke run; its figures are too short to mean anything")
    seq = samples["sequential"]
    print(
        f"  speedup (median of the whole-sweep times): ensemble "
        f"{med['sequential'] / med['ensemble']:.2f}, ensemble_grouped "
        f"{med['sequential'] / med['ensemble_grouped']:.2f}"
    )
    print(
        f"speedup={_harness.paired(seq, samples['ensemble']):.3f} "
        f"speedup_grouped={_harness.paired(seq, samples['ensemble_grouped']):.3f}"
    )


if __name__ == "__main__":
    main()
