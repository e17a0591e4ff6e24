"""Regenerate the DeepSpeed-written checkpoints the tests read (``tests/test_deepspeed_*``).

Needs DeepSpeed (``pip install deepspeed``; its CPU accelerator and gloo, no GPU)::

    DS_ACCELERATOR=cpu python tests/data/deepspeed_checkpoints/make_fixtures.py

For each case (ZeRO stage x precision) two ranks train a small MLP for 4 steps and save
(``<case>/ckpt``); DeepSpeed's own ``get_fp32_state_dict_from_zero_checkpoint`` of it is
``<case>/consolidated.safetensors``; a fresh DeepSpeed engine then loads the checkpoint,
trains 3 more steps on the next batches and its consolidated weights are
``<case>/continued.safetensors``. ``batches.safetensors`` holds every global batch, and
``<case>/config.json`` the config each case ran.

``lightning_s2``: the same through Lightning's ``DeepSpeedStrategy`` (a ``.ckpt`` directory,
tag ``checkpoint``, Lightning's loop state as client state). Lightning allows that strategy on
CUDA only; here its device check is skipped, everything else is Lightning's and DeepSpeed's.
``hf_s2``: Hugging Face's ``Trainer`` with a DeepSpeed config (ZeRO-2) on a tiny GPT-2 whose
head is tied to its embedding, checkpointing at step 4 of 7 (``checkpoint-4/global_step4``);
``continued.safetensors`` holds the weights of a Trainer resumed from it at step 7 (no dropout:
the same steps at any world size). On CPU the
Trainer's data loader is not sharded over DeepSpeed's two ranks (Accelerate sees one process),
so both ranks train on the same batch of 2 each step: a one-process run with that batch size
takes the same steps.
``accelerate_s2``: Accelerate's DeepSpeed integration (``Accelerator(deepspeed_plugin=...)``,
ZeRO-2) with the loop's AdamW, a LambdaLR (Accelerate's, ``scheduler.bin``: DeepSpeed takes
only its own scheduler classes) and an object registered for checkpointing;
``state/`` is ``accelerator.save_state``: DeepSpeed's ``pytorch_model/`` and ``latest`` beside
Accelerate's files. As with ``hf_s2``, Accelerate counts one process on CPU: its loader is not
sharded and it writes only ``random_states_0.pkl``; each rank reads the whole global batch of
each step (the loader's batch is a rank's share of it, ``WORLD * MICRO // num_processes``), so
DeepSpeed's ranks average equal gradients and a one-process run on the global batch takes the
same steps. ``accelerate_s2_config``: the same with ``DummyOptim`` and ``DummyScheduler``, so
DeepSpeed builds the config's AdamW and WarmupLR and saves the scheduler's position itself
(Accelerate writes no ``scheduler.bin``).
``fabric_s2``: Lightning Fabric's ``DeepSpeedStrategy`` (``fabric.save`` of the model, its
optimizer, a LambdaLR and a step count: a ``.ckpt`` directory, tag ``checkpoint``, the last
two as client state); each rank its half of the global batch. Its CUDA-only device check is
skipped as for ``lightning_s2``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CASES = {
    "s1_fp32": (1, "fp32"),
    "s2_fp32": (2, "fp32"),
    "s3_fp32": (3, "fp32"),
    "s1_bf16": (1, "bf16"),
    "s2_bf16": (2, "bf16"),
    "s3_bf16": (3, "bf16"),
    "s2_fp16": (2, "fp16"),
}
STEPS, MORE, MICRO, WORLD = 4, 3, 2, 2
SIZES = (7, 13, 13, 3)  # odd sizes: no parameter splits evenly over the ranks


def config(stage: int, precision: str) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02, "warmup_num_steps": 5},
        },
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,
            "reduce_bucket_size": 64,
            "allgather_bucket_size": 64,
        },
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 6, "loss_scale_window": 2}
    return cfg


def model():
    import torch

    torch.manual_seed(0)
    a, b, c, d = SIZES
    return torch.nn.Sequential(
        torch.nn.Linear(a, b),
        torch.nn.Tanh(),
        torch.nn.Linear(b, c),
        torch.nn.Tanh(),
        torch.nn.Linear(c, d),
    )


def batches():
    import torch

    g = torch.Generator().manual_seed(1)
    n = STEPS + MORE
    return {
        "inputs": torch.randn(n, WORLD * MICRO, SIZES[0], generator=g),
        "targets": torch.randn(n, WORLD * MICRO, SIZES[-1], generator=g),
    }


def train(engine, data, steps: range, dtype) -> None:
    import torch.distributed as dist

    rank = dist.get_rank()
    rows = slice(rank * MICRO, (rank + 1) * MICRO)
    for i in steps:
        x, y = data["inputs"][i, rows], data["targets"][i, rows]
        loss = ((engine(x.to(dtype)).float() - y) ** 2).mean()
        engine.backward(loss)
        engine.step()


def run_case(name: str) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file, save_file

    stage, precision = CASES[name]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    cfg = config(stage, precision)
    data = load_file(HERE / "batches.safetensors")
    out = HERE / name
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()

    net = model()
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    train(engine, data, range(STEPS), dtype)
    engine.save_checkpoint(out / "ckpt", client_state={"epoch": 1, "note": "written by DeepSpeed"})
    dist.barrier()
    if rank == 0:
        state = get_fp32_state_dict_from_zero_checkpoint(str(out / "ckpt"))
        save_file({k: v.contiguous() for k, v in state.items()}, out / "consolidated.safetensors")

    net = model()
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    engine.load_checkpoint(out / "ckpt")
    train(engine, data, range(STEPS, STEPS + MORE), dtype)
    engine.save_checkpoint(out / "continued_ckpt")
    dist.barrier()
    if rank == 0:
        state = get_fp32_state_dict_from_zero_checkpoint(str(out / "continued_ckpt"))
        save_file({k: v.contiguous() for k, v in state.items()}, out / "continued.safetensors")
        shutil.rmtree(out / "continued_ckpt")
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):  # DeepSpeed's copies of its tools
            (out / "ckpt" / script).unlink(missing_ok=True)
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        print(
            f"{name}: {engine.optimizer.__class__.__name__} over {type(engine.optimizer.optimizer if hasattr(engine.optimizer, 'optimizer') else engine.optimizer).__name__}"
        )


def lightning_parts(data: dict, rank: int, replicas: int):
    """The LightningModule of the Lightning case and its loaders: ``loader(steps)`` yields, on
    this rank, its share of each step's global batch (``replicas`` ranks, 1: the whole)."""
    import lightning.pytorch as pl
    import torch

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return ((self.net(x) - y) ** 2).mean()

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.01)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
            return [opt], [{"scheduler": sched, "interval": "step"}]

    class Rows(torch.utils.data.Dataset):  # the samples of the given steps, in order
        def __init__(self, steps: range) -> None:
            self.steps = list(steps)

        def __len__(self) -> int:
            return len(self.steps) * WORLD * MICRO

        def __getitem__(self, k: int):
            step, row = self.steps[k // (WORLD * MICRO)], k % (WORLD * MICRO)
            return data["inputs"][step, row], data["targets"][step, row]

    def loader(steps: range):
        rows = Rows(steps)
        sampler = torch.utils.data.distributed.DistributedSampler(
            rows, num_replicas=replicas, rank=rank, shuffle=False
        )
        return torch.utils.data.DataLoader(
            rows, batch_size=WORLD * MICRO // replicas, sampler=sampler
        )

    return Net, loader


def _deepspeed_strategy_on_cpu(module, strategy: type, ddp: type) -> None:
    """Lightning's (or Fabric's) DeepSpeedStrategy on CPU: its CUDA-only checks skipped, and
    the CPU's device index (None) passed to DeepSpeed as no index."""
    import deepspeed

    strategy.setup_environment = ddp.setup_environment
    module._validate_device_index_selection = lambda devices: None
    initialize = deepspeed.initialize

    def on_cpu(args=None, **kwargs):
        if args is not None and getattr(args, "device_rank", 0) is None:
            args.device_rank = -1
        return initialize(args=args, **kwargs)

    deepspeed.initialize = on_cpu


def run_lightning(name: str) -> None:
    import lightning.pytorch as pl
    import lightning.pytorch.strategies.deepspeed as lightning_deepspeed
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
    from safetensors.torch import load_file, save_file

    _deepspeed_strategy_on_cpu(lightning_deepspeed, DeepSpeedStrategy, DDPStrategy)
    cfg = config(2, "fp32")
    for key in ("optimizer", "scheduler", "gradient_accumulation_steps", "gradient_clipping"):
        cfg.pop(key)  # Lightning's configure_optimizers and Trainer flags instead
    data = load_file(HERE / "batches.safetensors")
    out = HERE / name

    Net, loader = lightning_parts(data, int(os.environ["RANK"]), WORLD)

    def trainer(steps: int):
        return pl.Trainer(
            strategy=DeepSpeedStrategy(config=json.loads(json.dumps(cfg))),  # it fills it in
            accelerator="cpu",
            devices=WORLD,
            max_steps=steps,
            gradient_clip_val=0.5,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,
        )

    t = trainer(STEPS)
    t.fit(Net(), loader(range(STEPS)))
    t.save_checkpoint(out / "model.ckpt")
    if t.global_rank == 0:
        state = get_fp32_state_dict_from_zero_checkpoint(str(out / "model.ckpt"))
        save_file({k: v.contiguous() for k, v in state.items()}, out / "consolidated.safetensors")
    t = trainer(STEPS + MORE)
    t.fit(Net(), loader(range(STEPS + MORE)), ckpt_path=out / "model.ckpt")
    t.save_checkpoint(out / "continued.ckpt")
    if t.global_rank == 0:
        state = get_fp32_state_dict_from_zero_checkpoint(str(out / "continued.ckpt"))
        save_file({k: v.contiguous() for k, v in state.items()}, out / "continued.safetensors")
        shutil.rmtree(out / "continued.ckpt")
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):
            (out / "model.ckpt" / script).unlink(missing_ok=True)
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def mlp_rows(data: dict, steps: range):
    """The samples of the given steps' global batches, in order, as a dataset."""
    import torch

    class Rows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(steps) * WORLD * MICRO

        def __getitem__(self, k: int):
            step, row = steps[k // (WORLD * MICRO)], k % (WORLD * MICRO)
            return data["inputs"][step, row], data["targets"][step, row]

    return Rows()


def lambda_lr(optimizer):
    import torch

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5))


