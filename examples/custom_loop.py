"""A GAN — two models, two optimizers, alternating steps — built from the loop primitives.

The Trainer has one model and one optimizer; this loop has two, so it is written by hand out
of the same pieces ``loops.fit`` is made of:

- ``engine.train_step`` twice (discriminator and generator), ``engine.predict_step`` for
  sampling, ``engine.Binder`` to apply the discriminator inside the generator's loss with the
  discriminator's parameters as constants (they come in with the batch, so both steps stay
  pure functions of their inputs);
- ``loops.data.source`` for the real data's deterministic, resumable order;
- ``loops.aggregate`` to turn step outputs into per-epoch values;
- a ``loops.Driver`` to announce events to callbacks and write to loggers;
- ``engine.checkpoint`` to save the pair of states — the whole run — each epoch.

The data are 8 Gaussians on a circle; the score is the share of the 8 modes the generator
covers. The last line printed is ``mode_coverage=<x>``.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from purestep import engine, seed_everything
from purestep.engine import checkpoint, optim, rng
from purestep.loops import Driver, aggregate, data, loop_state
from purestep.loops.callbacks import LambdaCallback, init_states
from purestep.loops.events import Requests
from purestep.loops.loggers import CSVLogger

NOISE = 8


def ring(n: int, seed: int) -> torch.Tensor:
    """``n`` points from 8 Gaussians (std 0.05) on a circle of radius 2."""
    g = torch.Generator().manual_seed(seed)
    angles = torch.randint(0, 8, (n,), generator=g) * (2 * math.pi / 8)
    centers = torch.stack([2 * angles.cos(), 2 * angles.sin()], 1)
    return centers + 0.05 * torch.randn(n, 2, generator=g)


def mlp(inputs: int, outputs: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(inputs, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, outputs)
    )


def coverage(points: torch.Tensor) -> float:
    """The share of the 8 modes with a generated point within 0.25 of their centre."""
    angles = torch.arange(8) * (2 * math.pi / 8)
    centers = torch.stack([2 * angles.cos(), 2 * angles.sin()], 1)
    near = torch.cdist(centers, points) < 0.25
    return near.any(1).float().mean().item()


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--root", default="runs/gan")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    seed_everything(args.seed)  # the networks' initial weights

    generator, critic = mlp(NOISE, 2), mlp(2, 1)
    g_opt = optim.adam(1e-3, betas=(0.5, 0.999))
    d_opt = optim.adam(1e-3, betas=(0.5, 0.999))
    bind_critic = engine.Binder(critic)

    def critic_loss(apply, batch):
        real, fake = batch
        real_logits, fake_logits = apply(real), apply(fake)
        loss = F.binary_cross_entropy_with_logits(
            real_logits, torch.ones_like(real_logits)
        ) + F.binary_cross_entropy_with_logits(fake_logits, torch.zeros_like(fake_logits))
        return loss, {"real_score": real_logits.sigmoid().mean()}

    def generator_loss(apply, batch):
        noise, critic_params, critic_buffers = batch
        fake = apply(noise)
        with bind_critic.bind(critic_params, critic_buffers, training=True) as judge:
            logits = judge(fake)
        return F.binary_cross_entropy_with_logits(logits, torch.ones_like(logits))

    d_step = engine.train_step(critic, critic_loss, d_opt)
    g_step = engine.train_step(generator, generator_loss, g_opt)
    sample = engine.predict_step(generator, lambda apply, noise: apply(noise))

    run_key = rng.key(args.seed)
    d_state = engine.init(critic, d_opt, seed=args.seed + 1)
    g_state = engine.init(generator, g_opt, seed=args.seed + 2)
    real = data.source(
        ring(args.samples, seed=3), batch_size=args.batch_size, shuffle=True, seed=run_key
    )

    def noise(purpose: str, step: int, n: int) -> torch.Tensor:
        key = rng.fold_in(run_key, purpose, step)
        return torch.randn(n, NOISE, generator=rng.generator(key))

    def report(ctx):
        return Requests(messages=(f"epoch {ctx.epoch}: {dict(ctx.metrics)}",))

    callbacks = [LambdaCallback(on_train_epoch_end=report)]
    logger = CSVLogger(args.root, name="gan")
    driver = Driver(fn="fit", callbacks=callbacks, loggers=[logger])
    d_state = init_states(callbacks, loop_state.ready(d_state))  # it carries the loop's

    for epoch in range(args.epochs):
        d_state = driver.fire("on_train_epoch_start", d_state)
        totals: dict = {}
        for batch in real.iterate(epoch):
            step = d_state.progress.step
            fake = sample(g_state, noise("fake", step, len(batch)))
            d_state, d_out = d_step(d_state, (batch, fake))
            z = noise("generator", step, len(batch))
            g_state, g_out = g_step(g_state, (z, d_state.params, d_state.buffers))
            values = {"d_loss": d_out.loss, "g_loss": g_out.loss, **d_out.metrics}
            resolved = aggregate.resolve(
                {k: aggregate.log(v, on_step=False, on_epoch=True) for k, v in values.items()},
                "train",
            )
            totals = aggregate.accumulate(totals, resolved, len(batch))
            specs = aggregate.specs_of(resolved)
        score = coverage(sample(g_state, noise("eval", epoch, 2000)))
        logged, _, _ = aggregate.epoch_values(totals, specs)
        logged["mode_coverage"] = torch.tensor(score)
        driver.log_metrics({**logged, "epoch": epoch}, d_state.progress.step)
        loop = d_state.loop.replace(callback_metrics=logged)  # what callbacks see: ctx.metrics
        d_state = d_state.replace(loop=loop)
        d_state = driver.fire("on_train_epoch_end", d_state)
        d_state = d_state.replace(progress=d_state.progress.replace(epoch=epoch + 1))
        checkpoint.save((g_state, d_state), os.path.join(args.root, "gan", "last.ckpt"))
    driver.finalize("success")
    print(f"mode_coverage={score:.3f}")
    return score


if __name__ == "__main__":
    main()
