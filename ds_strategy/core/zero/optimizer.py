"""The user's optimizer, rebuilt over this rank's shard of every parameter.

[Note: one optimizer tensor per parameter piece]
Each parameter's piece inside this rank's slice becomes one tensor for the optimizer (a view
into the flat shard, its ``.grad`` a view into the flat gradient shard). Param groups keep
their hyper-parameters; state is per piece, so stage 1/2/3 hold 1/N of Adam's moments. Before
each step, a piece whose parameter got no gradient on *any* rank gets ``.grad = None``, so
the optimizer skips it exactly as plain PyTorch skips a parameter without a gradient (no
weight decay, no momentum drift). Under stage 0 the "piece" is the parameter itself.

[Note: optimizers that need whole-parameter norms]
LAMB's trust ratio is a ratio of norms over a whole parameter, which a piece alone does not
have. An optimizer that says so (``core.optim.NeedsParamNorms``) gets a ``ParamNorms`` from
``ShardedOptimizer``: each piece's slot in one per-parameter vector laid out alike on every
rank (groups in order, parameters in order inside each), and the all-reduce that sums it. Its
``step`` then makes one small all-reduce of partial sums, so it must run once per step on every
rank: the NVMe stepper, which steps bucket by bucket a number of times that differs between
ranks, is refused with such an optimizer.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..collectives import Comm
from ..optim.lowbit import QuantizedStates, state_parts
from ..optim.muon import Muon, NeedsWholeMatrices, WholeMatrices
from ..optim.norms import NeedsParamNorms, ParamNorms
from .flat_group import FlatParamGroup
from .layout import split_into_buckets

__all__ = ["OptimizerPiece", "ShardedOptimizer", "rebuild_optimizer"]

OptimizerLike = torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer]


@dataclass
class OptimizerPiece:
    """One tensor the optimizer updates: this rank's piece of one parameter of ``group``."""

    group: FlatParamGroup
    index: int  # parameter index inside the group
    tensor: torch.Tensor  # what the optimizer updates
    sl: slice | None  # its range in the group's flat step tensors; None: the parameter itself
    start: int = 0  # offset of the piece inside the flattened parameter

    def grad(self) -> torch.Tensor:
        if self.sl is None:
            return self.group.grad_view(self.index)
        return self.group.step_grad()[self.sl]


def _pieces_of(group: FlatParamGroup) -> list[OptimizerPiece]:
    if not group.policy.shard_optimizer and group.master is None:
        # stage 0 without a master copy: the parameters themselves, shapes and all
        return [OptimizerPiece(group, i, p, None) for i, p in enumerate(group.params)]
    flat = group.step_params
    out = []
    for pc in group.layout.pieces(group.rank):
        sl = slice(pc.shard_start, pc.shard_start + pc.length)
        out.append(OptimizerPiece(group, pc.index, flat[sl], sl, pc.param_start))
    return out


