"""The names of a sharded checkpoint's entries, as records: :class:`EntryKey`.

On disk an entry is named ``<kind>/<parameter>`` (weights ``model``, buffers ``buffer``) or
``<kind>/<parameter>/<state>`` (optimizer state ``optim`` per element, ``optim_scalar``,
``optim_obj``; compression residuals ``compression``); ``rng/<rank>``, ``engine``,
``client_state`` and ``optim_groups`` stand alone. The text is the format; code builds and
reads the record, never the string.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = [
    "CLIENT_STATE",
    "ENGINE",
    "EntryKey",
    "MODEL_KINDS",
    "OPTIMIZER_GROUPS",
    "OPTIMIZER_KINDS",
    "rng_key",
]

MODEL_KINDS = ("model", "buffer")
OPTIMIZER_KINDS = ("optim", "optim_scalar", "optim_obj")
_WITH_STATE = (*OPTIMIZER_KINDS, "compression")

# the entries that stand alone, each packed (``trust.pack``)
ENGINE = "engine"  # counters, lr scheduler and loss scaler, the layout saved from
CLIENT_STATE = "client_state"  # the caller's, rank 0's
OPTIMIZER_GROUPS = "optim_groups"  # the optimizer's param groups, without their params


def rng_key(rank: int) -> str:
    """The entry of rank ``rank``'s random state."""
    return f"rng/{rank}"


@dataclass(frozen=True)
class EntryKey:
    """One entry: its kind, the parameter (or buffer) it belongs to, and for optimizer state
    and residuals the state's name (``exp_avg``, ``residual``)."""

    kind: str
    param: str
    state: str = ""

    @property
    def text(self) -> str:
        return (
            f"{self.kind}/{self.param}/{self.state}" if self.state else f"{self.kind}/{self.param}"
        )

    @staticmethod
    def parse(text: str) -> EntryKey | None:
        """The record of a per-parameter entry's name (None for the others)."""
        kind, sep, rest = text.partition("/")
        if not sep:
            return None
        if kind in _WITH_STATE:
            param, sep, state = rest.rpartition("/")
            return EntryKey(kind, param, state) if sep else None
        return EntryKey(kind, rest) if kind in MODEL_KINDS else None

    def under(self, param: str) -> EntryKey:
        """The same entry for another parameter name (a tied weight's alias)."""
        return replace(self, param=param)