class Counter:
    """An object registered for Accelerate's checkpointing: its state is Accelerate's to save."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.seen = state["seen"]


def front_config() -> dict:
    """The DeepSpeed config of the Accelerate and Fabric cases: the loop brings its optimizer
    and lr scheduler."""
    cfg = config(2, "fp32")
    del cfg["optimizer"], cfg["scheduler"]
    return cfg


def save_consolidated(ckpt: Path, out: Path) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import save_file

    state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
    save_file({k: v.contiguous() for k, v in state.items()}, out)


def run_accelerate(name: str) -> None:
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.state import AcceleratorState
    from accelerate.utils import DummyOptim, DummyScheduler
    from safetensors.torch import load_file

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # what accelerate launch sets
    data = load_file(HERE / "batches.safetensors")
    out = HERE / name
    owned = name.endswith("_config")  # DeepSpeed's optimizer and scheduler, from the config
    cfg = config(2, "fp32") if owned else front_config()

    def run(steps: range, resume: Path | None = None):
        AcceleratorState._reset_state()  # a fresh Accelerator, as in a new job
        acc = Accelerator(
            deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=json.loads(json.dumps(cfg)))
        )
        net = model()
        if owned:
            opt = DummyOptim(net.parameters())
            sched = DummyScheduler(opt)
        else:
            opt = torch.optim.AdamW(net.parameters(), lr=0.02, weight_decay=0.01)
            sched = lambda_lr(opt)
        # each rank's share of a global batch, were the loader sharded over DeepSpeed's ranks
        share = WORLD * MICRO // acc.num_processes
        loader = torch.utils.data.DataLoader(mlp_rows(data, steps), batch_size=share)
        counter = Counter()
        acc.register_for_checkpointing(counter)
        net, opt, loader, sched = acc.prepare(net, opt, loader, sched)
        if resume is not None:
            acc.load_state(str(resume))
        seen = []
        for x, y in loader:
            if len(seen) == len(steps):
                break
            seen.append(x[:, 0].tolist())
            acc.backward(((net(x) - y) ** 2).mean())
            opt.step()
            sched.step()
            opt.zero_grad()
            counter.seen += len(x)
        print(f"rank {dist.get_rank()} of {acc.num_processes} read {seen}", flush=True)
        return acc

    acc = run(range(STEPS))
    acc.save_state(str(out / "state"))
    dist.barrier()
    if dist.get_rank() == 0:  # Accelerate may count one process (see the note)
        save_consolidated(out / "state", out / "consolidated.safetensors")
    acc = run(range(STEPS, STEPS + MORE), out / "state")
    acc.save_state(str(out / "continued_state"))
    dist.barrier()
    if dist.get_rank() == 0:
        save_consolidated(out / "continued_state", out / "continued.safetensors")
        shutil.rmtree(out / "continued_state")
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):
            (out / "state" / script).unlink(missing_ok=True)
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def run_fabric(name: str) -> None:
    import lightning.fabric.strategies.deepspeed as fabric_deepspeed
    import torch
    import torch.distributed as dist
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy, DeepSpeedStrategy
    from safetensors.torch import load_file

    _deepspeed_strategy_on_cpu(fabric_deepspeed, DeepSpeedStrategy, DDPStrategy)
    data = load_file(HERE / "batches.safetensors")
    out = HERE / name
    cfg = front_config()

    def run(steps: range, resume: Path | None = None):
        strategy = DeepSpeedStrategy(config=json.loads(json.dumps(cfg)))  # it fills it in
        fabric = Fabric(strategy=strategy, accelerator="cpu", devices=WORLD)
        fabric.launch()
        net = model()
        opt = torch.optim.AdamW(net.parameters(), lr=0.02, weight_decay=0.01)
        sched = lambda_lr(opt)
        net, opt = fabric.setup(net, opt)
        state = {"model": net, "optimizer": opt, "scheduler": sched, "step": 0}
        if resume is not None:
            fabric.load(resume, state)
        rows = slice(dist.get_rank() * MICRO, (dist.get_rank() + 1) * MICRO)
        for i in steps:
            x, y = data["inputs"][i, rows], data["targets"][i, rows]
            fabric.backward(((net(x) - y) ** 2).mean(), model=net)
            opt.step()
            sched.step()
            state["step"] += 1
        return fabric, state

    fabric, state = run(range(STEPS))
    fabric.save(out / "model.ckpt", state)
    fabric.barrier()
    if fabric.global_rank == 0:
        save_consolidated(out / "model.ckpt", out / "consolidated.safetensors")
    fabric, state = run(range(STEPS, STEPS + MORE), out / "model.ckpt")
    assert state["step"] == STEPS + MORE, state["step"]
    fabric.save(out / "continued.ckpt", state)
    fabric.barrier()
    if fabric.global_rank == 0:
        save_consolidated(out / "continued.ckpt", out / "continued.safetensors")
        shutil.rmtree(out / "continued.ckpt")
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):
            (out / "model.ckpt" / script).unlink(missing_ok=True)
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


HF_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    "zero_optimization": {"stage": 2},
}


def hf_parts(out: str, resume: bool = False):
    """The Hugging Face case's model, data and arguments."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=1, n_head=2)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0  # the same steps at any world
    net = GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 32, (7 * WORLD * MICRO, 8), generator=g)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(ids)

        def __getitem__(self, i: int):
            return {"input_ids": ids[i], "labels": ids[i]}

    args = dict(
        output_dir=out,
        per_device_train_batch_size=MICRO,
        max_steps=STEPS + MORE,
        save_steps=STEPS,
        learning_rate=0.01,
        weight_decay=0.01,
        max_grad_norm=0.5,
        report_to=[],
        logging_steps=100,
        seed=7,
        disable_tqdm=True,
    )
    return net, Tokens(), lambda **more: TrainingArguments(**{**args, **more})


