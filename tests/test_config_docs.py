"""Every config key carries its meaning in the schema, and ``config_keys()`` (what the docs
site's reference of keys is generated from) lists exactly the schema's keys with the paths,
defaults, types and bounds the loader itself uses."""

from __future__ import annotations

import dataclasses
import typing
import warnings
from typing import Any

import pytest

from ds_strategy.config import ConfigError, ZeroConfig, load_config
from ds_strategy.config._schema import KeyDoc, config_keys


def _section_type(hint: Any) -> type | None:
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    if len(args) == 1 and isinstance(args[0], type) and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def _walk(cls: type, prefix: str = "") -> list[tuple[str, dataclasses.Field[Any], bool]]:
    """(dotted path, field, is_section) of every field reachable from ``cls``, in order."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        nested = _section_type(hints[f.name])
        if nested is not None and "leaf" not in f.metadata:
            out.append((path, f, True))
            out += _walk(nested, f"{path}.")
        else:
            out.append((path, f, False))
    return out


FIELDS = _walk(ZeroConfig)
KEYS = config_keys()
BY_PATH = {k.path: k for k in KEYS}
REQUIRED_TYPE = {"optimizer": "AdamW", "scheduler": "WarmupLR"}


def _nested(path: str, value: Any) -> dict[str, Any]:
    data: Any = value
    for part in reversed(path.split(".")):
        data = {part: data}
    return data


def _merge(into: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    for key, value in more.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict) and value:
            _merge(into[key], value)
        else:
            into[key] = value
    return into


def _at(cfg: Any, path: str) -> Any:
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_every_leaf_and_section_has_a_doc() -> None:
    missing = [path for path, f, _ in FIELDS if not str(f.metadata.get("doc", "")).strip()]
    assert not missing, f"fields without doc=: {missing}"
    assert sum(1 for _, _, section in FIELDS if section) >= 20  # the walk reached the sections


def test_docs_are_one_or_two_plain_sentences() -> None:
    too_long = [k.path for k in KEYS if len(k.doc) > 320]
    assert not too_long, too_long
    unfinished = [k.path for k in KEYS if not k.doc.rstrip().endswith((".", ")"))]
    assert not unfinished, unfinished


def test_config_keys_cover_exactly_the_schema_keys_in_order() -> None:
    leaves = [path for path, _, section in FIELDS if not section]
    assert [k.path for k in KEYS] == leaves
    assert len(KEYS) > 100
    assert all(isinstance(k, KeyDoc) and k.section_doc for k in KEYS)
    assert {k.doc for k in KEYS} >= {str(f.metadata["doc"]) for _, f, s in FIELDS if not s}


def test_every_key_loads_with_its_default_and_holds_it() -> None:
    defaults = load_config({})
    loaded = 0
    for key in KEYS:
        if key.default == "MISSING":
            continue
        data = _nested(key.path, key.default)
        section = key.path.split(".")[0]
        if section in REQUIRED_TYPE:  # a section that is absent by default needs its type
            data = _merge(_nested(f"{section}.type", REQUIRED_TYPE[section]), data)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a documented key with its default never warns
            try:
                cfg = load_config(data)
            except ConfigError as err:  # pragma: no cover - the assertion names the key
                pytest.fail(f"{key.path}={key.default!r}: {err}")
        value = _at(cfg, key.path)
        assert value == key.default, key.path
        if key.default != "auto" and section not in REQUIRED_TYPE:
            assert _at(defaults, key.path) == key.default, key.path
        loaded += 1
    assert loaded >= len(KEYS) - 2  # only optimizer.type and scheduler.type are required


def test_aliases_are_accepted_spellings_of_the_same_key() -> None:
    aliased = [k for k in KEYS if k.aliases]
    assert {a for k in aliased for a in k.aliases} >= {
        "bfloat16.enabled",
        "zero_optimization.prefetch_bucket_size",
        "tensor_parallel.tp_size",
    }
    for key in aliased:
        for alias in key.aliases:
            value = 7 if key.type == "int" else key.choices[0] if key.choices else True
            cfg = load_config(_nested(alias, value))
            assert _at(cfg, key.path) == value, alias


def test_spot_checks() -> None:
    stage = BY_PATH["zero_optimization.stage"]
    assert (stage.type, stage.choices, stage.default) == ("int", (0, 1, 2, 3), 0)
    assert "optimizer state" in stage.doc and "parameters" in stage.doc

    bucket = BY_PATH["zero_optimization.reduce_bucket_size"]
    assert (bucket.type, bucket.default, bucket.bounds) == ("int", 500_000_000, ">= 0")
    assert "Elements" in bucket.doc and "0" in bucket.doc

    device = BY_PATH["zero_optimization.offload_param.device"]
    assert device.type == "str" and device.choices == ("none", "cpu", "nvme")
    assert device.default == "none" and "stage 3" in device.doc
    # the optimizer section's own default, not the dataclass's
    assert BY_PATH["zero_optimization.offload_optimizer.buffer_count"].default == 4
    assert BY_PATH["zero_optimization.offload_param.buffer_count"].default == 5
    assert BY_PATH["zero_optimization.offload_param.buffer_count"].bounds == ">= 0, <= 1024"

    comm = BY_PATH["communication_data_type"]
    assert comm.type == "str | None" and comm.default is None
    assert comm.choices == ("fp32", "fp16", "bf16")
    assert BY_PATH["fp16.loss_scale"].bounds == ">= 0.0, <= 2**64"
    assert BY_PATH["gradient_clipping"].type == "float" and "no clipping" in (
        BY_PATH["gradient_clipping"].doc
    )
    assert BY_PATH["quantization.modules_to_not_convert"].type == "list[str]"
    assert BY_PATH["optimizer.params"].type == "dict"
    assert BY_PATH["optimizer.type"].default == "MISSING"
    # keys accepted but not used say so, and the package's own keys are marked
    assert "not used" in BY_PATH["zero_optimization.allgather_bucket_size"].doc
    assert "not implemented" in BY_PATH["activation_checkpointing.partition_activations"].doc
    assert "ds_strategy's own key" in BY_PATH["bf16.master_weights"].doc
    assert BY_PATH["zero_optimization.stage"].section_doc.startswith("``zero_optimization``")
