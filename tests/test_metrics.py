"""Mergeable metrics: merge laws, values against torch, dtypes, cross-rank sync, bad input.

Exactness: with integer or dyadic values (k / 2**8, |k| <= 2**20) every float64 accumulator is
exact, so merging in any grouping equals one pass bitwise (``torch.equal``). With arbitrary
float32 values the float64 totals of two groupings differ by at most
``n * 2**-52 * sum(|w * x|)`` (n values), and ``compute()`` (rounded to float32) by that
over the count plus one float32 rounding, ``2**-23 * |value|``.
"""

from __future__ import annotations

import math
import threading
from typing import ClassVar

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from purestep.engine import metrics as M
from purestep.engine import tree
from purestep.engine.metrics import Accuracy, Last, Max, Mean, Metric, Min, Sum
from purestep.engine.tree import struct

F32, F64 = torch.float32, torch.float64
CLASSES = [Mean, Sum, Max, Min, Last, Accuracy]

# --------------------------------------------------------------------------- strategies

dyadic = st.integers(-(2**20), 2**20).map(lambda k: k / 2**8)
weights = st.integers(0, 8).map(lambda k: k / 4)
any_float = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False, width=32)
# One metric's worth of values: a tensor of 1 to 4 elements, or a 0-d tensor.
chunk = st.one_of(
    st.lists(dyadic, min_size=1, max_size=4).map(lambda v: torch.tensor(v)),
    dyadic.map(lambda v: torch.tensor(v)),
)
float_chunk = st.lists(any_float, min_size=1, max_size=4).map(lambda v: torch.tensor(v))


def merge_in_random_grouping(metrics: list, data: st.DataObject, cls: type) -> Metric:
    """Merge ``metrics`` in order, in a bracketing drawn by hypothesis, with empties mixed in."""
    ms = list(metrics)
    for _ in range(data.draw(st.integers(0, 3))):
        ms.insert(data.draw(st.integers(0, len(ms))), cls.empty())
    if not ms:
        return cls.empty()
    while len(ms) > 1:
        i = data.draw(st.integers(0, len(ms) - 2))
        ms[i : i + 2] = [ms[i].merge(ms[i + 1])]
    return ms[0]


def fold(metrics: list, cls: type) -> Metric:
    out = cls.empty()
    for m in metrics:
        out = out.merge(m)
    return out


def sample(cls: type, seed: int = 0, dtype: torch.dtype = F32) -> Metric:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, generator=g, dtype=dtype)
    if cls is Accuracy:
        return Accuracy.of(torch.randn(6, 3, generator=g, dtype=dtype), torch.arange(6) % 3)
    if cls is Last:
        return Last.of(x[0])
    return cls.of(x)


# --------------------------------------------------------------------------- merge laws


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("dtype", [F32, F64])
def test_empty_is_an_identity(cls, dtype):
    m = sample(cls, dtype=dtype)
    tree.assert_trees_equal(cls.empty().merge(m), m)
    tree.assert_trees_equal(m.merge(cls.empty()), m)
    tree.assert_trees_equal(M.merge(M.merge(None, m), None), m)


@pytest.mark.parametrize("cls", CLASSES)
def test_merge_is_associative(cls):
    a, b, c = (sample(cls, seed) for seed in range(3))
    tree.assert_trees_equal(a.merge(b).merge(c), a.merge(b.merge(c)))


@given(st.lists(st.tuples(chunk, weights), max_size=8), st.data())
def test_mean_any_grouping_equals_one_pass_exactly(events, data):
    metrics = [Mean.of(v, weight=w) for v, w in events]
    merged = merge_in_random_grouping(metrics, data, Mean)
    tree.assert_trees_equal(merged, fold(metrics, Mean))
    if events:
        values = torch.cat([v.reshape(-1) for v, _ in events])
        w = torch.cat([torch.full((v.numel(),), w) for v, w in events])
        one_pass = Mean.of(values, weight=w)
        tree.assert_trees_equal(merged, one_pass)
        expected = (values.double() * w.double()).sum() / w.double().sum()
        torch.testing.assert_close(
            merged.compute(), expected.float(), rtol=0, atol=0, equal_nan=True
        )


