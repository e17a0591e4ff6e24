"""DeepSpeed compatibility of ds_strategy.config: DeepSpeed's value ranges and deprecated forms,
unknown keys (error when close to a known key, else a warning; strict mode), required scheduler
parameters, and the keyword form ``zero_config``. Single process, fast."""

from __future__ import annotations

import doctest
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ds_strategy
from ds_strategy.config import (
    STRICT_ENV,
    ConfigError,
    DeprecatedConfigWarning,
    UnknownConfigKeyWarning,
    UnsupportedConfigWarning,
    ZeroConfig,
    load_config,
    zero_config,
)
from ds_strategy.config import _env as env_mod
from ds_strategy.config import _keywords as keywords_mod
from ds_strategy.config.loop import LoopFacts, fill_auto


@pytest.fixture(autouse=True)
def _no_strict_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(STRICT_ENV, raising=False)


def _error(source: Any, **kwargs: Any) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(source, **kwargs)
    return info.value


def _quiet(source: Any, **kwargs: Any) -> ZeroConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsupportedConfigWarning)
        return load_config(source, **kwargs)


# ----------------------------------------------------------------------------- 1. value ranges


def test_zero_sizes_of_transformers_zero3_json_load() -> None:
    # the zero_optimization section of transformers' tests/deepspeed/ds_config_zero3.json
    # after its "auto" values were filled for a tiny model
    cfg = _quiet(
        {
            "zero_optimization": {
                "stage": 3,
                "reduce_bucket_size": 0,
                "stage3_prefetch_bucket_size": 0,
                "stage3_param_persistence_threshold": 0,
                "sub_group_size": 1e9,
                "stage3_max_live_parameters": 1e9,
                "stage3_max_reuse_distance": 1e9,
                "stage3_gather_16bit_weights_on_model_save": True,
            }
        }
    )
    zero = cfg.zero_optimization
    assert zero.reduce_bucket_size == 1  # DeepSpeed's "each gradient alone", see below
    assert (zero.stage3_prefetch_bucket_size, zero.stage3_param_persistence_threshold) == (0, 0)


def test_reduce_bucket_size_zero_is_stored_as_one() -> None:
    cfg = load_config({"zero_optimization": {"reduce_bucket_size": 0}})
    assert cfg.zero_optimization.reduce_bucket_size == 1
    assert load_config(cfg.to_dict()) == cfg  # the mapping is idempotent: round-trips
    assert load_config({"zero_optimization": {"reduce_bucket_size": 7}}).zero_optimization == (
        cfg.replace(**{"zero_optimization.reduce_bucket_size": 7}).zero_optimization
    )
    auto = load_config({"zero_optimization": {"reduce_bucket_size": "auto"}})
    resolved = auto.resolve(1, {"zero_optimization.reduce_bucket_size": 0})
    assert resolved.zero_optimization.reduce_bucket_size == 1
    err = _error({"zero_optimization": {"reduce_bucket_size": -1}})
    assert str(err) == "zero_optimization.reduce_bucket_size: got -1, must be >= 0"


@pytest.mark.parametrize(
    "key",
    [
        "allgather_bucket_size",
        "stage3_prefetch_bucket_size",
        "prefetch_bucket_size",
        "stage3_max_live_parameters",
        "max_live_parameters",
        "stage3_max_reuse_distance",
        "stage3_param_persistence_threshold",
    ],
)
def test_zero_sizes_accept_zero_and_refuse_negatives(key: str) -> None:
    cfg = load_config({"zero_optimization": {key: 0}})
    name = key if key.startswith(("stage3_", "allgather")) else f"stage3_{key}"
    assert getattr(cfg.zero_optimization, name) == 0
    err = _error({"zero_optimization": {key: -1}})
    assert err.key == f"zero_optimization.{name}" and "must be >= 0" in str(err)


