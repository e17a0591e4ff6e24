"""``save_state`` mid-training, then ``load_state`` in a fresh process group and finish.

The ZeRO config comes from the environment (``DS_STRATEGY_CONFIG`` and overrides), as with
``accelerate launch`` in practice; the script constructs ``ZeroAccelerator()`` bare.

--phase save: train uninterrupted (rank 0 saves the final weights), then a second run from
    the same seed stops at ``STOP`` and calls ``save_state(--ckpt)``.
--phase load: a new launch builds everything afresh, ``load_state(--ckpt)``, skips the
    batches already seen and finishes; rank 0 saves the final weights.
"""

from __future__ import annotations

import os

from common import ACCUMULATION, arguments, build, save_on_main, train

from ds_strategy.accelerate import ZeroAccelerator

STOP = (0, 6)  # epoch 0, after 6 batches = 3 optimizer steps


def run(phase: str, ckpt: str) -> dict:
    accelerator = ZeroAccelerator(gradient_accumulation_steps=ACCUMULATION)
    model, optimizer, loader, scheduler = accelerator.prepare(
        *build(dropout=float(os.environ.get("TEST_DROPOUT", "0.1")))
    )
    engine = accelerator.zero_engine
    result: dict = {"stage": engine.stage}
    if phase == "uninterrupted":
        result["log"] = train(accelerator, model, optimizer, loader, scheduler)
    elif phase == "save":
        result["log"] = train(accelerator, model, optimizer, loader, scheduler, stop=STOP)
        accelerator.save_state(ckpt)
        result["lr_at_save"] = scheduler.get_last_lr()
    else:
        accelerator.load_state(ckpt)
        result["lr_after_load"] = scheduler.get_last_lr()
        result["steps_after_load"] = engine.global_steps
        result["log"] = train(accelerator, model, optimizer, loader, scheduler, start=STOP)
    result["state"] = accelerator.get_state_dict(model)
    result["global_steps"] = engine.global_steps
    result["memory"] = engine.memory_report()
    accelerator.free_memory()
    return result


def main() -> None:
    args = arguments()
    if args.phase == "save":
        results = {"uninterrupted": run("uninterrupted", ""), "save": run("save", args.ckpt)}
    else:
        results = {"load": run("load", args.ckpt)}
    save_on_main(ZeroAccelerator(), results, args.out)


if __name__ == "__main__":
    main()
