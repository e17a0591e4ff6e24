"""Full parameters on every rank for the length of a ``with`` block: the counterpart of
DeepSpeed's ``zero.GatheredParameters``, reached through ``ZeroEngine.gathered_parameters``.

[Note: what a gathered block reads and writes]
Entering gathers: at stage 3 each unit holding one of the parameters is all-gathered whole
(through the runtime, so its count of live parameters stays right); at stages 0-2 the
parameters are full already, and only the post-step all-gathers still in flight are awaited.
Inside, ``p.data`` is the parameter's full value on every rank.

On leaving, ``modifier_rank`` says what happens to values written inside:

- ``None`` (read only, DeepSpeed's default): nothing is written back. At stage 3 a change is
  lost when the unit is released; at stages 0-2 it would stay in that rank's copy only, out
  of step with the masters and the other ranks. Do not write.
- a rank ``k``: that rank's values of the named parameters are broadcast, then written back.
- ``"all"``: every rank wrote the same values (a deterministic computation such as PEFT's
  merge); no broadcast, each rank writes back its own slice.

Writing back means every copy the engine keeps of this rank's slice: the stage-3 shard, and
the fp32 master that mixed precision or offload keeps for the optimizer (stages 0-2 compute
in the flat buffer itself, which holds the new values already). Only the elements that
changed inside are written to the master: one that was left alone keeps its fp32 value
rather than taking its rounding to the compute dtype. A snapshot of this rank's slice taken
on entering tells them apart (1/N of the gathered bytes while the block lasts). The hpZ
secondary shard of a changed group is dropped, as after an optimizer step.

Every rank enters and leaves together (the gathers and broadcasts are collectives). An
exception inside the block on any rank raises on every rank when it ends (``faults.agree``),
and then nothing is written back; the units gathered are released either way. At stages 0-2
without a modifier rank nothing is collective, so a block one rank runs alone (a merge done on
rank 0 only) works there as it does without ZeRO.

[Note: handing the model over]
``GatheredParameters.hand_over()`` (called inside the block, with every parameter named)
ends the engine's sharding of the model for good: on leaving, after the write-back, each
stage-3 parameter keeps its full value as a tensor of its own and the ZeRO-3 forward hooks are
removed, so nothing gathers or releases the model's parameters again. The flat groups keep
their shards, written back, so ``full_state_dict`` and checkpoints still read the same values.
PEFT's ``merge_and_unload`` needs this: the base model it returns is for saving or generating
with as it is (``frontends/peft.py``). At stages 0-2 the parameters are full tensors that the
engine keeps in place anyway, and nothing changes.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType
from typing import Final, Literal

import torch
from torch import nn

from ..collectives import Comm
from ..faults import agree
from .builders import ShardingPlan
from .flat_group import FlatParamGroup, ShardState
from .stage3 import Unit

__all__ = ["ALL_RANKS", "GatheredParameters", "ModifierRank", "full_numels"]

ALL_RANKS: Final = "all"
ModifierRank = int | Literal["all"] | None


class GatheredParameters:
    """A ``with`` block inside which ``params`` hold their full values on every rank.

    Build it with :meth:`ds_strategy.ZeroEngine.gathered_parameters`; see [Note: what a
    gathered block reads and writes] at the top of this file.

    Args:
        plan: the engine's sharding plan.
        comm: the engine's data-parallel ranks (a modifier rank is one of them).
        module: the engine's model (parameters outside it are refused).
        params: a parameter, an iterable of them, or ``None`` for every parameter.
        modifier_rank: ``None``, a rank, or ``"all"`` (see the note).
    """

    def __init__(
        self,
        plan: ShardingPlan,
        comm: Comm,
        module: nn.Module,
        params: nn.Parameter | Iterable[nn.Parameter] | None,
        modifier_rank: ModifierRank,
    ) -> None:
        self.plan, self.comm = plan, comm
        self.modifier_rank = _checked_modifier(modifier_rank, comm.world_size)
        mine = list(module.parameters())
        self.everything = params is None
        chosen = mine if params is None else _as_list(params)
        known = {id(p) for p in mine}
        for p in chosen:
            if id(p) not in known:
                raise ValueError(
                    f"gathered_parameters: a parameter of shape {tuple(p.shape)} is not one of "
                    f"the engine's model ({type(module).__name__}); pass parameters of "
                    "engine.module, or None for all of them"
                )
        self.params = list({id(p): p for p in chosen}.values())
        group_of = {id(p): g for g in plan.groups for p in g.params}
        self.loose = [p for p in self.params if id(p) not in group_of]  # full tensors
        # each group holding a named parameter, with the indices of those it holds
        self._named: dict[int, list[int]] = {}
        self.groups: list[FlatParamGroup] = []
        for p in self.params:
            g = group_of.get(id(p))
            if g is None:
                continue
            if id(g) not in self._named:
                self._named[id(g)] = []
                self.groups.append(g)
            self._named[id(g)].append(next(i for i, q in enumerate(g.params) if q is p))
        if self.modifier_rank is not None:
            for g in self.groups:
                _refuse_files(g)
        self._gathered_units: list[Unit] = []
        self._entry: dict[int, torch.Tensor] = {}
        self._hand_over = False
        self._active = False

    # -- the block ----------------------------------------------------------------------------

    def __enter__(self) -> GatheredParameters:
        if self._active:
            raise RuntimeError("gathered_parameters: this block is already entered")
        self.plan.wait_params()  # stages 1/2: the post-step all-gathers land first
        runtime = self.plan.stage3
        if runtime is not None:
            unit_of = {id(g): u for u in runtime.units for g in u.groups}
            units = {id(unit_of[id(g)]): unit_of[id(g)] for g in self.groups if id(g) in unit_of}
            for unit in units.values():
                self._check_bound(unit)
            # through the runtime (this package's), so its count of live parameters stays
            # right: a unit gathered here is released by the runtime as by a forward's hooks
            self._gathered_units = [u for u in units.values() if not u.gathered]
            for unit in self._gathered_units:
                runtime._gather(unit, wait=False)  # all launched, then all awaited
            for unit in units.values():
                runtime._gather(unit, wait=True)
        self._active = True
        if self.modifier_rank is not None:
            with torch.no_grad():
                self._entry = {id(g): _own_slice(g) for g in self.groups}
        return self

    def hand_over(self) -> None:
        """On leaving, the model keeps its full parameters and the engine stops gathering and
        releasing them (see [Note: handing the model over]). Only for a block over every
        parameter."""
        if not self.everything:
            raise ValueError(
                "gathered_parameters(...).hand_over() needs the block over every parameter "
                "(params=None): the engine stops sharding the whole model"
            )
        self._hand_over = True

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            # every rank raises if one did, and nothing is written; a block with no
            # collective (stages 0-2, nothing broadcast) leaves each rank to its own outcome
            collective = self.plan.stage3 is not None or isinstance(self.modifier_rank, int)
            if collective and (isinstance(exc, Exception) or exc is None):
                agree(self.comm, exc)
            if exc is None and self.modifier_rank is not None:
                with torch.no_grad():
                    self._write_back()
            if exc is None and self._hand_over:
                self._give_full_values()
        finally:
            self._release()
            self._active = False

    # -- inside ----------------------------------------------------------------------------------

    def _check_bound(self, unit: Unit) -> None:
        """A released unit's parameters are empty; one holding values was rebound by someone
        else (a model handed over): gathering would overwrite it."""
        for g in unit.groups:
            if g.state is ShardState.SHARDED and any(p.numel() > 0 for p in g.params):
                raise RuntimeError(
                    f"gathered_parameters: the parameters of {type(unit.module).__name__} are "
                    "no longer sharded by this engine (the model was handed over, e.g. by "
                    "PEFT's merge_and_unload); use the model's parameters directly"
                )

    def _write_back(self) -> None:
        k = self.modifier_rank
        if isinstance(k, int):
            for p in self.loose:
                self.comm.broadcast(p.data, k)
            for g in self.groups:
                for i in self._named[id(g)]:
                    self.comm.broadcast(g.full_tensor(i), k)
        for g in self.groups:
            new = _own_slice(g)
            changed = new != self._entry.pop(id(g))
            if not bool(changed.any()):
                continue
            if g.policy.shard_params:  # stages 0-2: the shard is a view of the full buffer
                g.shard.copy_(torch.where(changed.to(g.shard.device), new.to(g.shard), g.shard))
            if g.master is not None:
                where = changed.to(g.master.device)
                g.master.copy_(torch.where(where, new.to(g.master), g.master))
            g.drop_secondary()

    def _give_full_values(self) -> None:
        runtime = self.plan.stage3
        if runtime is None:
            return
        full = {
            id(p): g.full_tensor(i).clone()
            for u in runtime.units
            for g in u.groups
            for i, p in enumerate(g.params)
        }
        runtime.release_all()
        for u in runtime.units:
            for g in u.groups:
                for p in g.params:
                    p.data = full[id(p)]
        runtime.remove_hooks()
        self._gathered_units = []

    def _release(self) -> None:
        runtime = self.plan.stage3
        for unit in self._gathered_units:
            if runtime is not None:
                runtime._release(unit)
        self._gathered_units = []
        self._entry = {}


def full_numels(plan: ShardingPlan) -> dict[int, int]:
    """How many elements each parameter of the plan's flat groups has in full, by ``id``,
    whatever its state (a released stage-3 parameter is empty). Parameters outside the groups
    are full tensors: their ``numel()`` is right.

    Args:
        plan: an engine's sharding plan (``engine.plan``).

    Returns:
        ``{id(parameter): number of elements}``.

    Example::

        counts = full_numels(engine.plan)
        total = sum(counts.get(id(p), p.numel()) for p in engine.module.parameters())
    """
    return {
        id(p): int(torch.Size(shape).numel())
        for g in plan.groups
        for p, shape in zip(g.params, g.shapes, strict=True)
    }


def _own_slice(g: FlatParamGroup) -> torch.Tensor:
    """This rank's slice of ``g``'s gathered parameters, as a new shard-sized tensor (padding
    zero), read from the full values."""
    out = torch.zeros(g.shard.numel(), dtype=g.dtype, device=g.device)
    for pc in g.layout.pieces(g.rank):
        src = g.full_tensor(pc.index).reshape(-1)[pc.param_start : pc.param_start + pc.length]
        out[pc.shard_start : pc.shard_start + pc.length].copy_(src)
    return out


def _refuse_files(g: FlatParamGroup) -> None:
    if g.store.kind == "nvme":
        raise ValueError(
            "gathered_parameters(modifier_rank=...): writing parameters back is not supported "
            "with NVMe offload (offload_param / offload_optimizer device 'nvme'), whose shards "
            "and masters live in swap files; use CPU offload, or load the changed weights "
            "with engine.load_weights"
        )


def _checked_modifier(rank: ModifierRank, world: int) -> ModifierRank:
    if rank is None or rank == ALL_RANKS:
        return rank
    if isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < world:
        return rank
    raise ValueError(
        f"gathered_parameters(modifier_rank={rank!r}): expected None (read only), a rank "
        f'in 0..{world - 1} whose values are kept, or "all" (every rank wrote the same values)'
    )


def _as_list(params: nn.Parameter | Iterable[nn.Parameter]) -> list[nn.Parameter]:
    if isinstance(params, torch.Tensor):
        return [params]  # type: ignore[list-item]
    return list(params)
