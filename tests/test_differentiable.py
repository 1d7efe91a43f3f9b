"""Differentiating through training: ``engine.train_step(..., differentiable=True)``.

* Hypergradients and gradients with respect to the initial parameters, through k = 1..5
  unrolled steps of SGD, momentum SGD (with dampening, and Nesterov), Adam and AdamW, equal
  central finite differences of the ordinary step's results (float64; tolerance below).
* The differentiable step's values are bitwise the ordinary step's (``torch.equal``).
* What cannot be differentiated is refused with a ``ValueError`` saying why.
* The MAML example's meta-gradient equals a hand-written ``torch.autograd`` version of the
  same unrolled loop bitwise; the learned-rate example beats its starting rate; the docs
  page's blocks run.
"""

from __future__ import annotations

import os
import runpy

import pytest
import torch
from torch import nn

from purestep import engine, hardware
from purestep.engine import optim
from purestep.engine.differentiable import leaf_params, loss_of, unroll, with_hyperparams
from purestep.engine.strategy import Local
from purestep.engine.tree import leaves
from tests.docs_book import PAGE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
DOC = os.path.join(ROOT, "docs", "differentiable.md")
F64 = torch.float64

# Central differences ``(f(h + e) - f(h - e)) / 2e`` with ``e = 1e-4 * |h|`` in float64: the
# truncation error is about ``e**2 * f''' / 6`` (1e-9 relative here) and the rounding error
# about ``1e-16 * |f| / e`` (below 1e-9 for these values), so rtol 1e-6 has a wide margin and
# still catches a wrong term (a missing tangent is off by 1e-2 or more).
# The initial parameters move along a random direction (norm about 6) by ``PARAM_STEP``:
# smaller, since Adam's first steps are sharply curved in the gradient near zero (``g /
# (|g| + eps)``), where a larger step's truncation error reaches 1e-5 relative.
RTOL, ATOL = 1e-6, 1e-10
STEP = 1e-4
PARAM_STEP = 1e-7


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).to(F64)


MODEL = _model()


def _batches(n: int, size: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, 3, generator=g, dtype=F64), torch.randn(size, 1, generator=g, dtype=F64))
        for _ in range(n)
    ]


BATCHES = _batches(5, 16, 1)
VAL = _batches(1, 32, 2)[0]


def loss_fn(apply, batch):
    x, y = batch
    return ((apply(x) - y) ** 2).mean()


def objective(params: dict[str, torch.Tensor]) -> torch.Tensor:
    """The held-out loss of ``params``, computed without purestep."""
    x, y = VAL
    return ((torch.func.functional_call(MODEL, params, (x,)) - y) ** 2).mean()


