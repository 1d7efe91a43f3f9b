import optree
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from purestep.engine import tree
from purestep.engine.tree import field, struct


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


@pytest.mark.bitwise
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


# --------------------------------------------------------------------------- complex, infinities


def test_complex_tensors_compare_both_parts():
    assert not tree.trees_equal({"x": torch.tensor(1 + 1j)}, {"x": torch.tensor(1 + 2j)})
    a = torch.tensor([1 + 1j, 2 - 3j], dtype=torch.complex64)
    b = torch.tensor([1 + 1j, 2 - 3.5j], dtype=torch.complex64)
    problems = tree.diff({"x": a}, {"x": b}, rtol=1e-6)
    assert len(problems) == 1 and "1/2 elements differ" in problems[0]
    assert "first at [1]" in problems[0]
    with pytest.raises(AssertionError, match="rtol=1e-06"):
        tree.assert_trees_close({"x": a}, {"x": b}, rtol=1e-6)
    tree.assert_trees_close({"x": a}, {"x": b}, atol=0.6)
    # a conjugated view compares by its values
    assert tree.trees_equal({"x": torch.tensor([1 + 2j]).conj()}, {"x": torch.tensor([1 - 2j])})


def test_infinities_match_only_the_same_infinity_under_tolerances():
    inf = float("inf")
    a = {"x": torch.tensor([1.0, inf, -inf])}
    tree.assert_trees_close(a, {"x": torch.tensor([1.0, inf, -inf])}, rtol=1e-6)
    for other in ([1.0, -inf, -inf], [1.0, inf, inf], [1.0, 3e38, -inf]):
        with pytest.raises(AssertionError, match="1/3 elements differ"):
            tree.assert_trees_close(a, {"x": torch.tensor(other)}, rtol=1e-6)
        with pytest.raises(AssertionError, match="1/3 elements differ"):
            tree.assert_trees_close({"x": torch.tensor(other)}, a, rtol=1e-6, atol=1.0)


# --------------------------------------------------------------------------- global norm


MIXED_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _clip_grad_norm_reference(tensors):
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in tensors]
    for p, t in zip(params, tensors):
        p.grad = t.clone()
    return torch.nn.utils.clip_grad_norm_(params, float("inf"), foreach=True)


@pytest.mark.skipif(
    not hasattr(torch.nn.utils, "get_total_norm"),
    reason="torch < 2.6: mixed dtypes are grouped by first appearance, not torch's order",
)
@pytest.mark.bitwise
def test_global_norm_of_mixed_dtypes_is_bitwise_clip_grad_norm():
    """torch orders dtype groups by an internal hash, not first appearance; the order changes
    the last bit of the result in a few percent of cases, so try many."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        picks = torch.randint(0, len(MIXED_DTYPES), (8,), generator=g).tolist()
        sizes = torch.randint(1, 40, (8,), generator=g).tolist()
        tensors = {
            f"t{i}": (torch.randn(n, generator=g) * 3.0).to(MIXED_DTYPES[k])
            for i, (k, n) in enumerate(zip(picks, sizes))
        }
        expected = _clip_grad_norm_reference(list(tensors.values()))
        got = tree.global_norm(tensors)
        assert got.dtype == expected.dtype
        assert torch.equal(got, expected), (picks, got, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.bitwise
def test_global_norm_over_two_devices_is_bitwise_clip_grad_norm():
    tensors = {"a": torch.randn(5, 3, device="cuda"), "b": torch.randn(4), "c": torch.randn(2)}
    assert tree.global_norm(tensors).device.type == "cuda"
    assert torch.equal(tree.global_norm(tensors), _clip_grad_norm_reference(list(tensors.values())))


@pytest.mark.bitwise
def test_combine_norms_is_the_last_step_of_global_norm():
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randn(n, generator=g) for n in (3, 17, 1, 64)]
    norms = torch._foreach_norm(tensors, 2.0)
    assert torch.equal(tree.combine_norms(norms), tree.global_norm(tensors))
    assert torch.equal(tree.combine_norms([]), torch.tensor(0.0))
    # per-member vectors: entry i combines the i-th entries, as a separate run would. Per-row
    # and batched norms against torch._foreach_norm are two kernels, so not bitwise in general
    members = [torch.randn(4, n, generator=g) for n in (3, 5, 2)]
    rows = [torch.linalg.vector_norm(m, 2.0, dim=1) for m in members]
    combined = tree.combine_norms(rows)
    assert combined.shape == (4,)
    for i in range(4):
        alone = tree.global_norm([m[i] for m in members])
        torch.testing.assert_close(combined[i], alone, rtol=1e-6, atol=0)


def test_device_dtype_groups_keep_first_appearance_order():
    ts = [torch.ones(1, dtype=d) for d in (torch.float64, torch.float32, torch.float64)]
    assert tree.device_dtype_groups(ts) == [[0, 2], [1]]
    assert tree.device_dtype_groups([]) == []
