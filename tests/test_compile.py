"""Whole-step compilation (``engine.compile``): the compiled step keeps the eager step's
contracts, repeats bitwise against itself, and compiles once per configuration.

Compilation is slow, so the tests share a few tiny models (identical graphs hit inductor's
cache) and use module-scoped runs; the logic-only tests use the ``eager`` dynamo backend
(dynamo traces, nothing is code-generated). Compiled vs eager tolerance: ``rtol=1e-4,
atol=1e-5`` on float32 parameters after the steps below (different kernels round
differently); against itself a compiled run is compared with ``torch.equal``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import astuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from purestep import engine, hardware, optim
from purestep.engine.compile import CompileError, CompileOptions, compile_options

RTOL, ATOL = 1e-4, 1e-5
EAGER_BACKEND = {"backend": "eager"}
# Inductor's CPU code generation fails to build under ATEN_CPU_CAPABILITY=default (torch
# 2.13: its vectorised kernels need the headers that setting leaves out), which the bitwise
# rerun uses; there the repeat/resume tests run the traced graph on torch's own kernels.
INDUCTOR = {"backend": "aot_eager"} if os.environ.get("ATEN_CPU_CAPABILITY") == "default" else True


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def bn_dropout(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 4)
    )


def loss_fn(apply, batch):
    x, y = batch
    logits = apply(x)
    return F.cross_entropy(logits, y), {"acc": (logits.argmax(-1) == y).float().mean()}


def data(n: int = 8, seed: int = 1, batches: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g))
        for _ in range(batches)
    ]


def run(step, state, batches):
    outs = []
    for b in batches:
        state, out = step(state, b)
        outs.append(out)
    return state, outs


def clone(tree):
    return engine.tree.map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


def assert_equal_trees(a, b):
    la, lb = engine.tree.leaves(a), engine.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y)
        else:
            assert x == y


def assert_close_params(a, b, rtol=RTOL, atol=ATOL):
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=rtol, atol=atol, msg=n)


# ---------------------------------------------------------------------- options


def test_compile_options_accept_bool_dict_and_options_and_refuse_bad_input():
    assert compile_options(False) is None
    assert compile_options(True) == CompileOptions()
    assert compile_options({"backend": "eager"}).backend == "eager"
    with pytest.raises(TypeError, match="unknown compile options"):
        compile_options({"modee": "max-autotune"})
    with pytest.raises(TypeError, match="compile must be"):
        compile_options("yes")
    with pytest.raises(ValueError, match="inductor backend only"):
        CompileOptions(backend="eager", mode="max-autotune")
    with pytest.raises(TypeError, match="dynamic"):
        CompileOptions(dynamic="sometimes")
    with pytest.raises(ValueError, match="unknown inductor mode 'fast'.*max-autotune"):
        compile_options({"mode": "fast"})  # refused when given, not at the first step
    assert compile_options({"mode": "max-autotune"}).mode == "max-autotune"


# ---------------------------------------------------------------------- 100 steps, one graph


@pytest.fixture(scope="module")
def hundred_steps():
    """100 compiled steps with a cosine learning-rate schedule (the count, the key and the
    learning rate change every step), next to 100 eager steps."""
    net = mlp()
    tx = optim.adam(optim.schedules.cosine(1e-2, 100))
    batches = data(batches=4)
    state = engine.init(net, tx, seed=0)
    step = engine.train_step(net, loss_fn, tx, compile=True)
    eager = engine.train_step(net, loss_fn, tx)
    s, se = state, state
    for i in range(100):
        s, _ = step(s, batches[i % 4])
        se, _ = eager(se, batches[i % 4])
    return step, s, se


def test_100_steps_compile_once_with_the_counter_key_and_lr_changing(hundred_steps):
    step, s, _ = hundred_steps
    assert step.fused is True
    assert step.compilations == 1
    assert s.opt_state.count == 100 and s.progress.step == 100
    assert isinstance(s.opt_state.count, int)


def test_compiled_run_agrees_with_eager_within_tolerance(hundred_steps):
    _, s, se = hundred_steps
    assert_close_params(s.params, se.params, rtol=1e-3, atol=1e-4)
    assert_close_params(s.opt_state.exp_avg, se.opt_state.exp_avg, rtol=1e-3, atol=1e-4)


# ---------------------------------------------------------------------- purity, keys, buffers


@pytest.fixture(scope="module")
def bn_step():
    net = bn_dropout()
    tx = optim.adam(1e-2)
    return net, tx, engine.train_step(net, loss_fn, tx, compile=INDUCTOR)


@pytest.mark.bitwise
def test_compiled_step_is_pure_leaf_by_leaf_and_repeats_bitwise(bn_step):
    net, tx, step = bn_step
    state = engine.init(net, tx, seed=3)
    state, _ = step(state, data()[0])  # a state with non-zero moments and statistics
    before = clone(state)
    batch = data()[1]
    new, out = step(state, batch)
    assert_equal_trees(state, before)  # every leaf of the input is bitwise unchanged
    again, out2 = step(state, batch)
    assert_equal_trees(new, again)
    assert torch.equal(out.loss, out2.loss)
    # the forward pass's BatchNorm statistics come back in the new state
    assert not torch.equal(new.buffers["1.running_mean"], state.buffers["1.running_mean"])
    assert new.buffers["1.num_batches_tracked"].item() == 2


def test_dropout_is_a_function_of_the_key_and_the_global_rng_is_left_alone(bn_step):
    net, tx, step = bn_step
    batch = data()[0]
    a = engine.init(net, tx, seed=5)
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    new_a, _ = step(a, batch)
    assert torch.equal(torch.rand(3), expected_next)  # the caller's stream did not move
    new_b, _ = step(a.replace(rng=engine.rng.key(6)), batch)
    assert not torch.equal(new_a.params["0.weight"], new_b.params["0.weight"])
    # the next step draws a new mask: same batch, same params, a different key
    masked = [step(a.replace(progress=a.progress.replace(step=i)), batch)[1].loss for i in range(3)]
    assert len({m.item() for m in masked}) == 3


@pytest.mark.bitwise
def test_donation_updates_in_place_with_the_same_result():
    # aot_eager: the same functionalisation of in-place updates as inductor, without codegen
    net = bn_dropout()
    tx = optim.adam(1e-2)
    step = engine.train_step(net, loss_fn, tx, compile={"backend": "aot_eager"})
    state = engine.init(net, tx, seed=3)
    expected, _ = step(state, data()[0])
    donating = step.donating()
    given = clone(state)
    pointers = {n: p.data_ptr() for n, p in given.params.items()}
    new, _ = donating(given, data()[0])
    assert {n: p.data_ptr() for n, p in new.params.items()} == pointers
    assert_equal_trees(new.params, expected.params)
    assert_equal_trees(new.opt_state, expected.opt_state)


def test_an_in_place_write_to_a_buffer_is_refused():
    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 4)
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x):
            self.calls.add_(1)
            return self.lin(x)

    net = Counting()
    tx = optim.sgd(0.1)
    state = engine.init(net, tx)
    step = engine.train_step(net, loss_fn, tx, compile=EAGER_BACKEND)
    with pytest.raises(RuntimeError, match="modified buffers"):
        step(state, data()[0])


# ---------------------------------------------------------------------- shapes and windows


def test_a_short_last_batch_costs_one_more_compilation_and_epochs_none():
    net = mlp()
    tx = optim.adam(1e-2)
    state = engine.init(net, tx)
    step = engine.train_step(net, loss_fn, tx, compile=EAGER_BACKEND)
    epoch = data(8, batches=3) + data(5, seed=2, batches=1)
    for _ in range(3):
        state, _ = run(step, state, epoch)
    assert step.compilations == 2


def test_accumulation_matches_eager_and_compiles_once_per_window_position():
    net = mlp()
    tx = optim.chain(optim.clip_by_global_norm(0.5), optim.adam(1e-2))
    state = engine.init(net, tx)
    step = engine.train_step(net, loss_fn, tx, accumulate=2, compile=EAGER_BACKEND)
    eager = engine.train_step(net, loss_fn, tx, accumulate=2)
    batches = data(batches=6)
    s, outs = run(step, state, batches)
    se, outs_e = run(eager, state, batches)
    assert [o.stepped for o in outs] == [o.stepped for o in outs_e] == [False, True] * 3
    assert astuple(s.progress) == astuple(se.progress)
    assert_close_params(s.params, se.params)
    # the open micro-batch's gradient graph, and the closing whole step
    assert step.compilations == 2
    for o, oe in zip(outs, outs_e):
        torch.testing.assert_close(o.loss, oe.loss, rtol=RTOL, atol=ATOL)
        if o.stepped:
            torch.testing.assert_close(o.grad_norm, oe.grad_norm, rtol=RTOL, atol=ATOL)


def test_injected_hyperparameters_run_the_update_eagerly_and_follow_the_state():
    net = mlp()
    tx = optim.inject_hyperparams(optim.adam)(lr=1e-2)
    state = engine.init(net, tx)
    with _no_warning():  # routed to the eager update up front: no failed trace, no warning
        step = engine.train_step(net, loss_fn, tx, compile=EAGER_BACKEND)
        eager = engine.train_step(net, loss_fn, tx)
        s, _ = run(step, state, data())
    assert step.fused is False
    se, _ = run(eager, state, data())
    assert_close_params(s.params, se.params)
    lowered = s.replace(
        opt_state=s.opt_state.replace(hyperparams={"lr": torch.tensor(0.0, dtype=torch.float64)})
    )
    frozen, _ = step(lowered, data()[0])
    assert_equal_trees(frozen.params, s.params)  # lr 0: nothing moves
    assert step.compilations == 1


class _no_warning:
    """Turn warnings into errors inside the block."""

    def __enter__(self):
        import warnings

        self._cm = warnings.catch_warnings()
        self._cm.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        self._cm.__exit__(*exc)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_matches_eager(precision):
    net = mlp()
    tx = optim.adam(1e-2)
    strategy = hardware.single_device("cpu", precision)
    state = engine.init(net, tx, strategy=strategy)
    step = engine.train_step(net, loss_fn, tx, strategy=strategy, compile=EAGER_BACKEND)
    eager = engine.train_step(net, loss_fn, tx, strategy=strategy)
    s, _ = run(step, state, data())
    se, _ = run(eager, state, data())
    assert step.fused is (precision == "bf16-mixed")
    assert_close_params(s.params, se.params, rtol=1e-2, atol=1e-3)
    if precision == "16-mixed":
        assert astuple(s.precision) == astuple(se.precision)


# ---------------------------------------------------------------------- untraceable code


def test_an_untraceable_loss_names_the_construct_and_the_fallback_works():
    def branching(apply, batch):
        x, y = batch
        logits = apply(x)
        if logits.sum() > 0:  # data-dependent Python control flow
            logits = logits * 2
        return F.cross_entropy(logits, y)

    net = mlp()
    tx = optim.sgd(0.1)
    state = engine.init(net, tx)
    step = engine.train_step(net, branching, tx, compile=EAGER_BACKEND)
    with pytest.raises(CompileError, match="fullgraph") as info:
        step(state, data()[0])
    message = str(info.value)
    assert "branching" in message and "compile=False" in message
    assert "test_compile.py" in message  # where the construct is
    assert_equal_trees(state, engine.init(net, tx))
    relaxed = engine.train_step(
        net, branching, tx, compile={"backend": "eager", "fullgraph": False}
    )
    eager = engine.train_step(net, branching, tx)
    s, _ = run(relaxed, state, data())
    se, _ = run(eager, state, data())
    assert_close_params(s.params, se.params)


def test_an_ordinary_error_in_the_loss_is_raised_as_it_is():
    def wrong(apply, batch):
        x, _ = batch
        return apply(x[:, :3]).sum()  # the model takes 8 features

    net = mlp()
    tx = optim.sgd(0.1)
    step = engine.train_step(net, wrong, tx, compile=EAGER_BACKEND)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as info:
        step(engine.init(net, tx), data()[0])
    assert not isinstance(info.value, CompileError)


# ---------------------------------------------------------------------- eval and predict


def test_compiled_eval_and_predict_match_eager():
    net = bn_dropout()
    tx = optim.sgd(0.1)
    state, _ = engine.train_step(net, loss_fn, tx)(engine.init(net, tx), data()[0])
    ev = engine.eval_step(net, loss_fn, compile=EAGER_BACKEND)
    pr = engine.predict_step(net, compile=EAGER_BACKEND)
    before = clone(state)
    for b in data() + data(5, batches=1):
        out, ref = ev(state, b), engine.eval_step(net, loss_fn)(state, b)
        assert out.keys() == ref.keys()
        for k in out:
            torch.testing.assert_close(out[k], ref[k], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(
            pr(state, b[0]), engine.predict_step(net)(state, b[0]), rtol=RTOL, atol=ATOL
        )
    assert_equal_trees(state, before)
    assert ev.compilations == 2 and pr.compilations == 2  # full batches, the short one


# ---------------------------------------------------------------------- the Trainer


def test_trainer_compile_flag_fits_like_eager(tmp_path):
    from purestep import Trainer

    x, y = torch.randn(40, 8), torch.randint(0, 4, (40,))
    results = {}
    for flag in (False, True):
        trainer = Trainer(
            max_epochs=2,
            compile={"backend": "eager"} if flag else False,
            default_root_dir=str(tmp_path / str(flag)),
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        net = mlp()
        loader = DataLoader(TensorDataset(x, y), batch_size=16)
        val = DataLoader(TensorDataset(x[:12], y[:12]), batch_size=8)
        results[flag] = trainer.fit(net, loss_fn, optim.adam(1e-2), loader, val)
        step = trainer._loop.step
        assert isinstance(step, engine.compile.CompiledTrainStep) is flag
        assert isinstance(trainer._loop.eval_step, engine.compile.CompiledEvalStep) is flag
        if flag:
            # the loop runs step.donating(backward=False): its graphs are its own
            assert trainer._loop._stepper.compilations == 2  # full batches, the short last
    assert astuple(results[True].progress) == astuple(results[False].progress)
    assert_close_params(results[True].params, results[False].params)
    with pytest.raises(TypeError, match="compile"):
        Trainer(compile="fast")
    with pytest.raises(TypeError, match=r"unknown compile options \['modee'\]"):
        Trainer(compile={"modee": "max-autotune"})
    with pytest.raises(ValueError, match="unknown inductor mode"):
        Trainer(compile={"mode": "fast"})


# ---------------------------------------------------------------------- fresh process, resume

_CHILD = textwrap.dedent(
    """
    import sys, time, torch
    torch.set_num_threads({threads!r})  # as the parent: reductions split by thread count
    sys.path.insert(0, {tests!r})
    from test_compile import bn_dropout, loss_fn, data
    from purestep import engine, optim
    net = bn_dropout()
    tx = optim.adam(1e-2)
    step = engine.train_step(net, loss_fn, tx, compile={compile!r})
    state, _ = engine.checkpoint.load({path!r}, target=engine.init(net, tx, seed=9))
    start = time.perf_counter()
    for b in data(batches=3):
        state, _ = step(state, b)
    engine.checkpoint.save(state, {out!r})
    print("warm_compile_s", step.compile_seconds, time.perf_counter() - start)
    """
)


@pytest.mark.bitwise
def test_a_compiled_run_resumed_in_a_fresh_process_ends_bitwise_equal(tmp_path):
    # a step of its own, called exactly as the child calls its step (the shared one has seen
    # other states; inductor's cache makes this compilation cheap)
    net = bn_dropout()
    tx = optim.adam(1e-2)
    step = engine.train_step(net, loss_fn, tx, compile=INDUCTOR)
    state = engine.init(net, tx, seed=9)
    batches = data(batches=3)
    half, _ = run(step, state, batches)
    uninterrupted, _ = run(step, half, batches)
    engine.checkpoint.save(half, str(tmp_path / "half.ckpt"))
    child = _CHILD.format(
        tests=os.path.dirname(__file__),
        path=str(tmp_path / "half.ckpt"),
        out=str(tmp_path / "end.ckpt"),
        compile=INDUCTOR,
        threads=torch.get_num_threads(),
    )
    done = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    resumed, _ = engine.checkpoint.load(str(tmp_path / "end.ckpt"), target=uninterrupted)
    assert_equal_trees(resumed, uninterrupted)


# ---------------------------------------------------------------------- strategies


class TwoRanks(engine.Local):
    """Two identical ranks: the all-reduce of the mean hands back each gradient (counted)."""

    reduces = 0

    @property
    def world_size(self) -> int:
        return 2

    def all_reduce(self, tree, op="mean"):
        TwoRanks.reduces += 1
        return engine.tree.map(lambda g: g.clone(), tree)

    def sync_step_buffers(self, buffers):
        return buffers


def test_several_processes_run_the_gradient_graph_then_the_all_reduce_then_the_update():
    net = mlp()
    tx = optim.adam(1e-2)
    strategy = TwoRanks()
    state = engine.init(net, tx)
    step = engine.train_step(net, loss_fn, tx, strategy=strategy, compile=EAGER_BACKEND)
    eager = engine.train_step(net, loss_fn, tx, strategy=strategy)
    before = TwoRanks.reduces
    s, _ = run(step, state, data())
    assert TwoRanks.reduces - before == 3  # one all-reduce per step, between the graphs
    assert step.fused is False
    assert step.compilations == 2  # the gradient graph and the update graph
    se, _ = run(eager, state, data())
    assert_close_params(s.params, se.params)


def test_a_compiled_ensemble_matches_its_eager_twin():
    net = mlp()
    tx = optim.adam(1e-2)
    ens = hardware.ensemble(3, clip_grad_norm=0.5)
    state = engine.init(net, tx, seed=0, strategy=ens)
    step = engine.train_step(net, loss_fn, tx, strategy=ens, compile=EAGER_BACKEND)
    eager = engine.train_step(net, loss_fn, tx, strategy=ens)
    s, outs = run(step, state, data())
    se, outs_e = run(eager, state, data())
    assert type(step).__name__ == "CompiledEnsembleTrainStep" and step.fused
    assert step.compilations == 1
    assert_close_params(s.params, se.params)
    torch.testing.assert_close(outs[-1].loss, outs_e[-1].loss, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(outs[-1].grad_norm, outs_e[-1].grad_norm, rtol=RTOL, atol=ATOL)


def test_an_eager_per_sample_step_compiles_to_its_two_piece_form():
    # (the compiled DP-SGD step itself is tested in test_compile_per_sample.py)
    eager = engine.per_sample_step(
        mlp(), loss_fn, optim.sgd(0.1), max_grad_norm=1.0, noise_multiplier=0.0
    )
    step = engine.compile.compiled(eager, EAGER_BACKEND)
    assert type(step).__name__ == "CompiledPerSampleStep"
    assert step.max_grad_norm == 1.0 and step.options.backend == "eager"


def test_a_step_class_with_its_own_update_and_no_traced_form_is_refused():
    # (as hardware.fsdp's step: the graphs would trace the base update and skip its own)
    class OwnUpdate(engine.TrainStep):
        def _update(self, state, grads, norms):
            return super()._update(state, grads, norms)

    net = mlp()
    step = OwnUpdate(net, loss_fn, optim.sgd(0.1))
    with pytest.raises(ValueError, match="OwnUpdate.*_traced_update.*compile=False"):
        engine.compile.compiled(step)


def test_an_untraceable_optimizer_runs_eagerly_after_the_gradient_graph_with_a_warning():
    net = mlp()
    tx = optim.skip_nonfinite(optim.adam(1e-2))  # its finite check is a host sync
    state = engine.init(net, tx)
    step = engine.train_step(net, loss_fn, tx, compile=EAGER_BACKEND)
    with pytest.warns(UserWarning, match="optimizer update could not be traced"):
        s, _ = run(step, state, data())
    assert step.fused is False
    se, _ = run(engine.train_step(net, loss_fn, tx), state, data())
    assert_close_params(s.params, se.params)
    nan = (torch.full((8, 8), float("nan")), data()[0][1])
    skipped, out = step(s, nan)
    assert out.skipped and skipped.opt_state.skipped == 1
    assert_equal_trees(skipped.params, s.params)


# ---------------------------------------------------------------------- global dynamo config


def test_marking_the_counter_dynamic_leaves_a_users_own_torch_compile_alone():
    """The step marks its optimizer-state ints dynamic by appending to the process-wide
    ``torch.compiler.config.dynamic_sources``; the names start with an argument name only the
    engine's graphs use, so a user's compiled function specialises and recompiles exactly as
    without it, and a user's own entries are kept."""
    from uuid import uuid4

    from torch._dynamo.testing import CompileCounter

    def uuid() -> str:
        return f"<user {uuid4().hex}>"

    def user_recompiles() -> int:
        # a function of its own each time (dynamo keeps graphs per code object)
        ns: dict = {}
        exec(compile("def scaled(x, count):\n    return x * count\n", uuid(), "exec"), ns)
        counter = CompileCounter()
        scaled = torch.compile(ns["scaled"], backend=counter, fullgraph=True)
        for c in (1, 2, 3, 4):
            scaled(torch.ones(2), c)
        return counter.frame_count

    config = torch.compiler.config
    with config.patch(dynamic_sources="L['n']"):
        before = user_recompiles()
        net = mlp()
        tx = optim.adam(optim.schedules.cosine(1e-2, 10))
        step = engine.train_step(net, loss_fn, tx, compile=EAGER_BACKEND)
        run(step, engine.init(net, tx), data())
        marked = [s for s in config.dynamic_sources.split(",") if s]
        assert marked[0] == "L['n']" and len(marked) > 1
        assert all(s.startswith("L['purestep_opt_state']") for s in marked[1:])
        assert user_recompiles() == before
        assert step.compilations == 1


