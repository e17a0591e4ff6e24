"""Unit tests of ds_strategy.config: parsing, validation, "auto", batch arithmetic, sources."""

from __future__ import annotations

import ast
import dataclasses
import doctest
import json
import pickle
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError

import ds_strategy.config as config_pkg
from ds_strategy.config import (
    AUTO,
    UNSUPPORTED_KEYS,
    ConfigError,
    OffloadConfig,
    UnsupportedConfigWarning,
    ZeroConfig,
    config_schema,
    load_config,
)
from ds_strategy.config import _load as load_mod
from ds_strategy.config import _schema as schema_mod

# A DeepSpeed ZeRO-3 config as Hugging Face's docs / trainers write it.
HF_ZERO3: dict[str, Any] = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def _error(source: Any) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(source)
    return info.value


def _quiet_load(source: Any) -> ZeroConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsupportedConfigWarning)
        return load_config(source)


# ----------------------------------------------------------------------------- defaults, schema


def test_defaults_follow_deepspeed() -> None:
    cfg = load_config()
    assert cfg == ZeroConfig() == load_config({})
    zero = cfg.zero_optimization
    assert (zero.stage, zero.reduce_bucket_size, zero.allgather_bucket_size) == (0, 5e8, 5e8)
    assert zero.stage3_prefetch_bucket_size == 50_000_000
    assert zero.stage3_param_persistence_threshold == 100_000
    # DeepSpeed's two offload models differ in buffer_count; the rest is shared.
    assert zero.offload_optimizer.buffer_count == 4
    assert zero.offload_param.buffer_count == 5 == OffloadConfig().buffer_count
    assert (cfg.fp16.initial_scale_power, cfg.fp16.loss_scale, cfg.bf16.enabled) == (16, 0.0, False)
    assert cfg.optimizer is None and cfg.scheduler is None
    assert cfg.gradient_clipping == 0.0
    # DeepSpeed's default: no progress line; the monitors still write every 10 steps
    assert (cfg.steps_per_print, cfg.report_every) == (None, 10)


