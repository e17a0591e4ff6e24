"""The optional front ends: each needs its framework, installed with the package's extra of
the same purpose (``pip install 'ds_strategy[lightning]'``); importing one without it is an
error that names the extra. The core needs none of them."""

from __future__ import annotations

import importlib.util

__all__ = ["require_extra"]


def require_extra(front_end: str, extra: str, *modules: str) -> None:
    """Raise ``ImportError`` naming ``extra`` when one of ``modules`` is not installed.

    >>> require_extra("ds_strategy.demo", "demo", "json")  # installed: nothing happens
    >>> require_extra("ds_strategy.demo", "demo", "no_such_module_xyz")
    Traceback (most recent call last):
    ...
    ImportError: ds_strategy.demo needs no_such_module_xyz, which is not installed: pip install 'ds_strategy[demo]'
    """
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(
            f"{front_end} needs {', '.join(missing)}, which is not installed: "
            f"pip install 'ds_strategy[{extra}]'"
        )