#: name -> (factory, hyper-parameters differentiated, static arguments)
CONFIGS = {
    "sgd": (optim.sgd, {"lr": 0.1, "weight_decay": 0.01}, {}),
    "momentum": (
        optim.sgd,
        {"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01},
        {},
    ),
    "nesterov": (optim.sgd, {"lr": 0.1, "momentum": 0.8, "weight_decay": 0.02}, {"nesterov": True}),
    "adam": (
        optim.adam,
        {"lr": 0.01, "betas": (0.9, 0.99), "eps": 1e-3, "weight_decay": 0.01},
        {},
    ),
    "adamw": (optim.adamw, {"lr": 0.01, "betas": (0.8, 0.95), "weight_decay": 0.1}, {}),
}


def _optimizer(name: str, values: dict):
    factory, _, static = CONFIGS[name]
    return optim.inject_hyperparams(factory)(**values, **static)


def _tensors(values: dict) -> dict:
    def one(v):
        return torch.tensor(v, dtype=F64, requires_grad=True)

    return {
        n: tuple(one(x) for x in v) if isinstance(v, tuple) else one(v) for n, v in values.items()
    }


def _flat(values: dict) -> list[tuple[tuple[str, int | None], float]]:
    out = []
    for n, v in values.items():
        if isinstance(v, tuple):
            out += [((n, i), x) for i, x in enumerate(v)]
        else:
            out.append(((n, None), v))
    return out


def _with(values: dict, where: tuple[str, int | None], x: float) -> dict:
    name, i = where
    if i is None:
        return {**values, name: x}
    seq = list(values[name])
    seq[i] = x
    return {**values, name: tuple(seq)}


def ordinary_run(name: str, values: dict, k: int, shift: dict | None = None) -> dict:
    """Final params after ``k`` ordinary steps (float hyper-parameters), initial params
    shifted by ``shift``."""
    opt = _optimizer(name, values)
    step = engine.train_step(MODEL, loss_fn, opt)
    state = engine.init(MODEL, opt)
    if shift is not None:
        state = state.replace(params={n: p + shift[n] for n, p in state.params.items()})
    for batch in BATCHES[:k]:
        state, _ = step(state, batch)
    return state.params


def central(f, x: float, e: float) -> float:
    return (float(f(x + e)) - float(f(x - e))) / (2 * e)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_gradients_through_k_steps_equal_central_differences(name, k):
    _, values, _ = CONFIGS[name]
    opt = _optimizer(name, values)
    step = engine.train_step(MODEL, loss_fn, opt, differentiable=True)
    start = leaf_params(engine.init(MODEL, opt))
    hyper = _tensors(values)
    final, outputs = unroll(step, with_hyperparams(start, **hyper), BATCHES[:k])
    assert len(outputs) == k and all(out.stepped for out in outputs)
    hyper_leaves = [t for v in hyper.values() for t in (v if isinstance(v, tuple) else (v,))]
    params = list(start.params.values())
    grads = torch.autograd.grad(objective(final.params), hyper_leaves + params, allow_unused=True)
    grads = [torch.zeros((), dtype=F64) if g is None else g for g in grads]  # unused: 0

    for (where, value), g in zip(_flat(values), grads):
        fd = central(
            lambda x, where=where: objective(ordinary_run(name, _with(values, where, x), k)),
            value,
            STEP * abs(value),
        )
        assert abs(float(g) - fd) <= RTOL * abs(fd) + ATOL, (where, float(g), fd)

    # initial parameters: the directional derivative along a random direction
    gen = torch.Generator().manual_seed(3)
    direction = {n: torch.randn(p.shape, generator=gen, dtype=F64) for n, p in start.params.items()}
    dot = sum(
        float((g * direction[n]).sum()) for n, g in zip(start.params, grads[len(hyper_leaves) :])
    )
    fd = central(
        lambda e: objective(
            ordinary_run(name, values, k, {n: e * d for n, d in direction.items()})
        ),
        0.0,
        PARAM_STEP,
    )
    assert abs(dot - fd) <= RTOL * abs(fd) + ATOL, (dot, fd)


def test_momentum_and_dampening_have_no_effect_on_the_first_step():
    # torch's first momentum buffer is the gradient itself: the hypergradients are absent
    # (not in the graph), which is right, and the finite differences agree (exactly zero).
    _, values, _ = CONFIGS["momentum"]
    assert central(
        lambda x: objective(ordinary_run("momentum", {**values, "momentum": x}, 1)), 0.9, 1e-4
    ) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("grad", ["autograd", "func"])
def test_torch_func_grad_through_the_unroll_equals_autograd(grad):
    opt = optim.inject_hyperparams(optim.sgd)(lr=0.1, momentum=0.9)
    step = engine.train_step(MODEL, loss_fn, opt, differentiable=True, grad=grad)
    start = engine.init(MODEL, opt)

    def by_params(params):
        final, _ = unroll(step, start.replace(params=params), BATCHES[:3])
        return objective(final.params)

    # the reference: the autograd inner step, differentiated by torch.autograd (a grad="func"
    # step that cut its inner gradients' graph would differ from it)
    reference = engine.train_step(MODEL, loss_fn, opt, differentiable=True)
    leaf = leaf_params(start)
    final, _ = unroll(reference, leaf, BATCHES[:3])
    want = torch.autograd.grad(objective(final.params), list(leaf.params.values()))
    got = torch.func.grad(by_params)(dict(start.params))
    for w, g in zip(want, got.values()):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)  # the same ops; see below

    if grad == "func":  # hyper-parameters under torch.func.grad need the torch.func inner step

        def by_lr(lr, step=step):
            final, _ = unroll(step, with_hyperparams(start, lr=lr), BATCHES[:3])
            return objective(final.params)

        # a fresh step whose first call is inside torch.func.grad over the learning rate
        fresh = engine.train_step(MODEL, loss_fn, opt, differentiable=True, grad="func")
        first = torch.func.grad(lambda lr: by_lr(lr, fresh))(torch.tensor(0.1, dtype=F64))

        lr = torch.tensor(0.1, dtype=F64, requires_grad=True)
        (want_lr,) = torch.autograd.grad(by_lr(lr, reference), [lr])
        torch.testing.assert_close(torch.func.grad(by_lr)(torch.tensor(0.1, dtype=F64)), want_lr)
        torch.testing.assert_close(first, want_lr)


def test_torch_func_grad_over_hyperparameters_with_the_autograd_step_says_what_to_do():
    opt = optim.inject_hyperparams(optim.sgd)(lr=0.1)
    step = engine.train_step(MODEL, loss_fn, opt, differentiable=True)
    start = engine.init(MODEL, opt)

    def by_lr(lr):
        final, _ = unroll(step, with_hyperparams(start, lr=lr), BATCHES[:1])
        return objective(final.params)

    with pytest.raises(ValueError, match="grad='func'"):
        torch.func.grad(by_lr)(torch.tensor(0.1, dtype=F64))


