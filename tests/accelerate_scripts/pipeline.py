"""A pipeline config (2 stages x 2 data-parallel ranks) under ``accelerate launch`` with 4
processes: the loop is ``loss = model.train_batch(x, y)``.

Runs, in one launch:
- ``uninterrupted``: every batch of the loader; records which samples each rank read, the
  losses, the lr, what a plain-Accelerate call under a pipeline raises;
- ``save``: the same from the same seed, stopped after ``STOP`` steps, ``save_state``;
- ``load``: built afresh, ``load_state``, skips the batches already seen and finishes;
- ``bf16``: ``uninterrupted`` again under ``mixed_precision="bf16"``.
Rank 0 also trains the same model in one process with plain PyTorch on the global batches
(the reference) and saves everything to ``--out``.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
from accelerate.state import AcceleratorState
from accelerate.utils import set_seed
from accelerate.utils.deepspeed import DummyOptim, DummyScheduler
from common import arguments, save_on_main
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from ds_strategy.accelerate import ZeroAccelerator, ZeroPlugin

STAGES, MICRO, ACCUM, STEPS, CLIP, LR = 2, 2, 2, 3, 0.3, 0.02
D_IN, WIDTH, D_OUT = 6, 8, 3
STOP = 1  # save_state after this many steps


def sequential() -> nn.Sequential:
    set_seed(0)
    layers: list[nn.Module] = []
    for i in range(4):
        layers += [nn.Linear(D_IN if i == 0 else WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, D_OUT))


def dataset(dp_size: int) -> torch.utils.data.TensorDataset:
    n = STEPS * MICRO * ACCUM * dp_size
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, D_IN, generator=g)
    x[:, 0] = torch.arange(n, dtype=torch.float32)  # a sample's index, to see who read it
    y = torch.randn(n, D_OUT, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def config(zero_stage: int, optimizer_section: bool) -> dict:
    cfg = {
        "pipeline": {"stages": STAGES, "schedule": "1f1b"},
        "train_micro_batch_size_per_gpu": "auto",  # the loader's batch / accumulation steps
        "gradient_accumulation_steps": "auto",  # the Accelerator's
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": zero_stage},
    }
    if optimizer_section:  # "auto" filled from the DummyOptim
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}
    return cfg


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y)


def schedule(step: int) -> float:
    return 1.0 / (1.0 + 0.5 * step)


def build(dp_size: int, dummy: bool) -> tuple:
    model = sequential()
    loader = torch.utils.data.DataLoader(dataset(dp_size), batch_size=MICRO * ACCUM)
    if dummy:  # the optimizer from the config's section, the scheduler built by the engine
        opt = DummyOptim(model.parameters(), lr=LR, weight_decay=0.01)
        sched = DummyScheduler(opt, lr_scheduler_callable=lambda o: LambdaLR(o, schedule))
        return model, opt, loader, sched
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    return model, opt, loader, LambdaLR(opt, schedule)


def refusals(accelerator: ZeroAccelerator, model: nn.Module, x: torch.Tensor) -> dict:
    out = {}
    calls = {
        "backward": lambda: accelerator.backward(x.sum()),
        "clip_grad_norm_": lambda: accelerator.clip_grad_norm_(model.parameters(), 1.0),
        "accumulate": lambda: accelerator.accumulate(model).__enter__(),
        "forward": lambda: model(x),
        "late_scheduler": lambda: accelerator.prepare(
            LambdaLR(accelerator._optimizers[0].optimizer, schedule)
        ),
    }
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except RuntimeError as err:
            out[name] = str(err)
    return out


def run(phase: str, ckpt: str, dp_size: int) -> dict:
    # the resumed runs: ZeRO-2 within each stage, DummyOptim / DummyScheduler
    resumed = phase in ("save", "load")
    plugin = ZeroPlugin(config=config(2 if resumed else 1, resumed), loss_fn=mse)
    precision = "no"
    if phase == "bf16":  # Accelerate's mixed_precision flag; a new state for the new flag
        AcceleratorState._reset_state()
        precision = "bf16"
    accelerator = ZeroAccelerator(
        config=plugin, gradient_accumulation_steps=ACCUM, mixed_precision=precision
    )
    model, optimizer, loader, scheduler = accelerator.prepare(*build(dp_size, resumed))
    result: dict = {"losses": [], "seen": [], "lrs": []}
    skip = 0
    if phase == "load":
        accelerator.load_state(ckpt)
        result["steps_after_load"] = model.global_steps
        skip = STOP
    batches = accelerator.skip_first_batches(loader, skip) if skip else loader
    for step, (x, y) in enumerate(batches, start=skip):
        if phase == "save" and step == STOP:
            break
        if phase == "uninterrupted" and step == 0:
            result["refused"] = refusals(accelerator, model, x)
        loss = model.train_batch(x, y)
        optimizer.step()  # no-ops: train_batch stepped
        scheduler.step()
        optimizer.zero_grad()
        result["losses"].append(float(loss))
        result["seen"].append(x[:, 0].long().tolist())
        result["lrs"].append(optimizer.param_groups[0]["lr"])
    if phase == "save":
        accelerator.save_state(ckpt)
    if phase == "uninterrupted":
        x, y = next(iter(loader))  # global batch 0, after training
        result["eval"] = float(model.eval_batch(x, y))
        try:  # 3 samples per rank cannot be 2 micro-batches of 2
            accelerator.prepare(torch.utils.data.DataLoader(dataset(dp_size), batch_size=3))
            result["bad_loader"] = None
        except ValueError as err:
            result["bad_loader"] = str(err)
    state = accelerator.get_state_dict(model)
    result.update(
        state=state,
        global_steps=model.global_steps,
        layout=(model.stage_id, model.data_parallel_rank, model.data_parallel_size),
        resolved={
            "micro": model.engine.micro_batch_size,
            "accum": model.engine.micro_batches,
            "clip": model.engine.config.gradient_clipping,
            "stage": model.engine.config.zero_optimization.stage,
            "optimizer": type(optimizer.optimizer).__name__,
            "weight_decay": optimizer.param_groups[0]["weight_decay"],
        },
        unwrapped=sorted(accelerator.unwrap_model(model).state_dict()),
        skipped=optimizer.step_was_skipped,
        bf16=model.engine.config.bf16.enabled,
    )
    if phase == "uninterrupted":
        accelerator.save_model(model, os.path.join(ckpt, "..", "model"))
    gathered: list = [None] * accelerator.num_processes
    dist.all_gather_object(gathered, {k: result[k] for k in ("seen", "layout", "unwrapped")})
    result["per_rank"] = gathered
    accelerator.free_memory()
    return result


def reference(dp_size: int) -> dict:
    """One process, plain PyTorch: each step's global batch (the data-parallel ranks' shares
    together), the mean loss over it, clipping, AdamW and the same lr schedule."""
    model = sequential()
    initial = copy.deepcopy(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    sched = LambdaLR(opt, schedule)
    x, y = dataset(dp_size).tensors
    g = MICRO * ACCUM * dp_size
    losses = []
    for k in range(STEPS):
        loss = mse(model(x[k * g : (k + 1) * g]), y[k * g : (k + 1) * g])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(loss))
    with torch.no_grad():
        evaluated = float(mse(model(x[:g]), y[:g]))
    return {"state": model.state_dict(), "initial": initial, "losses": losses, "eval": evaluated}


def main() -> None:
    args = arguments()
    dp_size = int(os.environ["WORLD_SIZE"]) // STAGES
    results = {
        "uninterrupted": run("uninterrupted", args.ckpt, dp_size),
        "save": run("save", args.ckpt, dp_size),
        "load": run("load", args.ckpt, dp_size),
        "bf16": run("bf16", args.ckpt, dp_size),
    }
    if int(os.environ["RANK"]) == 0:
        results["reference"] = reference(dp_size)
    save_on_main(ZeroAccelerator(), results, args.out)


if __name__ == "__main__":
    main()
