"""An engine's state on this rank as the checkpoint seam's records (``checkpoint/seam.py``).

This is where the engine's layout is read (its flat groups' pieces, fp32 masters, the
tensor-parallel split, gradient compression's buffers) so that checkpoint code never is: it
gets each piece with its global position, and saves, reshards and loads those. Every tensor
in the records is the live storage, so a load writes straight into the shards.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .checkpoint.seam import ExtraState, OptimizerSlot, Placement, Run, ShardedState, WeightPiece
from .compression.reduction import GradientCompression
from .moe.parallel import ExpertParallel
from .names import plain_names
from .tp import TensorParallel
from .zero.builders import ShardingPlan
from .zero.optimizer import OptimizerPiece

__all__ = ["sharded_state"]


class _Places:
    """Each parameter's name and full shape in the checkpoint, and where a range of it sits."""

    def __init__(
        self,
        plan: ShardingPlan,
        module: nn.Module,
        tp: TensorParallel | None,
        experts: ExpertParallel | None = None,
    ) -> None:
        self.tp = tp
        self.experts = experts.params if experts is not None else {}
        self.plain = plain_names(module)  # a compiled or DDP-wrapped model saves its own names
        self.names: dict[int, str] = {}
        for name, p in module.named_parameters():
            info = tp.params.get(id(p)) if tp is not None else None
            self.names.setdefault(id(p), self.plain(info.name if info is not None else name))
            expert = self.experts.get(id(p))
            if expert is not None:  # the whole model's name (a global expert index)
                self.names[id(p)] = self.plain(expert.name)
        # real shapes: sharded parameters are empty between uses
        self.shapes = {self.names[id(p)]: tuple(p.shape) for p in module.parameters()}
        for g in plan.groups:
            for p, shape in zip(g.params, g.shapes, strict=True):
                self.shapes[self.names[id(p)]] = tuple(shape)
        for info in tp.params.values() if tp is not None else ():
            # the full weight's, not this rank's part
            self.shapes[self.plain(info.name)] = tuple(info.shape)
        for expert in self.experts.values():  # every expert's, for a fused tensor
            self.shapes[self.plain(expert.name)] = expert.shape

    def of(self, p: torch.Tensor, start: int, length: int, at: int = 0) -> Placement:
        """Elements ``[start, start + length)`` of ``p`` flattened, held at ``at`` of a local
        tensor (a tensor-parallel part is several runs of the full weight)."""
        info = self.tp.params.get(id(p)) if self.tp is not None else None
        if info is None:
            name = self.names[id(p)]
            expert = self.experts.get(id(p))
            shift = expert.offset if expert is not None else 0  # this rank's experts' place
            return Placement(name, self.shapes[name], (Run(at, start + shift, length),))
        runs = tuple(Run(at + o, s, n) for o, s, n in info.full_runs(start, length))
        return Placement(self.plain(info.name), tuple(info.shape), runs)


def _weights(plan: ShardingPlan, module: nn.Module, places: _Places) -> list[WeightPiece]:
    out = []
    grouped: set[int] = set()
    for g in plan.groups:
        grouped.update(id(p) for p in g.params)
        if not g.policy.shard_optimizer and g.master is None:  # stage 0: every rank saves all
            for i, p in enumerate(g.params):
                full = g.full_tensor(i).view(-1)
                out.append(WeightPiece(places.of(p, 0, full.numel()), full))
            continue
        flat = g.master if g.master is not None else g.shard  # fp32 masters when training mixed
        for pc in g.layout.pieces(g.rank):
            where = places.of(g.params[pc.index], pc.param_start, pc.length, at=pc.shard_start)
            out.append(WeightPiece(where, flat))
    for p in module.parameters():
        if id(p) not in grouped:  # not sharded (frozen, or persistent and frozen): replicated
            out.append(WeightPiece(places.of(p, 0, p.numel()), p.detach().view(-1)))
    return out


def _extra(compression: GradientCompression | None, places: _Places) -> list[ExtraState]:
    """The buffers gradient compression saves, per parameter.

    Top-k saves its residual and momentum-correction velocity. The 1-bit errors restart at
    a load, as in DeepSpeed, so they are not saved.
    """
    if compression is None:
        return []
    out = []
    for g, buffers in compression.saved_buffers():
        for kind, buf in buffers.items():
            for p, slot in zip(g.params, g.layout.slots, strict=True):
                view = buf[slot.offset : slot.offset + slot.numel]
                out.append(ExtraState("compression", places.names[id(p)], kind, view))
    return out


def sharded_state(
    plan: ShardingPlan,
    module: nn.Module,
    tensor_parallel: TensorParallel | None,
    pieces: Sequence[OptimizerPiece],
    compression: GradientCompression | None,
    *,
    stage: int,
    world_size: int,
    tp_degree: int,
    experts: ExpertParallel | None = None,
) -> ShardedState:
    """The records of an engine's state on this rank, once in-flight gathers have landed.
    Expert parameters are placed in the whole model's (``core/moe/parallel.py``)."""
    plan.wait_params()
    places = _Places(plan, module, tensor_parallel, experts)
    slots = tuple(
        OptimizerSlot(places.of(pc.group.params[pc.index], pc.start, pc.tensor.numel()), pc.tensor)
        for pc in pieces
    )
    buffers = {
        places.plain(name): t.detach()
        for name, t in module.state_dict(keep_vars=True).items()
        if not isinstance(t, nn.Parameter) and torch.is_tensor(t)
    }
    return ShardedState(
        weights=tuple(_weights(plan, module, places)),
        buffers=buffers,
        optimizer=slots,
        extra=tuple(_extra(compression, places)),
        shapes=places.shapes,
        stage=stage,
        world_size=world_size,
        tp_degree=tp_degree,
        replicas_from_rank0=compression is not None and compression.replicas_drift,
        elsewhere=frozenset(places.plain(n) for n in experts.other_names())
        if experts is not None
        else frozenset(),
    )
