import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from purestep.engine import rng


def _compute(entry):
    kind = entry[0]
    if kind == "key":
        return rng.key(entry[1])
    if kind == "fold":
        return rng.fold_in(rng.key(entry[1]), *entry[2])
    return rng.hash_str(entry[1])


# Pinned values: these must never change, or resumed runs and published seeds would silently
# draw different random numbers. Change them only with a documented format break.
PINNED_VALUES = {
    ("key", 0): 0xF2EE2134306FF565,
    ("key", 1): 0x803BE1DFAC842450,
    ("key", -1): 0xD9E50EDBEB02EC3A,
    ("fold", 0, (1,)): 0x4AD500B4EAF0040F,
    ("fold", 0, (2, 0, 0, 0)): 0x87BEA78DFBAE9107,
    ("fold", 0, ("dropout", 7)): 0x183609EC03D3A131,
    ("hash", "purestep"): 0xD1384CB1DE3DCD41,
}


def test_mixing_is_the_splitmix64_finaliser():
    # SplitMix64 seeded with 0 outputs mix(0x9E3779B97F4A7C15) first: a published value.
    assert rng._mix(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF


@pytest.mark.parametrize("entry", list(PINNED_VALUES))
def test_pinned_values_never_change(entry):
    assert _compute(entry) == PINNED_VALUES[entry], hex(_compute(entry))


def test_fnv1a_reference_vectors():
    # Published FNV-1a 64 test vectors.
    assert rng.hash_str("") == 0xCBF29CE484222325
    assert rng.hash_str("a") == 0xAF63DC4C8601EC8C
    assert rng.hash_str("foobar") == 0x85944171F73967E8


@given(st.integers(-(2**70), 2**70), st.lists(st.integers(0, 2**40), max_size=5))
def test_keys_are_64_bit_and_deterministic(seed, data):
    k = rng.fold_in(rng.key(seed), *data)
    assert 0 <= k < 2**64
    assert k == rng.fold_in(rng.key(seed), *data)


@given(st.integers(0, 2**32), st.integers(0, 2**32), st.integers(0, 2**32))
def test_fold_in_depends_on_order(k, a, b):
    if a != b:
        assert rng.fold_in(k, a, b) != rng.fold_in(k, b, a)
        assert rng.fold_in(k, a) != rng.fold_in(k, b)


def test_split_gives_distinct_keys():
    keys = rng.split(rng.key(0), 1000)
    assert len(set(keys)) == 1000


def test_bad_seeds_are_refused():
    with pytest.raises(TypeError, match="seed must be an int"):
        rng.key(1.5)
    with pytest.raises(TypeError, match="seed must be an int"):
        rng.key(True)
    with pytest.raises(TypeError, match="fold_in data"):
        rng.fold_in(rng.key(0), 0.5)


def test_generator_is_seeded_from_the_key():
    a = torch.rand(5, generator=rng.generator(rng.key(3)))
    b = torch.rand(5, generator=rng.generator(rng.key(3)))
    c = torch.rand(5, generator=rng.generator(rng.key(4)))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_scope_is_pure_and_restores_the_callers_stream():
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    with rng.scope(rng.key(9)):
        inside = torch.rand(4)
    after = torch.rand(3)
    assert torch.equal(after, expected_next)
    with rng.scope(rng.key(9)):
        again = torch.rand(4)
    assert torch.equal(inside, again)


def test_scope_restores_on_exception():
    torch.manual_seed(5)
    expected = torch.rand(2)
    torch.manual_seed(5)
    with pytest.raises(ValueError), rng.scope(rng.key(1)):
        torch.rand(10)
        raise ValueError("boom")
    assert torch.equal(torch.rand(2), expected)


# --------------------------------------------------------------------------- tensor keys


@given(st.integers(-(2**63), 2**63 - 1), st.integers(-(2**63), 2**63 - 1))
def test_tensor_keys_and_data_reduce_modulo_2_64_like_ints(k, d):
    assert rng.fold_in(torch.tensor(k), 7) == rng.fold_in(k, 7)
    assert rng.fold_in(rng.key(0), torch.tensor(d)) == rng.fold_in(rng.key(0), d)
    assert 0 <= rng.fold_in(torch.tensor(k), torch.tensor(d)) < 2**64


def test_negative_tensor_key_seeds_like_the_int():
    with rng.scope(torch.tensor(-5)):
        a = torch.rand(3)
    with rng.scope(-5):
        b = torch.rand(3)
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    "bad", [torch.tensor(True), torch.tensor(1.0), torch.tensor([1, 2]), torch.tensor(1j)]
)
def test_non_integer_tensor_keys_are_refused(bad):
    with pytest.raises(TypeError, match="one-element integer tensor"):
        rng.fold_in(bad, 1)
    with pytest.raises(TypeError, match="one-element integer tensor"):
        rng.fold_in(rng.key(0), bad)