# --------------------------------------------------------------------------- bitwise


def _run(name, values, k, *, diff, grad="autograd", accumulate=1, strategy=None):
    opt = _optimizer(name, values)
    step = engine.train_step(
        MODEL,
        loss_fn,
        opt,
        differentiable=diff,
        grad=grad,
        accumulate=accumulate,
        strategy=strategy,
    )
    state = engine.init(MODEL, opt)
    if diff:
        state = with_hyperparams(leaf_params(state), **_tensors(values))
    outs = []
    for batch in BATCHES[:k]:
        state, out = step(state, batch)
        outs.append(out)
    return state, outs


@pytest.mark.bitwise
@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize(
    "options", [{}, {"grad": "func"}, {"accumulate": 2}], ids=["autograd", "func", "accumulate"]
)
def test_differentiable_values_are_bitwise_the_ordinary_steps(name, options):
    _, values, _ = CONFIGS[name]
    want, want_out = _run(name, values, 5, diff=False, **options)
    got, got_out = _run(name, values, 5, diff=True, **options)
    assert got.params["0.weight"].grad_fn is not None  # the graph is kept
    for a, b in zip(leaves(got.params), leaves(want.params)):
        assert torch.equal(a, b)
    for a, b in zip(leaves(got.opt_state), leaves(want.opt_state)):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    for a, b in zip(got_out, want_out):
        assert torch.equal(a.loss, b.loss) and a.loss.grad_fn is None
        assert a.stepped == b.stepped
        if a.stepped:
            assert torch.equal(a.grad_norm, b.grad_norm)
    assert (got.progress.step, got.progress.samples) == (want.progress.step, want.progress.samples)


@pytest.mark.bitwise
def test_single_device_strategy_is_accepted_and_gives_the_same_values():
    _, values, _ = CONFIGS["momentum"]
    want, _ = _run("momentum", values, 3, diff=True)
    got, _ = _run("momentum", values, 3, diff=True, strategy=hardware.single_device("cpu"))
    for a, b in zip(leaves(got.params), leaves(want.params)):
        assert torch.equal(a, b)


def test_the_input_state_is_left_unchanged():
    opt = optim.adam(0.01)
    step = engine.train_step(MODEL, loss_fn, opt, differentiable=True)
    state = leaf_params(engine.init(MODEL, opt))
    state, _ = step(state, BATCHES[0])
    tensors = [t for t in leaves((state.params, state.opt_state)) if isinstance(t, torch.Tensor)]
    before = [t.detach().clone() for t in tensors]
    versions = [t._version for t in tensors]
    step(state, BATCHES[1])
    assert [t._version for t in tensors] == versions  # nothing written in place
    assert all(torch.equal(a, b) for a, b in zip(before, tensors))


def test_direct_tensor_hyperparameters_get_their_gradient():
    lr = torch.tensor(0.1, dtype=F64, requires_grad=True)
    step = engine.train_step(MODEL, loss_fn, optim.sgd(lr, momentum=0.9), differentiable=True)
    final, _ = unroll(step, engine.init(MODEL, optim.sgd(0.1, momentum=0.9)), BATCHES[:2])
    (g,) = torch.autograd.grad(objective(final.params), [lr])
    fd = central(
        lambda x: objective(ordinary_run("momentum", {"lr": x, "momentum": 0.9}, 2)), 0.1, 1e-5
    )
    assert abs(float(g) - fd) <= RTOL * abs(fd) + ATOL


def test_loss_of_keeps_the_graph_and_equals_the_step_loss():
    opt = optim.sgd(0.1)
    step = engine.train_step(MODEL, loss_fn, opt, differentiable=True)
    state = leaf_params(engine.init(MODEL, opt))
    loss = loss_of(step, state, BATCHES[0])
    _, out = step(state, BATCHES[0])
    assert loss.grad_fn is not None and torch.equal(loss.detach(), out.loss)


@pytest.mark.bitwise
def test_the_per_tensor_foreach_ops_are_bitwise_torchs():
    from purestep.engine.optim._per_tensor import _TABLE

    gen = torch.Generator().manual_seed(4)
    shapes = [(2,), (1,), (1, 8), (3, 5)]  # (1, n) after the first: foreach addcdiv's bug

    def lists(k):
        return [[torch.rand(s, generator=gen) + 0.5 for s in shapes] for _ in range(k)]

    for func, ours in _TABLE.items():
        name = func.__name__
        arity = {"_foreach_sqrt": 1, "_foreach_neg": 1}.get(name.rstrip("_"))
        if arity is None:
            arity = 3 if "addc" in name else 2
        args = lists(arity)
        extra = (0.3,) if "addc" in name or "lerp" in name else ()
        kwargs = {"alpha": -0.7} if name.rstrip("_") in ("_foreach_add", "_foreach_sub") else {}
        mine = [[t.clone() for t in a] for a in args]
        want = func(*args, *extra, **kwargs)
        got = ours(*mine, *extra, **kwargs)
        if name.endswith("_"):  # in place: compare the first lists
            want, got = args[0], mine[0]
        assert all(torch.equal(a, b) for a, b in zip(got, want)), name


