"""How the Lightning front ends are built and configured: registered names, explicit
constructor arguments (LightningCLI / Hydra), the Trainer/Fabric flags written into the
config and the contradictions rejected; then, in one single-process run, the precision
flags reaching the engine and each misconfiguration failing with a message that says what
to change."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.lightning_scripts.launch import run_script

L = pytest.importorskip("lightning")

import ds_strategy  # noqa: E402,F401  (registers the strategies)
from ds_strategy.config import ZeroConfig  # noqa: E402
from ds_strategy.config.loop import apply_loop_flags, base_config  # noqa: E402
from ds_strategy.fabric import ZeroStrategy as FabricZeroStrategy  # noqa: E402
from ds_strategy.lightning import ZeroPrecision, ZeroStrategy  # noqa: E402

NAMES = ["zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"]


# -- registration and construction ----------------------------------------------------------------


def test_import_registers_the_names_for_trainer_and_fabric() -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    for name in NAMES:
        assert StrategyRegistry[name]["strategy"] is ZeroStrategy
        assert STRATEGY_REGISTRY[name]["strategy"] is FabricZeroStrategy


@pytest.mark.parametrize(
    "first",
    [
        "from lightning.fabric import Fabric",
        "from ds_strategy.fabric import ZeroStrategy",  # its own import imports Lightning
        "from ds_strategy.lightning import ZeroStrategy",
    ],
)
@pytest.mark.launcher
def test_import_defers_lightning_and_registers_whatever_comes_first(first: str) -> None:
    """``import ds_strategy`` leaves Lightning unimported (seconds saved in every rank) and the
    names appear, for the Trainer and Fabric alike and without a warning, the moment anything
    imports it: the user, or one of our Lightning front ends."""
    script = (
        "import sys, warnings, ds_strategy\n"
        "warnings.simplefilter('error', RuntimeWarning)\n"
        "assert 'lightning' not in sys.modules, 'imported eagerly'\n"
        f"{first}\n"
        "from lightning.fabric.strategies import STRATEGY_REGISTRY\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "assert 'zero3' in StrategyRegistry and 'zero2_offload' in STRATEGY_REGISTRY\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.parametrize(
    "name, stage, opt_device, param_device",
    [
        ("zero1", 1, "none", "none"),
        ("zero2_offload", 2, "cpu", "none"),
        ("zero3", 3, "none", "none"),
        ("zero3_offload", 3, "cpu", "cpu"),
    ],
)
def test_names_build_the_right_strategy(
    name: str, stage: int, opt_device: str, param_device: str
) -> None:
    trainer = L.Trainer(strategy=name, accelerator="cpu", devices=1, logger=False)
    fabric = L.Fabric(strategy=name, accelerator="cpu", devices=1)
    for strategy, cls in ((trainer.strategy, ZeroStrategy), (fabric.strategy, FabricZeroStrategy)):
        assert type(strategy) is cls
        zc = strategy.config.zero_optimization
        assert (zc.stage, zc.offload_optimizer.device, zc.offload_param.device) == (
            stage,
            opt_device,
            param_device,
        )


@pytest.mark.parametrize("cls", [ZeroStrategy, FabricZeroStrategy])
def test_constructors_have_explicit_typed_arguments(cls: type) -> None:
    params = inspect.signature(cls.__init__).parameters
    assert not any(p.kind is p.VAR_KEYWORD or p.kind is p.VAR_POSITIONAL for p in params.values())
    for name in ("stage", "config", "offload_optimizer", "offload_parameters", "param_init_fn"):
        assert params[name].annotation != inspect.Parameter.empty


def test_hydra_target_builds_the_strategy() -> None:
    hydra_utils = pytest.importorskip("hydra.utils")
    omegaconf = pytest.importorskip("omegaconf")
    node = omegaconf.OmegaConf.create(
        {
            "_target_": "ds_strategy.lightning.ZeroStrategy",
            "stage": 3,
            "offload_optimizer": True,
            "config": {"zero_optimization": {"reduce_bucket_size": 1000}},
        }
    )
    strategy = hydra_utils.instantiate(node)
    zc = strategy.config.zero_optimization
    assert (strategy.stage, zc.reduce_bucket_size, zc.offload_optimizer.device) == (3, 1000, "cpu")


def test_config_from_a_file_and_arguments_override_it(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1, "reduce_bucket_size": 77}}))
    assert ZeroStrategy(config=str(path)).stage == 1
    strategy = ZeroStrategy(stage=3, config=path)
    assert (strategy.stage, strategy.config.zero_optimization.reduce_bucket_size) == (3, 77)
    assert ZeroStrategy().stage == 2  # no stage, no config: DeepSpeed's default


def test_auto_layout_keys_read_as_their_defaults() -> None:
    """A DeepSpeed config may say "auto" for the stages and tensor-parallel size, which resolve
    to 1: the strategy reads them so before its engine exists."""
    import torch

    cfg = {"zero_optimization": {"stage": 3}, "pipeline": {"stages": "auto"}}
    cfg["tensor_parallel"] = {"autotp_size": "auto"}
    for cls, loop in ((ZeroStrategy, L.Trainer), (FabricZeroStrategy, L.Fabric)):
        kwargs = {"logger": False} if loop is L.Trainer else {}
        strategy = loop(strategy=cls(config=cfg), accelerator="cpu", devices=1, **kwargs).strategy
        assert strategy.stage == 3
        assert strategy.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}
        with strategy.module_sharded_context():  # stage 3 without tensor parallelism: meta
            assert torch.nn.Linear(2, 2).weight.is_meta


def test_trainer_precision_becomes_the_zero_precision_plugin() -> None:
    trainer = L.Trainer(
        strategy="zero2", accelerator="cpu", devices=1, precision="bf16-mixed", logger=False
    )
    plugin = trainer.strategy.precision_plugin
    assert type(plugin) is ZeroPrecision  # not Lightning's autocast plugin: the engine casts
    assert plugin.precision == "bf16-mixed"


# -- the loop flags written into the config ----------------------------------------------------------


def test_loop_flags_fill_the_config() -> None:
    cfg = apply_loop_flags(
        base_config(None, 3, False, False),
        world_size=2,
        precision="bf16-true",
        accumulate=4,
        clip_val=0.5,
    )
    assert (cfg.gradient_accumulation_steps, cfg.gradient_clipping) == (4, 0.5)
    assert (cfg.bf16.enabled, cfg.bf16.master_weights, cfg.fp16.enabled) == (True, False, False)
    assert apply_loop_flags(ZeroConfig(), world_size=1, precision="16-mixed").fp16.enabled is True


def test_matching_or_auto_config_values_are_accepted() -> None:
    cfg = ZeroConfig.from_any(
        {"gradient_accumulation_steps": 2, "gradient_clipping": "auto", "train_batch_size": 16}
    )
    out = apply_loop_flags(cfg, world_size=2, accumulate=2, clip_val=1.0)
    assert (out.gradient_accumulation_steps, out.gradient_clipping) == (2, 1.0)
    kept = apply_loop_flags(ZeroConfig.from_any({"gradient_clipping": 3.0}), world_size=1)
    assert kept.gradient_clipping == 3.0  # the Trainer asked for no clipping: the config's stays


@pytest.mark.parametrize(
    "config, flags, fragment",
    [
        ({"gradient_accumulation_steps": 4}, {"accumulate": 2}, "accumulate_grad_batches=4"),
        ({"gradient_clipping": 2.0}, {"clip_val": 1.0}, "gradient_clip_val=2.0"),
        ({}, {"clip_val": 1.0, "clip_algorithm": "value"}, "gradient_clip_algorithm='norm'"),
        ({"fp16": {"enabled": True}}, {"precision": "bf16-mixed"}, "fp16.enabled to false"),
        ({}, {"precision": "64-true"}, "'32-true'"),
    ],
)
def test_contradictions_name_the_value_to_change(
    config: dict[str, Any], flags: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(ValueError, match="Trainer") as err:
        apply_loop_flags(ZeroConfig.from_any(config), world_size=2, **flags)
    assert fragment in str(err.value)


# -- one real process: precision in the engine, errors from fit() ------------------------------------


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("single_process")
    run_script("single_process.py", out, ranks=1)
    return json.loads((out / "results.json").read_text())


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "flag, dtype, master, scaled",
    [
        ("32-true", "torch.float32", False, False),
        ("bf16-mixed", "torch.bfloat16", True, False),
        ("bf16-true", "torch.bfloat16", False, False),
        ("16-true", "torch.float16", True, True),
    ],
)
@pytest.mark.launcher
def test_trainer_precision_reaches_the_engine(
    single: dict[str, Any], flag: str, dtype: str, master: bool, scaled: bool
) -> None:
    res = single["precision"][flag]
    assert (res["param_dtype"], res["master_weights"]) == (dtype, master)
    assert (res["loss_scale"] > 1.0) == scaled
    assert res["steps"] == 2 and res["finite"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "name, devices", [("zero2_offload", ["cpu", "none"]), ("zero3_offload", ["cpu", "cpu"])]
)
@pytest.mark.launcher
def test_offload_names_train(single: dict[str, Any], name: str, devices: list[str]) -> None:
    res = single["precision"][name]
    assert res["offload"] == devices
    assert res["steps"] == 2 and res["finite"]


@pytest.mark.timeout(300)
@pytest.mark.launcher
def test_fabric_precision_reaches_the_engine(single: dict[str, Any]) -> None:
    assert single["precision"]["fabric_bf16-mixed"]["param_dtype"] == "torch.bfloat16"


@pytest.mark.timeout(300)
@pytest.mark.launcher
def test_several_optimizers_under_automatic_optimization_get_lightnings_own_error(
    single: dict[str, Any],
) -> None:
    message = single["errors"]["two_optimizers_automatic"]
    assert "only supported with manual optimization" in message, message


@pytest.mark.parametrize(
    "case, fragments",
    [
        ("double", ["precision='64-true'", "'32-true'"]),
        ("clip_value", ["gradient_clip_algorithm='value'", "gradient_clip_algorithm='norm'"]),
        (
            "accumulate_contradiction",
            ["gradient_accumulation_steps=4", "accumulate_grad_batches=4"],
        ),
        (
            "batch_size_contradiction",
            ["imply gradient_accumulation_steps=8", "accumulate_grad_batches=8"],
        ),
        ("clip_contradiction", ["gradient_clipping=2.0", "Trainer(gradient_clip_val=2.0)"]),
        (
            "two_optimizers",
            ["TwoOptimizers.body holds parameters of optimizers [0, 1]", "one submodule per"],
        ),
        ("file_checkpoint", ["plain.ckpt", "directories", "load_state_dict"]),
        ("no_optimizer", ["(configure_optimizers) got no optimizer", "one per model"]),
        ("fabric_clip_value", ["clip_val", "max_norm"]),
        ("fabric_double", ["Fabric(precision='64-true')"]),
    ],
)
@pytest.mark.launcher
def test_misconfiguration_fails_clearly(
    single: dict[str, Any], case: str, fragments: list[str]
) -> None:
    message = single["errors"][case]
    assert message.startswith("ValueError"), message
    for fragment in fragments:
        assert fragment in message, message
