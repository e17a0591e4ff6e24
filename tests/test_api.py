"""The public API as a newcomer meets it: ``dir(ds_strategy)`` lists the public names (the
lazily imported ones included) and nothing of what ``__init__`` uses itself; every name in a
public ``__all__`` resolves; every public callable, and every public method or property a
public class defines, has a docstring."""

from __future__ import annotations

import importlib
import inspect

import pytest

import ds_strategy

PUBLIC = [
    "ds_strategy",
    "ds_strategy.config",
    "ds_strategy.accelerate",
    "ds_strategy.lightning",
    "ds_strategy.fabric",
    "ds_strategy.hf",
]


def test_dir_lists_the_public_names_only() -> None:
    names = dir(ds_strategy)
    assert {"InferenceEngine", "PipelineEngine", "ModelFileError"} <= set(names)
    assert set(ds_strategy.__all__) <= set(names)
    for stray in ("torch", "nn", "Any", "warnings", "Callable", "TYPE_CHECKING", "annotations"):
        assert stray not in names
    assert not [n for n in names if n.startswith("_") and n != "__version__"]


@pytest.mark.parametrize("module", PUBLIC)
def test_every_exported_name_resolves(module: str) -> None:
    pytest.importorskip(
        {"ds_strategy.accelerate": "accelerate", "ds_strategy.hf": "transformers"}.get(
            module, "torch"
        )
    )
    if module in ("ds_strategy.lightning", "ds_strategy.fabric"):
        pytest.importorskip("lightning")
    mod = importlib.import_module(module)
    for name in mod.__all__:
        assert getattr(mod, name) is not None, f"{module}.{name}"


def _own_members(cls: type) -> list[tuple[str, object]]:
    """Public functions and properties ``cls`` defines itself (not inherited)."""
    out = []
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, property):
            out.append((name, value.fget))
        elif isinstance(value, (staticmethod, classmethod)):
            out.append((name, value.__func__))
        elif inspect.isfunction(value):
            out.append((name, value))
    return out


def _inherited_doc(cls: type, name: str) -> bool:
    """A base class (a framework's) documents the method being overridden."""
    for base in cls.__mro__[1:]:
        if name in vars(base):
            value = vars(base)[name]
            fn = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
            if getattr(fn, "__doc__", None):
                return True
    return False


@pytest.mark.parametrize("module", PUBLIC)
def test_every_public_callable_has_a_docstring(module: str) -> None:
    if module in ("ds_strategy.lightning", "ds_strategy.fabric"):
        pytest.importorskip("lightning")
    if module == "ds_strategy.hf":
        pytest.importorskip("transformers")
    mod = importlib.import_module(module)
    missing = []
    for name in mod.__all__:
        obj = getattr(mod, name)
        if not callable(obj):
            continue
        if not inspect.getdoc(obj):
            missing.append(f"{module}.{name}")
        if inspect.isclass(obj):
            for attr, fn in _own_members(obj):
                if not (getattr(fn, "__doc__", None) or "").strip() and not _inherited_doc(
                    obj, attr
                ):
                    missing.append(f"{module}.{name}.{attr}")
    assert not missing, missing


def test_front_ends_take_config_and_their_old_names_still_work_with_a_warning() -> None:
    pytest.importorskip("accelerate")
    from ds_strategy.accelerate import ZeroAccelerator, ZeroPlugin
    from ds_strategy.core.warnings import DsStrategyDeprecationWarning

    assert (
        ZeroAccelerator(config="zero3", cpu=True).zero_plugin.load({}).zero_optimization.stage == 3
    )
    plugin = ZeroPlugin(overrides={"zero_optimization.stage": 1})
    assert ZeroAccelerator(config=plugin, cpu=True).zero_plugin is plugin
    with pytest.warns(DsStrategyDeprecationWarning, match=r"zero_plugin=\.\.\.\) is deprecated"):
        old = ZeroAccelerator(zero_plugin=plugin, cpu=True)
    assert old.zero_plugin is plugin
    with pytest.raises(TypeError, match="pass config= only"):
        ZeroAccelerator(config=plugin, zero_plugin=plugin, cpu=True)
