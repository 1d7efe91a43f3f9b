"""Start-up time of the command line: ``python -m purestep fit --help`` against ``import torch``.

Run from the repository root::

    .venv/bin/python benchmarks/cli_startup.py                    # full run, about a minute
    .venv/bin/python benchmarks/cli_startup.py --quick            # smoke run, about 10 s
    .venv/bin/python benchmarks/cli_startup.py --cached-bytecode  # as an installed package runs

Every side is a fresh Python process (``subprocess.run`` of ``sys.executable``, output
discarded), timed from its start to its exit by this process's clock; the CPU seconds
(user + system) of each call are read from ``getrusage(RUSAGE_CHILDREN)`` too, a steadier
figure when other jobs share the machine:

* torch: ``python -c "import torch"``, what every purestep command pays at least;
* torch_frozen: ``import torch`` as ``python -m purestep`` imports it (the garbage collector
  paused for the import, the objects then frozen: see ``__main__.py``), the floor under the
  same treatment, so ``help - torch_frozen`` is what purestep itself adds;
* import: ``python -c "import purestep.loops.command_line"``, the command line's modules,
  before a parser exists (a plain import: no garbage-collector treatment);
* help: ``python -m purestep fit --help``, the parser of the ``fit`` subcommand built (the
  Trainer's flags from its signature, the model, the data, the callbacks and the loggers
  with their known subclasses) and its help printed;
* print_config: ``python -m purestep fit --model.class_path bench_task.Regression
  --data.class_path bench_task.Data --print_config``, a tiny task and data module (written
  into a temporary folder, the processes' working folder) named by class path, parsed,
  instantiated and printed as YAML: what a command that runs pays before its run starts.

Bytecode: by default the processes inherit this environment as it is. Where
``PYTHONDONTWRITEBYTECODE`` is set (as on the project's shared machines) nothing caches
purestep's bytecode, so every process compiles each purestep module it imports from source
(torch's and the other installed packages' bytecode was cached by their installer).
``--cached-bytecode`` gives the processes a private ``PYTHONPYCACHEPREFIX`` (a temporary
folder) with bytecode writing on, as an installed package runs; the untimed warm-up call of
each side fills it (the first one compiles torch too, which takes a while).

Timing: ``_harness.interleaved_calls``, one call per side per round, the order of the sides
rotating from round to round (a background job on the shared machine falls on every side
alike), after one untimed warm-up call of each side (the page cache; ``--quick`` skips it).
Per side: median (min..max) over rounds. The last line is ``help_s=<median help>
torch_import_s=<median torch> overhead_s=<help - torch> ratio=<help / torch>``, the ratio a
paired median (the median over rounds of each round's ratio). ``overhead_s`` is negative
when ``fit --help`` ends sooner than a bare ``import torch``: it pays no full garbage
collection over torch's objects (about 0.4 s here, at the import and at the exit), which
more than makes up for purestep's own modules and the parser.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

try:
    import resource
except ImportError:  # not on Unix: no CPU times of the children
    resource = None

try:
    import _harness
except ImportError:  # run as ``python -m benchmarks.cli_startup``
    from benchmarks import _harness

FULL_ROUNDS = 9
QUICK_ROUNDS = 1

#: the user's module the print_config side names by class path
TASK_MODULE = textwrap.dedent(
    """
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from purestep import optim
    from purestep.loops import DataModule, Task


    class Regression(Task):
        def __init__(self, hidden: int = 4, lr: float = 0.1):
            super().__init__(hparams={"hidden": hidden, "lr": lr})
            self.hidden, self.lr = hidden, lr

        def configure_model(self):
            hidden = self.hidden
            return torch.nn.Sequential(torch.nn.Linear(3, hidden), torch.nn.Linear(hidden, 1))

        def configure_optimizers(self):
            return optim.sgd(self.lr)

        def training_step(self, apply, batch):
            x, y = batch
            return torch.nn.functional.mse_loss(apply(x), y)


    class Data(DataModule):
        def __init__(self, n: int = 32, batch_size: int = 8):
            self.n, self.batch_size = n, batch_size

        def train_dataloader(self):
            x = torch.randn(self.n, 3, generator=torch.Generator().manual_seed(0))
            return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=self.batch_size)
    """
)

COMMANDS = {
    "torch": ["-c", "import torch"],
    "torch_frozen": ["-c", "import gc; gc.disable(); import torch; gc.freeze(); gc.enable()"],
    "import": ["-c", "import purestep.loops.command_line"],
    "help": ["-m", "purestep", "fit", "--help"],
    "print_config": [
        "-m",
        "purestep",
        "fit",
        "--model.class_path",
        "bench_task.Regression",
        "--data.class_path",
        "bench_task.Data",
        "--print_config",
    ],
}


def call(args: list[str], cwd: str, env: dict[str, str], cpu: list[float]) -> None:
    """Run ``python *args`` to its end and append its CPU seconds (user + system, all its
    threads) to ``cpu``; a failing command stops the benchmark."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN) if resource is not None else None
    done = subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=300,
    )
    if done.returncode != 0:
        raise RuntimeError(f"python {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    if before is not None:
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)


