"""Single-process logic of the in-flight bookkeeping: the reduction queue's bound, the
model-state meter, and which optimizer implementation the rebuilt optimizer keeps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ds_strategy
from ds_strategy.core.collectives import Work
from ds_strategy.core.memory import ModelStateMeter
from ds_strategy.core.zero.inflight import Fold, Reduction, ReductionQueue


class FakeGroup:
    """Stands in for a FlatParamGroup: records launches and completions."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log
        self.grad = torch.zeros(2)

    def launch_reduce(self, scaling: object) -> Reduction:
        self.log.append(f"launch {self.name}")
        out = torch.full((2,), 3.0)
        return Reduction(self, Work(None), torch.ones(4), out, self.grad, Fold.ADD, 0.5, 16)  # type: ignore[arg-type]

    def before_fold(self) -> None:
        """(a gradient shard in a file would be read back here)"""

    def reduction_done(self, reduction: Reduction) -> None:
        self.log.append(f"done {self.name}")


def test_queue_completes_the_oldest_before_launching_past_the_bound() -> None:
    log: list[str] = []
    queue = ReductionQueue(max_in_flight=1)
    groups = [FakeGroup(str(i), log) for i in range(3)]
    for g in groups:
        queue.launch(g, None)  # type: ignore[arg-type]
        assert len(queue) == 1
    queue.drain()
    assert log == ["launch 0", "done 0", "launch 1", "done 1", "launch 2", "done 2"]
    assert all(torch.equal(g.grad, torch.full((2,), 1.5)) for g in groups)  # 0.5 * 3 added


def test_unbounded_queue_keeps_everything_in_flight_until_drained() -> None:
    log: list[str] = []
    queue = ReductionQueue(max_in_flight=None)
    for i in range(3):
        queue.launch(FakeGroup(str(i), log), None)  # type: ignore[arg-type]
    assert len(queue) == 3 and log == ["launch 0", "launch 1", "launch 2"]
    queue.drain()
    assert log[3:] == ["done 0", "done 1", "done 2"] and len(queue) == 0
    with pytest.raises(ValueError, match="max_in_flight"):
        ReductionQueue(0)


def test_reduction_folds_replace_and_in_place() -> None:
    dest = torch.full((2,), 7.0)
    r = Reduction(FakeGroup("r", []), Work(None), None, torch.ones(2), dest, Fold.REPLACE, 0.25, 0)  # type: ignore[arg-type]
    r.complete()
    assert dest.tolist() == [0.25, 0.25] and r.out is None
    dest = torch.full((2,), 8.0)
    Reduction(FakeGroup("i", []), Work(None), None, None, dest, Fold.IN_PLACE, 0.5, 0).complete()  # type: ignore[arg-type]
    assert dest.tolist() == [4.0, 4.0]


def test_meter_tracks_the_high_water_mark() -> None:
    m = ModelStateMeter()
    m.set_resident(1000)
    m.alloc(300)
    m.touch(50)  # a gradient about to be freed
    m.free(300)
    assert (m.current, m.peak) == (1000, 1350)
    m.reset_peak()
    assert m.peak == 1000
    m.set_resident(1200)  # optimizer state appeared
    assert m.peak == 1200


def _implementation(**kwargs: object) -> dict:
    model = nn.Linear(4, 4)
    engine = ds_strategy.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3, **kwargs), {}
    )
    group = engine.optimizer.param_groups[0]
    return {"fused": group.get("fused"), "foreach": group.get("foreach")}


def test_optimizer_implementation_choice_is_kept() -> None:
    assert _implementation()["fused"] is True  # left to torch: the fused kernel
    assert _implementation(foreach=False) == {"fused": None, "foreach": False}
    assert _implementation(foreach=True) == {"fused": None, "foreach": True}
    assert _implementation(fused=False)["fused"] is False
