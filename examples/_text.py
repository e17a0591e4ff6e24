"""The examples' data: character windows of the project's documentation (no download), the
same corpus ``train_gpt.py`` trains on. A window is ``seq + 1`` characters: the model reads the
first ``seq`` and predicts the next of each (``ds_strategy.demos.gpt.gpt_loss``)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset

DOCS = Path(__file__).resolve().parents[1] / "docs"


class CharWindows(Dataset):
    """Every ``stride``-th window of ``seq + 1`` characters of ``docs/**/*.md``."""

    def __init__(self, seq: int = 64, stride: int = 16, root: Path = DOCS) -> None:
        text = "\n".join(p.read_text(encoding="utf-8") for p in sorted(root.rglob("*.md")))
        self.chars = sorted(set(text))
        self.data = torch.tensor([self.chars.index(c) for c in text])
        self.seq, self.stride = seq, stride

    @property
    def vocab(self) -> int:
        return len(self.chars)

    def __len__(self) -> int:
        return (len(self.data) - self.seq - 1) // self.stride

    def __getitem__(self, i: int) -> torch.Tensor:
        start = i * self.stride
        return self.data[start : start + self.seq + 1]