paired = _harness.paired


def paired_difference(a: list[float], b: list[float]) -> float:
    """The median over rounds of ``a - b``."""
    return statistics.median(x - y for x, y in zip(a, b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one round, no warm-up (smoke run)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 9)")
    parser.add_argument(
        "--cached-bytecode",
        action="store_true",
        help="cache the processes' bytecode in a private folder (as an installed package runs)",
    )
    args = parser.parse_args()
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else FULL_ROUNDS)
    t0 = time.perf_counter()

    with tempfile.TemporaryDirectory(prefix="cli_startup_") as folder:
        with open(os.path.join(folder, "bench_task.py"), "w", encoding="utf-8") as f:
            f.write(TASK_MODULE)
        env = dict(os.environ)
        if args.cached_bytecode:
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            env["PYTHONPYCACHEPREFIX"] = os.path.join(folder, "pycache")
        bytecode = (
            f"cached in {env['PYTHONPYCACHEPREFIX']}"
            if args.cached_bytecode
            else "not written (PYTHONDONTWRITEBYTECODE is set): purestep compiles its sources "
            "in every process"
            if env.get("PYTHONDONTWRITEBYTECODE")
            else "as this environment caches it"
        )
        print(
            f"python {sys.version.split()[0]} ({sys.executable}); {os.cpu_count()} CPUs; "
            f"{rounds} rounds; purestep's bytecode: {bytecode}"
        )
        cpu: dict[str, list[float]] = {name: [] for name in COMMANDS}
        sides = {
            name: (lambda: None, lambda _, a=argv, c=cpu[name]: call(a, folder, env, c))
            for name, argv in COMMANDS.items()
        }
        if not args.quick or args.cached_bytecode:
            for _, run in sides.values():  # warm-up: page cache (and bytecode cache)
                run(None)
            for c in cpu.values():
                c.clear()
        times = _harness.interleaved_calls(sides, rounds)

    print(f"\n[one fresh process per call] {rounds} rounds, median (min..max) in s")
    med = {name: statistics.median(v) for name, v in times.items()}
    for name, v in times.items():
        extra = "" if name == "torch" else f"   ({med[name] - med['torch']:+.3f} s against torch)"
        print(f"  {name:13s} {_harness.summary(v, 1.0, 3)} s{extra}")
    if all(cpu.values()):
        print("[CPU seconds of the same calls] user + system, median (min..max)")
        cpu_med = {name: statistics.median(v) for name, v in cpu.items()}
        for name, v in cpu.items():
            extra = "" if name == "torch" else f"   ({cpu_med[name] - cpu_med['torch']:+.3f} s)"
            print(f"  {name:13s} {_harness.summary(v, 1.0, 3)} s{extra}")
    help_s, torch_s = med["help"], med["torch"]
    ratio = paired(times["help"], times["torch"])
    own = paired_difference(times["help"], times["torch_frozen"])
    print(
        f"  fit --help: {help_s - torch_s:+.3f} s against a bare import torch (help / torch "
        f"{ratio:.3f}, paired median); purestep's own share, against torch_frozen: "
        f"{own:+.3f} s (paired median of the differences)"
    )
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if args.quick:
        print("--quick: a smoke run; its figures are too few to mean much")
    print(
        f"help_s={help_s:.3f} torch_import_s={torch_s:.3f} overhead_s={help_s - torch_s:.3f} "
        f"ratio={ratio:.3f}"
    )


if __name__ == "__main__":
    main()
