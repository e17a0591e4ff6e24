"""Train ``Regressor`` under DDP and ZeRO stages 1-3 with the Trainer, checkpoint, resume,
evaluate and export; rank 0 saves everything the test compares to ``OUT/results.pt``.

Usage: ``MASTER_PORT=... python trainer_parity.py OUT`` (one process per rank: see launch.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
from _common import (
    ZERO3_SHARD_ALL,
    Regressor,
    full_weights,
    loader,
    local_numel,
    out_dir,
    rank,
    trainer,
)
from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary
from safetensors.torch import load_file

import ds_strategy  # noqa: F401  (registers the strategies)
from ds_strategy.lightning import ZeroStrategy

ROOT = out_dir()
results: dict[str, Any] = {}


class Unlogged(Regressor):
    """``Regressor`` whose ``training_step`` does not call ``self.log``: traced by Dynamo,
    Lightning's ``log`` fails (``inspect.getfullargspec`` of a bound method) with any
    strategy, ``ddp`` included, in this torch and Lightning."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._loss(batch)


def zero(stage: int) -> ZeroStrategy:
    return ZeroStrategy(stage=stage, config=ZERO3_SHARD_ALL if stage == 3 else None)


def fit(
    strategy: Any, tag: str, perturb: bool = False, **kwargs: Any
) -> tuple[L.Trainer, Regressor]:
    # the seed also seeds the DistributedSampler's shuffling: keep it for resumed runs
    L.seed_everything(1)
    compiled = kwargs.pop("compiled", False)
    cls = Unlogged if compiled else Regressor
    model: Any = cls(param_groups=kwargs.pop("param_groups", 2))
    if compiled:  # trainer.fit(torch.compile(module))
        model = torch.compile(model, backend="aot_eager")
    if perturb:  # a resumed run must get every weight from the checkpoint
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    ckpt_path = kwargs.pop("ckpt_path", None)
    t = trainer(strategy, ROOT / tag, **kwargs)
    t.fit(model, loader(64), loader(16, seed=1, shuffle=False), ckpt_path=ckpt_path)
    return t, model


def record(tag: str, t: L.Trainer, model: Regressor) -> None:
    results[tag] = {
        "weights": full_weights(t, model),
        "global_step": t.global_step,
        "lr": [g["lr"] for g in t.optimizers[0].param_groups],
        "norms": list(model.norms),
        "local_numel": local_numel(model),
    }


# -- the reference and the three stages, two epochs, accumulate 2, clip 1.5 ----------------------
t, m = fit("ddp", "ddp")
record("ddp", t, m)
results["ddp"]["val"] = t.validate(m, loader(16, seed=1, shuffle=False), verbose=False)
results["ddp"]["pred"] = t.predict(m, loader(16, seed=2, shuffle=False))

for stage in (1, 2):
    t, m = fit(zero(stage), f"zero{stage}")
    record(f"zero{stage}", t, m)
    results[f"zero{stage}"]["engine_stage"] = t.strategy.engine.stage
    t.strategy.save_consolidated(ROOT / f"zero{stage}.pt")

every_epoch = ModelCheckpoint(dirpath=ROOT / "z3_epochs", filename="{epoch}", save_top_k=-1)
rotating = ModelCheckpoint(
    dirpath=ROOT / "z3_rot", filename="rot-{epoch}", monitor="step", mode="max", save_top_k=1
)
summary = ModelSummary(max_depth=2)
t, m = fit(zero(3), "zero3", callbacks=[every_epoch, rotating, summary], enable_checkpointing=True)
record("zero3", t, m)
z3 = results["zero3"]
# parameters are sharded (empty outside forward) now; the summary still counts them in full
report = summary._summary(t, m)
z3["summary"] = (report.total_parameters, report.trainable_parameters, report.param_nums)
z3["summary_names"] = report.layer_names
plain = Regressor()
from torch._dynamo.utils import counters  # noqa: E402

