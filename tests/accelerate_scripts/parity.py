"""ZeRO stages 1/2/3 through ``ZeroAccelerator`` against the same loop with a plain
``Accelerator`` (DDP), in one launch. Rank 0 saves, per run: the consolidated weights, the
norms ``clip_grad_norm_`` returned, the learning rates, and what the engine resolved.

    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml \\
        tests/accelerate_scripts/parity.py --out results.pt
"""

from __future__ import annotations

import os

from accelerate import Accelerator
from common import ACCUMULATION, arguments, build, save_on_main, train, zero_accelerator


def zero_run(stage: int, out_dir: str) -> dict:
    accelerator = zero_accelerator(stage)
    model, optimizer, loader, scheduler = accelerator.prepare(*build())
    log = train(accelerator, model, optimizer, loader, scheduler)
    engine = accelerator.zero_engine
    cfg = engine.config
    result = {
        **log,
        "state": accelerator.get_state_dict(model),
        "unwrapped": type(accelerator.unwrap_model(model)).__name__,
        "resolved": {
            "train_micro_batch_size_per_gpu": cfg.train_micro_batch_size_per_gpu,
            "train_batch_size": cfg.train_batch_size,
            "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
            "gradient_clipping": cfg.gradient_clipping,
            "stage": engine.stage,
        },
        "global_steps": engine.global_steps,
        "memory": engine.memory_report(),
        "distributed_type": str(accelerator.distributed_type),
        "num_processes": accelerator.num_processes,
    }
    if stage == 3:
        accelerator.save_model(model, os.path.join(out_dir, "model_zero3"))
    accelerator.free_memory()
    return result


def plain_run() -> dict:
    accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATION)
    model, optimizer, loader, scheduler = accelerator.prepare(*build())
    log = train(accelerator, model, optimizer, loader, scheduler)
    numel = sum(p.numel() for p in accelerator.unwrap_model(model).parameters())
    return {**log, "state": accelerator.get_state_dict(model), "numel": numel}


def main() -> None:
    args = arguments()
    out_dir = os.path.dirname(os.path.abspath(args.out))
    results = {f"zero{stage}": zero_run(stage, out_dir) for stage in (1, 2, 3)}
    # After the ZeroAccelerators: this process state was set up by ZeroAccelerator (MULTI_CPU
    # on a machine without GPUs), which a plain Accelerator reuses.
    results["plain"] = plain_run()
    save_on_main(Accelerator(), results, args.out)


if __name__ == "__main__":
    main()