def run_hf(name: str) -> None:
    import torch.distributed as dist
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import save_file
    from transformers import Trainer

    out = HERE / name
    net, data, args = hf_parts(str(out / "run"))
    Trainer(model=net, args=args(deepspeed=dict(HF_CONFIG)), train_dataset=data).train()
    net, data, args = hf_parts(str(out / "resumed"))
    trainer = Trainer(model=net, args=args(deepspeed=dict(HF_CONFIG)), train_dataset=data)
    trainer.train(resume_from_checkpoint=str(out / "run" / f"checkpoint-{STEPS}"))
    dist.barrier()
    if dist.get_rank() == 0:
        ckpt = out / "checkpoint"
        shutil.move(out / "run" / f"checkpoint-{STEPS}", ckpt)
        state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
        save_file({k: v.clone() for k, v in state.items()}, out / "consolidated.safetensors")
        final = trainer.model.state_dict()
        save_file({k: v.detach().clone() for k, v in final.items()}, out / "continued.safetensors")
        for extra in ("zero_to_fp32.py", "zero_to_torch.py", "training_args.bin"):
            (ckpt / extra).unlink(missing_ok=True)
        shutil.rmtree(out / "run")
        shutil.rmtree(out / "resumed")
        (out / "config.json").write_text(json.dumps(HF_CONFIG, indent=2) + "\n")


