"""The Hydra recipes: every preset composes into a valid engine config, a misspelt override
fails naming the key, and both recipes train for real on two CPU processes."""

from __future__ import annotations

import ast
import itertools
import os
import re
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

import ds_strategy

from .distributed import run_command

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ds_strategy.config.presets import PRECISIONS, preset_names  # noqa: E402
from recipes.schema import (  # noqa: E402
    CONF_DIR,
    engine_config,
    lightning_precision,
    precision_name,
    register,
)

register()


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


@pytest.fixture(scope="module")
def hydra_conf():  # type: ignore[no-untyped-def]
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        yield


@pytest.mark.slow
def test_every_preset_combination_composes(hydra_conf: None) -> None:
    strategies, precisions = preset_names(), PRECISIONS
    assert {"zero1", "zero2", "zero3", "zero1_tp2"} <= set(strategies)
    assert set(precisions) == {"fp32", "bf16", "fp16"}
    others = {g: group_options(g) for g in ("model", "data", "trainer")}
    assert all(len(options) >= 2 for options in others.values())
    # Every strategy x precision preset; the other groups' options each in one of them.
    combos = list(itertools.product(sorted(strategies), sorted(precisions)))
    picks = [
        {g: options[i % len(options)] for g, options in others.items()} for i in range(len(combos))
    ]
    assert all(
        {p[g] for p in picks} == set(options) for g, options in others.items()
    )  # every option of every group is composed at least once
    for (s, p), pick in zip(combos, picks, strict=True):
        cfg = compose(
            "config",
            overrides=[f"strategy={s}", f"precision={p}"] + [f"{g}={o}" for g, o in pick.items()],
        )
        zero = engine_config(cfg)
        preset = ds_strategy.load_config(s)  # the preset by its name
        assert zero.zero_optimization == preset.zero_optimization, (s, p)
        assert precision_name(zero) == p, (s, p)
        assert cfg.model.d % cfg.model.heads == 0
        assert (ROOT / cfg.data.path).is_file()
        assert cfg.model == compose("config", overrides=[f"model={pick['model']}"]).model


def test_overrides_reach_the_engine_config(hydra_conf: None) -> None:
    cfg = compose(
        "config",
        overrides=[
            "strategy=zero2",
            "precision=bf16",
            "strategy.zero_optimization.reduce_bucket_size=5e7",
            "strategy.wall_clock_breakdown=true",
            "trainer.devices=3",
        ],
    )
    zero = engine_config(cfg)
    assert zero.zero_optimization.stage == 2
    assert zero.zero_optimization.reduce_bucket_size == 50_000_000
    assert zero.wall_clock_breakdown is True
    assert lightning_precision(zero) == "bf16-mixed"
    assert cfg.trainer.devices == 3


@pytest.mark.parametrize(
    "override, key",
    [
        ("trainer.max_stepz=3", "trainer.max_stepz"),
        ("model.layerz=2", "model.layerz"),
        ("data.pathh=x.txt", "data.pathh"),
        ("strategy.zero_optimization.stgae=3", "strategy.zero_optimization.stgae"),
        ("strategy.bf16.enabeld=true", "strategy.bf16.enabeld"),
        ("trainer.max_steps=many", "max_steps"),
    ],
)
def test_typo_fails_naming_the_key(hydra_conf: None, override: str, key: str) -> None:
    with pytest.raises((ConfigCompositionException, ConfigKeyError, ValidationError)) as err:
        compose("config", overrides=[override])
    text = str(err.value) + str(err.value.__cause__ or "")
    assert key in text


@pytest.mark.parametrize(
    "override, message",
    [
        ("+trainer.max_stepz=3", "trainer.max_stepz: unknown key, did you mean trainer.max_steps?"),
        ("+strategy.zero_optimization.stgae=3", "zero_optimization.stgae: unknown key"),
    ],
)
def test_forced_unknown_key_fails_before_training(
    hydra_conf: None, override: str, message: str
) -> None:
    """``+key=value`` gets past composition; the recipes refuse it before building anything."""
    cfg = compose("config", overrides=[override])
    with pytest.raises(ValueError) as err:
        engine_config(cfg)
    assert message in str(err.value)


def test_unknown_preset_lists_the_options(hydra_conf: None) -> None:
    with pytest.raises(ConfigCompositionException) as err:
        compose("config", overrides=["strategy=zero9"])
    text = str(err.value)
    assert "zero9" in text and "zero3" in text


def _run(script: str, *overrides: str, tmp: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DS_STRATEGY_", "ACCELERATE_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, str(ROOT / "recipes" / script), *overrides, f"hydra.run.dir={tmp}"]
    return run_command(cmd, tmp, env, 240, script)


def _sample(out: str) -> str:
    """The generated sample rank 0 printed, as the string it is (printed as its repr, which
    quotes with ``"`` when it holds a ``'`` and escapes a generated newline)."""
    found = re.findall(r"^sample: (.*)$", out, re.M)
    assert len(found) == 1, out[-3000:]
    return str(ast.literal_eval(found[0]))


@pytest.mark.launcher
def test_lightning_recipe_trains_on_two_processes(tmp_path: Path) -> None:
    out = _run(
        "train.py",
        "trainer=smoke",
        "strategy=zero3",
        "precision=bf16",
        "strategy.wall_clock_breakdown=true",
        "strategy.steps_per_print=2",
        tmp=tmp_path,
    )
    for rank in (0, 1):
        assert re.search(rf"rank {rank}: stage 3, bf16-mixed, 4 steps", out), out[-3000:]
    sample = _sample(out)
    assert sample.startswith("ZeRO ") and len(sample) == len("ZeRO ") + 16, out[-3000:]
    # wall_clock_breakdown: printed on rank 0 at steps 2 and 4, and in the Trainer's logger.
    assert len(re.findall(r"\[wall_clock_breakdown\] step [24] ", out)) == 2, out[-3000:]
    (metrics,) = tmp_path.glob("lightning_logs/version_*/metrics.csv")
    header, *rows = metrics.read_text().splitlines()
    columns = header.split(",")
    for name in ("forward_ms", "backward_ms", "gather_ms", "reduce_ms", "all_gather_bytes"):
        assert f"wall_clock/{name}" in columns
    col = columns.index("wall_clock/gather_ms")
    assert sum(1 for r in rows if r.split(",")[col]) == 2


@pytest.mark.launcher
def test_accelerate_recipe_spawns_and_trains(tmp_path: Path) -> None:
    out = _run(
        "train_accelerate.py", "trainer=smoke", "strategy=zero2", "precision=fp32", tmp=tmp_path
    )
    for rank in (0, 1):
        assert f"rank {rank}: stage 2, fp32, 4 steps" in out, out[-3000:]
    losses = [float(x) for x in re.findall(r"step +\d+  loss ([0-9.]+)", out)]
    assert len(losses) == 4 and losses[-1] < losses[0], out[-3000:]
    assert _sample(out).startswith("ZeRO "), out[-3000:]


@pytest.mark.launcher
def test_tensor_parallel_preset_trains_on_two_processes(tmp_path: Path) -> None:
    """``strategy=zero1_tp2``: the two processes are one tensor-parallel pair (D=1 x T=2), so
    they read the same batches and report the same loss."""
    out = _run("train.py", "trainer=smoke", "strategy=zero1_tp2", "precision=fp32", tmp=tmp_path)
    losses = re.findall(r"rank [01]: stage 1, 32-true, 4 steps, final loss ([0-9.]+)", out)
    assert len(losses) == 2 and losses[0] == losses[1], out[-3000:]
    assert _sample(out).startswith("ZeRO "), out[-3000:]