# --------------------------------------------------------------------------- refusals


class _TwoProcesses(Local):
    world_size = 2


class _Scaled(Local):
    precision = hardware.single_device("cpu", precision="16-mixed").precision


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"compile": True}, "AOTAutograd, which does not support double backward"),
        ({"donate": True}, "cannot donate: .*in place"),
        ({"strategy": hardware.ensemble(2)}, "builds its own step"),
        ({"strategy": _TwoProcesses()}, "world_size=2"),
        ({"strategy": _Scaled()}, "float16 loss scaling"),
    ],
    ids=["compile", "donate", "ensemble", "two-processes", "fp16-scaling"],
)
def test_what_cannot_be_differentiated_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        engine.train_step(MODEL, loss_fn, optim.sgd(0.1), differentiable=True, **kwargs)


def test_other_misuses_are_refused_clearly():
    step = engine.train_step(MODEL, loss_fn, optim.sgd(0.1), differentiable=True)
    with pytest.raises(ValueError, match="cannot donate"):
        step.donating()
    with pytest.raises(TypeError, match="differentiable must be a bool"):
        engine.train_step(MODEL, loss_fn, optim.sgd(0.1), differentiable="yes")
    plain = engine.train_step(MODEL, loss_fn, optim.sgd(0.1))
    state = engine.init(MODEL, optim.sgd(0.1))
    with pytest.raises(TypeError, match="needs a differentiable step"):
        unroll(plain, state, BATCHES[:1])
    with pytest.raises(KeyError, match="no injected hyper-parameters"):
        with_hyperparams(state, lr=torch.tensor(0.1))
    with pytest.raises(KeyError, match="no parameters"):
        leaf_params(state, ["nope"])
    mu = torch.tensor(0.0, dtype=F64, requires_grad=True)
    zero = engine.train_step(MODEL, loss_fn, optim.sgd(0.1, momentum=mu), differentiable=True)
    with pytest.raises(ValueError, match="momentum=0 keeps no momentum buffer"):
        zero(state, BATCHES[0])


# --------------------------------------------------------------------------- examples


def _example(name: str, monkeypatch):
    monkeypatch.syspath_prepend(EXAMPLES)
    return runpy.run_path(os.path.join(EXAMPLES, name))


@pytest.mark.bitwise
@pytest.mark.parametrize("inner_steps", [1, 2, 3])
def test_maml_meta_gradient_is_bitwise_the_hand_written_one(inner_steps, monkeypatch):
    ns = _example("maml.py", monkeypatch)
    torch.manual_seed(0)
    model = ns["make_model"]()
    tasks = ns["sample_tasks"](torch.Generator().manual_seed(inner_steps), 4, 10, 10)
    state = engine.init(model, optim.sgd(0.01))
    step = ns["inner_step"](model, 0.01)
    ours, our_loss = ns["meta_gradient"](step, state, tasks, inner_steps)
    theirs, their_loss = ns["meta_gradient_by_hand"](model, state.params, tasks, inner_steps, 0.01)
    assert torch.equal(our_loss, their_loss)
    assert list(ours) == list(theirs)
    for n in ours:
        assert torch.equal(ours[n], theirs[n]), n


def test_maml_example_meta_trains(monkeypatch, capsys):
    main = _example("maml.py", monkeypatch)["main"]
    last = main(["--meta-steps", "120", "--log-every", "40"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == f"meta_loss={last:.4f}"
    windows = [float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("meta-step")]
    assert len(windows) == 3 and windows[-1] < windows[0]


def test_learned_rate_beats_the_starting_rate(monkeypatch, capsys):
    result = _example("learned_lr.py", monkeypatch)["main"]([])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("learned_lr=")
    assert result["learned_lr"] > 0.001  # the starting rate is too small: it grows
    assert result["learned_loss"] < result["start_loss"]


# --------------------------------------------------------------------------- the docs page

MAML_BLOCK = "from purestep import engine  # differentiable MAML"
HYPER_BLOCK = "from purestep.engine import differentiable, optim  # a hypergradient"


@PAGE.runs(MAML_BLOCK, HYPER_BLOCK)
def test_the_docs_page_blocks_run():
    ns: dict = {}
    PAGE.run(MAML_BLOCK, ns)
    assert ns["meta_grads"]["0.weight"].shape == (8, 3)
    PAGE.run(HYPER_BLOCK, ns)
    assert ns["lr_grad"].shape == () and torch.isfinite(ns["lr_grad"])
