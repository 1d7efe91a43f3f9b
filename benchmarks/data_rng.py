"""What scoping the global random streams per sample costs the data path.

Run from the repository root::

    .venv/bin/python benchmarks/data_rng.py           # full run, about half a minute
    .venv/bin/python benchmarks/data_rng.py --quick   # smoke run, a few seconds

The data: a map-style dataset of 4096 rows of 8 floats whose ``__getitem__`` adds
``torch.rand(8)`` (a cheap augmentation, so the overhead is visible). Two sides iterate one
epoch of ``loops.data.source(dataset, batch_size=32, shuffle=True)`` in the main process:
``scoped`` (the default: torch's CPU generator, ``random`` and numpy seeded per sample from
its key, the caller's states saved and restored once per batch) and ``plain``
(``scope_sample_rng=False``). Timing: ``_harness.interleaved``, the sides in rotating order,
one epoch per block, medians over rounds. The ``_w`` sides read through one persistent
DataLoader worker, where nothing is restored after a batch (the worker's streams serve only
the data path). The last line is ``ratio=<scoped / plain per sample, main process>
overhead_us=<scoped - plain, us per sample> worker_overhead_us=<the same in a worker>``.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy  # noqa: F401 - imported, so its global stream is scoped as in a real run
import torch
from torch.utils.data import Dataset

from purestep.loops.data import source

try:
    import _harness
except ImportError:  # run as ``python -m benchmarks.data_rng``
    from benchmarks import _harness


class Jittered(Dataset):
    def __init__(self, n: int) -> None:
        self.x = torch.randn(n, 8, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i] + torch.rand(8)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few rounds (smoke run)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    n, rounds = (512, 3) if args.quick else (4096, 15)
    ds = Jittered(n)
    worker = {"num_workers": 1, "persistent_workers": True}
    sides = {
        "scoped": source(ds, batch_size=32, shuffle=True, seed=1),
        "plain": source(ds, batch_size=32, shuffle=True, seed=1, scope_sample_rng=False),
        "scoped_w": source(ds, batch_size=32, shuffle=True, seed=1, **worker),
        "plain_w": source(
            ds, batch_size=32, shuffle=True, seed=1, scope_sample_rng=False, **worker
        ),
    }

    def epoch(batches):
        return lambda: sum(1 for _ in batches.iterate(0))

    for b in sides.values():  # warm up: the loaders are built on the first epoch
        epoch(b)()
    samples = _harness.interleaved({k: epoch(b) for k, b in sides.items()}, rounds, 1)
    print(f"[{rounds} rounds, {n} samples per epoch] median (min..max) us per sample")
    for name, values in samples.items():
        print(f"  {name:8s} {_harness.summary(values, 1e6 / n, 2)}")
    ratio = statistics.median(s / p for s, p in zip(samples["scoped"], samples["plain"]))

    def overhead(scoped: str, plain: str) -> float:
        us = (statistics.median(samples[scoped]) - statistics.median(samples[plain])) / n * 1e6
        return max(us, 0.001)

    if args.quick:
        print("--quick: a smoke run; its figures are too short to mean anything")
    print(
        f"ratio={ratio:.3f} overhead_us={overhead('scoped', 'plain'):.2f} "
        f"worker_overhead_us={overhead('scoped_w', 'plain_w'):.2f}"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
