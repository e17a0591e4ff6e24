"""Every rank must build the same engine: the same resolved config and the same model.

[Note: why compare]
Ranks that disagree (one launched with another config file, a model built with a different
size on one node) do not fail where the difference is: a ZeRO stage that differs issues
other collectives, so gloo aborts much later with "Received data size doesn't match expected
size", NCCL hangs, and a small model can even train silently out of step. One all-gather of
a digest at start-up costs microseconds; only when digests differ are the descriptions
gathered, to name the first difference and the ranks.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from ..config import ZeroConfig
from .collectives import Comm

__all__ = ["check_ranks_agree", "describe"]


def describe(config: ZeroConfig, model: nn.Module) -> list[str]:
    """One line per config leaf and per parameter (name, shape, dtype, requires_grad)."""
    lines = [f"config {key} = {value!r}" for key, value in _leaves(dataclasses.asdict(config))]
    for name, p in model.named_parameters():
        lines.append(
            f"parameter {name}: shape {list(p.shape)}, {p.dtype}, requires_grad={p.requires_grad}"
        )
    return lines


def _leaves(tree: Mapping[str, object], prefix: str = "") -> Iterator[tuple[str, object]]:
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def check_ranks_agree(comm: Comm, config: ZeroConfig, model: nn.Module) -> None:
    """Raise on every rank, naming the first difference and the ranks, unless every rank
    has the same resolved config and the same parameters."""
    if comm.world_size == 1:
        return
    lines = describe(config, model)
    digest = hashlib.sha256("\n".join(lines).encode()).digest()
    mine = torch.tensor([int.from_bytes(digest[:7], "little")], dtype=torch.int64)
    every = torch.empty(comm.world_size, dtype=torch.int64)
    comm.all_gather(every, mine)
    if bool((every == every[0]).all()):
        return
    described: list[list[str]] = []
    for theirs in comm.all_gather_object(lines):
        assert isinstance(theirs, list)  # every rank gathers its describe()
        described.append(theirs)
    raise ValueError(_first_difference(described))


def _first_difference(described: list[list[str]]) -> str:
    base = described[0]
    for rank, other in enumerate(described[1:], start=1):
        if other == base:
            continue
        for a, b in zip(base, other, strict=False):
            if a != b:
                return (
                    f"ranks disagree: rank 0 has {a}, rank {rank} has {b}; every rank must "
                    "build the same model with the same config (check the config file and "
                    "arguments each rank was started with)"
                )
        longer, rank_of = (base, 0) if len(base) > len(other) else (other, rank)
        extra = longer[min(len(base), len(other))]
        return (
            f"ranks disagree: only rank {rank_of} has {extra} (ranks 0 and {rank} have "
            f"{len(base)} and {len(other)} entries); every rank must build the same model "
            "with the same config"
        )
    return "ranks disagree on the config or model"
