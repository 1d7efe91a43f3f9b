"""Hugging Face ``transformers`` models (tiny configs, nothing downloaded) trained through
purestep: ``hf_loss`` on dict batches, tied embeddings, keyed dropout, compile, bf16-mixed,
gradient checkpointing, DDP and FSDP, and the trained weights back through
``save_pretrained`` / ``from_pretrained``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from purestep import Trainer, engine, hardware  # noqa: E402
from purestep.engine import optim, rng  # noqa: E402
from purestep.loops.integrations.hf_datasets import hf_loader  # noqa: E402
from purestep.loops.integrations.hf_models import (  # noqa: E402
    HFTask,
    block_classes,
    hf_loss,
    save_pretrained,
)
from purestep.loops.loggers import MemoryLogger  # noqa: E402
from tests.docs_book import PAGE  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 64


def gpt2(dropout: float = 0.1, layers: int = 2) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=16,
        n_embd=32,
        n_layer=layers,
        n_head=2,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


def bert() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
    )
    return transformers.BertForMaskedLM(config)


def vit() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        image_size=8,
        patch_size=4,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=3,
    )
    return transformers.ViTForImageClassification(config)


def text_batch(seed: int = 0, size: int = 4, length: int = 12) -> dict[str, torch.Tensor]:
    """Token ids with a padded tail: the mask hides it and the labels ignore it (-100)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (size, length), generator=g)
    mask = torch.ones_like(ids)
    mask[:, -3:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def image_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "pixel_values": torch.randn(4, 3, 8, 8, generator=g),
        "labels": torch.randint(0, 3, (4,), generator=g),
    }


def train(model, batches, opt=None, **step_options):
    opt = opt or optim.adamw(1e-2)
    state = engine.init(model, opt, seed=0, strategy=step_options.pop("strategy_init", None))
    step = engine.train_step(model, hf_loss, opt, **step_options)
    losses = []
    for batch in batches:
        state, out = step(state, batch)
        losses.append(float(out.loss))
    return state, losses


def wte_and_head(module):
    return module.transformer.wte.weight, module.lm_head.weight


# ---------------------------------------------------------------------- models train


@pytest.mark.parametrize(
    "make, batch",
    [(gpt2, text_batch), (bert, text_batch), (vit, image_batch)],
    ids=["gpt2", "bert", "vit"],
)
def test_models_from_configs_train_on_their_own_loss(make, batch):
    model = make()
    state, losses = train(model, [batch(0)] * 8)
    assert losses[-1] < losses[0] - 0.1, losses  # the same batch: the loss must fall
    trained = engine.to_module(state, model)
    with torch.no_grad():
        assert float(trained.eval()(**batch(0)).loss) < losses[0]


@pytest.mark.bitwise
def test_tied_embeddings_stay_one_tensor_through_training_to_module_and_save_pretrained(
    tmp_path,
):
    model = gpt2()
    state, _ = train(model, [text_batch(i) for i in range(3)])
    # one tensor in the state for both slots, and it trained
    assert "lm_head.weight" not in state.params
    assert not torch.equal(state.params["transformer.wte.weight"], model.transformer.wte.weight)
    trained = engine.to_module(state, model)
    wte, head = wte_and_head(trained)
    assert wte is head and torch.equal(wte, state.params["transformer.wte.weight"])
    assert wte_and_head(model)[0] is wte_and_head(model)[1]  # the template is untouched
    saved = save_pretrained(state, model, tmp_path / "gpt2")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2")
    wte, head = wte_and_head(loaded)
    assert wte.data_ptr() == head.data_ptr()
    want = saved.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    batch = text_batch(9)
    with torch.no_grad():
        assert torch.equal(loaded.eval()(**batch).logits, saved.eval()(**batch).logits)


