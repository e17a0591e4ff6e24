"""The gradient half of a flat group on one process: its states change only through the named
transitions, an illegal one raises, each legal sequence ends where the note says, and every
transient buffer it counted is uncounted by the time it is dropped."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ds_strategy.core.collectives import Comm
from ds_strategy.core.memory import ModelStateMeter
from ds_strategy.core.zero.flat_grads import FullGrads, GradSpec, GradState
from ds_strategy.core.zero.inflight import Fold, GradScaling, Reduction
from ds_strategy.core.zero.layout import FlatLayout
from ds_strategy.core.zero.sharded_grads import ShardedGrads
from ds_strategy.core.zero.stores import DeviceStore
from ds_strategy.core.zero.transports import PlainReduceScatter

PLAIN = GradScaling(1.0, 1.0)
SHAPES = [(3, 5), (7,)]


def _spec(meter: ModelStateMeter, reduce_dtype: torch.dtype = torch.float32) -> GradSpec:
    params = [nn.Parameter(torch.zeros(s)) for s in SHAPES]
    layout = FlatLayout([p.numel() for p in params], 1)
    lo, hi = layout.shard_range(0)
    step_like = torch.zeros(hi - lo)
    return GradSpec(
        params, layout, 0, torch.float32, torch.device("cpu"), reduce_dtype, meter, step_like
    )


def _sharded(meter: ModelStateMeter, reduce_dtype: torch.dtype = torch.float32) -> ShardedGrads:
    spec = _spec(meter, reduce_dtype)
    return ShardedGrads(spec, reduce=PlainReduceScatter(Comm()), store=DeviceStore())


def _full(meter: ModelStateMeter, *, scatter: bool) -> FullGrads:
    reduce = PlainReduceScatter(Comm()) if scatter else None
    grads = FullGrads(_spec(meter), comm=Comm(), scatter=reduce)
    grads.bind()
    return grads


def _backward(grads: ShardedGrads | FullGrads, value: float) -> None:
    """What autograd and the hooks do in one backward: a gradient for every parameter."""
    grads.begin_backward()
    for i, p in enumerate(grads.params):
        grads.before_accumulate()  # the hook on the incoming gradient
        if p.grad is None:
            p.grad = torch.full_like(p, value)
        else:  # stages 0/1: accumulated into the flat buffer
            p.grad.add_(value)
        grads.mark_ready(i)


def _reduce(grads: ShardedGrads | FullGrads) -> Reduction:
    reduction = grads.launch_reduce(PLAIN)
    assert reduction is not None
    assert grads.state is GradState.REDUCING
    reduction.complete()
    return reduction


def test_sharded_grads_reduce_in_place_first_then_add() -> None:
    meter = ModelStateMeter()
    grads = _sharded(meter)
    assert grads.state is GradState.EMPTY
    _backward(grads, 1.0)
    assert grads.state is GradState.ACCUMULATING and grads.all_ready
    assert meter.transient == 22 * 4  # the bucket
    assert _reduce(grads).fold is Fold.IN_PLACE  # the first reduction writes the shard itself
    assert grads.state is GradState.REDUCED and meter.transient == 0
    assert grads.launch_reduce(PLAIN) is None  # once per backward
    _backward(grads, 2.0)  # gradient accumulation: added by the next reduction
    assert grads.state is GradState.REDUCED
    assert _reduce(grads).fold is Fold.ADD
    assert torch.equal(grads.step_grad(), torch.full((22,), 3.0))
    # the resident shard, the second bucket and the reduction's output
    assert meter.transient == 0 and meter.peak == 3 * 22 * 4
    grads.zero_grad()
    assert grads.state is GradState.EMPTY and not grads.holds_grads()
    _backward(grads, 5.0)
    assert _reduce(grads).fold is Fold.IN_PLACE  # zero_grad: in place again
    assert torch.equal(grads.grad_shard, torch.full((22,), 5.0))


def test_a_converted_send_replaces_the_bucket_in_the_meter() -> None:
    meter = ModelStateMeter()
    grads = _sharded(meter, reduce_dtype=torch.bfloat16)
    _backward(grads, 1.0)
    reduction = grads.launch_reduce(PLAIN)
    assert reduction is not None and reduction.fold is Fold.ADD  # dtypes differ: never in place
    assert meter.transient == 22 * 2 + 22 * 2  # the bf16 send and the bf16 output
    reduction.complete()
    assert meter.transient == 0 and meter.peak == 22 * 4 + 22 * 4 + 22 * 2  # shard, bucket, send
    assert torch.equal(grads.grad_shard, torch.ones(22))


def test_transient_grad_shards_are_counted_while_they_exist() -> None:
    meter = ModelStateMeter()
    grads = _sharded(meter)
    grads.free_grads()
    assert grads.transient and grads.grad_shard.untyped_storage().nbytes() == 0
    _backward(grads, 1.0)
    _reduce(grads)
    assert meter.transient == 22 * 4 and meter.resident == 0  # the shard, counted transient
    assert grads.resident_bytes() == 0
    grads.zero_grad()
    assert meter.transient == 0 and grads.grad_shard.untyped_storage().nbytes() == 0


def test_full_grads_stage1_accumulation_form_round_trip() -> None:
    meter = ModelStateMeter()
    grads = _full(meter, scatter=True)
    scaling = GradScaling(2.0, 0.5)  # divide by 2 before, by 2 again after: a world of 4
    _backward(grads, 4.0)
    assert grads.state is GradState.ACCUMULATING
    reduction = grads.launch_reduce(scaling)
    assert reduction is not None and reduction.fold is Fold.REPLACE
    reduction.complete()
    assert grads.state is GradState.REDUCED and meter.transient == 0
    assert torch.equal(grads.grad_shard, torch.full((22,), 1.0))  # 4 / 2 * 0.5
    grads.to_accumulation_form(scaling)  # deferred: nothing is added yet
    assert grads.state is GradState.REDUCED
    assert torch.equal(grads.grad_shard, torch.full((22,), 1.0))
    _backward(grads, 4.0)  # carried out before the first gradient is added
    assert grads.state is GradState.ACCUMULATION_FORM
    lo, hi = grads.layout.shard_range(grads.rank)
    # the unscaled sum plus the new gradients; the rest of the buffer holds the new ones only
    assert torch.equal(grads.grad_shard, torch.full((22,), 8.0))
    assert torch.equal(grads.flat[hi:], torch.full_like(grads.flat[hi:], 4.0 if hi < 22 else 0))
    grads.to_final_form(scaling)
    assert grads.state is GradState.REDUCED
    grads.to_final_form(scaling)  # nothing left to undo
    assert grads.state is GradState.REDUCED
    grads.zero_grad()
    assert grads.state is GradState.EMPTY
    assert all(p.grad is None for p in grads.params)  # the buffer is not zeroed: see below
    assert torch.equal(grads.ensure_grad_shard(), torch.zeros(22))  # zeros once read
    assert all(p.grad is not None for p in grads.params)  # bound to the buffer again


def test_full_grads_first_gradient_after_zero_grad_is_copied_not_added() -> None:
    """[Note: a slot written by its first gradient]: zero_grad leaves the buffer as it was;
    a slot's first gradient overwrites it, and a slot no gradient reached reads as zeros."""
    meter = ModelStateMeter()
    grads = _full(meter, scatter=True)
    _backward(grads, 4.0)
    _reduce(grads)
    grads.zero_grad()
    assert bool((grads.flat != 0).any())  # the old sums are still there, unread
    grads.begin_backward()
    p0 = grads.params[0]
    p0.grad = torch.full_like(p0, 3.0)  # autograd's new tensor: .grad was None
    grads.mark_ready(0)
    view = grads.grad_view(0)
    assert p0.grad.data_ptr() == view.data_ptr() and torch.equal(view, torch.full((3, 5), 3.0))
    p0.grad.add_(1.0)  # a second micro-step: autograd adds in place
    grads.mark_ready(0)
    assert torch.equal(p0.grad, torch.full((3, 5), 4.0))
    reduction = grads.launch_reduce(PLAIN)  # parameter 1 got nothing: zeros, not old sums
    assert reduction is not None
    reduction.complete()
    assert torch.equal(grads.flat[:15], torch.full((15,), 4.0))
    assert torch.equal(grads.flat[15:], torch.zeros(7))
    assert grads.params[1].grad is not None and not bool(grads.params[1].grad.any())
    # a .grad set by hand, no hook: taken in when the buffer is read
    grads.zero_grad()
    grads.params[1].grad = torch.full((7,), 2.0)
    assert torch.equal(grads.ensure_grad_shard()[15:], torch.full((7,), 2.0))
    assert torch.equal(grads.flat[:15], torch.zeros(15))


