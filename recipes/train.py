"""Lightning recipe: a character-level GPT trained with ``ZeroStrategy`` from composed configs.

    python recipes/train.py                                   # ZeRO-3, fp32, 2 CPU processes
    python recipes/train.py strategy=zero3 precision=bf16 trainer.devices=2
    python recipes/train.py strategy=zero2 model=gpt_small trainer.max_steps=300
    python recipes/train.py --cfg job                         # print the composed config

Groups: ``strategy`` (the package's presets, ``ds_strategy.config.presets``), ``precision`` (fp32, bf16, fp16), ``model``,
``data``, ``trainer`` (recipes/conf/); any ZeRO key is an override too, e.g.
``strategy.zero_optimization.reduce_bucket_size=5e7`` or ``strategy.wall_clock_breakdown=true``.
Lightning starts the other processes itself (``trainer.devices``).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hydra  # noqa: E402
import lightning as L  # noqa: E402
import torch  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from omegaconf import DictConfig  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import recipes  # noqa: E402,F401  (names the extra when a framework is missing)
from ds_strategy.lightning import ZeroStrategy  # noqa: E402
from recipes.data import CharCorpus  # noqa: E402
from recipes.models import build_model, generate, lm_loss  # noqa: E402
from recipes.output import say  # noqa: E402
from recipes.schema import (  # noqa: E402
    corpus_path,
    engine_config,
    lightning_precision,
    register,
)

register()


class CharLM(L.LightningModule):
    def __init__(self, cfg: DictConfig, vocab: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = build_model(vocab, cfg.model)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = lm_loss(self.model, batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        o = self.cfg.optim
        return torch.optim.AdamW(
            self.parameters(), lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas)
        )


def sample(trainer: L.Trainer, lm: CharLM, corpus: CharCorpus, n: int) -> str | None:
    """Consolidate the weights (collective) and generate ``n`` characters on rank 0."""
    state = trainer.strategy.engine.full_state_dict()  # keyed like lm.state_dict()
    if trainer.global_rank != 0 or n <= 0:
        return None
    local = build_model(corpus.vocab, lm.cfg.model)
    local.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    local.eval()
    prompt = corpus.encode("ZeRO ")
    return "ZeRO " + corpus.decode(generate(local, prompt, n))


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    zero = engine_config(cfg)
    L.seed_everything(cfg.seed, verbose=False)
    corpus = CharCorpus(corpus_path(cfg), cfg.model.seq, cfg.data.stride)
    loader = DataLoader(
        corpus,
        batch_size=cfg.data.batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=cfg.data.num_workers,
    )
    lm = CharLM(cfg, corpus.vocab)
    t = cfg.trainer
    trainer = L.Trainer(
        strategy=ZeroStrategy(config=zero),
        precision=lightning_precision(zero),
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        max_steps=t.max_steps,
        accumulate_grad_batches=t.accumulate_grad_batches,
        gradient_clip_val=t.gradient_clip_val or None,
        log_every_n_steps=t.log_every_n_steps,
        enable_progress_bar=t.enable_progress_bar,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=HydraConfig.get().runtime.output_dir,
        # metrics.csv whatever else is installed (Lightning's default turns to TensorBoard
        # when tensorboard is there)
        logger=CSVLogger(HydraConfig.get().runtime.output_dir),
    )
    trainer.fit(lm, loader)
    engine = trainer.strategy.engine
    report = engine.memory_report()
    loss = trainer.callback_metrics.get("train_loss")
    say(
        f"rank {trainer.global_rank}: stage {engine.stage}, {lightning_precision(zero)}, "
        f"{engine.global_steps} steps, final loss {float(loss) if loss is not None else float('nan'):.3f}, "
        f"model state {report['total'] / 1e6:.3f} MB"
    )
    text = sample(trainer, lm, corpus, t.sample_chars)
    if text is not None:
        say(f"sample: {text!r}")


if __name__ == "__main__":
    main()