@pytest.mark.parametrize("key", ["buffer_count", "buffer_size"])
def test_offload_buffers_accept_zero(key: str) -> None:
    off = {"device": "cpu", key: 0}
    cfg = load_config({"zero_optimization": {"stage": 3, "offload_param": off}})
    assert getattr(cfg.zero_optimization.offload_param, key) == 0
    err = _error({"zero_optimization": {"stage": 3, "offload_param": {key: -1}}})
    assert err.key == f"zero_optimization.offload_param.{key}"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_engine_reduces_each_parameter_alone_with_bucket_size_zero(stage: int) -> None:
    """What the mapping 0 -> 1 buys: one flat group per parameter, and the same weights."""

    def train(config: dict[str, Any]) -> tuple[dict[str, torch.Tensor], int]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
        engine = ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
        gen = torch.Generator().manual_seed(0)
        try:
            for _ in range(2):
                engine.backward(engine(torch.randn(4, 6, generator=gen)).pow(2).mean())
                engine.step()
            return engine.full_state_dict(), len(engine.plan.groups)
        finally:
            engine.destroy()

    reference, _ = train({"zero_optimization": {"stage": stage}})
    zero = {"stage": stage, "reduce_bucket_size": 0, "stage3_prefetch_bucket_size": 0}
    zero["stage3_param_persistence_threshold"] = 0
    weights, groups = train({"zero_optimization": zero})
    assert groups == 4  # 2 weights + 2 biases, each reduced (and gathered) on its own
    for name, value in reference.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=1e-6)


def test_gradient_clipping_below_zero_means_off_as_in_deepspeed() -> None:
    assert load_config({"gradient_clipping": -1}).gradient_clipping == 0.0
    assert load_config({"gradient_clipping": 0.5}).gradient_clipping == 0.5


def test_communication_data_type_is_case_insensitive() -> None:
    assert load_config({"communication_data_type": "BF16"}).communication_data_type == "bf16"
    assert "allowed 'fp32', 'fp16', 'bf16'" in str(_error({"communication_data_type": "FP8"}))


def test_fp16_scaler_keys_checked_only_when_dynamic_scaling_runs() -> None:
    unused = {"loss_scale_window": 0, "min_loss_scale": 0, "hysteresis": 0}
    assert load_config({"fp16": {"enabled": False, **unused}}).fp16.loss_scale_window == 0
    assert load_config({"fp16": {"enabled": True, "loss_scale": 128, **unused}})
    err = _error({"fp16": {"enabled": True, "loss_scale_window": 0}})
    assert err.key == "fp16.loss_scale_window" and "must be >= 1 when fp16 is enabled" in str(err)
    err = _error({"fp16": {"enabled": True, "min_loss_scale": 0}})
    assert err.key == "fp16.min_loss_scale" and "must be > 0" in str(err)
    # "auto" is undecided: checked once resolved
    cfg = load_config({"fp16": {"enabled": "auto", "loss_scale_window": 0}})
    with pytest.raises(ConfigError, match=r"^fp16.loss_scale_window: got 0"):
        cfg.resolve(1, {"fp16.enabled": True})
    cfg = load_config({"fp16": {"enabled": True, "initial_scale_power": -2, "hysteresis": 1}})
    assert (cfg.fp16.initial_scale_power, cfg.fp16.hysteresis) == (-2, 1)
    err = _error({"fp16": {"enabled": True, "hysteresis": -1}})
    assert err.key == "fp16.hysteresis" and "must be >= 1 when fp16 is enabled" in str(err)


