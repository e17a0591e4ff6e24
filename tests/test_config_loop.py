"""A loop's ``torch.compile`` request merged into the config's ``compile`` section
(``config.loop.apply_compile``), as Accelerate's dynamo settings are; a config given in code
or read from the environment (``config.loop.code_or_env_config``), as ``ZeroPlugin``'s is; an
engine's rejection of the precision section a loop flag enabled names the flag."""

from __future__ import annotations

import pytest

from ds_strategy.config import load_config
from ds_strategy.config.loop import apply_compile, blaming_precision_flag, code_or_env_config


def test_no_backend_leaves_the_config() -> None:
    cfg = load_config({})
    assert apply_compile(cfg, "NO", {"mode": "max-autotune"}) is cfg


def test_the_request_enables_compile_and_the_configs_kwargs_win() -> None:
    cfg = load_config({"compile": {"kwargs": {"mode": "reduce-overhead"}}})
    options = {"backend": "inductor", "mode": "default", "fullgraph": True, "dynamic": None}
    out = apply_compile(cfg, "INDUCTOR", options)
    assert out.compile.enabled is True and out.compile.backend == "inductor"
    assert out.compile.kwargs == {"mode": "reduce-overhead", "fullgraph": True}


def test_another_backend_in_the_config_is_refused_naming_both() -> None:
    cfg = load_config({"compile": {"enabled": True, "backend": "eager"}})
    assert apply_compile(cfg, "eager", {}).compile.backend == "eager"
    with pytest.raises(
        ValueError, match="'eager' in the ZeRO config vs Fabric's compile 'inductor'"
    ):
        apply_compile(cfg, "inductor", {}, said="Fabric's compile")


def test_a_config_in_code_ignores_the_environment_saying_so() -> None:
    env = {"DS_STRATEGY_ZERO_STAGE": "3", "OTHER": "1"}
    assert code_or_env_config(None, env, {}, "Plugin").zero_optimization.stage == 3
    given = {"zero_optimization": {"stage": 1}}
    with pytest.warns(UserWarning, match=r"DS_STRATEGY_ZERO_STAGE ignored: Plugin\(config=...\)"):
        cfg = code_or_env_config(given, env, {"gradient_clipping": 2.0}, "Plugin")
    assert cfg.zero_optimization.stage == 1 and cfg.gradient_clipping == 2.0
    with pytest.raises(ValueError, match="Plugin.overrides"):
        code_or_env_config(given, {}, {"zero_optimization.stag": 2}, "Plugin")


def test_an_engine_error_names_the_precision_flag_that_enabled_the_section() -> None:
    cfg = load_config({"bf16": {"enabled": True}})
    flag = r"^Fabric\(precision='bf16-mixed'\) sets bf16.enabled"
    with (
        pytest.raises(ValueError, match=flag) as e,
        blaming_precision_flag(cfg, "Fabric", "bf16-mixed"),
    ):
        raise ValueError("bf16 needs X")
    assert str(e.value).endswith("which the engine rejected: bf16 needs X")
    plain = load_config({})  # no precision section enabled: the error as it is
    with (
        pytest.raises(ValueError, match="^stage 9$"),
        blaming_precision_flag(plain, "Trainer", "32-true"),
    ):
        raise ValueError("stage 9")
    with pytest.raises(TypeError), blaming_precision_flag(cfg, "Fabric", "bf16-mixed"):
        raise TypeError("bad call")  # not a rejection of the config