@given(st.lists(chunk, max_size=8), st.data())
def test_sum_max_min_any_grouping_equal_one_pass_exactly(chunks, data):
    for cls in (Sum, Max, Min):
        metrics = [cls.of(v) for v in chunks]
        merged = merge_in_random_grouping(metrics, data, cls)
        tree.assert_trees_equal(merged, fold(metrics, cls))
        if chunks:
            tree.assert_trees_equal(merged, cls.of(torch.cat([v.reshape(-1) for v in chunks])))
    if chunks:
        values = torch.cat([v.reshape(-1) for v in chunks])
        assert torch.equal(fold([Sum.of(v) for v in chunks], Sum).compute(), values.sum())
        assert torch.equal(fold([Max.of(v) for v in chunks], Max).compute(), values.max())
        assert torch.equal(fold([Min.of(v) for v in chunks], Min).compute(), values.min())


@given(st.lists(st.one_of(st.none(), any_float), max_size=8), st.data())
def test_last_keeps_the_latest_non_empty_in_any_grouping(values, data):
    metrics = [Last.empty() if v is None else Last.of(torch.tensor(v)) for v in values]
    merged = merge_in_random_grouping(metrics, data, Last)
    present = [v for v in values if v is not None]
    if present:
        tree.assert_trees_equal(merged, Last.of(torch.tensor(present[-1])))
        assert torch.equal(merged.compute(), torch.tensor(present[-1]))
    else:
        tree.assert_trees_equal(merged, Last.empty())
        assert merged.compute().isnan()


@given(
    st.lists(st.tuples(st.integers(1, 6), st.integers(0, 2**16)), min_size=1, max_size=6),
    st.data(),
)
def test_accuracy_any_grouping_equals_one_pass_exactly(batches, data):
    preds, targets, metrics = [], [], []
    for n, seed in batches:
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(n, 4, generator=g)
        y = torch.randint(0, 4, (n,), generator=g)
        preds.append(logits)
        targets.append(y)
        metrics.append(Accuracy.of(logits, y))
    merged = merge_in_random_grouping(metrics, data, Accuracy)
    logits, y = torch.cat(preds), torch.cat(targets)
    tree.assert_trees_equal(merged, Accuracy.of(logits, y))
    correct = (logits.argmax(-1) == y).sum()
    assert merged.correct.item() == correct.item()
    assert merged.total.item() == y.numel()
    torch.testing.assert_close(merged.compute(), (logits.argmax(-1) == y).float().mean())


@given(st.lists(st.tuples(float_chunk, weights), min_size=1, max_size=8), st.data())
def test_mean_of_arbitrary_floats_within_stated_tolerance(events, data):
    metrics = [Mean.of(v, weight=w) for v, w in events]
    merged = merge_in_random_grouping(metrics, data, Mean)
    values = torch.cat([v.reshape(-1) for v, _ in events]).double()
    w = torch.cat([torch.full((v.numel(),), w) for v, w in events]).double()
    exact_total = math.fsum((values * w).tolist())
    bound = values.numel() * 2.0**-52 * float((values * w).abs().sum())
    assert abs(float(merged.total) - exact_total) <= bound
    assert float(merged.count) == float(w.sum())
    if float(w.sum()) > 0:
        expected = exact_total / float(w.sum())
        tol = 2.0**-23 * abs(expected) + bound / float(w.sum())
        assert abs(float(merged.compute()) - expected) <= tol
        other = fold(metrics, Mean)
        assert abs(float(merged.compute()) - float(other.compute())) <= 2 * tol


@given(float_chunk)
def test_max_min_of_arbitrary_floats_are_exact(v):
    assert torch.equal(Max.of(v).compute(), v.max())
    assert torch.equal(Min.of(v).compute(), v.min())


# --------------------------------------------------------------------------- values


def test_values_against_torch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, generator=g)
    w = torch.rand(7, 1, generator=g)
    torch.testing.assert_close(Mean.of(x).compute(), x.mean())
    torch.testing.assert_close(Mean.of(x, weight=w).compute(), (x * w).sum() / (w.sum() * 3))
    torch.testing.assert_close(Mean.of(x, weight=2.5).compute(), x.mean())
    assert float(Mean.of(x, weight=2.5).count) == 2.5 * 21
    torch.testing.assert_close(Sum.of(x).compute(), x.sum())
    assert torch.equal(Max.of(x).compute(), x.max())
    assert torch.equal(Min.of(x).compute(), x.min())
    assert torch.equal(Last.of(x[2, 1]).compute(), x[2, 1])
    assert torch.equal(Last.of(x[2:3, 1:2]).compute(), x[2, 1])
    assert float(Mean.of(3).compute()) == 3.0
    assert float(Sum.of(True).compute()) == 1.0
    assert float(Max.of(torch.tensor([3, 9, 2])).compute()) == 9.0


