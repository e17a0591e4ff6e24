"""A resolved config holds every leaf as its declared type (the annotations of the schema), and
omegaconf's mirror of the schema still takes "auto" for any leaf."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
import warnings
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from ds_strategy.config import AUTO, ZeroConfig, config_schema, load_config
from ds_strategy.config._schema import Choice, CompressionMethod, OffloadDevice, PipelineSchedule

DATA = Path(__file__).parent / "data" / "deepspeed_configs"


def _leaves(obj: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, value, annotation) of every leaf under a config dataclass."""
    out = []
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, hint, key = getattr(obj, f.name), hints[f.name], f"{prefix}{f.name}"
        if "leaf" in f.metadata:
            out.append((key, value, hint))
        elif dataclasses.is_dataclass(value):
            out += _leaves(value, f"{key}.")
    return out


def _is_instance(value: Any, hint: Any) -> bool:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return any(_is_instance(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is int:  # a bool is an int to isinstance, never to the config
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _assert_typed(cfg: ZeroConfig) -> int:
    leaves = _leaves(cfg)
    wrong = [(k, v, h) for k, v, h in leaves if not _is_instance(v, h)]
    assert not wrong, wrong
    return len(leaves)


def test_default_config_is_typed() -> None:
    assert _assert_typed(ZeroConfig()) > 60
    assert _assert_typed(ZeroConfig().resolve(1)) > 60


def test_resolved_deepspeed_json_with_autos_and_string_numbers_is_typed(tmp_path: Path) -> None:
    data = json.loads((DATA / "transformers__tests_zero3_bf16.json").read_text())
    # string numbers as YAML 1.1 leaves them, and "auto" in every kind of leaf
    data["zero_optimization"]["stage3_max_live_parameters"] = "1e9"
    data["zero_optimization"]["offload_param"]["device"] = "auto"
    data["fp16"] = {"enabled": "auto", "loss_scale": "0", "initial_scale_power": "16"}
    data["communication_data_type"] = "BF16"
    data["pipeline"] = {"schedule": "auto"}
    data["gradient_compression"] = {"method": "NONE", "ratio": "auto"}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(data))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = load_config(path)
    assert cfg.zero_optimization.reduce_bucket_size == AUTO  # until resolved
    resolved = cfg.resolve(
        4,
        {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 3,
            "gradient_clipping": 1,  # an int given for a float
            "zero_optimization.reduce_bucket_size": 4096,
            "zero_optimization.offload_param.device": "cpu",
            "bf16.enabled": True,
        },
    )
    _assert_typed(resolved)
    zc = resolved.zero_optimization
    assert zc.stage3_max_live_parameters == 10**9 and type(zc.stage3_max_live_parameters) is int
    assert resolved.gradient_clipping == 1.0 and type(resolved.gradient_clipping) is float
    assert zc.offload_param.device is OffloadDevice.CPU
    assert zc.stage3_prefetch_bucket_size == 50_000_000  # "auto" without a value: the default
    assert resolved.pipeline.schedule is PipelineSchedule.ONE_F_ONE_B
    assert resolved.gradient_compression.method is CompressionMethod.NONE
    assert resolved.communication_data_type == "bf16"
    assert (resolved.train_batch_size, resolved.fp16.initial_scale_power) == (24, 16)


def test_choices_read_as_their_strings() -> None:
    cfg = load_config({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})
    device = cfg.zero_optimization.offload_param.device
    assert isinstance(device, OffloadDevice) and isinstance(device, Choice)
    assert device == "cpu" and {"cpu": 1}[device] == 1 and device in ("none", "cpu")
    assert f"{device!r} {device}" == "'cpu' cpu"
    # to_dict gives plain data that JSON and omegaconf take, and loads back to the same config
    tree = cfg.to_dict()
    assert type(tree["zero_optimization"]["offload_param"]["device"]) is str
    assert load_config(json.loads(json.dumps(tree))) == cfg
    assert load_config(OmegaConf.create(tree)) == cfg


def test_omegaconf_mirror_takes_auto_in_typed_leaves() -> None:
    node = OmegaConf.merge(
        config_schema(),
        {
            "zero_optimization": {"stage": AUTO, "offload_param": {"device": AUTO}},
            "pipeline": {"stages": AUTO, "schedule": "gpipe"},
            "bf16": {"enabled": AUTO},
        },
    )
    cfg = load_config(node)
    assert cfg.zero_optimization.stage == AUTO and cfg.bf16.enabled == AUTO
    assert cfg.pipeline.schedule is PipelineSchedule.GPIPE
    _assert_typed(cfg.resolve(2))
    # the mirror keeps the schema's defaults (the optimizer tier's 4 buffers) and its keys
    assert config_schema().zero_optimization.offload_optimizer.buffer_count == 4
    assert set(OmegaConf.to_container(config_schema())) == {
        f.name for f in dataclasses.fields(ZeroConfig)
    }


def test_a_choice_outside_its_enum_is_refused() -> None:
    with pytest.raises(ValueError, match=r"offload_optimizer.device: got 'disk', allowed 'none'"):
        load_config({"zero_optimization": {"offload_optimizer": {"device": "disk"}}})