@pytest.mark.parametrize(
    ("config", "key", "message"),
    [
        ({"fp16": {"enabled": True, "initial_scale_power": 1e308}}, "fp16.initial_scale_power", "out of range"),
        ({"fp16": {"enabled": True, "initial_scale_power": 2000}}, "fp16.initial_scale_power", "<= 64"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": float("inf")}}},
         "scheduler.params.warmup_num_steps", "whole number of steps"),
        ({"optimizer": {"type": "AdamW", "params": {"betas": {}}}}, "optimizer.params.betas", "pair"),
        ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.0]}}}, "optimizer.params.betas", "[0, 1)"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": ""}}},
         "scheduler.params.warmup_min_lr", "expected a number"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": 2**70}}}, "optimizer.params.lr", "<= 1e+06"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": -1e-3}}}, "optimizer.params.lr", ">= 0"),
        ({"optimizer": {"type": "AdamW", "params": {"weight_decay": float("inf")}}},
         "optimizer.params.weight_decay", "finite"),
        ({"train_micro_batch_size_per_gpu": 1e308}, "train_micro_batch_size_per_gpu", "out of range"),
        ({"zero_optimization": {"offload_optimizer": {"buffer_size": 1e308}}},
         "zero_optimization.offload_optimizer.buffer_size", "out of range"),
        ({"zero_optimization": {"offload_optimizer": {"buffer_size": 2**45}}},
         "zero_optimization.offload_optimizer.buffer_size", "<= 1099511627776"),
    ],
)  # fmt: skip
def test_every_number_in_range_names_its_key(config: dict, key: str, message: str) -> None:
    """Values that used to hang the engine's construction, crash inside torch naming no key,
    or be accepted: each a ConfigError at load naming the key (before any process group)."""
    err = _error(config)
    assert err.key == key and message in str(err), str(err)


def test_numbers_in_range_still_load() -> None:
    cfg = load_config(
        {
            "optimizer": {"type": "AdamW", "params": {"lr": "1e-4", "betas": [0.9, 0.95],
                                                      "eps": 1e-8, "weight_decay": "auto"}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 100.0,
                                                               "total_num_steps": "auto",
                                                               "warmup_max_lr": 3e-4}},
            "fp16": {"enabled": True, "initial_scale_power": 32},
        }
    )  # fmt: skip
    assert cfg.optimizer.params["lr"] == "1e-4" and cfg.fp16.initial_scale_power == 32


def test_deprecated_boolean_zero_optimization() -> None:
    with pytest.warns(UnsupportedConfigWarning) as record:
        cfg = load_config({"zero_optimization": True, "allgather_size": 5e8})
    assert cfg == _quiet({"zero_optimization": {"stage": 1}})
    [deprecated] = [r for r in record if r.category is DeprecatedConfigWarning]
    assert str(deprecated.message) == "zero_optimization: deprecated boolean form, read as stage 1"
    with pytest.warns(DeprecatedConfigWarning):
        assert load_config({"zero_optimization": False}).zero_optimization.stage == 0


def test_deprecated_cpu_offload_keys_keep_deepspeeds_meaning() -> None:
    with pytest.warns(DeprecatedConfigWarning, match=r"zero_optimization.cpu_offload: .*'cpu'"):
        cfg = load_config({"zero_optimization": {"stage": 2, "cpu_offload": True}})
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    with pytest.warns(DeprecatedConfigWarning):
        cfg = load_config({"zero_optimization": {"stage": 3, "cpu_offload_param": True}})
    assert cfg.zero_optimization.offload_param.device == "cpu"
    with pytest.warns(DeprecatedConfigWarning):
        cfg = load_config({"zero_optimization": {"stage": 2, "cpu_offload": False}})
    assert cfg.zero_optimization.offload_optimizer.device == "none"
    both = {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}
    err = _error({"zero_optimization": both})
    assert err.key == "zero_optimization.cpu_offload" and "keep only 'offload_optimizer'" in str(
        err
    )
    with pytest.raises(ConfigError, match="set zero_optimization.offload_optimizer"):
        ZeroConfig().replace(**{"zero_optimization.cpu_offload": True})


