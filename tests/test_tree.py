import optree
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engine import tree
from engine.tree import field, struct


@struct
class Pair:
    a: torch.Tensor
    b: dict
    name: str = field(static=True, default="pair")


def test_struct_flattens_children_and_keeps_static_fields_out_of_leaves():
    p = Pair(torch.ones(2), {"x": torch.zeros(1), "y": 3}, name="n")
    leaves = tree.leaves(p)
    assert len(leaves) == 3
    assert all(not isinstance(v, str) for v in leaves)
    doubled = tree.map(lambda v: v * 2, p)
    assert isinstance(doubled, Pair)
    assert doubled.name == "n"
    assert torch.equal(doubled.a, torch.full((2,), 2.0))
    assert doubled.b["y"] == 6


def test_struct_is_frozen_and_replace_builds_a_copy():
    p = Pair(torch.ones(2), {})
    with pytest.raises(AttributeError):
        p.a = torch.zeros(2)
    q = p.replace(a=torch.zeros(2))
    assert torch.equal(p.a, torch.ones(2))
    assert torch.equal(q.a, torch.zeros(2))
    assert q.b is p.b
    with pytest.raises(TypeError, match="unknown field 'c'"):
        p.replace(c=1)


def test_static_fields_are_part_of_the_structure():
    assert tree.structure(Pair(torch.ones(1), {}, name="a")) != tree.structure(
        Pair(torch.ones(1), {}, name="b")
    )


def test_struct_is_a_node_only_in_the_project_namespace():
    p = Pair(torch.ones(1), {})
    assert optree.tree_leaves(p) == [p]
    assert len(tree.leaves(p)) == 1


def test_paths_are_readable():
    p = Pair(torch.ones(1), {"fc.weight": torch.ones(1), "n": [1, 2]})
    paths = [path for path, _ in tree.flatten_with_paths(p)]
    assert paths == [".a", ".b['fc.weight']", ".b['n'][0]", ".b['n'][1]"]


def test_diff_names_the_first_mismatching_paths():
    a = {"w": torch.tensor([1.0, 2.0, 3.0]), "b": torch.zeros(2), "step": 3}
    b = {"w": torch.tensor([1.0, 2.5, 3.0]), "b": torch.zeros(2), "step": 4}
    problems = tree.diff(a, b)
    assert len(problems) == 2
    assert problems[0].startswith("['step']: 3 vs 4")
    assert "['w']: 1/3 elements differ" in problems[1]
    assert "first at [1]: 2 vs 2.5" in problems[1]
    with pytest.raises(AssertionError, match=r"\['w'\]"):
        tree.assert_trees_equal(a, b)


def test_diff_reports_structure_shape_and_dtype():
    assert tree.diff({"a": torch.ones(1)}, {"b": torch.ones(1)}) == [
        "['b']: missing in the first tree",
        "['a']: missing in the second tree",
    ]
    assert "shape (2,) vs (3,)" in tree.diff(torch.ones(2), torch.ones(3))[0]
    assert "dtype" in tree.diff(torch.ones(2), torch.ones(2, dtype=torch.float64))[0]


def test_equal_treats_nans_in_the_same_place_as_equal():
    a = torch.tensor([1.0, float("nan")])
    assert tree.trees_equal({"x": a}, {"x": a.clone()})
    assert not tree.trees_equal({"x": a}, {"x": torch.tensor([1.0, 2.0])})


def test_close_respects_tolerances():
    a = {"x": torch.tensor([1.0, 100.0])}
    b = {"x": torch.tensor([1.0 + 1e-7, 100.0 + 1e-5])}
    tree.assert_trees_close(a, b, rtol=1e-6)
    with pytest.raises(AssertionError, match="rtol=1e-08"):
        tree.assert_trees_close(a, b, rtol=1e-8)


def test_helpers_zeros_cast_device_norm():
    t = {"a": torch.ones(2, 2), "i": torch.ones(3, dtype=torch.int64), "s": 5}
    z = tree.zeros_like(t)
    assert torch.equal(z["a"], torch.zeros(2, 2)) and z["s"] == 5
    c = tree.cast(t, torch.float64)
    assert c["a"].dtype == torch.float64 and c["i"].dtype == torch.int64
    moved = tree.to_device(t, "cpu")
    assert moved["a"] is t["a"]
    g = {"a": torch.randn(3, 4), "b": torch.randn(5)}
    expected = torch.nn.utils.get_total_norm([g["a"], g["b"]], foreach=True)
    assert torch.equal(tree.global_norm(g), expected)


@given(st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=1, max_size=20))
def test_global_norm_matches_torch(values):
    g = {"a": torch.tensor(values), "b": torch.tensor(values[::-1]) * 2}
    reference = torch.linalg.vector_norm(torch.cat([g["a"], g["b"]]))
    torch.testing.assert_close(tree.global_norm(g), reference, rtol=1e-5, atol=1e-6)


def test_integer_tensors_compare_exactly_with_or_without_tolerances():
    a = {"n": torch.tensor([1, 2, 3])}
    tree.assert_trees_close(a, {"n": torch.tensor([1, 2, 3])}, rtol=1e-3)
    with pytest.raises(AssertionError, match="1/3 elements differ"):
        tree.assert_trees_close(a, {"n": torch.tensor([1, 2, 4])}, rtol=1e-3)
