"""Printing from several ranks that share one output stream."""

from __future__ import annotations

import sys


def say(*lines: str) -> None:
    """Print ``lines`` in one write: under a launcher the ranks share an unbuffered stdout, and
    ``print`` writes a line's end separately, so another rank's line could land in between."""
    sys.stdout.write("".join(f"{line}\n" for line in lines))
    sys.stdout.flush()