def test_configs_are_frozen_and_picklable() -> None:
    cfg = load_config({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.zero_optimization.stage = 3  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(cfg)) == cfg  # spawned ranks receive it pickled


def test_config_package_imports_only_stdlib_and_omegaconf() -> None:
    allowed = set(sys.stdlib_module_names) | {"omegaconf"}
    for path in Path(config_pkg.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots = [(node.module or "").split(".")[0]]
            else:
                continue
            assert set(roots) <= allowed, f"{path.name} imports {roots}"


def test_unsupported_table_does_not_shadow_schema_keys() -> None:
    sections = {"": ZeroConfig, "zero_optimization": schema_mod.ZeroOptimizationConfig}
    sections.update(
        {
            "zero_optimization.offload_optimizer": OffloadConfig,
            "fp16": schema_mod.FP16Config,
            "bf16": schema_mod.BF16Config,
            "optimizer": schema_mod.OptimizerConfig,
            "checkpoint": schema_mod.CheckpointConfig,
            "pipeline": schema_mod.PipelineConfig,
            "tensor_parallel": schema_mod.TensorParallelConfig,
            "compile": schema_mod.CompileConfig,
        }
    )
    assert set(UNSUPPORTED_KEYS) <= set(sections)
    for prefix, table in UNSUPPORTED_KEYS.items():
        cls = sections[prefix]
        names = {f.name for f in dataclasses.fields(cls)} | set(load_mod._aliases(cls))
        assert not names & set(table), prefix


@pytest.mark.parametrize(
    ("prefix", "key"), [(p, k) for p, table in UNSUPPORTED_KEYS.items() for k in table]
)
def test_every_unsupported_key_warns_and_is_ignored(prefix: str, key: str) -> None:
    data: dict[str, Any] = {"zero_optimization": {"stage": 3}, "optimizer": {"type": "SGD"}}
    node = data
    for part in filter(None, prefix.split(".")):
        node = node.setdefault(part, {})
    node[key] = {"enabled": True}  # any value: it is skipped whole
    dotted = f"{prefix}.{key}" if prefix else key
    with pytest.warns(UnsupportedConfigWarning, match=rf"^{dotted}: .*ignored") as record:
        cfg = load_config(data)
    assert len(record) == 1
    assert cfg == load_config({"zero_optimization": {"stage": 3}, "optimizer": {"type": "SGD"}})


# ----------------------------------------------------------------------------- unknown keys


def test_unknown_nested_key_names_path_and_suggests() -> None:
    err = _error({"zero_optimization": {"stgae": 1}})
    assert str(err) == "zero_optimization.stgae: unknown key, did you mean 'stage'?"
    assert err.key == "zero_optimization.stgae"
    assert isinstance(err, ValueError)


def test_unknown_top_level_key_suggests_or_lists_valid_keys() -> None:
    err = _error({"train_batch_sise": 8})
    assert str(err) == "train_batch_sise: unknown key, did you mean 'train_batch_size'?"
    # a key far from every known one only warns by default (test_config_compat.py), so the
    # list of valid keys is what strict loading says
    with pytest.raises(ConfigError) as info:
        load_config({"xyzzy": 1}, strict=True)
    err = info.value
    assert str(err).startswith("xyzzy: unknown key; valid keys here are: train_batch_size,")
    assert "zero_optimization" in str(err) and "did you mean" not in str(err)


def test_unknown_key_inside_offload_section() -> None:
    err = _error({"zero_optimization": {"offload_optimizer": {"devcie": "cpu"}}})
    assert str(err) == (
        "zero_optimization.offload_optimizer.devcie: unknown key, did you mean 'device'?"
    )


def test_aliases_bfloat16_and_unprefixed_stage3_names() -> None:
    cfg = load_config({"bfloat16": {"enabled": True}, "zero_optimization": {"stage": 3}})
    assert cfg.bf16.enabled is True
    cfg = load_config({"zero_optimization": {"prefetch_bucket_size": 1234}})
    assert cfg.zero_optimization.stage3_prefetch_bucket_size == 1234
    err = _error({"bf16": {"enabled": True}, "bfloat16": {"enabled": False}})
    assert err.key == "bfloat16" and "keep only 'bf16'" in str(err)


# ----------------------------------------------------------------------------- leaf parsing


@pytest.mark.parametrize("written", [1e9, "1e9", "1E+9", 1_000_000_000, "1000000000"])
def test_scientific_notation_accepted_for_int(written: Any) -> None:
    value = load_config({"zero_optimization": {"allgather_bucket_size": written}})
    size = value.zero_optimization.allgather_bucket_size
    assert size == 1_000_000_000 and type(size) is int


@pytest.mark.parametrize("written", [2.5, "2.5", 5e-1])
def test_non_integral_number_rejected_for_int(written: Any) -> None:
    err = _error({"gradient_accumulation_steps": written})
    assert str(err) == f"gradient_accumulation_steps: expected an integer, got {written!r}"


def test_int_accepted_for_float() -> None:
    cfg = load_config({"gradient_clipping": 1, "fp16": {"min_loss_scale": 1}})
    assert cfg.gradient_clipping == 1.0 and type(cfg.gradient_clipping) is float
    assert type(cfg.fp16.min_loss_scale) is float


@pytest.mark.parametrize("written", ["true", "yes", 1, 0, None])
def test_bool_is_strict(written: Any) -> None:
    err = _error({"fp16": {"enabled": written}})
    shown = "null" if written is None else repr(written)
    assert str(err) == f"fp16.enabled: expected a bool (true/false), got {shown}"


def test_bool_is_not_an_int_or_float() -> None:
    assert _error({"zero_optimization": {"stage": True}}).key == "zero_optimization.stage"
    assert "expected a number, got False" in str(_error({"gradient_clipping": False}))


def test_wrong_values_name_key_value_and_allowed() -> None:
    assert str(_error({"zero_optimization": {"stage": 4}})) == (
        "zero_optimization.stage: got 4, allowed 0, 1, 2, 3"
    )
    assert str(_error({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}})) == (
        "zero_optimization.offload_optimizer.device: got 'gpu', allowed 'none', 'cpu', 'nvme'"
    )
    assert str(_error({"communication_data_type": "fp8"})).endswith(
        "allowed 'fp32', 'fp16', 'bf16'"
    )
    assert str(_error({"zero_optimization": {"reduce_bucket_size": -1}})) == (
        "zero_optimization.reduce_bucket_size: got -1, must be >= 0"
    )
    assert str(_error({"train_micro_batch_size_per_gpu": "four"})) == (
        "train_micro_batch_size_per_gpu: expected an integer, got 'four'"
    )
    assert _error({"zero_optimization": 3}).key == "zero_optimization"


def test_zero_is_fine_where_a_threshold_allows_it() -> None:
    cfg = load_config({"zero_optimization": {"stage3_param_persistence_threshold": 0}})
    assert cfg.zero_optimization.stage3_param_persistence_threshold == 0


def test_optimizer_and_scheduler_sections() -> None:
    params = {"lr": 1e-4, "betas": [0.9, 0.95]}
    cfg = load_config({"optimizer": {"type": "AdamW", "params": params}, "scheduler": None})
    assert cfg.optimizer is not None and cfg.optimizer.type == "AdamW"
    assert cfg.optimizer.params == params and cfg.optimizer.params is not params
    assert cfg.scheduler is None
    assert str(_error({"optimizer": {"params": {}}})) == "optimizer.type: required key missing"
    assert _error({"optimizer": {"type": "SGD", "params": [1]}}).key == "optimizer.params"


# ----------------------------------------------------------------------------- cross-field rules


def test_fp16_and_bf16_together_is_an_error() -> None:
    err = _error({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert err.key == "fp16.enabled" and "cannot both be enabled" in str(err)
    # "auto" is undecided, so loading passes; resolving to both enabled fails.
    cfg = load_config({"fp16": {"enabled": True}, "bf16": {"enabled": "auto"}})
    with pytest.raises(ConfigError, match="cannot both be enabled"):
        cfg.resolve(1, {"bf16.enabled": True})


def test_nvme_offload_requires_nvme_path() -> None:
    err = _error({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}})
    assert err.key == "zero_optimization.offload_optimizer.nvme_path"
    assert str(err).startswith("zero_optimization.offload_optimizer.nvme_path: required")
    off = {"device": "nvme", "nvme_path": "/local_nvme"}
    cfg = load_config({"zero_optimization": {"stage": 2, "offload_optimizer": off}})
    assert cfg.zero_optimization.offload_optimizer.nvme_path == "/local_nvme"
    off = {"device": "nvme", "nvme_path": Path("/local_nvme")}  # stored as str, JSON-able
    assert load_config({"zero_optimization": {"stage": 2, "offload_optimizer": off}}) == cfg


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_offload_param_below_stage_3_is_ignored_or_strictly_refused(stage: int) -> None:
    src = {"zero_optimization": {"stage": stage, "offload_param": {"device": "cpu"}}}
    with pytest.raises(ConfigError) as info:
        load_config(src, strict=True)
    assert info.value.key == "zero_optimization.offload_param"
    assert "set zero_optimization.stage to 3 or remove offload_param" in str(info.value)
    # as DeepSpeed, which reads offload_param in stage 3 only: ignored, but said
    with pytest.warns(UnsupportedConfigWarning, match="offload_param: device 'cpu' is ignored"):
        lenient = load_config(src)
    assert lenient.zero_optimization.offload_param.device == "none"
    off = {"device": "none"}  # explicitly off is fine at any stage
    assert load_config({"zero_optimization": {"stage": stage, "offload_param": off}})
    cfg = load_config({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})
    assert cfg.zero_optimization.offload_param.device == "cpu"


def test_partial_optimizer_offload_requires_stage_3() -> None:
    off = {"device": "cpu", "ratio": 0.5}
    assert _error({"zero_optimization": {"stage": 2, "offload_optimizer": off}}).key == (
        "zero_optimization.offload_optimizer.ratio"
    )
    assert load_config({"zero_optimization": {"stage": 3, "offload_optimizer": off}})


# ----------------------------------------------------------------------------- auto / resolve


def test_auto_is_kept_until_resolved() -> None:
    cfg = load_config(
        {
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_clipping": "auto",
            "fp16": {"enabled": "auto"},
            "zero_optimization": {"stage": "auto", "reduce_bucket_size": "auto"},
        }
    )
    assert cfg.train_micro_batch_size_per_gpu == AUTO == "auto"
    assert cfg.fp16.enabled == AUTO and cfg.zero_optimization.reduce_bucket_size == AUTO
    assert cfg.zero_optimization.stage == AUTO and cfg.gradient_clipping == AUTO


def test_resolve_fills_auto_from_auto_values() -> None:
    cfg = load_config(
        {
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_clipping": "auto",
            "fp16": {"enabled": "auto"},
            "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"},
        }
    )
    values = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_clipping": 1,
        "fp16.enabled": True,
        "zero_optimization.reduce_bucket_size": 4096 * 4096,
        "zero_optimization.stage": 1,  # not "auto" in the config: ignored
    }
    r = cfg.resolve(2, values)
    assert (r.train_micro_batch_size_per_gpu, r.train_batch_size) == (8, 16)
    assert r.gradient_clipping == 1.0 and type(r.gradient_clipping) is float
    assert r.fp16.enabled is True and r.zero_optimization.reduce_bucket_size == 4096 * 4096
    assert r.zero_optimization.stage == 3
    assert cfg.fp16.enabled == AUTO  # resolve returns a new config