# ---------------------------------------------------------------------- real DDP (gloo)


def _ddp_compiled_and_eager(rank: int) -> dict:
    """On one of two gloo ranks: the same 3 Adam steps eagerly and compiled (``aot_eager``:
    the gradient graph, the all-reduce between the graphs, the update graph), each rank on
    its half of every batch."""
    strategy = hardware.ddp(timeout=30)
    out: dict = {}
    for name, compile in (("eager", False), ("compiled", {"backend": "aot_eager"})):
        net = mlp()
        tx = optim.adam(1e-2)
        state = engine.init(net, tx, seed=0, strategy=strategy)
        step = engine.train_step(net, loss_fn, tx, strategy=strategy, compile=compile)
        for x, y in data(8, batches=3):
            state, _ = step(state, (x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4]))
        out[name] = state.params
        if compile:
            out["fused"], out["compilations"] = step.fused, step.compilations
    return out


@pytest.mark.timeout(150)
def test_a_compiled_ddp_step_on_two_gloo_ranks_matches_the_eager_ddp_step():
    ranks = hardware.launch(_ddp_compiled_and_eager, 2, max_seconds=120, timeout=30)
    for r in ranks:
        assert r["fused"] is False and r["compilations"] == 2  # gradient graph, update graph
        assert_close_params(r["compiled"], r["eager"])
    assert_equal_trees(ranks[0]["compiled"], ranks[1]["compiled"])  # the ranks stay in sync


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize(
    "tx",
    [
        optim.adamw(1e-2, weight_decay=0.1),
        optim.adam(1e-2, amsgrad=True),
        optim.adam(1e-2, maximize=True, weight_decay=0.01),
        optim.adam(optim.schedules.cosine(1e-2, 10)),
    ],
    ids=["adamw", "amsgrad", "maximize_l2", "cosine_lr"],
)
def test_traced_adam_keeps_its_count_scalars_as_tensors_and_matches_eager(tx, donate):
    """Traced, Adam computes its bias corrections and step size as 0-d tensors (so inductor
    does not recompute the count's powers per element); every variant still follows the
    eager update to float32 rounding over 12 steps."""
    batches = data(batches=4) * 3
    finals = []
    for comp in (False, {"backend": "aot_eager"}):
        state = engine.init(mlp(), tx)
        step = engine.train_step(mlp(), loss_fn, tx, compile=comp, donate=donate)
        for b in batches:
            state, _ = step(state, b)
        finals.append(state.params)
    for name in finals[0]:
        torch.testing.assert_close(finals[1][name], finals[0][name], rtol=1e-5, atol=1e-6)