# Every key DeepSpeed's config reads, per section (runtime/config.py, runtime/constants.py,
# runtime/zero/config.py, runtime/zero/offload_config.py, runtime/precision_config.py,
# runtime/activation_checkpointing/config.py, model_checkpointing, monitor, comm, ...).
DEEPSPEED_KEYS = {
    "": "train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps "
    "steps_per_print dump_state gradient_clipping prescale_gradients gradient_predivide_factor "
    "sparse_gradients communication_data_type seq_parallel_communication_data_type "
    "gradient_allreduce_op disable_allgather wall_clock_breakdown memory_breakdown "
    "graph_harvesting zero_allow_untested_optimizer zero_force_ds_cpu_optimizer amp "
    "torch_autocast fp16 bf16 bfloat16 zero_optimization optimizer scheduler "
    "activation_checkpointing aio checkpoint data_types pipeline tensorboard wandb csv_monitor "
    "comet trackio flops_profiler comms_logger timers autotuning elasticity nebula "
    "data_efficiency curriculum_learning compression_training quantize_training eigenvalue "
    "progressive_layer_drop sparse_attention hybrid_engine weight_quantization compile "
    "tensor_parallel expert_parallel use_data_before_expert_parallelism sequence_parallel_size "
    "vocabulary_size dataloader_drop_last log_level managed_gradient_accumulation "
    "datastates_ckpt allgather_size comms_config monitor_config",
    "zero_optimization": "stage contiguous_gradients reduce_scatter reduce_bucket_size "
    "use_multi_rank_bucket_allreduce allgather_partitions allgather_bucket_size overlap_comm "
    "load_from_fp32_weights elastic_checkpoint offload_param offload_optimizer zenflow "
    "sub_group_size cpu_offload_param cpu_offload_use_pin_memory cpu_offload "
    "prefetch_bucket_size stage3_prefetch_bucket_size param_persistence_threshold "
    "stage3_param_persistence_threshold model_persistence_threshold "
    "stage3_model_persistence_threshold max_live_parameters stage3_max_live_parameters "
    "max_reuse_distance stage3_max_reuse_distance gather_16bit_weights_on_model_save "
    "stage3_gather_16bit_weights_on_model_save module_granularity_threshold "
    "stage3_module_granularity_threshold use_all_reduce_for_fetch_params "
    "stage3_use_all_reduce_for_fetch_params allgather_sequential stage3_allgather_sequential "
    "stage3_gather_fp16_weights_on_model_save ignore_unused_parameters legacy_stage1 "
    "round_robin_gradients zero_hpz_partition_size zero_quantized_weights "
    "zero_quantized_nontrainable_weights zero_quantized_gradients zeropp_loco_param "
    "mics_shard_size mics_hierarchical_params_gather memory_efficient_linear "
    "pipeline_loading_checkpoint override_module_apply log_trace_cache_warnings "
    "enable_sanity_checks save_muon_momentum_buffer_in_memory leaf_module",
    "zero_optimization.offload_param": "device nvme_path buffer_count buffer_size max_in_cpu "
    "pin_memory",
    "zero_optimization.offload_optimizer": "device nvme_path buffer_count pin_memory "
    "pipeline_read pipeline_write fast_init ratio super_offload cpuadam_cores_perc",
    "bf16": "enabled immediate_grad_update check_grad_overflow bf16_master_weights_and_grads "
    "bf16_optimizer_states",
    "fp16": "enabled auto_cast loss_scale initial_scale_power loss_scale_window hysteresis "
    "consecutive_hysteresis min_loss_scale fp16_master_weights_and_grads",
    "pipeline": "stages partition seed_layers activation_checkpoint_interval pipe_partitioned "
    "grad_partitioned use_reentrant",
    "activation_checkpointing": "partition_activations number_checkpoints "
    "contiguous_memory_optimization synchronize_checkpoint_boundary profile cpu_checkpointing",
    "checkpoint": "tag_validation load_universal use_node_local_storage parallel_write "
    "checkpoint_serialization writer",
    "optimizer": "type params legacy_fusion",
    "scheduler": "type params",
}


@pytest.mark.parametrize(
    ("section", "key"), [(s, k) for s, keys in DEEPSPEED_KEYS.items() for k in keys.split()]
)
def test_every_deepspeed_key_is_known_even_when_strict(section: str, key: str) -> None:
    data: dict[str, Any] = {key: {}}  # the value may be wrong for the key; not what is tested
    for part in reversed(section.split(".") if section else []):
        data = {part: data}
    try:
        _quiet(data, strict=True)
    except ConfigError as err:
        assert "unknown key" not in str(err)