def test_resolve_falls_back_to_field_defaults() -> None:
    cfg = load_config(
        {
            "gradient_clipping": "auto",
            "bf16": {"enabled": "auto"},
            "zero_optimization": {
                "stage": 3,
                "stage3_prefetch_bucket_size": "auto",
                "offload_optimizer": {"device": "cpu", "buffer_count": "auto"},
                "offload_param": {"device": "cpu", "buffer_count": "auto"},
            },
        }
    )
    r = cfg.resolve(1)
    assert r.gradient_clipping == 0.0 and r.bf16.enabled is False
    zero = r.zero_optimization
    assert zero.stage3_prefetch_bucket_size == 50_000_000
    # the default of the section it sits in, not just the class default
    assert (zero.offload_optimizer.buffer_count, zero.offload_param.buffer_count) == (4, 5)


def test_resolve_auto_values_are_validated_and_keys_checked() -> None:
    cfg = load_config({"gradient_clipping": "auto"})
    with pytest.raises(ConfigError, match=r"^gradient_clipping: expected a number, got 'x'$"):
        cfg.resolve(1, {"gradient_clipping": "x"})
    with pytest.raises(ConfigError) as info:
        cfg.resolve(1, {"zero_optimization.stgae": 1})
    assert str(info.value) == (
        "auto_values: zero_optimization.stgae: unknown key, did you mean 'stage'?"
    )
    with pytest.raises(ConfigError, match="world_size"):
        cfg.resolve(0)