def test_full_grads_stage1_form_never_carried_out_when_the_step_comes_first() -> None:
    """The usual case: the boundary's reduction, then the step. The deferred form costs
    nothing and leaves the reduced gradients as they are."""
    meter = ModelStateMeter()
    grads = _full(meter, scatter=True)
    scaling = GradScaling(2.0, 0.5)
    _backward(grads, 4.0)
    reduction = grads.launch_reduce(scaling)
    assert reduction is not None
    reduction.complete()
    grads.to_accumulation_form(scaling)
    grads.to_final_form(scaling)
    assert grads.state is GradState.REDUCED
    assert torch.equal(grads.grad_shard, torch.full((22,), 1.0))
    grads.before_accumulate()  # nothing deferred any more
    assert grads.state is GradState.REDUCED


def test_full_grads_stage0_all_reduces_in_place_and_keeps_no_form() -> None:
    meter = ModelStateMeter()
    grads = _full(meter, scatter=False)
    _backward(grads, 1.0)
    assert _reduce(grads).fold is Fold.IN_PLACE
    grads.to_accumulation_form(PLAIN)  # the mean composes with more gradients as it is
    assert grads.state is GradState.REDUCED
    _backward(grads, 1.0)
    assert grads.state is GradState.REDUCED  # added to what was reduced


