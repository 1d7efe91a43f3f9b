"""``combine``: each mode's structure, length and O(1) resume; ``as_list``."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from purestep.loops import data


def reference(lists, mode, limits):
    """Lightning's CombinedLoader modes over plain lists (fetcher cut at the length)."""
    eff = [min(len(values), lim) for values, lim in zip(lists, limits)]
    if mode == "sequential":
        return [(values[j], j, i) for i, values in enumerate(lists) for j in range(eff[i])]
    if mode == "min_size":
        return [[values[j] for values in lists] for j in range(min(eff))]
    if mode == "max_size":
        return [
            [values[j] if j < len(values) else None for values in lists] for j in range(max(eff))
        ]
    if any(not values for values in lists):  # max_size_cycle cannot restart an empty source
        return []
    return [[values[j % len(values)] for values in lists] for j in range(max(eff))]


def plain(item):
    """Batches (tensors of one sample index) as ints, keeping structure and None."""
    if item is None:
        return None
    if isinstance(item, torch.Tensor):
        return item.item()
    if isinstance(item, dict):
        return [plain(v) for v in item.values()]
    return [plain(v) for v in item]


def sequential_plain(items):
    return [(b.item(), j, i) for b, j, i in items]


class Stream:
    """A re-iterable, unsized stream of ints."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


lengths = st.lists(st.integers(0, 6), min_size=1, max_size=3)
limit = st.one_of(st.none(), st.integers(0, 7))


@given(
    lens=lengths,
    mode=st.sampled_from(data.MODES),
    shape=st.sampled_from([list, tuple, dict]),
    data_=st.data(),
)
def test_modes_follow_lightning_and_resume_anywhere(lens, mode, shape, data_):
    limits = data_.draw(st.lists(limit, min_size=len(lens), max_size=len(lens)))
    lists = [[100 * i + j for j in range(n)] for i, n in enumerate(lens)]
    sources = [data.source(torch.tensor(values, dtype=torch.int64)) for values in lists]
    if shape is dict:
        sources = {f"s{i}": s for i, s in enumerate(sources)}
        given_limits = {f"s{i}": lim for i, lim in enumerate(limits)}
    else:
        sources, given_limits = shape(sources), limits
    combined = data.combine(sources, mode, limits=given_limits)
    expected = reference(lists, mode, [math.inf if v is None else v for v in limits])
    full = list(combined.iterate(0))
    assert len(combined) == len(full)
    normalise = sequential_plain if mode == "sequential" else (lambda xs: [plain(x) for x in xs])
    assert normalise(full) == expected
    if mode != "sequential" and full:
        assert type(full[0]) is shape
    start = data_.draw(st.integers(0, len(full)))
    assert normalise(list(combined.iterate(0, start))) == expected[start:]


def test_lightning_example_limit_four_lengths_three_and_five():
    a, b = data.source(torch.arange(3)), data.source(torch.arange(5))
    combined = data.combine({"a": a, "b": b}, "max_size_cycle", limits=4)
    got = [(x["a"].item(), x["b"].item()) for x in combined.iterate(0)]
    assert got == [(0, 0), (1, 1), (2, 2), (0, 3)]
    assert combined.lengths == [3, 4]


def test_resume_does_not_load_skipped_batches():
    loads = []

    class Logged(torch.utils.data.Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            loads.append(i)
            return i

    combined = data.combine([Logged(), Logged()], "sequential", batch_size=2)
    assert [(b.tolist(), j, i) for b, j, i in combined.iterate(0, 4)] == [
        ([2, 3], 1, 1),
        ([4, 5], 2, 1),
    ]
    assert sorted(loads) == [2, 3, 4, 5]


def test_unsized_sources_cycle_and_chain():
    def stream(n):
        return data.source(Stream(n))

    cycled = data.combine([stream(5), data.source(torch.arange(2))], "max_size_cycle")
    assert cycled.num_batches == math.inf and not cycled.resumable
    got = [(s, t.item()) for s, t in cycled.iterate(0)]
    assert got == [(0, 0), (1, 1), (2, 0), (3, 1), (4, 0)]  # stops once all went through
    assert [(s, t.item()) for s, t in cycled.iterate(0, 3)] == got[3:]
    empty = data.combine([stream(0), data.source(torch.arange(2))], "max_size_cycle")
    assert list(empty.iterate(0)) == []  # an empty source cannot be restarted
    chained = data.combine([stream(3), data.source(torch.arange(2))], "sequential")
    expected = [(0, 0, 0), (1, 1, 0), (2, 2, 0), (0, 0, 1), (1, 1, 1)]
    normalise = [(int(b), j, i) for b, j, i in chained.iterate(0)]
    assert normalise == expected
    for start in range(6):
        assert [(int(b), j, i) for b, j, i in chained.iterate(0, start)] == expected[start:]


def test_with_options_and_describe():
    combined = data.combine({"a": torch.arange(6), "b": torch.arange(3)}, "min_size", limits=None)
    shuffled = combined.with_options(shuffle=True, seed=3, batch_size=2)
    assert len(combined) == 3 and len(shuffled) == 2
    assert all(s.options.shuffle for s in shuffled.sources)
    d = shuffled.describe()
    assert d["kind"] == "combined" and d["mode"] == "min_size" and d["length"] == 2
    assert [s["batch_size"] for s in d["sources"]] == [2, 2]
    assert shuffled.names == ["a", "b"]


def test_as_list():
    x = torch.arange(4)
    one = data.source(x)
    assert data.as_list(one) == [one]
    assert len(data.as_list((x, x))) == 1  # a tuple of tensors is one source
    several = data.as_list({"val": x, "extra": one}, batch_size=2)
    assert len(several) == 2 and several[1] is one and len(several[0]) == 2
    assert len(data.as_list([x, x, x])) == 3
    seq = data.combine([x, x], "sequential")
    assert data.as_list(seq) == seq.sources


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: data.combine([torch.arange(2)], "zip"), ValueError, "unknown mode"),
        (lambda: data.combine([], "min_size"), ValueError, "at least one"),
        (lambda: data.combine(torch.arange(2)), TypeError, "dict, list or tuple"),
        (lambda: data.combine((torch.arange(2),)), TypeError, "one source"),
        (lambda: data.combine([torch.arange(2)], limits=[1, 2]), ValueError, "2 limits"),
        (lambda: data.combine({"a": torch.arange(2)}, limits={"b": 1}), ValueError, "keys"),
        (lambda: data.combine([torch.arange(2)], limits=-1), ValueError, "limit must be"),
        (lambda: data.combine([torch.arange(2)], limits="1"), TypeError, "limits must be"),
        (lambda: data.combine([torch.arange(2)]).iterate(0, 3), ValueError, "past the end"),
    ],
)
def test_bad_combinations(call, error, match):
    with pytest.raises(error, match=match):
        call()
