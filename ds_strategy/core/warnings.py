"""The categories of the warnings ds_strategy gives, so a job can filter them by kind::

    import warnings
    from ds_strategy.core.warnings import DsStrategyWarning, PerformanceWarning

    warnings.filterwarnings("ignore", category=PerformanceWarning)  # this kind only
    warnings.filterwarnings("error", category=DsStrategyWarning)  # every kind, in a test suite

``DsStrategyWarning`` is used directly for a setting the engine adjusts (a OneCycle schedule's
momentum on an optimizer without ``betas``). The config's warnings are kinds of it too
(``ds_strategy.config``: ``UnsupportedConfigWarning``, ``UnknownConfigKeyWarning``,
``DeprecatedConfigWarning``).

[Note: why the kinds are RuntimeWarnings too]
Before they had categories, the warnings about compilation and checkpoints were
``RuntimeWarning``s and the others ``UserWarning``s. Each kind below is both (through
``DsStrategyWarning``, a ``UserWarning``), so a filter or a ``pytest.warns`` written against
either still matches, whichever a warning was. Deprecations stay ``DeprecationWarning``s, which Python shows
by default only in code run as ``__main__`` (and pytest shows always).
"""

from __future__ import annotations

import warnings
from typing import TypeVar

from ..config import DsStrategyWarning  # the root: the config's warnings are kinds of it too

__all__ = [
    "CheckpointWarning",
    "DsStrategyDeprecationWarning",
    "DsStrategyWarning",
    "FrontEndWarning",
    "PerformanceWarning",
    "renamed_argument",
]

T = TypeVar("T")


class PerformanceWarning(DsStrategyWarning, RuntimeWarning):
    """The job runs, slower or larger than asked: modules compiled with ``Module.compile()``
    that run eagerly, layers kept in full precision by quantization."""


class CheckpointWarning(DsStrategyWarning, RuntimeWarning):
    """A checkpoint was recovered from or worked around: a save that failed in the background,
    an interrupted save whose previous checkpoint is read instead, a torn pipeline
    checkpoint whose newest complete step is loaded."""


class FrontEndWarning(DsStrategyWarning, RuntimeWarning):
    """A front end meets settings of its framework that disagree with the engine's config
    (Accelerate's ``gradient_accumulation_steps`` against the config's)."""


class DsStrategyDeprecationWarning(DeprecationWarning):
    """A ds_strategy name or argument that still works and will be removed; the message says
    what replaces it."""


def renamed_argument(
    owner: str, old: str, new: str, old_value: T | None, new_value: T | None
) -> T | None:
    """The value of argument ``new`` of ``owner``, given under its deprecated name ``old``
    (warned as :class:`DsStrategyDeprecationWarning`) or its new one; both is an error.

    >>> renamed_argument("ZeroTrainer", "zero_config", "config", None, "zero3")
    'zero3'
    """
    if old_value is None:
        return new_value
    if new_value is not None:
        raise TypeError(f"{owner}: pass {new}= only ({old}= is its deprecated name)")
    warnings.warn(
        f"{owner}({old}=...) is deprecated: pass {new}=... (the same value)",
        DsStrategyDeprecationWarning,
        stacklevel=3,
    )
    return old_value