def test_accuracy_with_logits_and_with_labels():
    logits = torch.tensor([[0.1, 2.0, 0.3], [3.0, 0.0, 0.0], [0.0, 0.0, 1.0], [1.0, 2.0, 0.0]])
    y = torch.tensor([1, 0, 0, 0])
    from_logits = Accuracy.of(logits, y)
    from_labels = Accuracy.of(logits.argmax(-1), y)
    tree.assert_trees_equal(from_logits, from_labels)
    assert float(from_logits.correct) == 2.0 and float(from_logits.total) == 4.0
    assert torch.equal(from_logits.compute(), torch.tensor(0.5))
    # Extra leading axes ([B, T, C] against [B, T]) and bool labels.
    seq = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(1))
    yt = torch.randint(0, 4, (2, 5), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(
        Accuracy.of(seq, yt).compute(), (seq.argmax(-1) == yt).float().mean()
    )
    b = Accuracy.of(torch.tensor([True, False, True]), torch.tensor([True, True, True]))
    torch.testing.assert_close(b.compute(), torch.tensor(2 / 3))
    assert Accuracy.of(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long)).compute().isnan()


def test_empty_values():
    assert Mean.empty().compute().isnan()
    assert Last.empty().compute().isnan()
    assert Accuracy.empty().compute().isnan()
    assert float(Sum.empty().compute()) == 0.0
    assert float(Max.empty().compute()) == -math.inf
    assert float(Min.empty().compute()) == math.inf
    tree.assert_trees_equal(Max.of(torch.zeros(0)), Max.empty())
    assert Mean.of(torch.zeros(0)).compute().isnan()


def test_dtypes_and_accumulators():
    x32 = torch.tensor([0.1, 0.2, 0.7])
    x64 = x32.double()
    for cls in (Mean, Sum, Max, Min):
        assert cls.of(x32).compute().dtype == F32
        assert cls.of(x64).compute().dtype == F64
        assert cls.of(torch.tensor([1, 2])).compute().dtype == F32
        assert cls.of(x32.bfloat16()).compute().dtype == F32
        assert cls.of(0.5).compute().dtype == F32
        assert cls.of(x32).merge(cls.of(x64)).compute().dtype == F64
        assert cls.empty().merge(cls.of(x64)).dtype == F64
        assert all(leaf.dtype == F64 for leaf in tree.leaves(cls.of(x32)))
    assert Last.of(x64[0]).compute().dtype == F64
    assert Accuracy.of(x64.reshape(1, 3), torch.tensor([2])).compute().dtype == F64
    # float64 accumulators keep what float32 would lose: 2**24 + 1.
    big = Sum.of(torch.tensor(2.0**24)).merge(Sum.of(torch.tensor(1.0)))
    assert float(big.total) == 2.0**24 + 1
    # Python floats are accumulated exactly.
    assert float(Sum.of(0.1).total) == 0.1


def test_values_are_detached_and_copied():
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    loss = (x * 3).sum()
    for m in (
        Mean.of(loss),
        Mean.of(x * 2, weight=x),
        Sum.of(x),
        Max.of(x),
        Last.of(loss),
        Accuracy.of(torch.stack([x, -x], 1), torch.tensor([1, 0])),
    ):
        assert not any(leaf.requires_grad for leaf in tree.leaves(m))
        assert m.compute().grad_fn is None
    for dtype in (F32, F64):
        v = torch.tensor(2.0, dtype=dtype)
        ms = [Mean.of(v), Sum.of(v), Max.of(v), Last.of(v)]
        v.add_(1.0)
        assert all(float(m.compute()) == 2.0 for m in ms)
    # compute() returns fresh tensors.
    s = Sum.of(torch.tensor(1.0, dtype=F64))
    s.compute().add_(5)
    assert float(s.compute()) == 1.0


def test_metrics_are_pytrees_in_the_purestep_namespace():
    m = Mean.of(torch.tensor([1.0, 3.0]))
    leaves = tree.leaves({"loss": m})
    assert len(leaves) == 2 and all(isinstance(x, torch.Tensor) for x in leaves)
    doubled = tree.map(lambda t: t * 2, m)
    assert isinstance(doubled, Mean) and doubled.dtype == F32
    assert float(doubled.compute()) == 2.0
    assert tree.structure(Mean.of(1.0)) == tree.structure(m)
    assert tree.structure(Mean.of(torch.tensor(1.0, dtype=F64))) != tree.structure(m)
    with pytest.raises(AttributeError):
        m.total = torch.zeros(())


