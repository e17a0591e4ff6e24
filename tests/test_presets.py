"""The named presets: one registry (``ds_strategy/config/presets.py`` over the YAML files in
``ds_strategy/presets/``), resolved by name by every entry point that takes a config."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import ds_strategy
from ds_strategy.cli import main as cli_main
from ds_strategy.config import ConfigError, load_config
from ds_strategy.config.presets import (
    PRECISIONS,
    describe,
    precision_fragment,
    preset,
    preset_names,
)

STAGES = {
    "zero1": 1,
    "zero1_tp2": 1,
    "zero2": 2,
    "zero2_offload": 2,
    "zero3": 3,
    "zero3_nvme": 3,
    "zero3_offload": 3,
}


def test_the_registry_is_the_files_shipped_in_the_package() -> None:
    shipped = Path(ds_strategy.__file__).parent / "presets"
    assert preset_names() == sorted(p.stem for p in shipped.glob("*.yaml"))
    assert set(preset_names()) == set(STAGES)
    assert not (Path(__file__).resolve().parents[1] / "configs" / "zero3.yaml").exists()


@pytest.mark.parametrize("name", sorted(STAGES))
def test_load_config_resolves_each_name(name: str) -> None:
    cfg = load_config(name)
    assert cfg.zero_optimization.stage == STAGES[name]
    assert cfg == load_config(preset(name))  # the name is the file's data, nothing else
    offload = cfg.zero_optimization.offload_optimizer.device
    assert offload == {"zero2_offload": "cpu", "zero3_offload": "cpu", "zero3_nvme": "nvme"}.get(
        name, "none"
    )
    assert describe(name).startswith("ZeRO stage")


def test_an_unknown_name_lists_the_presets_and_a_file_named_like_one_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigError, match=r"'zero4' is neither a file nor a preset; did you mean "):
        load_config("zero4")
    with pytest.raises(ConfigError, match=r"zero3_offload"):
        load_config("zero4")
    with pytest.raises(ConfigError, match=r"config file not found \(the preset of that name: pass"):
        load_config("zero3.yaml")
    # a file of the preset's name in the working directory is the user's: it wins
    monkeypatch.chdir(tmp_path)
    Path("zero3").write_text("{}")  # not a config file: its own error, not the preset
    with pytest.raises(ConfigError, match="unsupported file extension"):
        load_config("zero3")
    Path("zero2").mkdir()
    with pytest.raises(ConfigError, match="zero2: a directory, not a config file"):
        load_config("zero2")


def test_precision_fragments_hold_only_their_sections() -> None:
    for name in PRECISIONS:
        assert set(precision_fragment(name)) == {"bf16", "fp16"}
    assert precision_fragment("bf16")["bf16"]["enabled"] is True
    with pytest.raises(ConfigError, match="choose one of bf16, fp16, fp32"):
        precision_fragment("fp8")


def test_initialize_and_the_accelerate_plugin_take_a_name() -> None:
    from ds_strategy.accelerate import ZeroPlugin

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    engine = ds_strategy.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), "zero2_offload"
    )
    assert engine.stage == 2 and engine.config.zero_optimization.offload_optimizer.device == "cpu"
    engine.destroy()
    assert ZeroPlugin(config="zero3_offload").load({}).zero_optimization.stage == 3
    env = {"DS_STRATEGY_CONFIG": "zero1"}
    assert ZeroPlugin().load(env).zero_optimization.stage == 1


def test_lightning_and_fabric_register_every_preset_by_name() -> None:
    pytest.importorskip("lightning")
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from ds_strategy.fabric import ZeroStrategy as FabricZeroStrategy
    from ds_strategy.lightning import ZeroStrategy

    for name in preset_names():
        for registry, cls in (
            (StrategyRegistry, ZeroStrategy),
            (STRATEGY_REGISTRY, FabricZeroStrategy),
        ):
            entry = registry[name]
            assert entry["strategy"] is cls and entry["init_params"] == {"config": name}
            assert describe(name) in entry["description"]
    strategy = ZeroStrategy(config="zero3_offload")
    assert strategy.config.zero_optimization.offload_param.device == "cpu"
    assert strategy.stage == 3


def test_estimate_takes_a_name(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["estimate", "--params", "7e9", "--world-size", "2", "--config"]
    assert cli_main([*args, "zero3_nvme"]) == 0
    by_name = capsys.readouterr().out
    shipped = Path(ds_strategy.__file__).parent / "presets" / "zero3_nvme.yaml"
    assert cli_main([*args, os.fspath(shipped)]) == 0
    assert by_name == capsys.readouterr().out and "zero3+nvme" in by_name
    assert cli_main([*args, "zero4"]) == 2
    assert "'zero4' is neither a file nor a preset" in capsys.readouterr().err
