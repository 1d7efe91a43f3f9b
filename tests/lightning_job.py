"""A kill-and-resume job for Lightning-style modules (run as a script in its own folder).

``--model NAME`` (tests/lightning_models.py) trains under ``purestep.Trainer`` with a
checkpoint after every step; ``--kill N`` SIGKILLs the process at the N-th training batch
end, ``--resume`` continues from ``ckpt_path="last"``. The last line printed is
``digest=<hash of the final TrainState>``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import purestep
from purestep.loops.callbacks import LambdaCallback, ModelCheckpoint
from tests.helpers import digest
from tests.lightning_models import EPOCHS, build


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--base", default="lightning")
    parser.add_argument("--kill", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    batches = [0]

    def maybe_die(ctx):
        batches[0] += 1
        if args.kill is not None and batches[0] == args.kill:
            os.kill(os.getpid(), signal.SIGKILL)

    purestep.seed_everything(0)
    model, data = build(args.model, args.base)
    trainer = purestep.Trainer(
        max_epochs=EPOCHS[args.model],
        default_root_dir="runs",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            LambdaCallback(name="killer", on_train_batch_end=maybe_die),
            ModelCheckpoint(every_n_train_steps=1, save_top_k=0, save_last=True),
        ],
    )
    state = trainer.fit(model, **data, ckpt_path="last" if args.resume else None)
    print(f"step={state.progress.step}")
    print(f"digest={digest(state)}")


if __name__ == "__main__":
    main()