# ----------------------------------------------------------------------------- 2. unknown keys


def test_far_unknown_key_warns_names_it_and_is_ignored() -> None:
    base = {"zero_optimization": {"stage": 2}}
    with pytest.warns(UnknownConfigKeyWarning) as record:
        cfg = load_config({**base, "cuda_visible_devices": "0,1,2,3"})
    assert cfg == load_config(base)
    assert len(record) == 1 and issubclass(record[0].category, UnsupportedConfigWarning)
    message = str(record[0].message)
    assert message.startswith("cuda_visible_devices: unknown key, ignored")
    assert STRICT_ENV in message and "strict=True" in message
    assert record[0].filename == __file__
    with pytest.warns(UnknownConfigKeyWarning, match=r"^zero_optimization.xyzzy: unknown key"):
        assert load_config({"zero_optimization": {"stage": 2, "xyzzy": {"a": 1}}}) == cfg


def test_far_unknown_key_warning_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text('{"cuda_visible_devices": 0, "zero_optimization": {"stage": 1}}')
    with pytest.warns(UnknownConfigKeyWarning, match=rf"^{path}: cuda_visible_devices: "):
        assert load_config(path).zero_optimization.stage == 1


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"zero_optimisation": {}},
            "zero_optimisation: unknown key, did you mean 'zero_optimization'?",
        ),
        (
            {"zero_optimization": {"stgae": 1}},
            "zero_optimization.stgae: unknown key, did you mean 'stage'?",
        ),
        ({"zero_optimization": {"sub_group_sise": 1}}, "did you mean 'sub_group_size'?"),
        ({"zero_optimization": {"cpu_ofload": True}}, "did you mean 'cpu_offload'?"),
        ({"fp16": {"enable": True}}, "fp16.enable: unknown key, did you mean 'enabled'?"),
    ],
)
def test_close_unknown_key_stays_an_error(data: dict[str, Any], message: str) -> None:
    assert message in str(_error(data))
    assert message in str(_error(data, strict=False))


def test_strict_argument_and_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    data = {"cuda_visible_devices": 0}
    err = _error(data, strict=True)
    assert err.key == "cuda_visible_devices"
    assert str(err).startswith("cuda_visible_devices: unknown key; valid keys here are: ")
    with pytest.raises(ConfigError, match="^cuda_visible_devices: unknown key;"):
        ZeroConfig.from_any(data, strict=True)
    for on in ("1", "true", "YES"):
        monkeypatch.setenv(STRICT_ENV, on)
        assert _error(data).key == "cuda_visible_devices"
    with pytest.warns(UnknownConfigKeyWarning):
        load_config(data, strict=False)  # the argument wins over the environment
    for off in ("0", "false", ""):
        monkeypatch.setenv(STRICT_ENV, off)
        with pytest.warns(UnknownConfigKeyWarning):
            load_config(data)
    monkeypatch.setenv(STRICT_ENV, "maybe")
    err = _error({})
    assert err.key == STRICT_ENV and str(err).startswith(f"{STRICT_ENV}='maybe': expected 1")


def test_strict_mode_keeps_unimplemented_deepspeed_keys_warnings() -> None:
    with pytest.warns(UnsupportedConfigWarning, match="round_robin_gradients"):
        load_config({"zero_optimization": {"round_robin_gradients": True}}, strict=True)


def test_keys_set_from_code_are_always_strict() -> None:
    with pytest.raises(ConfigError, match=r"^xyzzy: unknown key; valid keys"):
        ZeroConfig().replace(xyzzy=1)
    with pytest.raises(ConfigError, match=r"^fp16.xyzzy: unknown key; valid keys"):
        ZeroConfig().replace(fp16={"xyzzy": 1})
    with pytest.raises(ConfigError, match=r"^auto_values: xyzzy: unknown key"):
        ZeroConfig().resolve(1, {"xyzzy": 1})