def test_resolve_optimizer_params() -> None:
    cfg = _quiet_load(HF_ZERO3)
    r = cfg.resolve(1, {"optimizer.params.lr": 3e-4, "optimizer.params.betas": [0.9, 0.95]})
    assert r.optimizer is not None
    # given values fill in; the other "auto" entries are dropped so the optimizer's defaults apply
    assert r.optimizer.params == {"lr": 3e-4, "betas": [0.9, 0.95]}
    cfg = load_config({"optimizer": {"type": "auto"}})
    with pytest.raises(
        ConfigError, match=r"^optimizer.type: 'auto' has no default here; pass auto_values"
    ):
        cfg.resolve(1)
    assert cfg.resolve(1, {"optimizer.type": "SGD"}).optimizer == schema_mod.OptimizerConfig("SGD")


@pytest.mark.parametrize(
    ("given", "world_size", "expected"),
    [
        ((32, 4, 2), 4, (32, 4, 2)),  # all three, consistent
        ((32, 4, None), 2, (32, 4, 4)),  # gas computed
        ((32, None, 2), 4, (32, 4, 2)),  # micro computed
        ((None, 4, 2), 3, (24, 4, 2)),  # train_batch_size computed
        ((32, None, None), 4, (32, 8, 1)),  # only train_batch_size
        ((None, 4, None), 3, (12, 4, 1)),  # only micro
        ((None, None, None), 8, (None, None, 1)),  # none
        ((None, None, 4), 8, (None, None, 4)),  # only gas: kept
    ],
)
def test_batch_size_resolution(
    given: tuple[int | None, ...], world_size: int, expected: tuple[int | None, ...]
) -> None:
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    cfg = load_config({k: v for k, v in zip(keys, given, strict=True) if v is not None})
    r = cfg.resolve(world_size)
    assert tuple(getattr(r, k) for k in keys) == expected
    assert r.resolve(world_size) == r  # resolving a resolved config changes nothing


