"""A failure on one rank fails every rank, at once, with the failing rank's message.

[Note: agreement points]
Ranks run the same program, but a step that touches one rank's disk, memory or arguments can
fail on that rank alone: a read-only mount on one node, a full disk, a config file missing on
one machine, an out-of-memory while materialising a layer. If that rank raises and the caller
catches the error (or the rank simply exits), the others wait in the next collective until the
process-group timeout, thirty minutes by default, and then report a timeout that names nothing.

So every multi-rank operation (initialisation, save, load) is cut into *phases* of local work
separated by *agreement points*: before a rank enters a collective that the others could be
left waiting in, the ranks all-reduce an error flag (``agree``; one small tensor, microseconds).
When any rank failed, the messages are all-reduced too and every rank raises: the failing rank
its own exception, the others ``error_type`` carrying the first failing rank's message and its
number. ``together(comm)`` wraps a block of local work in one such point.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .collectives import Comm

__all__ = ["RankFailedError", "agree", "together"]

_MSG_BYTES = 2048


class RankFailedError(RuntimeError):
    """Another rank failed; the message is that rank's."""


RankFailedError.__module__ = "ds_strategy"


def agree(
    comm: Comm, err: BaseException | None, error_type: type[Exception] = RankFailedError
) -> None:
    """Raise on every rank if any rank has ``err`` (see the note above); otherwise return.

    Collective: every rank of ``comm.agreement`` calls it, with its own outcome."""
    comm = comm.agreement
    if comm.world_size == 1:
        if err is not None:
            raise err
        return
    flag = torch.tensor([0 if err is None else 1], dtype=torch.int64)
    comm.all_reduce(flag, kind="control")
    if int(flag.item()) == 0:
        return
    buf = torch.zeros(comm.world_size, _MSG_BYTES, dtype=torch.int32)
    if err is not None:
        text = (str(err) or type(err).__name__).encode()[:_MSG_BYTES]
        buf[comm.rank, : len(text)] = torch.tensor(list(text), dtype=torch.int32)
    comm.all_reduce(buf, kind="control")
    if err is not None:
        raise err
    failing = int(torch.nonzero(buf.any(dim=1))[0])
    row = buf[failing]
    message = bytes(row[row > 0].tolist()).decode(errors="replace")
    raise error_type(f"{message} (found by rank {failing})")


@contextlib.contextmanager
def together(comm: Comm, error_type: type[Exception] = RankFailedError) -> Iterator[None]:
    """Run a block of local work, then agree on its outcome: an exception on any rank raises
    on every rank when the block ends (the failing rank's own, ``error_type`` elsewhere)."""
    err: BaseException | None = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - handed to agree(), which raises it on every rank
        err = e
    agree(comm, err, error_type)