# --------------------------------------------------------------------------- module helpers


def test_from_values_merge_and_compute():
    kept = Accuracy.of(torch.tensor([1, 2]), torch.tensor([1, 1]))
    out = {"loss": torch.tensor(2.0), "lr": 0.5, "n": torch.tensor([1.0, 2.0]), "acc": kept}
    ms = M.from_values(out, reduce={"lr": "last", "n": "sum"})
    assert list(ms) == ["loss", "lr", "n", "acc"]
    assert isinstance(ms["loss"], Mean) and isinstance(ms["lr"], Last)
    assert isinstance(ms["n"], Sum) and ms["acc"] is kept
    assert all(
        isinstance(m, Max) for m in M.from_values(out, reduce="max").values() if m is not kept
    )

    out2 = {"loss": torch.tensor(4.0), "lr": 0.25, "n": torch.tensor(3.0), "extra": 1.0}
    acc = None
    for step in (out, out2):
        acc = M.merge(acc, M.from_values(step, reduce={"lr": "last", "n": "sum"}))
    assert list(acc) == ["loss", "lr", "n", "acc", "extra"]
    values = M.compute(acc)
    assert values == {
        "acc": torch.tensor(0.5),
        "extra": torch.tensor(1.0),
        "loss": torch.tensor(3.0),
        "lr": torch.tensor(0.25),
        "n": torch.tensor(6.0),
    }
    nested = M.compute({"train": {"loss": Mean.of(1.0)}, "val": {"loss": Mean.of(2.0)}})
    assert nested == {"train/loss": torch.tensor(1.0), "val/loss": torch.tensor(2.0)}
    deep = M.merge({"train": {"loss": Mean.of(1.0)}}, {"train": {"loss": Mean.of(3.0)}})
    assert float(deep["train"]["loss"].compute()) == 2.0


# --------------------------------------------------------------------------- sync


class FakeWorld:
    """Simulates ``n`` ranks in threads: ``all_reduce`` meets the other ranks at a barrier."""

    def __init__(self, n: int):
        self.n = n
        self.barrier = threading.Barrier(n, timeout=20)
        self.inbox: list = [None] * n
        self.calls: list[list[tuple[str, int]]] = [[] for _ in range(n)]

    def all_reduce_for(self, rank: int, in_place: bool = False):
        reduce = {"sum": torch.sum, "max": torch.amax, "min": torch.amin}

        def all_reduce(tensors, op):
            self.calls[rank].append((op, len(tensors)))
            self.inbox[rank] = list(tensors)
            self.barrier.wait()
            out = [
                reduce[op](torch.stack([self.inbox[r][i] for r in range(self.n)]), dim=0)
                for i in range(len(tensors))
            ]
            self.barrier.wait()  # everyone has read the inbox before it is overwritten
            if in_place:  # like torch.distributed.all_reduce
                for t, o in zip(tensors, out):
                    t.copy_(o)
                return tensors
            return out

        return all_reduce

    def run(self, trees: list, in_place: bool = False) -> list:
        results: list = [None] * self.n
        errors: list = []

        def work(rank):
            try:
                results[rank] = M.sync(trees[rank], self.all_reduce_for(rank, in_place))
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=work, args=(r,)) for r in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