def test_environment_config_file_and_strict_variable(tmp_path: Path) -> None:
    path = tmp_path / "ds.yaml"
    path.write_text("zero_optimization:\n  stage: 2\ncuda_visible_devices: 0\n")
    env = {"DS_STRATEGY_CONFIG": str(path), "DS_STRATEGY_ZERO_STAGE": "3"}
    with pytest.warns(UnknownConfigKeyWarning):
        assert env_mod.config_from_env(env).zero_optimization.stage == 3
    strict = {**env, STRICT_ENV: "1"}
    assert STRICT_ENV not in str(env_mod.overrides_from_env(strict))  # not a config key
    with pytest.raises(ConfigError, match="cuda_visible_devices: unknown key;"):
        env_mod.config_from_env(strict)


def test_the_packages_other_variables_are_not_config_keys() -> None:
    env = {"DS_STRATEGY_PROGRESS": "0", "DS_STRATEGY_PROGRESS_EVERY": "5",
           "DS_STRATEGY_NVME_PATH": "/nvme", "DS_STRATEGY_ZERO_STAGE": "2"}  # fmt: skip
    assert env_mod.config_from_env(env).zero_optimization.stage == 2  # (was: "unknown key")


# ----------------------------------------------------------------------------- 3. scheduler


@pytest.mark.parametrize("type_name", ["WarmupDecayLR", "WarmupCosineLR"])
def test_missing_total_num_steps_is_an_error_at_load(type_name: str) -> None:
    err = _error({"scheduler": {"type": type_name, "params": {"warmup_num_steps": 10}}})
    assert err.key == "scheduler.params.total_num_steps"
    assert str(err).startswith(f"scheduler.params.total_num_steps: required by {type_name}")
    ok = load_config({"scheduler": {"type": type_name, "params": {"total_num_steps": 100}}})
    assert ok.scheduler is not None and ok.scheduler.params == {"total_num_steps": 100}


def test_schedulers_without_required_params_load() -> None:
    assert load_config({"scheduler": {"type": "WarmupLR"}}).scheduler is not None
    assert load_config({"scheduler": {"type": "auto"}}).scheduler is not None
    # OneCycle needs its cycle's bounds: named at load, as WarmupDecayLR's total_num_steps
    with pytest.raises(ConfigError) as info:
        load_config({"scheduler": {"type": "OneCycle", "params": {"cycle_max_lr": 0.1}}})
    assert info.value.key == "scheduler.params.cycle_min_lr"
    bounds = {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1}
    assert load_config({"scheduler": {"type": "OneCycle", "params": bounds}}).scheduler


def test_auto_total_num_steps_must_be_filled_when_resolved() -> None:
    section = {
        "type": "WarmupDecayLR",
        "params": {"total_num_steps": "auto", "warmup_max_lr": "auto"},
    }
    cfg = load_config({"scheduler": section})  # "auto" is not missing
    with pytest.raises(ConfigError) as info:
        cfg.resolve(1)
    assert info.value.key == "scheduler.params.total_num_steps"
    assert "'auto' has no value here and WarmupDecayLR requires it" in str(info.value)
    resolved = cfg.resolve(1, {"scheduler.params.total_num_steps": 50})
    assert resolved.scheduler is not None
    assert resolved.scheduler.params == {"total_num_steps": 50}  # warmup_max_lr: its default
    filled = fill_auto(cfg, LoopFacts(world_size=1, total_num_steps=20, base_lr=0.1))
    assert filled.scheduler is not None and filled.scheduler.params["total_num_steps"] == 20


# ----------------------------------------------------------------------------- 4. zero_config