counters.clear()
tc, mc = fit(zero(3), "zero3_compiled", compiled=True)
record("zero3_compiled", tc, mc._orig_mod)  # the LightningModule the Trainer ran
results["zero3_compiled"]["graphs"] = counters["stats"]["unique_graphs"]
counters.clear()
# the config's compile section: the engine compiles each unit (the body's two Linear layers,
# through their forward: Module.compile() compiles nothing of torch's own modules)
section = {**ZERO3_SHARD_ALL, "compile": {"enabled": True, "backend": "aot_eager"}}
tc, mc = fit(ZeroStrategy(stage=3, config=section), "zero3_config_compiled")
record("zero3_config_compiled", tc, mc)
results["zero3_config_compiled"]["report"] = tc.strategy.engine.compile_report()
z3["plain_counts"] = {
    n: sum(p.numel() for p in mod.parameters()) for n, mod in plain.named_modules()
}
z3["released"] = sum(p.numel() for p in m.parameters())
z3["engine_stage"] = t.strategy.engine.stage
z3["memory"] = t.strategy.engine.memory_report()
t.strategy.save_consolidated(ROOT / "zero3.safetensors")
# evaluation loops reuse the trained engine
z3["val"] = t.validate(m, loader(16, seed=1, shuffle=False), verbose=False)
z3["test"] = t.test(m, loader(16, seed=1, shuffle=False), verbose=False)
z3["pred"] = t.predict(m, loader(16, seed=2, shuffle=False))
weights_only = ROOT / "z3_weights_only.ckpt"
t.save_checkpoint(weights_only, weights_only=True)
z3["val_weights_only"] = t.validate(m, loader(16, seed=1, shuffle=False), ckpt_path=weights_only)

# -- resume from the epoch-0 checkpoint in a fresh Trainer and model ---------------------------
epoch0 = ROOT / "z3_epochs" / "epoch=0.ckpt"
t, m = fit(zero(3), "resume3", perturb=True, ckpt_path=epoch0)
record("resume3", t, m)
# the same checkpoint resumed under stage 2: the engine reshards
t, m = fit(zero(2), "resume3as2", perturb=True, ckpt_path=epoch0)
record("resume3as2", t, m)

# -- a fresh Trainer evaluating checkpoints of a model with two param groups -------------------
t, m = fit(zero(3), "twogroups", param_groups=2, max_epochs=1)
full_dir, weights_dir = ROOT / "twogroups.ckpt", ROOT / "twogroups_weights.ckpt"
t.save_checkpoint(full_dir)
t.save_checkpoint(weights_dir, weights_only=True)
results["twogroups_val"] = t.validate(m, loader(16, seed=1, shuffle=False), verbose=False)
for name, path in (("fresh_val", full_dir), ("fresh_val_weights_only", weights_dir)):
    fresh = trainer(zero(3), ROOT / name)
    results[name] = fresh.validate(
        Regressor(param_groups=2), loader(16, seed=1, shuffle=False), ckpt_path=path
    )
results["saved_optimizer"] = [
    json.loads((d / "ds_strategy.json").read_text())["optimizer"] for d in (full_dir, weights_dir)
]
try:
    fit(zero(3), "resume_weights_only", ckpt_path=weights_dir)
    results["resume_weights_only_error"] = None
except ValueError as e:
    results["resume_weights_only_error"] = str(e)

if rank() == 0:
    results["files"] = {
        "zero1": torch.load(ROOT / "zero1.pt"),
        "zero3": load_file(str(ROOT / "zero3.safetensors")),
    }
    results["epoch_dirs"] = sorted(p.name for p in (ROOT / "z3_epochs").iterdir())
    results["rot_dirs"] = sorted(p.name for p in (ROOT / "z3_rot").iterdir())
    results["epoch0_is_dir"] = Path(epoch0).is_dir()
    torch.save(results, ROOT / "results.pt")

if torch.distributed.is_initialized():  # the end of the job: destroyed before the interpreter
    torch.distributed.destroy_process_group()  # exits (left to its destructors, gloo can abort)
