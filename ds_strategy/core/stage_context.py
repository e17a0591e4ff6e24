"""What a pipeline tells the engine of one of its stages: which stage, its mesh, the layers of
the whole model (the optimizer holds them all) and the parameters it materialised before the
engine existed. A :class:`~ds_strategy.ZeroEngine` built without one trains a whole model."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from .mesh import ParallelMesh

__all__ = ["StageContext"]


@dataclass(frozen=True)
class StageContext:
    """One pipeline stage, as its :class:`~ds_strategy.ZeroEngine` sees it.

    Args:
        stage: the stage's index (its checkpoint part is ``stage_<stage>``).
        whole_model: every stage's layers: the optimizer may hold all their parameters, a
            checkpoint it loads may hold more than this stage, and a weight tied across
            stages is saved under the whole model's name.
        mesh: the pipeline's mesh; the stage's engine takes its rank layout (groups,
            device mesh) from it under tensor parallelism.
        replaced: ``id(meta parameter) -> parameter`` for the layers the pipeline
            materialised (the optimizer may hold the meta ones).
        stages: how many stages the pipeline has (a stage's flops profile counts them as
            model parallel).
    """

    stage: int
    whole_model: nn.Module
    mesh: ParallelMesh | None = None
    replaced: dict[int, nn.Parameter] = field(default_factory=dict)
    stages: int = 1