@pytest.mark.parametrize(
    ("kwargs", "data"),
    [
        ({"stage": 2}, {"zero_optimization": {"stage": 2}}),
        (
            {
                "stage": 3,
                "offload_optimizer": True,
                "offload_parameters": False,
                "contiguous_memory_optimization": True,
                "precision": "bf16",
                "reduce_bucket_size": 0,
                "prefetch_bucket_size": 5e7,
            },
            {
                "zero_optimization": {
                    "stage": 3,
                    "offload_optimizer": {"device": "cpu"},
                    "offload_param": {"device": "none"},
                    "reduce_bucket_size": 0,
                    "stage3_prefetch_bucket_size": 5e7,
                },
                "activation_checkpointing": {"contiguous_memory_optimization": True},
                "bf16": {"enabled": True},
            },
        ),
        (
            {"stage": 3, "offload_parameters": "cpu", "precision": "fp16", "gradient_clipping": 1},
            {
                "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
                "fp16": {"enabled": True},
                "gradient_clipping": 1.0,
            },
        ),
        (
            {
                "stage": 1,
                "precision": "fp32",
                "train_micro_batch_size_per_gpu": 4,
                "zero_optimization.overlap_comm": False,
                "fp16": {"loss_scale_window": 500},
            },
            {
                "zero_optimization": {"stage": 1, "overlap_comm": False},
                "train_micro_batch_size_per_gpu": 4,
                "fp16": {"loss_scale_window": 500},
            },
        ),
    ],
)
def test_zero_config_equals_the_equivalent_json(
    kwargs: dict[str, Any], data: dict[str, Any]
) -> None:
    assert zero_config(**kwargs) == load_config(data)


def test_zero_config_nvme(tmp_path: Path) -> None:
    cfg = zero_config(3, offload_optimizer="nvme", offload_parameters="nvme", nvme_path=tmp_path)
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    assert cfg == load_config(
        {"zero_optimization": {"stage": 3, "offload_optimizer": nvme, "offload_param": nvme}}
    )
    mixed = zero_config(3, offload_optimizer="nvme", offload_parameters=True, nvme_path="/nvme")
    assert mixed.zero_optimization.offload_param.nvme_path is None
    with pytest.raises(ConfigError) as info:
        zero_config(2, offload_optimizer="nvme")
    assert info.value.key == "zero_optimization.offload_optimizer.nvme_path"
    with pytest.raises(ConfigError, match="^nvme_path: given, but neither") as info:
        zero_config(2, offload_optimizer=True, nvme_path="/nvme")


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"stage": 4}, "zero_optimization.stage"),
        ({"stage": 2, "precision": "bf16-mixed"}, "precision"),
        ({"stage": 2, "offload_optimizer": "gpu"}, "offload_optimizer"),
        ({"stage": 2, "offload_parameters": True}, "zero_optimization.offload_param"),
        ({"stage": 2, "reduce_bucket_size": -5}, "zero_optimization.reduce_bucket_size"),
        ({"stage": 2, "gradient_clippin": 1.0}, "gradient_clippin"),
        ({"stage": 2, "cuda_visible_devices": 0}, "cuda_visible_devices"),
        ({"stage": 2, "zero_optimization.stage": 3}, "zero_optimization.stage"),
    ],
)
def test_zero_config_errors_name_the_key(kwargs: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        zero_config(**kwargs)
    assert info.value.key == key and str(info.value).startswith(f"{key}: ")


def test_zero_config_is_exported() -> None:
    assert "zero_config" in ds_strategy.config.__all__
    assert ds_strategy.config.zero_config is zero_config


@pytest.mark.parametrize("module", [keywords_mod, env_mod])
def test_docstring_examples_run(module: Any) -> None:
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_auto_layout_keys_build_an_engine_as_their_defaults() -> None:
    """DeepSpeed configs may say "auto" for any key; the stage, pipeline stages and
    tensor-parallel size are read before the config is resolved (which pipeline to build, how
    many data-parallel ranks), and read as resolving makes them: the defaults."""
    auto = {"zero_optimization": {"stage": "auto"}, "pipeline": {"stages": "auto"}}
    auto["tensor_parallel"] = {"autotp_size": "auto"}
    assert load_config(auto).layout == (0, 1, 1, 1, 1) == tuple(load_config({}).layout)
    model = nn.Linear(2, 2)
    engine = ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), auto)
    assert isinstance(engine, ds_strategy.ZeroEngine) and engine.stage == 0
    assert (engine.config.pipeline.stages, engine.config.tensor_parallel.autotp_size) == (1, 1)
    engine.destroy()
