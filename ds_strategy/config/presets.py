"""The named presets: one registry, resolved by name everywhere a config is accepted.

A preset is a DeepSpeed-keyed YAML file shipped inside the package (``ds_strategy/presets/``):
``load_config("zero3_offload")``, ``initialize(model, opt, "zero2")``,
``ZeroStrategy(config="zero3")``, ``ZeroPlugin(config="zero3")``, ``DS_STRATEGY_CONFIG=zero3``,
``ds-strategy estimate --config zero3``, Lightning's and Fabric's registered strategy names and
the Hydra recipes' ``strategy=`` group all read these files. A path to an existing file always
wins over a preset of the same name.

The precision fragments (``precision/bf16.yaml`` ...) hold only the ``bf16`` / ``fp16``
sections, for merging into a preset (the recipes' ``precision=`` group); they are not configs
on their own and are not resolved by :func:`load_config`.

>>> "zero3_offload" in preset_names()
True
>>> preset("zero2")["zero_optimization"].get("stage")
2
"""

from __future__ import annotations

import difflib
from importlib import resources
from typing import Any

from omegaconf import OmegaConf

from ._schema import ConfigError

__all__ = [
    "PRECISIONS",
    "describe",
    "precision_fragment",
    "preset",
    "preset_names",
    "resolve_preset",
]

_PACKAGE = "ds_strategy"
_DIR = "presets"
PRECISIONS = ("bf16", "fp16", "fp32")


def _root() -> Any:
    return resources.files(_PACKAGE).joinpath(_DIR)


def preset_names() -> list[str]:
    """Every preset's name, sorted (``zero1`` ... ``zero3_offload``)."""
    return sorted(
        entry.name[: -len(".yaml")]
        for entry in _root().iterdir()
        if entry.is_file() and entry.name.endswith(".yaml")
    )


def _read(entry: Any, what: str) -> dict[str, Any]:
    data = OmegaConf.to_container(OmegaConf.create(entry.read_text(encoding="utf-8")))
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: the preset file is not a mapping of config keys")
    return {str(k): v for k, v in data.items()}


def preset(name: str) -> dict[str, Any]:
    """The preset ``name`` as nested data keyed like DeepSpeed's JSON (a fresh copy), or a
    :class:`ConfigError` naming the presets there are."""
    if name not in preset_names():
        raise ConfigError(_unknown(name))
    return _read(_root().joinpath(f"{name}.yaml"), f"preset {name!r}")


def precision_fragment(name: str) -> dict[str, Any]:
    """The ``bf16`` / ``fp16`` sections of the precision preset ``name`` (``bf16``, ``fp16``
    or ``fp32``), for merging into a config."""
    if name not in PRECISIONS:
        raise ConfigError(
            f"precision preset {name!r} does not exist; choose one of {', '.join(PRECISIONS)}"
        )
    return _read(_root().joinpath("precision", f"{name}.yaml"), f"precision preset {name!r}")


def describe(name: str) -> str:
    """The head of the first comment of preset ``name``'s file, up to its first colon or full
    stop (its description in Lightning's strategy registry).

    >>> describe("zero2_offload")
    'ZeRO stage 2 with the optimizer offloaded to the CPU (ZeRO-Offload)'
    """
    text = _root().joinpath(f"{name}.yaml").read_text(encoding="utf-8")
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# ").strip())
    first = " ".join(lines).split(". ")[0].split(": ")[0].rstrip(".")
    return first or name


def resolve_preset(source: str) -> dict[str, Any] | None:
    """``source`` read as a preset name: its data when it names one, None when it does not
    look like a name (it has a file suffix or a path separator), else a :class:`ConfigError`
    for a bare name that is neither a file nor a preset."""
    if "/" in source or "\\" in source or "." in source:
        return None
    return preset(source)


def _unknown(name: str) -> str:
    names = preset_names()
    close = difflib.get_close_matches(name, names, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return (
        f"config {name!r} is neither a file nor a preset; {hint}presets: {', '.join(names)} "
        "(or pass a path to a .json / .yaml file)"
    )