def test_compressed_exchange_goes_through_reducing() -> None:
    meter = ModelStateMeter()
    grads = _sharded(meter)
    _backward(grads, 1.0)
    local = grads.take_local_grad()
    assert grads.state is GradState.REDUCING and torch.equal(local, torch.ones(22))
    assert meter.transient == 22 * 4  # the bucket, held until the result is set
    grads.set_reduced_grad((torch.tensor([0, 21]), torch.tensor([2.0, 3.0])))
    assert grads.state is GradState.REDUCED and meter.transient == 0
    assert grads.grad_shard[0] == 2.0 and grads.grad_shard[21] == 3.0
    assert float(grads.grad_shard[1:21].abs().sum()) == 0.0
    full = _full(meter, scatter=True)
    _backward(full, 1.0)
    assert full.take_local_grad() is full.flat
    full.set_reduced_grad(None)  # an overflow somewhere: NaN, the step is skipped
    assert full.state is GradState.REDUCED and bool(full.grad_shard.isnan().all())


def test_illegal_transitions_raise() -> None:
    meter = ModelStateMeter()
    grads = _sharded(meter)
    _backward(grads, 1.0)
    reduction = grads.launch_reduce(PLAIN)
    assert reduction is not None
    grads.begin_backward()  # a new backward while the last reduction is still in flight
    with pytest.raises(AssertionError, match="REDUCING"):
        grads.launch_reduce(PLAIN)
    with pytest.raises(AssertionError, match="REDUCING"):
        grads.take_local_grad()
    with pytest.raises(AssertionError, match="in flight"):
        grads.to_final_form(PLAIN)
    reduction.complete()
    with pytest.raises(AssertionError, match="REDUCED"):
        grads.reduction_done(reduction)  # completed twice
    with pytest.raises(AssertionError, match="REDUCED"):
        grads.set_reduced_grad(None)  # nothing was taken for a compressed exchange
    full = _full(meter, scatter=True)
    with pytest.raises(AssertionError, match="EMPTY"):
        full.to_accumulation_form(PLAIN)  # nothing reduced yet
    _backward(full, 1.0)
    with pytest.raises(AssertionError, match="ACCUMULATING"):
        full.to_accumulation_form(PLAIN)


def test_zero_grad_drops_a_bucket_no_reduction_took() -> None:
    """Gradients kept by ``no_sync`` and never reduced: zero_grad uncounts their bucket."""
    meter = ModelStateMeter()
    grads = _sharded(meter)
    _backward(grads, 1.0)
    assert meter.transient == 22 * 4
    grads.zero_grad()
    assert grads.state is GradState.EMPTY and meter.transient == 0
    assert all(p.grad is None for p in grads.params)


def _more_backward_worker(rank: int, world: int, stage: int, shared: bool) -> list[torch.Tensor]:
    """Every step: a backward that reduces (each is a boundary here), then a second one
    before the step, so stage 1's deferred form is carried out by the hook on the incoming
    gradient; and gradients reduced into the flat buffer's own slice."""
    import ds_strategy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3))
    config = {
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 150},
        "topology": {"shared_memory": shared},
    }
    engine = ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        for _ in range(2):
            engine.backward(engine(torch.randn(4, 6, generator=g)).pow(2).mean())
        engine.step()
    return [t.clone() for t in engine.full_state_dict().values()]


@pytest.mark.parametrize("shared", [True, False])
def test_stage1_more_backward_after_a_reduction_matches_stage0(shared: bool) -> None:
    from tests.distributed import run_ranks

    one = run_ranks(_more_backward_worker, 2, 1, shared)
    zero = run_ranks(_more_backward_worker, 2, 0, shared)
    for a, b in zip(one[0], zero[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16])
def test_sharded_grads_zero_grad_leaves_the_shard_to_its_next_use(
    reduce_dtype: torch.dtype,
) -> None:
    """zero_grad does not write the resident shard: the first reduction after it overwrites
    the shard (in place), or, when the reduction adds into it (another reduce dtype), it is
    zeroed first; read before any reduction it is zeros."""
    meter = ModelStateMeter()
    grads = _sharded(meter, reduce_dtype)
    _backward(grads, 1.0)
    _reduce(grads)
    assert torch.equal(grads.ensure_grad_shard(), torch.ones(22))
    grads.zero_grad()
    assert torch.equal(grads.grad_shard, torch.ones(22))  # not written by zero_grad
    assert torch.equal(grads.ensure_grad_shard(), torch.zeros(22))  # zeros once used
    _backward(grads, 2.0)
    _reduce(grads)
    grads.zero_grad()
    _backward(grads, 3.0)
    fold = _reduce(grads).fold
    assert fold is (Fold.IN_PLACE if reduce_dtype == torch.float32 else Fold.ADD)
    assert torch.equal(grads.step_grad(), torch.full((22,), 3.0))  # not 2 + 3