def test_batch_size_inconsistency_shows_arithmetic() -> None:
    cfg = load_config(
        {
            "train_batch_size": 32,
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 2,
        }
    )
    with pytest.raises(ConfigError) as info:
        cfg.resolve(world_size=2)
    assert str(info.value) == (
        "train_batch_size (32) != train_micro_batch_size_per_gpu (4) * "
        "gradient_accumulation_steps (2) * data-parallel world size (2) = 16; "
        "fix one of them or remove train_batch_size to have it computed"
    )
    assert info.value.key == "train_batch_size"


@pytest.mark.parametrize(
    ("given", "world_size", "message"),
    [
        (
            {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4},
            2,
            "train_batch_size (30) is not divisible by train_micro_batch_size_per_gpu (4) * "
            "data-parallel world size (2) = 8, so gradient_accumulation_steps cannot be "
            "computed; make train_batch_size a multiple of 8",
        ),
        (
            {"train_batch_size": 30, "gradient_accumulation_steps": 4},
            1,
            "train_batch_size (30) is not divisible by gradient_accumulation_steps (4) * "
            "data-parallel world size (1) = 4, so train_micro_batch_size_per_gpu cannot be "
            "computed; make train_batch_size a multiple of 4",
        ),
        (
            {"train_batch_size": 30},
            4,
            "train_batch_size (30) is not divisible by data-parallel world size (4), so "
            "train_micro_batch_size_per_gpu cannot be computed; make train_batch_size a "
            "multiple of 4",
        ),
        (  # fewer samples than ranks * micro batch: the quotient would be 0
            {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4},
            2,
            "train_batch_size (4) is not divisible by train_micro_batch_size_per_gpu (4) * "
            "data-parallel world size (2) = 8",
        ),
    ],
)
def test_batch_size_not_divisible(given: dict[str, int], world_size: int, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(given).resolve(world_size)
    assert str(info.value).startswith(message)


# ----------------------------------------------------------------------------- files


def test_json_file(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}))
    cfg = load_config(path)
    assert cfg.zero_optimization.stage == 2 and cfg.bf16.enabled is True
    assert load_config(str(path)) == cfg == ZeroConfig.from_any(path)


@pytest.mark.parametrize("suffix", [".yaml", ".yml"])
def test_yaml_file(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"ds{suffix}"
    path.write_text(
        "zero_optimization:\n"
        "  stage: 3\n"
        "  reduce_bucket_size: 5e8\n"  # a float for omegaconf's loader
        "  allgather_bucket_size: '2e8'\n"  # a str, as plain YAML 1.1 leaves it
        "fp16:\n  enabled: auto\n"
    )
    cfg = load_config(path)
    assert cfg.zero_optimization.stage == 3
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert cfg.zero_optimization.allgather_bucket_size == 200_000_000
    assert cfg.fp16.enabled == AUTO


def test_errors_from_a_file_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "configs" / "x.yaml"
    path.parent.mkdir()
    path.write_text("zero_optimization:\n  stgae: 2\n")
    err = _error(path)
    assert str(err) == f"{path}: zero_optimization.stgae: unknown key, did you mean 'stage'?"
    assert err.key == "zero_optimization.stgae" and err.path == str(path)


def test_warnings_from_a_file_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 3, "round_robin_gradients": true}}')
    with pytest.warns(UnsupportedConfigWarning) as record:
        load_config(path)
    assert str(record[0].message).startswith(f"{path}: zero_optimization.round_robin_gradients: ")
    assert record[0].filename == __file__  # points at the caller, not at the loader


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("missing.json", None, "config file not found"),
        ("bad.json", '{"zero_optimization": {"stage": 2,}}', "invalid JSON at line 1"),
        ("bad.yaml", "zero_optimization: [1,\n", "invalid YAML"),
        ("dup.json", '{"fp16": {}, "fp16": {}}', "duplicate key 'fp16'"),
        ("list.json", "[1, 2]", "the top level must be a mapping"),
        ("ds.toml", "x = 1", "unsupported file extension '.toml'"),
    ],
)
def test_bad_files_are_config_errors_naming_the_path(
    tmp_path: Path, name: str, text: str | None, expected: str
) -> None:
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    err = _error(str(path))
    assert str(err).startswith(f"{path}: ") and expected in str(err)
    assert err.path == str(path)


def test_wrong_source_type() -> None:
    with pytest.raises(TypeError, match="got list"):
        load_config([("zero_optimization", {})])