@pytest.mark.bitwise
def test_dropout_is_keyed_by_the_state():
    model = gpt2(dropout=0.3)
    opt = optim.sgd(0.1)
    state = engine.init(model, opt, seed=0)
    step = engine.train_step(model, hf_loss, opt)
    batch = text_batch()
    a, out_a = step(state, batch)
    b, out_b = step(state, batch)
    assert torch.equal(out_a.loss, out_b.loss)
    assert all(torch.equal(a.params[k], b.params[k]) for k in a.params)
    _, out_c = step(state.replace(rng=rng.key(1)), batch)  # another key: other masks
    assert not torch.equal(out_a.loss, out_c.loss)
    eval_model = gpt2(dropout=0.0)
    _, out_d = engine.train_step(eval_model, hf_loss, opt)(engine.init(eval_model, opt), batch)
    assert not torch.equal(out_a.loss, out_d.loss)  # the dropout did draw


@pytest.mark.bitwise
def test_gradient_checkpointing_recomputes_the_same_dropout():
    plain = gpt2(dropout=0.3)
    checkpointed = gpt2(dropout=0.3)
    checkpointed.activation_checkpointing_enable()  # the model's own switch, nothing else
    assert any(getattr(m, "gradient_checkpointing", False) for m in checkpointed.modules())
    batches = [text_batch(i) for i in range(3)]
    a, losses_a = train(plain, batches, optim.sgd(0.1))
    b, losses_b = train(checkpointed, batches, optim.sgd(0.1))
    # the recomputation runs on the state's weights and replays the step's dropout masks
    assert losses_a == losses_b
    for name in a.params:
        assert torch.equal(a.params[name], b.params[name]), name


def test_bf16_mixed_trains_close_to_float32():
    model = gpt2(dropout=0.0)
    batches = [text_batch(0)] * 3
    _, ref = train(model, batches, optim.sgd(0.1))
    strategy = hardware.single_device("cpu", precision="bf16-mixed")
    state, got = train(model, batches, optim.sgd(0.1), strategy=strategy, strategy_init=strategy)
    assert state.params["transformer.wte.weight"].dtype == torch.float32  # master weights
    # bfloat16 keeps 8 bits of mantissa: the losses agree to about 1e-2 relative
    assert got != ref and all(abs(g - r) <= 2e-2 * abs(r) for g, r in zip(got, ref))


def test_a_task_trains_through_the_trainer_on_a_dataset():
    rows = {key: value.repeat(4, 1).tolist() for key, value in text_batch().items()}
    ds = datasets.Dataset.from_dict(rows).with_format("torch")
    model = gpt2()
    trainer = Trainer(
        max_epochs=2,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=MemoryLogger(),
    )
    task = HFTask(model, optim.adamw(1e-2))
    state = trainer.fit(task, hf_loader(ds, 4, shuffle=True), hf_loader(ds, 4))
    assert state.progress.step == 8
    assert trainer.callback_metrics["val_loss"] < 4.0  # ln(64) = 4.16 at the start
    logits = trainer.predict(task, hf_loader(ds, 4), state=state)
    assert logits[0].shape == (4, 12, VOCAB)


def test_clear_errors():
    model = gpt2()
    opt = optim.sgd(0.1)
    state = engine.init(model, opt)
    step = engine.train_step(model, hf_loss, opt)
    batch = text_batch()
    del batch["labels"]
    with pytest.raises(ValueError, match="labels"):
        step(state, batch)
    with pytest.raises(TypeError, match="dict batches"):
        step(state, (batch["input_ids"],))
    with pytest.raises(ValueError, match="_no_split_modules"):
        block_classes(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="transformers model"):
        save_pretrained(state, nn.Linear(2, 2), "out")
    assert block_classes(model) == {type(model.transformer.h[0])}


# ---------------------------------------------------------------------- slow: compile, ranks


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.bitwise
def test_compiled_step_matches_eager_and_repeats_itself():
    model = gpt2(dropout=0.0, layers=1)  # one block: less to compile
    opt = optim.sgd(0.1)
    state = engine.init(model, opt, seed=0)
    compiled = engine.train_step(model, hf_loss, opt, compile=True)
    batch = text_batch()
    a, out_a = compiled(state, batch)
    b, _ = compiled(state, batch)
    assert all(torch.equal(a.params[k], b.params[k]) for k in a.params)  # bitwise repeat
    e, out_e = engine.train_step(model, hf_loss, opt)(state, batch)
    # inductor fuses and reorders float32 sums: agreement to rounding, not bits
    assert abs(float(out_a.loss) - float(out_e.loss)) < 1e-4
    for name in a.params:
        torch.testing.assert_close(a.params[name], e.params[name], rtol=1e-4, atol=1e-5)