TP_CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.5,
    "tensor_parallel": {"autotp_size": WORLD},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01}},
    "zero_optimization": {"stage": 1},
}


def tp_parts():
    """The tensor-parallel case's model (a 1-layer Llama from a config) and token batches."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=8,
    )
    g = torch.Generator().manual_seed(3)
    return LlamaForCausalLM(config), torch.randint(0, 32, (STEPS + MORE, MICRO, 8), generator=g)


def universal_weights(ckpt: Path, out: Path) -> None:
    """DeepSpeed's own join of the tensor-parallel parts: ds_to_universal's fp32 per parameter."""
    import torch
    from safetensors.torch import save_file

    tag = ckpt / (ckpt / "latest").read_text().strip()
    universal = ckpt.parent / "universal"
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal"]
    subprocess.run(
        [*cmd, "--input_folder", str(tag), "--output_folder", str(universal)], check=True
    )
    state = {}
    for d in sorted((universal / "zero").iterdir()):
        if d.is_dir():
            state[d.name] = torch.load(d / "fp32.pt", weights_only=False)["param"].contiguous()
    save_file(state, out)
    shutil.rmtree(universal)
    (ckpt.parent / "latest_universal").unlink(missing_ok=True)  # ds_to_universal's pointer


def run_tp(name: str) -> None:
    """``tp_s1``: DeepSpeed's AutoTP training (tensor_parallel.autotp_size 2, ZeRO-1) on two
    ranks, one tensor-parallel group: ``mp_rank_00`` and ``mp_rank_01`` files with its
    ``universal_checkpoint_info``; the references are DeepSpeed's ds_to_universal joins."""
    import deepspeed
    import torch.distributed as dist

    out = HERE / name
    deepspeed.init_distributed(dist_backend="gloo")

    def steps(engine, ids, which: range) -> None:
        for i in which:
            engine.backward(engine(input_ids=ids[i], labels=ids[i]).loss)
            engine.step()

    net, ids = tp_parts()
    engine, *_ = deepspeed.initialize(
        model=net, model_parameters=net.parameters(), config=TP_CONFIG
    )
    steps(engine, ids, range(STEPS))
    engine.save_checkpoint(out / "ckpt", client_state={"epoch": 1})
    dist.barrier()
    if dist.get_rank() == 0:
        universal_weights(out / "ckpt", out / "consolidated.safetensors")
    dist.barrier()
    net, ids = tp_parts()
    engine, *_ = deepspeed.initialize(
        model=net, model_parameters=net.parameters(), config=TP_CONFIG
    )
    engine.load_checkpoint(out / "ckpt")
    steps(engine, ids, range(STEPS, STEPS + MORE))
    engine.save_checkpoint(out / "continued_ckpt")
    dist.barrier()
    if dist.get_rank() == 0:
        universal_weights(out / "continued_ckpt", out / "continued.safetensors")
        shutil.rmtree(out / "continued_ckpt")
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):
            (out / "ckpt" / script).unlink(missing_ok=True)
        (out / "config.json").write_text(json.dumps(TP_CONFIG, indent=2) + "\n")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--case":
        kinds = {
            "lightning": run_lightning,
            "hf": run_hf,
            "accelerate": run_accelerate,
            "fabric": run_fabric,
            "tp": run_tp,
        }
        kinds.get(sys.argv[2].split("_")[0], run_case)(sys.argv[2])
        return
    from safetensors.torch import save_file

    save_file(batches(), HERE / "batches.safetensors")
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    fronts = [
        "lightning_s2",
        "hf_s2",
        "accelerate_s2",
        "accelerate_s2_config",
        "fabric_s2",
        "tp_s1",
    ]
    for name in sys.argv[1:] or [*CASES, *fronts]:
        shutil.rmtree(HERE / name, ignore_errors=True)
        cmd = ["torchrun", f"--nproc_per_node={WORLD}", "--master_port=29613", __file__]
        subprocess.run([*cmd, "--case", name], check=True, env=env)


if __name__ == "__main__":
    main()
