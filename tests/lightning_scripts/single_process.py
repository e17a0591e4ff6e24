"""One process (``devices=1``): the Trainer's and Fabric's precision flags reaching the engine,
and misconfigurations that must fail with a message naming the setting to change. Writes
``{"precision": {flag: facts}, "errors": {case: "ExceptionType: message"}}`` to
``OUT/results.json``.

Usage: ``MASTER_PORT=... python single_process.py OUT``
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from _common import Regressor, loader, out_dir, trainer
from torch import nn

import ds_strategy  # noqa: F401  (registers the strategies)
from ds_strategy.fabric import ZeroStrategy as FabricZero
from ds_strategy.lightning import ZeroStrategy

ROOT = out_dir()
errors: dict[str, str] = {}


def expect(case: str, fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the message is what the test checks
        errors[case] = f"{type(err).__name__}: {err}"
    else:
        errors[case] = "no error"


def fit(
    strategy: Any = "zero2", model: L.LightningModule | None = None, **kwargs: Any
) -> L.Trainer:
    ckpt_path = kwargs.pop("ckpt_path", None)
    t = trainer(strategy, ROOT, devices=1, max_epochs=1, **kwargs)
    t.fit(model or Regressor(), loader(16), ckpt_path=ckpt_path)
    return t


precision: dict[str, dict[str, Any]] = {}
for flag in ("32-true", "bf16-mixed", "bf16-true", "16-true"):
    L.seed_everything(1)
    engine = fit(precision=flag).strategy.engine
    precision[flag] = {
        "param_dtype": str(engine.precision.param_dtype),
        "master_weights": engine.precision.master_weights,
        "loss_scale": engine.loss_scale,
        "steps": engine.global_steps,
        "finite": all(bool(torch.isfinite(v).all()) for v in engine.full_state_dict().values()),
    }


class TwoOptimizers(Regressor):
    """Manual optimization (automatic optimization takes one optimizer in Lightning itself),
    the optimizers splitting one submodule, which cannot become one engine each."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def configure_optimizers(self) -> Any:
        first, rest = self.body[0].parameters(), self.body[2].parameters()
        return [torch.optim.SGD(first), torch.optim.SGD([*rest, *self.head.parameters()])]

    def training_step(self, batch: Any, batch_idx: int) -> None:
        return None


class TwoOptimizersAutomatic(Regressor):
    """Several optimizers under automatic optimization: Lightning itself refuses them."""

    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD(self.body.parameters()), torch.optim.SGD(self.head.parameters())]


class NoOptimizer(Regressor):
    def configure_optimizers(self) -> Any:
        return None


expect("two_optimizers_automatic", lambda: fit(model=TwoOptimizersAutomatic()))
expect("no_optimizer", lambda: fit(model=NoOptimizer()))
expect("double", lambda: trainer("zero2", ROOT, devices=1, precision="64-true"))
expect("clip_value", lambda: fit(gradient_clip_algorithm="value"))
expect(
    "accumulate_contradiction",
    lambda: fit(ZeroStrategy(stage=2, config={"gradient_accumulation_steps": 4})),
)
expect(
    "batch_size_contradiction",
    lambda: fit(
        ZeroStrategy(stage=1, config={"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4})
    ),
)
expect(
    "clip_contradiction",
    lambda: fit(ZeroStrategy(stage=2, config={"gradient_clipping": 2.0}), gradient_clip_val=1.0),
)
expect(
    "two_optimizers",
    lambda: fit(model=TwoOptimizers(), accumulate_grad_batches=1, gradient_clip_val=None),
)
ckpt_file = ROOT / "plain.ckpt"
torch.save({"state_dict": Regressor().state_dict()}, ckpt_file)
expect("file_checkpoint", lambda: fit(ckpt_path=ckpt_file))


for name in ("zero2_offload", "zero3_offload"):
    engine = fit(name).strategy.engine
    zc = engine.config.zero_optimization
    precision[name] = {
        "offload": [zc.offload_optimizer.device, zc.offload_param.device],
        "steps": engine.global_steps,
        "finite": all(bool(torch.isfinite(v).all()) for v in engine.full_state_dict().values()),
    }


def fabric_setup(precision: str = "32-true", clip_value: bool = False) -> str:
    fabric = L.Fabric(
        accelerator="cpu", devices=1, strategy=FabricZero(stage=2), precision=precision
    )
    fabric.launch()
    model = nn.Linear(4, 1)
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    fabric.backward(model(torch.randn(2, 4)).sum())
    if clip_value:
        fabric.clip_gradients(model, opt, clip_val=0.5)
    return str(fabric.strategy.engine.precision.param_dtype)


precision["fabric_bf16-mixed"] = {"param_dtype": fabric_setup("bf16-mixed")}
expect("fabric_clip_value", lambda: fabric_setup(clip_value=True))
expect(
    "fabric_double",
    lambda: L.Fabric(accelerator="cpu", devices=1, strategy="zero2", precision="64-true"),
)
(ROOT / "results.json").write_text(json.dumps({"precision": precision, "errors": errors}, indent=1))

if torch.distributed.is_initialized():  # the end of the job: destroyed before the interpreter
    torch.distributed.destroy_process_group()  # exits (left to its destructors, gloo can abort)