# --------------------------------------------------------------------------- prebuilt generators


def test_scope_with_prebuilt_generators_matches_the_device_form():
    gens = rng.default_generators(["cpu"])
    assert gens == (torch.default_generator,)
    assert rng.default_generators() == gens
    torch.manual_seed(11)
    expected_next = torch.rand(2)
    torch.manual_seed(11)
    with rng.scope(rng.key(4), generators=gens):
        a = torch.rand(5)
    assert torch.equal(torch.rand(2), expected_next)
    with rng.scope(rng.key(4), ["cpu"]):
        b = torch.rand(5)
    assert torch.equal(a, b)
    with pytest.raises(TypeError, match="devices or generators, not both"):
        rng.scope(rng.key(4), ["cpu"], generators=gens)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cuda_device_without_cuda_is_a_clear_error():
    with pytest.raises(RuntimeError, match="cuda:0 was requested but CUDA is not available"):
        rng.default_generators(["cuda:0"])


def test_cuda_generators_are_looked_up_after_cuda_initialises(monkeypatch):
    """Simulated CUDA (no GPU needed): the generator table is empty until ``torch.cuda.init``,
    so the lookup must initialise first. Real CUDA: the subprocess test below."""
    table = (torch.Generator(), torch.Generator())
    calls = []

    def fake_init():
        calls.append("init")
        monkeypatch.setattr(torch.cuda, "default_generators", table)

    monkeypatch.setattr(torch.cuda, "default_generators", ())
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: bool(calls))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "init", fake_init)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    gens = rng.default_generators(["cuda:1", "cuda", torch.device("cuda", 1)])
    assert calls == ["init"]
    assert gens == (torch.default_generator, table[1], table[0])
    with pytest.raises(ValueError, match="no CUDA device 5 \\(2 visible\\)"):
        rng.default_generators(["cuda:5"])
    with rng.scope(rng.key(2), generators=gens):
        inside = torch.rand(2, generator=table[1])
    assert torch.equal(inside, torch.rand(2, generator=rng.generator(rng.key(2))))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_scope_on_an_explicit_cuda_device_before_cuda_initialises():
    code = (
        "import torch\n"
        "from engine import rng\n"
        "assert not torch.cuda.is_initialized()\n"
        "with rng.scope(rng.key(1), ['cuda:0']):\n"
        "    a = torch.rand(3, device='cuda:0')\n"
        "with rng.scope(rng.key(1), generators=rng.default_generators(['cuda:0'])):\n"
        "    b = torch.rand(3, device='cuda:0')\n"
        "assert torch.equal(a, b)\n"
    )
    root = __import__("pathlib").Path(__file__).resolve().parents[1]
    subprocess = __import__("subprocess")
    sys = __import__("sys")
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=120)


def test_seed_process_makes_every_global_stream_follow_the_key():
    import random

    def draws(k):
        rng.seed_process(k)
        return torch.rand(3), random.random()

    saved_torch, saved_random = torch.get_rng_state(), random.getstate()
    try:
        a, b, c = draws(rng.key(5)), draws(rng.key(5)), draws(rng.key(6))
    finally:
        torch.set_rng_state(saved_torch)
        random.setstate(saved_random)
    assert torch.equal(a[0], b[0]) and a[1] == b[1]
    assert not torch.equal(a[0], c[0]) and a[1] != c[1]
    with pytest.raises(TypeError, match="key"):
        rng.seed_process(1.5)
