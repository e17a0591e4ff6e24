"""Weights tied across pipeline stages (an embedding and the output head sharing one matrix).

[Note: keeping a tied weight in sync]
Every stage that uses a tied parameter holds its own copy. At start-up the lowest such stage
broadcasts its values to the others; after the schedule, before the data-parallel reduction,
the owning stages sum their locally accumulated gradients (one small group per data-parallel
index), so every copy sees the gradient of the whole model and the identical optimizer steps
keep the copies equal. For the global gradient norm the copy on the lowest stage counts; the
others subtract theirs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..collectives import Comm
from ..zero.flat_group import FlatParamGroup
from .mesh import Mesh

__all__ = ["TiedParam", "find_tied"]


@dataclass
class TiedParam:
    param: nn.Parameter
    stages: list[int]  # pipeline ranks holding a layer that uses it
    comm: Comm | None  # this rank's group of the owning stages (None: not an owner)

    @property
    def primary(self) -> int:
        return self.stages[0]


def find_tied(
    layers: Sequence[nn.Module], stage_of_layer: list[int], mesh: Mesh
) -> list[TiedParam]:
    """Parameters used by layers on two or more pipeline ranks; builds their groups (the
    rank layout's ``cross_stage``: collective in layer order, so all ranks agree)."""
    owners: dict[int, tuple[nn.Parameter, list[int]]] = {}
    for layer, stage in zip(layers, stage_of_layer, strict=True):
        for p in layer.parameters():
            entry = owners.setdefault(id(p), (p, []))
            if stage not in entry[1]:
                entry[1].append(stage)
    out = []
    for p, stages in owners.values():
        if len(stages) < 2:
            continue
        stages = sorted(stages)
        out.append(TiedParam(p, stages, mesh.new_cross_stage_groups(stages)))
    return out


def broadcast_tied(tied: list[TiedParam]) -> None:
    """The lowest owning stage's values everywhere (before the engines copy them)."""
    with torch.no_grad():
        for t in tied:
            if t.comm is not None:
                t.comm.broadcast(t.param.data, 0)


def sum_tied_grads(tied: list[TiedParam], groups: list[FlatParamGroup]) -> None:
    """Sum each tied parameter's local gradient over its owning stages."""
    where = {id(p): (g, i) for g in groups if g.trainable for i, p in enumerate(g.params)}
    for t in tied:
        if t.comm is None or id(t.param) not in where:
            continue
        g, i = where[id(t.param)]
        t.comm.all_reduce(g.accumulated_grad(i))
        g.grad_seen[i] = 1.0


def duplicate_sq_norm(tied: list[TiedParam], pieces: list, stage: int) -> float:
    """Squared norm of this rank's reduced-gradient pieces of tied parameters whose primary
    copy lives on another stage (so the global norm counts each tied weight once)."""
    ids = {id(t.param) for t in tied if t.comm is not None and t.primary != stage}
    sq = 0.0
    for pc in pieces:
        if id(pc.group.params[pc.index]) in ids and pc.group.grad_seen[pc.index] > 0:
            sq += float(pc.grad().double().square().sum())
    return sq