def rank_tree(rank: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    x = (torch.randint(-1000, 1000, (5,), generator=g) / 8.0).float()
    logits = torch.randn(6, 3, generator=g)
    y = torch.randint(0, 3, (6,), generator=g)
    return {
        "train": {
            "loss": Mean.of(x, weight=rank + 1),
            "n": Sum.of(x),
            "hi": Max.of(x),
            "lo": Min.of(x),
            # rank 1 has no last value: it must not count in the mean of last values.
            "lr": Last.empty() if rank == 1 else Last.of(x[0]),
            "acc": Accuracy.of(logits, y),
            "f64": Mean.of(x.double()),
        },
        "step": torch.tensor(rank),
        "name": "run",
    }


@pytest.mark.parametrize("in_place", [False, True])
def test_sync_equals_merging_the_ranks(in_place):
    trees = [rank_tree(r) for r in range(3)]
    before = [tree.map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, t) for t in trees]
    world = FakeWorld(3)
    synced = world.run(trees, in_place=in_place)

    merged = trees[0]["train"]
    for t in trees[1:]:
        merged = M.merge(merged, t["train"])
    lasts = [float(trees[r]["train"]["lr"].value) for r in (0, 2)]
    for rank in range(3):
        s = synced[rank]["train"]
        for key in ("loss", "n", "hi", "lo", "acc", "f64"):
            tree.assert_trees_equal(s[key], merged[key])
        assert float(s["lr"].compute()) == pytest.approx(sum(lasts) / 2, rel=1e-7)
        assert s["lr"].compute().dtype == F32
        assert synced[rank]["step"] is trees[rank]["step"]
        assert synced[rank]["name"] == "run"
        # One collective per op, each with one packed tensor per (dtype, device).
        assert world.calls[rank] == [("max", 1), ("min", 1), ("sum", 1)]
        # The input trees are untouched, even by an in-place all_reduce.
        tree.assert_trees_equal(trees[rank], before[rank])
    # After a sync, merging still keeps the later non-empty Last.
    later = synced[0]["train"]["lr"].merge(Last.of(torch.tensor(7.0)))
    assert float(later.compute()) == 7.0


def test_sync_moves_fields_to_the_given_device():
    seen = []
    out = M.sync(
        {"m": Mean.of(1.0)}, lambda ts, op: seen.extend(ts) or [t * 3 for t in ts], device="meta"
    )
    assert all(t.device.type == "meta" for t in seen + tree.leaves(out))


def test_sync_of_a_tree_without_metrics_calls_nothing():
    calls = []
    t = {"a": torch.ones(2), "b": [1, 2]}
    out = M.sync(t, lambda ts, op: calls.append(op) or ts)
    assert calls == [] and out["a"] is t["a"] and out["b"] == [1, 2]


# --------------------------------------------------------------------------- bad input


@struct
class NoSyncOps(Metric):
    x: torch.Tensor
    sync_ops: ClassVar[dict] = {"x": "mean"}


def test_bad_input_errors():
    with pytest.raises(ValueError, match="unknown reduce 'median'"):
        M.from_values({"a": 1.0}, reduce="median")
    with pytest.raises(ValueError, match="unknown reduce 'avg' for 'a'"):
        M.from_values({"a": 1.0}, reduce={"a": "avg"})
    with pytest.raises(TypeError, match="cannot merge Mean with Sum"):
        Mean.of(1.0).merge(Sum.of(1.0))
    with pytest.raises(TypeError, match="Mean with Max at train/loss"):
        M.merge({"train": {"loss": Mean.of(1.0)}}, {"train": {"loss": Max.of(1.0)}})
    with pytest.raises(TypeError, match="cannot merge dict with Mean"):
        M.merge({"a": Mean.of(1.0)}, Mean.of(1.0))
    with pytest.raises(ValueError, match=r"shape \(4, 3\) do not match targets of shape \(5,\)"):
        Accuracy.of(torch.randn(4, 3), torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="do not match"):
        Accuracy.of(torch.zeros(4, dtype=torch.long), torch.zeros(5, dtype=torch.long))
    with pytest.raises(TypeError, match="must be integers or bools"):
        Accuracy.of(torch.randn(4), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="expects a single value"):
        Last.of(torch.ones(3))
    with pytest.raises(ValueError, match="does not broadcast"):
        Mean.of(torch.ones(3), weight=torch.ones(2))
    with pytest.raises(TypeError, match="expected a tensor or a number"):
        Mean.of(object())
    with pytest.raises(TypeError, match="complex"):
        Sum.of(torch.ones(2, dtype=torch.complex64))
    with pytest.raises(TypeError, match="not a metric"):
        M.compute({"a": torch.ones(())})
    with pytest.raises(TypeError, match=r"metric\.compute\(\)"):
        M.compute(Mean.of(1.0))
    with pytest.raises(TypeError, match="'x' has 'mean'"):
        M.sync({"m": NoSyncOps(torch.ones(()))}, lambda ts, op: ts)
    with pytest.raises(ValueError, match="returned 0 tensors for 1"):
        M.sync({"m": Mean.of(1.0)}, lambda ts, op: [])
    with pytest.raises(ValueError, match=r"returned \(1,\) for a tensor of shape \(2,\)"):
        M.sync({"m": Mean.of(1.0)}, lambda ts, op: [t[:1] for t in ts])
