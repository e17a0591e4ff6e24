"""What guards the bytes of swap files: block checksums checked when the bytes are read back,
and write errors that name the file, the bytes it needs and the room left.

[Note: checksums of swapped tensors]
A swap file is private to its run, but nothing stops another process, a failing drive or a
stray ``dd`` from changing it between a write and the next read. Read back unchecked, such
bytes become weights or Adam moments (NaN, or plausible garbage) and training goes on.
Each swapped tensor therefore keeps, in memory, a CRC-32 of every :data:`BLOCK` bytes of
what it last wrote; a read recomputes them and a mismatch is an error naming the file.

Why a CRC and not a cheaper check that the values are finite: a finite check misses any
change to other finite values, and it would refuse legitimate bytes, since an fp16
gradient shard holds inf on an overflow step. ``zlib.crc32`` releases the GIL, and it runs
on the I/O threads next to the read or write itself. Blocks, not one CRC a file: a
checkpoint reads and writes a piece of a file at a time (``streaming.py``), and checks or
updates only the blocks it touches.
"""

from __future__ import annotations

import errno
import os
import zlib
from array import array
from pathlib import Path

from ..memory import file_size_limit, free_bytes, human_bytes

__all__ = [
    "BLOCK",
    "SwapCorruptionError",
    "SwapWriteError",
    "block_crcs",
    "check_blocks",
    "span",
    "write_error",
    "write_file",
    "zero_crcs",
]

BLOCK = 1 << 16  # bytes: one CRC each; a piece read by a checkpoint reads at most 2 more


class SwapCorruptionError(OSError):
    """A swap file (``path``) no longer holds the bytes this run wrote to it."""

    path: Path


class SwapWriteError(OSError):
    """A swap file (``path``) could not be written (a full drive, a file-size limit);
    ``errno`` is the underlying error's."""

    path: Path


def block_crcs(*parts: memoryview) -> array[int]:
    """The CRC-32 of every :data:`BLOCK` bytes of ``parts`` end to end (the last block may be
    shorter): a block may span parts, as when a piece is read between its neighbours' bytes."""
    out, crc, filled = array("I"), 0, 0
    for part in parts:
        at = 0
        while at < len(part):
            take = min(BLOCK - filled, len(part) - at)
            crc = zlib.crc32(part[at : at + take], crc)
            at, filled = at + take, filled + take
            if filled == BLOCK:
                out.append(crc)
                crc, filled = 0, 0
    if filled:
        out.append(crc)
    return out


def span(offset: int, nbytes: int, size: int) -> tuple[int, int]:
    """The whole blocks around bytes ``[offset, offset + nbytes)`` of a file of ``size`` bytes:
    (first byte, end byte)."""
    return offset - offset % BLOCK, min(size, -(-(offset + nbytes) // BLOCK) * BLOCK)


_ZERO_CRC = zlib.crc32(bytes(BLOCK))


def zero_crcs(nbytes: int) -> array[int]:
    """The block CRCs of ``nbytes`` zero bytes (a new sparse file), computed without them."""
    full, rest = divmod(nbytes, BLOCK)
    out = array("I", [_ZERO_CRC]) * full
    if rest:
        out.append(zlib.crc32(bytes(rest)))
    return out


def check_blocks(parts: list[memoryview], want: array[int] | None, first: int, path: Path) -> None:
    """``parts`` hold blocks ``first, first + 1, ...`` of ``path`` as read, end to end; raise
    :class:`SwapCorruptionError` unless each matches its CRC in ``want`` (every block's)."""
    if want is None:
        raise OSError(
            f"{path}: read back, but its last write did not finish; this is a bug in "
            "ds_strategy's offload tier, or an error before this one went unreported"
        )
    got = block_crcs(*parts)
    if got == want[first : first + len(got)]:
        return
    bad = next(i for i, c in enumerate(got) if c != want[first + i])
    start = (first + bad) * BLOCK
    end = start + min(BLOCK, sum(len(p) for p in parts) - bad * BLOCK)
    e = SwapCorruptionError(
        f"swap file {path} was changed after this run wrote it: bytes {start:,}-{end:,} do not "
        f"match what was written (CRC-32 {got[bad]:#010x}, expected {want[first + bad]:#010x}). "
        "Another process wrote under nvme_path, or the drive is failing; the swapped state "
        "cannot be trusted. Stop this run, check the drive (dmesg, smartctl) and that nothing "
        "else writes there, and resume from the last checkpoint"
    )
    e.path = path  # (no errno: nothing failed to read, the bytes are wrong)
    raise e


def write_file(path: Path, buf: memoryview) -> None:
    """Write ``buf`` as the whole of ``path``; a failure is :func:`write_error`'s."""
    done = 0
    try:
        with open(path, "wb", buffering=0) as f:
            while done < len(buf):
                n = f.write(buf[done:])
                if not n:  # a regular file never accepts nothing; do not spin
                    raise OSError(errno.EIO, "the write accepted no bytes")
                done += n
    except OSError as e:
        raise write_error(e, path, len(buf), done) from e


def write_error(e: OSError, path: Path, needed: int, done: int = 0) -> OSError:
    """``e``, raised writing ``needed`` bytes to ``path`` of which ``done`` went in, as an
    error saying what ran out and what to do; errors of other kinds name the file only."""
    what = f"swap file {path} needs {needed:,} bytes ({human_bytes(needed)}); {done:,} were written"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        message = (
            f"no space left on the drive of nvme_path writing swap files: {what}, and "
            f"{_free(path.parent)}. The run checked that nvme_path had room for all its swap "
            "files when it started: something else filled the drive since (another run, "
            "leftover files). Free space there or point nvme_path at a larger drive, then "
            "resume from the last checkpoint"
        )
    elif e.errno == errno.EFBIG:
        message = (
            f"file too large writing swap files: {what}, but {_size_limit()}. Raise the "
            "limit (ulimit -f unlimited, or the job scheduler's file-size limit), then resume "
            "from the last checkpoint"
        )
    else:
        message = f"{os.strerror(e.errno) if e.errno else e} writing swap files: {what}"
    out = SwapWriteError(message)
    out.errno, out.path = e.errno, path  # (``filename`` would replace the message in str())
    return out


def _free(where: Path) -> str:
    free = free_bytes(where)
    if free is None:
        return "the room left there is unknown"
    return f"{free:,} bytes ({human_bytes(free)}) are free there"


def _size_limit() -> str:
    soft = file_size_limit()
    if soft is None:
        return "the file system refuses a file that large"
    return f"this process may write files of at most {soft:,} bytes (RLIMIT_FSIZE, ulimit -f)"
