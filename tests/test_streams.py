"""Collectives on their own CUDA streams (``core/streams.py``): on a CPU the stream code is
a no-op that never touches ``torch.cuda``; on a GPU (tests marked ``gpu``) an asynchronous
collective runs on a side stream and its result is ordered before the current stream reads it.
"""

from __future__ import annotations

import pytest
import torch

import ds_strategy
from ds_strategy.core import streams
from ds_strategy.core.collectives import Comm
from tests.distributed import run_ranks
from tests.models import ToyLM, batches

CUDA_CALLS = ("Stream", "Event", "current_stream", "stream", "current_device")


def _forbid_cuda(monkeypatch: pytest.MonkeyPatch | None = None) -> list[str]:
    """Make every stream call of ``torch.cuda`` record itself and raise."""
    called: list[str] = []

    def forbidden(name: str):  # noqa: ANN202 - a stand-in of any signature
        def call(*args: object, **kwargs: object) -> None:
            called.append(name)
            raise AssertionError(f"torch.cuda.{name} called on a CPU run")

        return call

    for name in CUDA_CALLS:
        if monkeypatch is not None:
            monkeypatch.setattr(torch.cuda, name, forbidden(name))
        else:
            setattr(torch.cuda, name, forbidden(name))
    return called


def test_side_stream_on_cpu_yields_nothing_and_touches_no_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    called = _forbid_cuda(monkeypatch)
    t = torch.ones(4)
    with streams.side_stream("all_gather", t) as done:
        t.add_(1)
    assert done == [None]
    with streams.side_stream("all_gather", t, when=False) as later:
        t.add_(1)
    assert later == [None]
    assert called == [] and streams._STREAMS == {}
    assert not streams.uses_streams(t)


def test_an_unknown_kind_is_refused() -> None:
    stream = streams.side_stream("gather", torch.ones(1))
    with pytest.raises(ValueError, match="unknown collective kind 'gather'"), stream:
        pass


def cpu_worker(rank: int, world: int) -> dict:
    """ZeRO-3 training and every asynchronous collective of ``Comm`` with ``torch.cuda``'s
    stream calls replaced by ones that raise."""
    saved = {name: getattr(torch.cuda, name) for name in CUDA_CALLS}
    try:
        return _train_and_collect(rank, world, _forbid_cuda())
    finally:  # the rank serves later tests
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)


def _train_and_collect(rank: int, world: int, called: list[str]) -> dict:
    torch.manual_seed(0)
    model = ToyLM()
    config = {
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "train_micro_batch_size_per_gpu": 2,
    }
    engine = ds_strategy.initialize(model, torch.optim.AdamW(model.parameters()), config)
    for batch in batches(2, 1, 2 * world):
        x = batch[rank * 2 : (rank + 1) * 2]
        engine.backward(engine(x[:, :-1]).float().pow(2).mean())
        engine.step()
    comm = Comm()
    full, out = torch.ones(4 * world), torch.empty(4)
    works = [
        comm.all_reduce(full, async_op=True),
        comm.reduce_scatter(out, full.clone(), async_op=True),
        comm.all_gather(torch.empty(4 * world), out, async_op=True),
    ]
    for w in works:
        w.wait()
    return {"called": called, "streams": len(streams._STREAMS), "steps": engine.global_steps}


def test_a_cpu_run_never_creates_a_stream() -> None:
    for r in run_ranks(cpu_worker, 2):
        assert r == {"called": [], "streams": 0, "steps": 2}, r


@pytest.mark.gpu
def test_a_side_stream_is_ordered_after_the_current_one_and_before_its_reader() -> None:
    """What an asynchronous collective on a GPU goes through: the work issued inside
    ``side_stream`` runs on the kind's own stream (made once, then reused), starts only
    after what the current stream had queued (a long sleep, then the write it reads), and
    the current stream reads its result only after the event."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    x = torch.full((1 << 20,), 2.0, device="cuda")
    y = torch.empty_like(x)
    torch.cuda._sleep(50_000_000)  # the current stream is busy: ordering matters
    x.mul_(3)
    with streams.side_stream("all_gather", x, y) as done:
        assert torch.cuda.current_stream() == streams._STREAMS[(x.device.index, "all_gather")]
        torch.cuda._sleep(50_000_000)
        y.copy_(x)
    assert torch.cuda.current_stream() != streams._STREAMS[(x.device.index, "all_gather")]
    event = done[0]
    assert event is not None
    event.wait()
    assert float(y.sum()) == 6.0 * y.numel()
    with streams.side_stream("all_gather", y):
        pass
    assert sum(k[1] == "all_gather" for k in streams._STREAMS) == 1