# ----------------------------------------------------------------------------- omegaconf


def test_omegaconf_node() -> None:
    node = OmegaConf.create({"stage": 3, "zero_optimization": {"stage": "${stage}"}, "seed": 7})
    with pytest.raises(ConfigError, match=r"^stage: unknown key"):
        load_config(node, strict=True)  # interpolation resolved, the helper key still unknown
    with pytest.warns(UnsupportedConfigWarning, match=r"^stage: unknown key, ignored"):
        assert load_config(node).zero_optimization.stage == 3  # lenient: warned and ignored
    node = OmegaConf.create(
        {"zero_optimization": {"stage": 3}, "seed": 7, "fp16": {"enabled": True}}
    )
    cfg = load_config(node)
    assert (cfg.zero_optimization.stage, cfg.seed, cfg.fp16.enabled) == (3, 7, True)
    missing = OmegaConf.create({"zero_optimization": {"stage": "???"}})
    assert _error(missing).key == "zero_optimization.stage"


def test_omegaconf_structured_schema() -> None:
    assert OmegaConf.structured(ZeroConfig).zero_optimization.stage == 0
    with pytest.raises(Exception):  # noqa: B017 - read-only (frozen) or unknown key: both fail
        OmegaConf.merge(OmegaConf.structured(ZeroConfig), {"zero_optimization": {"stgae": 1}})
    # config_schema() is the writable version for Hydra: valid keys merge, typos still fail.
    merged = OmegaConf.merge(
        config_schema(),
        {
            "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"},
            "bf16": {"enabled": True},
        },
    )
    cfg = load_config(merged)
    assert cfg.zero_optimization.stage == 3 and cfg.zero_optimization.reduce_bucket_size == AUTO
    assert cfg.bf16.enabled is True
    with pytest.raises(ConfigKeyError, match="stgae"):
        OmegaConf.merge(config_schema(), {"zero_optimization": {"stgae": 1}})
    assert load_config(config_schema()) == ZeroConfig()


# ----------------------------------------------------------------------------- to_dict / replace


def test_to_dict_round_trips() -> None:
    cfg = load_config(
        {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_clipping": "auto",
            "communication_data_type": "bf16",
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": "nvme", "nvme_path": "/nvme"},
            },
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.99]}},
        }
    )
    data = cfg.to_dict()
    assert json.loads(json.dumps(data)) == data  # plain JSON-able data
    assert data["zero_optimization"]["offload_param"]["nvme_path"] == "/nvme"
    assert "scheduler" not in data  # absent, as DeepSpeed expects, rather than null
    assert load_config(data) == cfg
    data["optimizer"]["params"]["lr"] = 1.0
    assert cfg.optimizer is not None and cfg.optimizer.params["lr"] == 1e-3  # a copy


def test_replace_with_dotted_keys() -> None:
    cfg = load_config({"zero_optimization": {"stage": 1}, "fp16": {"loss_scale_window": 500}})
    new = cfg.replace(**{"zero_optimization.stage": 3, "gradient_accumulation_steps": 2})
    assert new.zero_optimization.stage == 3 and new.gradient_accumulation_steps == 2
    assert cfg.zero_optimization.stage == 1 and cfg.gradient_accumulation_steps is None
    merged = cfg.replace(fp16={"enabled": True}, **{"bfloat16.immediate_grad_update": True})
    assert merged.fp16.enabled is True and merged.fp16.loss_scale_window == 500
    assert merged.bf16.immediate_grad_update is True
    with_opt = cfg.replace(**{"optimizer.type": "SGD", "optimizer.params.lr": 0.1})
    assert with_opt.optimizer == schema_mod.OptimizerConfig("SGD", {"lr": 0.1})
    assert cfg.replace(**{"zero_optimization.prefetch_bucket_size": 7}).zero_optimization == (
        dataclasses.replace(cfg.zero_optimization, stage3_prefetch_bucket_size=7)
    )


