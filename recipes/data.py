"""A character-level corpus: every ``stride``-th window of ``seq + 1`` characters."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset


class CharCorpus(Dataset):
    def __init__(self, path: Path, seq: int, stride: int) -> None:
        text = path.read_text(encoding="utf-8")
        if len(text) < seq + 2:
            raise ValueError(
                f"{path}: {len(text)} characters, fewer than model.seq + 2 = {seq + 2}; "
                "give a longer text (data.path) or a shorter context (model.seq)"
            )
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        self.data = self.encode(text)
        self.seq = seq
        self.starts = range(0, len(text) - seq - 1, max(1, stride))

    @property
    def vocab(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in text if c in self.index], dtype=torch.long)

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.chars[i] for i in ids.tolist())

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> torch.Tensor:
        s = self.starts[i]
        return self.data[s : s + self.seq + 1]
