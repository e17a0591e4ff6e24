"""Building a model without allocating its weights: a factory named ``'package.module:fn'``,
called with keyword arguments on the meta device (``ds-strategy estimate``) or with only its
parameters there (inference, which then reads each rank's part of every weight from a file).

[Note: parameters on meta, buffers real]
Buffers that a module computes in its constructor and never saves (a rotary embedding's
``inv_freq``) cannot be recovered once built on the meta device, while parameters always come
from the weights file. :func:`params_on_meta` therefore moves each parameter to the meta device
as it is registered and leaves buffers where they are: the model's weights never exist in
memory (each ``nn.Linear`` allocates its weight untouched, and it is dropped at once), its
buffers are the small, real ones.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
import typing
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

__all__ = ["build_with", "import_factory", "params_on_meta"]


def import_factory(spec: str, what: str = "--model") -> Callable[..., object]:
    """The callable ``spec`` names (``'package.module:attr'``); errors name ``what``."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"{what} {spec!r}: expected 'package.module:factory' (e.g. 'ds_strategy.demos.gpt:GPT' "
            "or 'mypkg.models:build_model')"
        )
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # a module of the current project, like python -m
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"{what} {spec!r}: cannot import {module_name!r} ({err}); run from the directory "
            "that contains it or install its package"
        ) from None
    obj: object = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} {spec!r}: {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{what} {spec!r}: {attr!r} is not callable")
    return obj


def build_with(
    factory: Callable[..., object],
    kwargs: Mapping[str, object],
    context: Callable[[], contextlib.AbstractContextManager[object]],
) -> nn.Module:
    """``factory(**kwargs)`` inside ``context()``. A factory whose first parameter is a config
    object (e.g. ``GPT(config)``) gets one built from its annotation's type."""
    with context():
        try:
            return _checked_module(factory(**kwargs))
        except TypeError as first:
            params = list(inspect.signature(factory).parameters.values())
            if not params:
                raise
            ann = params[0].annotation
            hints = getattr(factory, "__init__", factory)
            with contextlib.suppress(Exception):  # string annotations that do not resolve
                ann = typing.get_type_hints(hints).get(params[0].name, ann)
            if not isinstance(ann, type):
                raise ValueError(f"cannot build the model: {first}") from None
            return _checked_module(factory(ann(**kwargs)))


def build_failure(err: BaseException) -> str:
    """Why a factory could not build its model, for an error that names what was given:
    the exception's type and the first line of its message (at most 200 characters)."""
    lines = str(err).splitlines()
    return f"{type(err).__name__}: {lines[0][:200] if lines else ''}"


def _checked_module(obj: object) -> nn.Module:
    if not isinstance(obj, nn.Module):
        raise ValueError(f"the model factory returned {type(obj).__name__}, not an nn.Module")
    return obj


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Inside the block every parameter a module registers goes to the meta device (its
    ``requires_grad`` and class kept); buffers stay real (see the note above)."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        p = module._parameters.get(name)
        if p is not None and p.device.type != "meta":
            module._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def meta_device() -> contextlib.AbstractContextManager[torch.device]:
    return torch.device("meta")