def test_replace_validates() -> None:
    cfg = load_config()
    with pytest.raises(ConfigError, match=r"^zero_optimization.stage: got 5, allowed"):
        cfg.replace(**{"zero_optimization.stage": 5})
    with pytest.raises(ConfigError, match=r"^zero_optimization.stgae: unknown key, did you mean"):
        cfg.replace(**{"zero_optimization.stgae": 3})
    with pytest.raises(ConfigError, match="is a value, not a section"):
        cfg.replace(**{"zero_optimization.stage.x": 3})
    with pytest.raises(ConfigError, match="needs ZeRO stage 3"):
        cfg.replace(**{"zero_optimization.offload_param.device": "cpu"})


def test_from_any_passes_a_config_through() -> None:
    cfg = load_config({"seed": 1})
    assert load_config(cfg) is cfg and ZeroConfig.from_any(cfg) is cfg
    assert ZeroConfig.from_any({"seed": 1}) == cfg


# ----------------------------------------------------------------------------- realistic input


def test_hugging_face_deepspeed_json_loads_with_warnings_only_for_unimplemented(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ds_config_zero3.json"
    path.write_text(json.dumps(HF_ZERO3, indent=2))
    with pytest.warns(UnsupportedConfigWarning) as record:
        cfg = load_config(path)
    warned = {str(w.message).split(": ")[1] for w in record}
    # sub_group_size is read (the rounded step's chunk): no warning for it
    assert warned == {"zero_optimization.stage3_gather_16bit_weights_on_model_save"}
    zero = cfg.zero_optimization
    assert zero.stage == 3 and zero.offload_param.device == "cpu"
    assert zero.stage3_max_live_parameters == 1_000_000_000 and zero.reduce_bucket_size == AUTO
    assert cfg.fp16.enabled == AUTO and cfg.fp16.min_loss_scale == 1.0
    assert cfg.optimizer is not None and cfg.optimizer.params["lr"] == AUTO

    hidden = 4096  # what HF's trainer derives from the model
    r = cfg.resolve(
        world_size=8,
        auto_values={
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 2,
            "gradient_clipping": 1.0,
            "bf16.enabled": True,
            "zero_optimization.reduce_bucket_size": hidden * hidden,
            "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "zero_optimization.stage3_param_persistence_threshold": 10 * hidden,
            "optimizer.params.lr": 2e-5,
        },
    )
    assert (r.train_batch_size, r.train_micro_batch_size_per_gpu) == (64, 4)
    assert r.gradient_accumulation_steps == 2 and r.gradient_clipping == 1.0
    assert (r.fp16.enabled, r.bf16.enabled) == (False, True)
    assert r.zero_optimization.stage3_param_persistence_threshold == 10 * hidden
    assert r.optimizer is not None and r.optimizer.params == {"lr": 2e-5}
    assert f'"{AUTO}"' not in json.dumps(r.to_dict())


# ----------------------------------------------------------------------------- docs


@pytest.mark.parametrize("module", [config_pkg, schema_mod, load_mod])
def test_docstring_examples_run(module: Any) -> None:
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


# -- the rule table -----------------------------------------------------------------------------


def test_the_rule_table_refuses_with_a_config_error_naming_the_key() -> None:
    from ds_strategy.config.rules import RULES, Facts, check_rules

    assert len({r.name for r in RULES}) == len(RULES)
    cases = [
        ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
         Facts(), "config", "zero_optimization.offload_optimizer", "stage 1, 2 or 3"),
        ({"zero_optimization": {"stage": 2, "mics_shard_size": 2},
          "topology": {"hierarchical": True}},
         Facts(world_size=4), "ranks", "zero_optimization.mics_shard_size", "hierarchical"),
        ({"zero_optimization": {"stage": 2, "mics_shard_size": 3}},
         Facts(world_size=4, ranks_per_machine=2), "ranks", "zero_optimization.mics_shard_size",
         "does not divide the 4 data-parallel ranks"),
        ({"zero_optimization": {"stage": 3}},
         Facts(optimizer="OneBitAdam", compressed_optimizer=True), "optimizer", "optimizer",
         "zero_optimization.stage 3 (use stage 0, 1 or 2)"),
    ]  # fmt: skip
    for raw, facts, when, key, fragment in cases:
        cfg = load_config(raw).resolve(world_size=facts.world_size)
        check_rules(cfg, facts, "other point")  # rules of another point do not run
        with pytest.raises(ConfigError, match=re.escape(fragment)) as info:
            check_rules(cfg, facts, when)
        assert info.value.key == key
    check_rules(load_config({}).resolve(world_size=4), Facts(world_size=4), "ranks")