def rebuild_optimizer(
    optimizer: OptimizerLike,
    groups: list[FlatParamGroup],
    replaced: dict[int, nn.Parameter],
) -> tuple[torch.optim.Optimizer, list[OptimizerPiece]]:
    """Build the optimizer over this rank's pieces.

    ``replaced`` maps ``id(original parameter)`` to the parameter now in the model (they
    differ only for a model materialised from the meta device).
    """
    pieces = [pc for g in groups if g.trainable for pc in _pieces_of(g)]
    by_param: dict[int, list[torch.Tensor]] = {}
    for pc in pieces:
        by_param.setdefault(id(pc.group.params[pc.index]), []).append(pc.tensor)
    if not isinstance(optimizer, torch.optim.Optimizer):
        flat = [t for pc in pieces for t in [pc.tensor]]
        if getattr(optimizer, "optimizer_class", None) is Muon:  # the config's {"type": "Muon"}
            # pieces are flat: say which are matrices' (from their parameters' shapes)
            kinds = [len(pc.group.shapes[pc.index]) == 2 for pc in pieces]
            return optimizer(
                [
                    {
                        "params": [t for t, m in zip(flat, kinds, strict=True) if m],
                        "use_muon": True,
                    },
                    {
                        "params": [t for t, m in zip(flat, kinds, strict=True) if not m],
                        "use_muon": False,
                    },
                ]
            ), pieces
        return optimizer(flat or [torch.zeros(0)]), pieces
    new_groups = []
    for group in optimizer.param_groups:
        tensors: list[torch.Tensor] = []
        for p in group["params"]:
            current = replaced.get(id(p), p)
            tensors.extend(by_param.get(id(current), []))
        new_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": tensors})
    if not any(g["params"] for g in new_groups):
        # A tiny model on many ranks can leave this rank nothing to own; torch rejects an
        # optimizer with no parameters, so give it one empty tensor that never has a grad.
        new_groups[0]["params"] = [torch.zeros(0)]
    cls: type[torch.optim.Optimizer] = type(optimizer)
    if cls is torch.optim.Muon:  # its pieces are not matrices: ours steps them (muon.py)
        cls = Muon
        new_groups = [{**g, "use_muon": True} for g in new_groups]
    # Every group carries all its hyper-parameters; pass the constructor only the defaults it
    # accepts (some, like AdamW's decoupled_weight_decay, live in defaults but not __init__).
    accepted = inspect.signature(cls.__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return _construct(cls, new_groups, defaults), pieces


def _construct(
    cls: type[torch.optim.Optimizer], groups: list[dict[str, Any]], defaults: dict[str, Any]
) -> torch.optim.Optimizer:
    """Prefer torch's fused kernel when the user left the implementation to torch.

    [Note: fused by default] The pieces are plain dense tensors of one dtype on one device,
    which is what torch's fused Adam/AdamW/SGD/Adagrad kernels want; on CPU they are several
    times faster than the per-tensor loop torch picks by default. A user who set ``foreach``
    (True or False) or ``fused`` explicitly keeps that choice.
    """

    def left_to_torch(d: dict[str, Any]) -> bool:
        # foreach=False is a choice too (the per-tensor loop), not only foreach=True
        return d.get("fused") is None and d.get("foreach") is None and not d.get("differentiable")

    if "fused" in defaults and left_to_torch(defaults) and all(left_to_torch(g) for g in groups):
        # the copied groups carry fused=None too, which would override the default
        fused_groups = [{**g, "fused": True} for g in groups]
        try:
            return cls(fused_groups, **{**defaults, "fused": True})
        except (RuntimeError, ValueError):
            pass  # this dtype/device has no fused kernel
    return cls(groups, **defaults)


class ShardedOptimizer:
    """Grad masking, global-norm clipping and the step, over the pieces of all groups.

    Args:
        optimizer: the optimizer rebuilt over the pieces.
        pieces: what it updates, one tensor per parameter piece.
        groups: the plan's flat groups (the trainable ones are kept).
        comm: the shard group; the norm and the gradient flags are all-reduced over it.
        tp_norm: under tensor parallelism, each parameter's weight in the squared norm, and
            the tensor-parallel ranks.
        replica: MiCS's replica group, over which the flags are combined too; None otherwise.
        matrix_chunk: the most elements of whole matrices Muon's step holds at once.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        pieces: list[OptimizerPiece],
        groups: list[FlatParamGroup],
        comm: Comm,
        tp_norm: tuple[Callable[[torch.Tensor], float], Comm] | None = None,
        replica: Comm | None = None,
        matrix_chunk: int = 1 << 22,
    ) -> None:
        self.optimizer = optimizer
        self.matrix_chunk = matrix_chunk
        self.pieces = pieces
        self.groups = [g for g in groups if g.trainable]
        self.comm = comm
        # MiCS's replica group (None otherwise): gradient flags are combined over it too
        self.replica = replica
        self.sharded = any(g.policy.shard_optimizer for g in self.groups)
        # stage 0 with expert groups, whose gradients are whole on the expert-data-parallel
        # group (a part of ``comm``), not on every rank
        self._whole_on_subgroups = not self.sharded and any(
            g.comm.world_size != comm.world_size for g in self.groups
        )
        # a step in buckets: NVMe offload's, which brings the swapped state in (core/offload),
        # or the rounded step of low-precision weights and state (core/precision/step.py)
        self._stepper: Any = None
        # the engine's optimizer-step counter (part of the rounded step's rounding key)
        self.clock: Callable[[], int] = lambda: 0
        # torchao's low-bit optimizers: which pieces keep quantized state (core/optim/lowbit.py)
        self.quantized: QuantizedStates | None = None
        # tensor parallelism (core/tp): the parameter -> weight of its squared norm, and the
        # ranks holding the other parts; see sync_grad_flags_and_norm
        self.tp_norm = tp_norm
        self.param_norms: ParamNorms | None = None
        if isinstance(optimizer, NeedsParamNorms):
            needed = self.sharded or tp_norm is not None
            self.param_norms = self._param_norms() if needed else None
            optimizer.use_param_norms(self.param_norms)
        # Muon: whole matrices from the pieces (core/optim/muon.py); its step is collective
        self.whole_matrices: WholeMatrices | None = None
        if isinstance(optimizer, NeedsWholeMatrices):
            flat = any(pc.sl is not None for pc in pieces)  # 1-D pieces, not the parameters
            self.whole_matrices = self._whole_matrices() if flat else None
            optimizer.use_whole_matrices(self.whole_matrices)

    def _whole_matrices(self) -> WholeMatrices:
        """Every matrix of the trainable groups, alike on every rank, with this rank's piece
        of each (a 2-D parameter Muon does not step is carried along and never updated)."""
        held = {(id(pc.group), pc.index): pc for pc in self.pieces if pc.sl is not None}
        matrices: list[tuple[Sequence[int], tuple[int, int] | None]] = []
        keys: dict[int, int] = {}
        for g in self.groups:
            for i, shape in enumerate(g.shapes):
                if len(shape) != 2:
                    continue
                pc = held.get((id(g), i))
                if pc is not None:
                    keys[id(pc.tensor)] = len(matrices)
                piece = (pc.start, pc.tensor.numel()) if pc is not None else None
                matrices.append((tuple(shape), piece))
        if not self.sharded:  # stage 0 with a master: every rank holds every piece
            return WholeMatrices(matrices, keys, lambda t: None, 0, 1, self.matrix_chunk)
        return WholeMatrices(
            matrices,
            keys,
            lambda t: self.comm.all_reduce(t, kind="muon"),
            self.comm.rank,
            self.comm.world_size,
            self.matrix_chunk,
        )

    def _param_norms(self) -> ParamNorms:
        """Where each sharded piece's parameter sits in the per-parameter vector (the note);
        under tensor parallelism every parameter, whose sums are also added over the
        tensor-parallel ranks (a replicated parameter's counted once, as in the gradient norm)."""
        first: dict[int, int] = {}
        size = 0
        for g in self.groups:
            first[id(g)], size = size, size + len(g.params)
        slots = {
            id(pc.tensor): first[id(pc.group)] + pc.index
            for pc in self.pieces
            if (pc.group.policy.shard_optimizer and pc.sl is not None) or self.tp_norm is not None
        }
        device = self.groups[0].device if self.groups else None
        if self.tp_norm is None:
            return ParamNorms(
                slots,
                size,
                lambda t: self.comm.all_reduce(t, kind="control"),
                device,
                lambda t: self.comm.all_reduce(t, op="max", kind="control"),
            )
        weight, tp_comm = self.tp_norm
        weights = torch.ones(size, 1, dtype=torch.float64, device=device)
        for g in self.groups:
            for i, p in enumerate(g.params):
                weights[first[id(g)] + i] = weight(p)

        def reduce(t: torch.Tensor) -> None:
            if self.sharded:
                self.comm.all_reduce(t, kind="control")
            t.mul_(weights)
            tp_comm.all_reduce(t, kind="control")

        return ParamNorms(slots, size, reduce, device)

    @property
    def stepper(self) -> Any:
        return self._stepper

    @stepper.setter
    def stepper(self, stepper: Any) -> None:
        collective = self.param_norms is not None or self.whole_matrices is not None
        if stepper is not None and collective and self.comm.world_size > 1:
            raise ValueError(
                f"{stepper.what} steps the optimizer bucket by bucket, and "
                f"{type(self.optimizer).__name__} needs whole parameters split between ranks "
                f"(their norms, or the matrices) at each step; {stepper.instead}"
            )
        if stepper is not None and self._stepper is not None:
            raise ValueError(
                f"{stepper.what} and {self._stepper.what} cannot both run the optimizer "
                f"step; {stepper.instead}"
            )
        self._stepper = stepper

    def live_runs(self, limit: int) -> list[list[int]]:
        """Indices of the pieces whose parameter got a gradient on some rank, cut into runs
        of at most ``limit`` elements (a larger piece is a run of its own): what a step in
        buckets steps at a time.

        Args:
            limit: the most elements of a run.
        """
        live = [i for i, pc in enumerate(self.pieces) if pc.group.grad_seen[pc.index] > 0]
        numels = [self.pieces[i].tensor.numel() for i in live]
        return [[live[j] for j in b] for b in split_into_buckets(numels, limit)]

    def after_load(self) -> None:
        """A checkpoint was loaded into the state: it is stored the way this optimizer
        stores it (quantized, in bf16)."""
        if self.quantized is not None:
            self.quantized.settle()
        settle = getattr(self._stepper, "settle", None)
        if settle is not None:
            settle()

    def sync_grad_flags_and_norm(self) -> float:
        """One all-reduce carries both which parameters got a gradient on any rank and this
        rank's share of the squared gradient norm. Returns the global L2 norm."""
        flags = [g.grad_seen for g in self.groups]
        sq = torch.zeros(1, dtype=torch.float64)
        if self.tp_norm is None:
            for g in self.groups:
                # one fused pass per group (taken as it was put away, for a gradient shard in
                # its file); squares summed in float64 across groups
                part = g.grad_sq_norm()
                if self._whole_on_subgroups:  # see below
                    part = part / g.comm.world_size
                sq += part
        else:
            # Under tensor parallelism a split parameter's parts live on the tensor-parallel
            # ranks (their squares are summed over them) while a replicated one is the same on
            # each of them (it counts 1/T on each, so once in the sum)
            weight, _ = self.tp_norm
            for pc in self.pieces:
                piece_sq = torch.linalg.vector_norm(pc.grad(), dtype=torch.float32).double()
                sq += piece_sq.square() * weight(pc.group.params[pc.index])
        packed = torch.cat(flags + [sq]) if flags else sq
        if self.sharded:
            self.comm.all_reduce(packed, kind="control")
            if self.replica is not None and flags:
                # the norm is whole in each shard group; a gradient seen in another counts
                self.replica.all_reduce(packed, op="max", kind="control")
        elif self._whole_on_subgroups:
            # stage 0 with expert groups: each group's gradient is whole on every rank of its
            # own group, so each rank added 1/(its size) of its square
            self.comm.all_reduce(packed, kind="control")
        elif flags:  # stage 0: gradients are identical everywhere, only flags need combining
            self.comm.all_reduce(packed[:-1], kind="control")
        if self.tp_norm is not None:
            self.tp_norm[1].all_reduce(packed, kind="control")  # flags are clamped below
        offset = 0
        for g in self.groups:
            n = g.grad_seen.numel()
            g.grad_seen.copy_(packed[offset : offset + n].clamp(max=1.0))
            offset += n
        return float(packed[-1].sqrt())

    def attach_grads(self) -> None:
        if self.stepper is not None:
            return  # the stepper attaches each bucket's gradients in turn
        for pc in self.pieces:
            pc.tensor.grad = pc.grad() if pc.group.grad_seen[pc.index] > 0 else None

    def scale_grads(self, total_norm: float, max_norm: float, loss_scale: float = 1.0) -> None:
        """Undo the loss scale and clip like ``torch.nn.utils.clip_grad_norm_`` (the same
        coefficient, computed on the unscaled norm), in one pass over the gradients."""
        factor = 1.0 / loss_scale
        if max_norm > 0:
            coef = max_norm / (total_norm / loss_scale + 1e-6)
            factor *= min(coef, 1.0)
        if factor != 1.0:
            for g in self.groups:
                g.scale_grads_by(factor)

    def step(self) -> None:
        if self.stepper is not None:
            self.stepper.step()
        else:
            self.optimizer.step()

    def state_bytes(self, groups: set[int] | None = None) -> int:
        """Bytes of the optimizer's state tensors (each storage once).

        Args:
            groups: ids of flat groups: only their pieces' state (None: all of it).
        """
        seen: set[int] = set()
        total = 0
        states: Iterable[Mapping[str, object]] = self.optimizer.state.values()
        if groups is not None:
            held = [pc.tensor for pc in self.pieces if id(pc.group) in groups]
            states = [self.optimizer.state[t] for t in held if t in self.optimizer.state]
        for state in states:
            for v in state.values():
                if not torch.is_tensor(v):
                    continue
                for part in state_parts(v):  # a quantized state's codes and scales
                    if part.untyped_storage().data_ptr() not in seen:
                        seen.add(part.untyped_storage().data_ptr())
                        total += part.untyped_storage().nbytes()
        return total
