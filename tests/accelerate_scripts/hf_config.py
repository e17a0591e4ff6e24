"""A DeepSpeed JSON written for Hugging Face tools ("auto" values, an ``optimizer`` section
used through ``accelerate.utils.DummyOptim``, keys ds_strategy only warns about), read
unmodified from ``DS_STRATEGY_CONFIG``, against the same loop with a plain ``Accelerator``.
"""

from __future__ import annotations

import warnings

from accelerate import Accelerator
from accelerate.utils.deepspeed import DummyOptim
from common import ACCUMULATION, arguments, build, param_groups, save_on_main, train

from ds_strategy.accelerate import ZeroAccelerator
from ds_strategy.config import UnsupportedConfigWarning


def zero_run() -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator = ZeroAccelerator(gradient_accumulation_steps=ACCUMULATION)
    model, _, loader, _ = build()
    optimizer = DummyOptim(param_groups(list(model.named_parameters())), lr=0.02, weight_decay=0.01)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    log = train(accelerator, model, optimizer, loader, None)
    cfg = accelerator.zero_engine.config
    zc = cfg.zero_optimization
    opt = optimizer.optimizer
    return {
        **log,
        "state": accelerator.get_state_dict(model),
        "warnings": [str(w.message) for w in caught if w.category is UnsupportedConfigWarning],
        "resolved": {
            "stage": zc.stage,
            "reduce_bucket_size": zc.reduce_bucket_size,
            "stage3_prefetch_bucket_size": zc.stage3_prefetch_bucket_size,
            "stage3_param_persistence_threshold": zc.stage3_param_persistence_threshold,
            "fp16": cfg.fp16.enabled,
            "bf16": cfg.bf16.enabled,
            "train_micro_batch_size_per_gpu": cfg.train_micro_batch_size_per_gpu,
            "train_batch_size": cfg.train_batch_size,
            "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
            "gradient_clipping": cfg.gradient_clipping,
        },
        "optimizer": type(opt).__name__,
        "weight_decay": [g["weight_decay"] for g in opt.param_groups],
        "lr": [g["lr"] for g in opt.param_groups],
        "memory": accelerator.zero_engine.memory_report(),
    }


def plain_run() -> dict:
    accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATION)
    model, optimizer, loader, _ = build()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    log = train(accelerator, model, optimizer, loader, None)
    return {**log, "state": accelerator.get_state_dict(model)}


def main() -> None:
    args = arguments()
    results = {"zero": zero_run(), "plain": plain_run()}
    save_on_main(Accelerator(), results, args.out)


if __name__ == "__main__":
    main()