G = 4  # samples per global batch in the two-rank run


def _two_rank_worker(rank: int) -> dict:
    """Two steps of DDP and of FSDP (one unit per GPT2Block) on this rank's half batch."""
    torch.set_num_threads(1)
    out = {}
    half = slice(rank * G // 2, (rank + 1) * G // 2)
    batches = [{k: v[half] for k, v in text_batch(i, size=G).items()} for i in range(2)]
    for name in ("ddp", "fsdp"):
        model = gpt2(dropout=0.0)
        strategy = (
            hardware.ddp()
            if name == "ddp"
            else hardware.fsdp(auto_wrap_policy=block_classes(model))
        )
        state, _ = train(model, batches, optim.sgd(0.1), strategy=strategy, strategy_init=strategy)
        if hasattr(strategy, "full_state"):
            state = strategy.full_state(state)
        out[name] = {k: v.detach().clone() for k, v in state.params.items()}
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.xdist_group("processes")
def test_ddp_and_fsdp_match_one_process_with_the_global_batch():
    ranks = hardware.launch(_two_rank_worker, 2, timeout=60, max_seconds=200, grace=3.0)
    # SGD: Adam would divide tiny gradients' rounding differences by their own size
    ref, _ = train(gpt2(dropout=0.0), [text_batch(i, size=G) for i in range(2)], optim.sgd(0.1))
    for rank in ranks:
        for name in ("ddp", "fsdp"):
            got = rank[name]
            assert set(got) == set(ref.params)
            for key, want in ref.params.items():
                # two half-batch means reduced, against one mean: the last bits differ
                bound = 1e-5 * float(want.abs().max()) + 1e-6
                assert float((got[key] - want).abs().max()) <= bound, (name, key)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_example_trains_eager_and_compiled():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "hf_gpt2.py"), "--steps", "2", "--layers", "1"],
        capture_output=True,
        text=True,
        timeout=220,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if "loss" in line]
    eager = [line for line in lines if line.startswith("eager")]
    compiled = [line for line in lines if line.startswith("compiled")]
    assert len(eager) == len(compiled) == 1, result.stdout
    # both runs start from the same state on the same batches: the same first loss, to
    # the rounding of inductor's reordered float32 sums (printed to 3 decimals)
    assert abs(float(eager[0].split()[2]) - float(compiled[0].split()[2])) <= 2e-3, result.stdout


# ---------------------------------------------------------------------- the docs page

MODELS_BLOCK = "# a tiny GPT-2 from a config, trained, saved and loaded back"
DATA_BLOCK = "# a table and a stream as sources, each resumed mid-epoch"


@PAGE.runs(MODELS_BLOCK)
def test_the_page_trains_saves_and_reloads_a_gpt2(tmp_path, capsys):
    ns: dict = {}
    PAGE.run(MODELS_BLOCK, ns)
    assert "loss" in capsys.readouterr().out
    state, loaded = ns["state"], ns["loaded"]
    assert state.progress.step == 5
    assert torch.equal(loaded.transformer.wte.weight, state.params["transformer.wte.weight"])
    assert (tmp_path / "gpt2-tiny").is_dir()


@PAGE.runs(DATA_BLOCK)
def test_the_page_resumes_a_table_and_a_stream(capsys):
    ns: dict = {}
    PAGE.run(DATA_BLOCK, ns)
    assert ns["again"].starts == [(0, 2, "state")]
    assert len(ns["rest"]) == 3  # 40 rows: batches 2, 3 and 4 of 8
    assert "[(0, 2, 'state')]" in capsys.readouterr().out
