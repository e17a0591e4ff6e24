"""The names of DeepSpeed-style experts: ``...deepspeed_experts.<i>...``, where ``i`` is an
expert's index on its rank (local) or in its layer (global).

>>> renumber("moe.deepspeed_moe.experts.deepspeed_experts.1.fc.weight", 2)
'moe.deepspeed_moe.experts.deepspeed_experts.3.fc.weight'
>>> expert_place("moe.deepspeed_moe.experts.deepspeed_experts.1.fc.weight")
('moe.deepspeed_moe.experts', 1)
"""

from __future__ import annotations

import re

__all__ = ["expert_place", "renumber"]

_EXPERT = re.compile(r"(^|\.)deepspeed_experts\.(\d+)\.")


def expert_place(name: str) -> tuple[str, int] | None:
    """The layer a DeepSpeed-style expert parameter belongs to (the name before
    ``.deepspeed_experts``) and its expert index; None for any other name.

    Args:
        name: a parameter's name.
    """
    m = _EXPERT.search(name)
    return (name[: m.start()], int(m.group(2))) if m is not None else None


def renumber(name: str, first: int) -> str:
    """``name`` with its expert index ``i`` made ``first + i``.

    Args:
        name: a DeepSpeed-style expert parameter's name.
        first: what index 0 becomes.
    """

    def shift(m: re.Match[str]) -> str:
        return f"{m.group(1)}deepspeed_experts.{first + int(m.group(2))}."

    return _EXPERT.sub(shift, name, count=1)
