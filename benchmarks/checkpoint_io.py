"""Save and load of a ~200 MB ``TrainState``: ``engine.checkpoint`` against plain ``torch.save``.

Run from the repository root::

    .venv/bin/python benchmarks/checkpoint_io.py           # full run, about fifteen seconds
    .venv/bin/python benchmarks/checkpoint_io.py --quick   # smoke run, a few seconds
    .venv/bin/python benchmarks/checkpoint_io.py --fsync   # both sides also fsync the file

The state: an MLP of four ``Linear(2048, 2048)`` layers (16.8 M float32 parameters) with
Adam's state (first and second moments) after one real step, so the ``TrainState`` holds
about 201 MB of tensors (MB = 1e6 bytes) plus its counters and key. Both sides write the
same tensors to the same folder (a temporary folder on the filesystem of the system's
temporary directory, or ``--dir``):

* ours: ``engine.checkpoint.save(state, path)`` (the codec's plain-data encoding plus
  metadata, ``torch.save`` into a hidden temporary file, then an atomic rename) and
  ``engine.checkpoint.load(path)`` (``torch.load(weights_only=True)`` plus decoding back to
  a ``TrainState``);
* plain: ``torch.save(flat, path)`` and ``torch.load(path, weights_only=True)`` of a flat
  dict ``{path string: tensor}`` of the very same tensors (no metadata, no rename).

Before timing, both files are loaded once and compared with the state bitwise. Saves go to a
fresh path each time (the previous file is removed before the call, untimed); loads read
the same file again and again, so they are served from the OS page cache, and saves end
when the data is in the page cache (neither side asks for an fsync unless ``--fsync``):
these are the times a training process is blocked, not the disk's own speed. What a load
returns is freed after its timing stops. Before every call the C allocator's free memory is
handed back to the OS (``_harness.release_free_memory``), so every load faults in fresh
pages for its 200 MB as a freshly started process does; without it, a load runs at one of
two speeds (about 50 or 130 ms here) depending on what the previous call left in the
allocator, on both sides alike, and the medians jump between them.

For information, ``engine.checkpoint.AsyncCheckpointer`` is timed too: how long ``save``
blocks the caller (the snapshot; CPU tensors are not copied, since a step never writes into
its input state), and how long until ``wait()`` returns.

Threads: ``torch.set_num_threads(1)``. Timing: ``_harness.interleaved_calls``, the four
sides (save ours / save plain / load ours / load plain) in rotating order, one call each
per round, medians over rounds. The last line is ``save_ratio=<ours / plain>
load_ratio=<ours / plain>``, ratios of times (above 1: ours is slower), each the paired
median: the median over rounds of that round's ours / plain, which a background job that
slows a whole round does not move (the ratio of the two medians is printed too).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from purestep import engine
from purestep.engine import checkpoint, optim, tree

try:
    import _harness
except ImportError:  # run as ``python -m benchmarks.checkpoint_io``
    from benchmarks import _harness

# (layer width, layers, rounds, async repetitions); then --quick's
FULL = (2048, 4, 11, 5)
QUICK = (256, 4, 2, 1)


def build_state(width: int, layers: int) -> engine.TrainState:
    """The MLP's state after one Adam step (so the moments are real numbers, not zeros)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

    def loss_fn(apply: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(apply(batch), batch)

    state = engine.init(model, optim.adam(1e-3), seed=0)
    step = engine.train_step(model, loss_fn, optim.adam(1e-3), donate=True)
    state, _ = step(state, torch.randn(8, width))
    return state


def flat_tensors(state: Any) -> dict[str, torch.Tensor]:
    return {p: v for p, v in tree.flatten_with_paths(state) if isinstance(v, torch.Tensor)}


def plain_save(flat: dict[str, torch.Tensor], path: str, fsync: bool) -> None:
    if not fsync:
        torch.save(flat, path)
        return
    with open(path, "wb") as f:
        torch.save(flat, f)
        f.flush()
        os.fsync(f.fileno())


def fresh(path: str) -> str:
    """``path`` with any previous file there removed (untimed preparation of a save)."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
    _harness.release_free_memory()
    return path


def existing(path: str) -> str:
    """``path`` as it is (untimed preparation of a load)."""
    _harness.release_free_memory()
    return path


def verify(state: Any, flat: dict[str, torch.Tensor], ours: str, plain: str) -> None:
    loaded, _ = checkpoint.load(ours)
    tree.assert_trees_equal(loaded, state)
    back = torch.load(plain, weights_only=True)
    if back.keys() != flat.keys() or not all(torch.equal(back[k], flat[k]) for k in flat):
        raise AssertionError("the plain file does not hold the state's tensors")


def time_async(state: Any, path: str, reps: int) -> tuple[list[float], list[float]]:
    """Seconds ``AsyncCheckpointer.save`` blocked, and seconds until ``wait()`` returned."""
    saver = checkpoint.AsyncCheckpointer()
    blocked, total = [], []
    try:
        for _ in range(reps):
            fresh(path)
            gc.collect()
            t0 = time.perf_counter()
            saver.save(state, path)
            t1 = time.perf_counter()
            saver.wait()
            t2 = time.perf_counter()
            blocked.append(t1 - t0)
            total.append(t2 - t0)
    finally:
        saver.close()
    return blocked, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a ~3 MB state (smoke run)")
    parser.add_argument("--fsync", action="store_true", help="both sides fsync the file")
    parser.add_argument("--dir", default=None, help="where to write (default: the temp dir)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    width, layers, rounds, async_reps = QUICK if args.quick else FULL
    state = build_state(width, layers)
    flat = flat_tensors(state)
    nbytes = _harness.storage_bytes(flat.values())
    mb = nbytes / 1e6
    with tempfile.TemporaryDirectory(prefix="checkpoint_io_", dir=args.dir) as folder:
        paths = {
            name: os.path.join(folder, name)
            for name in ("save_ours.ckpt", "save_plain.pt", "load_ours.ckpt", "load_plain.pt")
        }
        checkpoint.save(state, paths["load_ours.ckpt"])
        torch.save(flat, paths["load_plain.pt"])
        verify(state, flat, paths["load_ours.ckpt"], paths["load_plain.pt"])
        sizes = {k: os.path.getsize(p) / 1e6 for k, p in paths.items() if k.startswith("load")}
        print(
            f"torch {torch.__version__}, {torch.get_num_threads()} thread, python "
            f"{sys.version.split()[0]}; MLP {layers} x Linear({width}, {width}) + Adam state: "
            f"{len(flat)} tensors, {mb:.1f} MB; files: ours {sizes['load_ours.ckpt']:.1f} MB, "
            f"plain {sizes['load_plain.pt']:.1f} MB, in {folder}"
            f"{' (fsync on)' if args.fsync else ''}; both files load back bitwise equal"
        )
        fsync = args.fsync
        sides = {
            "save ours": (
                lambda: fresh(paths["save_ours.ckpt"]),
                lambda p: checkpoint.save(state, p, fsync=fsync),
            ),
            "save plain": (
                lambda: fresh(paths["save_plain.pt"]),
                lambda p: plain_save(flat, p, fsync),
            ),
            "load ours": (lambda: existing(paths["load_ours.ckpt"]), checkpoint.load),
            "load plain": (
                lambda: existing(paths["load_plain.pt"]),
                lambda p: torch.load(p, weights_only=True),
            ),
        }
        for prepare, run in sides.values():  # warm-up
            run(prepare())
        times = _harness.interleaved_calls(sides, rounds)
        print(f"\n[{rounds} rounds] median (min..max) ms per call, and MB/s at the median")
        med = {}
        for name, v in times.items():
            med[name] = statistics.median(v)
            print(f"  {name:10s} {_harness.summary(v, 1e3)} ms  {mb / med[name]:8.0f} MB/s")
        save_ratio = med["save ours"] / med["save plain"]
        load_ratio = med["load ours"] / med["load plain"]
        paired_save = statistics.median(
            a / b for a, b in zip(times["save ours"], times["save plain"])
        )
        paired_load = statistics.median(
            a / b for a, b in zip(times["load ours"], times["load plain"])
        )
        print(
            f"  ours / plain: save {paired_save:.3f} paired-median ({save_ratio:.3f} as a ratio "
            f"of medians), load {paired_load:.3f} paired-median ({load_ratio:.3f})"
        )

        blocked, total = time_async(state, paths["save_ours.ckpt"], async_reps)
        print(
            f"\n[informational] AsyncCheckpointer, {async_reps} saves: save() blocks "
            f"{_harness.summary(blocked, 1e3, 2)} ms; until wait() returns "
            f"{_harness.summary(total, 1e3)} ms (a synchronous save: "
            f"{med['save ours'] * 1e3:.1f} ms)"
        )
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if args.quick:
        print("--quick: a smoke run; its figures are too short to mean anything")
    print(f"save_ratio={paired_save:.3f} load_ratio={paired_load:.3f}")


if __name__ == "__main__":
    main()
