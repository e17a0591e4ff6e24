"""Collectives on their own CUDA streams, ordered by events; nothing at all on a CPU.

[Note: collectives on their own streams]
On a GPU the engine's compute runs on the current stream. An asynchronous all-gather or
reduce-scatter issued there would queue behind the compute already issued, and the next
unit's gather could not start before this unit's kernels finish. As FSDP2's comm context
does, each kind of collective gets a stream of its own per device:

- before issuing, the collective's stream waits for the current stream (the shard it sends,
  the gradients it reduces, were written there);
- the collective is issued on its stream, and an event is recorded there after it;
- ``Work.wait()`` makes the stream current at that moment wait for the event, so the
  gathered parameters or the reduced shard are read only once written, without blocking the
  host;
- every tensor the collective reads or writes is marked as used on its stream
  (``record_stream``): the caching allocator then does not hand its memory to another
  tensor until the collective's stream has passed that point, although the engine drops its
  reference right after ``wait()``.

Under CPU offload of parameters a ZeRO-3 gather first copies the shard from pinned host
memory to the device (``non_blocking``); that copy runs on the all-gather's stream too
(``flat_params.py``), so the next unit's copy overlaps this unit's compute.

On a CPU (gloo) there are no streams: ``side_stream`` yields None, touches nothing in
``torch.cuda`` and costs a comparison. The suite checks that it stays so
(``tests/test_streams.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["StreamEvent", "side_stream", "uses_streams"]

# one stream per (device index, kind of collective), made on first use
_STREAMS: dict[tuple[int, str], torch.cuda.Stream] = {}

KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def uses_streams(tensor: torch.Tensor) -> bool:
    """Whether a collective on ``tensor`` runs on a side stream (a CUDA tensor)."""
    return tensor.device.type == "cuda"


def _stream(device: torch.device, kind: str) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, kind)
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(device=index)
    return _STREAMS[key]


class StreamEvent:
    """Where a side-stream collective ends: :meth:`wait` orders the current stream after it."""

    def __init__(self, event: torch.cuda.Event, device: torch.device) -> None:
        self.event = event
        self.device = device

    def wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.event)


@contextlib.contextmanager
def side_stream(
    kind: str, *tensors: torch.Tensor | None, when: bool = True
) -> Iterator[list[StreamEvent | None]]:
    """Issue the collective of ``kind`` inside this block on its own stream (see the note).

    Yields a list that holds, after the block, the :class:`StreamEvent` to wait on (None on
    a CPU, or with ``when`` False, where the block runs as it is). ``tensors``: every tensor
    the collective reads or writes; on a GPU each is marked as used on the collective's
    stream. ``when``: False for a synchronous collective, which runs where it is issued.
    """
    present = [t for t in tensors if t is not None]
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; one of {KINDS}")
    if not when or not present or not uses_streams(present[0]):
        yield [None]
        return
    device = present[0].device
    stream = _stream(device, kind)
    stream.wait_stream(torch.cuda.current_stream(device))
    done: list[StreamEvent | None] = [None]
    with torch.cuda.stream(stream):
        yield done
        event = torch.cuda.Event()
        event.record(stream)
    for t in present:
        t.record_stream(stream)
    done[0] = StreamEvent(event, device)
