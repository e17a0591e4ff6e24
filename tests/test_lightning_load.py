"""``LightningModule.load_from_checkpoint`` on what ``Trainer(strategy="zero3")`` saves: the
sharded checkpoint directory itself (consolidated in memory, in this one process, with no
process group), and the file ``ds-strategy consolidate`` writes from it.

``tests/lightning_scripts/load_from_checkpoint.py`` trains and saves on 2 ranks.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import ds_strategy
from ds_strategy.cli import main

pytest.importorskip("lightning")

import lightning  # noqa: E402

from tests.lightning_scripts.launch import max_diff, run_for_results  # noqa: E402
from tests.lightning_scripts.load_from_checkpoint import HParamNet  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.launcher]

HPARAMS = {"hidden": 12, "lr": 0.02}  # what the script built its module with


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_for_results("load_from_checkpoint.py", tmp_path_factory.mktemp("lightning_load"))


def _check_loaded(model: HParamNet, saved: dict[str, Any]) -> None:
    assert dict(model.hparams) == HPARAMS == saved["hparams"]
    assert model.head.in_features == 12  # built from the saved hyper-parameters, not defaults
    assert max_diff(model.state_dict(), saved["weights"]) == 0.0
    assert model.scale.item() == 0.5  # the buffer as the fit left it


def test_load_from_checkpoint_reads_the_sharded_directory(saved: dict[str, Any]) -> None:
    """The directory trainer.save_checkpoint wrote on 2 ranks under ZeRO-3 loads in one
    process: the trained weights and buffer, the module built from its hyper-parameters;
    map_location places the weights as torch.load would."""
    directory = saved["out"] / "model.ckpt"
    assert directory.is_dir()
    _check_loaded(HParamNet.load_from_checkpoint(directory), saved)
    _check_loaded(HParamNet.load_from_checkpoint(str(directory), map_location="cpu"), saved)
    from ds_strategy.lightning._load_from_checkpoint import read_lightning_directory

    on_meta = read_lightning_directory(directory, map_location=torch.device("meta"))
    assert {t.device.type for t in on_meta["state_dict"].values()} == {"meta"}
    by_dict = read_lightning_directory(directory, map_location={"cpu": "meta"})
    assert {t.device.type for t in by_dict["state_dict"].values()} == {"meta"}


def test_consolidate_writes_a_file_load_from_checkpoint_reads(
    saved: dict[str, Any], tmp_path: Path
) -> None:
    """ds-strategy consolidate of a Lightning checkpoint to a .ckpt file keeps Lightning's
    entries, the weights under state_dict with the module's own names, and no optimizer
    state; --plain-weights writes the weights alone."""
    directory, out = saved["out"] / "model.ckpt", tmp_path / "model.ckpt"
    assert main(["consolidate", str(directory), str(out)]) == 0
    checkpoint = torch.load(out, weights_only=True)
    assert checkpoint["pytorch-lightning_version"] == lightning.__version__
    assert checkpoint["hyper_parameters"] == HPARAMS
    assert checkpoint["global_step"] == 2
    assert "optimizer_states" not in checkpoint
    assert sorted(checkpoint["state_dict"]) == sorted(HParamNet().state_dict())
    _check_loaded(HParamNet.load_from_checkpoint(out), saved)

    plain = ds_strategy.consolidate(directory, tmp_path / "plain.pt", plain_weights=True)
    assert max_diff(torch.load(plain, weights_only=True), saved["weights"]) == 0.0


def test_a_foreign_or_damaged_directory_is_an_error_naming_it(
    saved: dict[str, Any], tmp_path: Path
) -> None:
    """A directory ZeroStrategy did not save, and one with a damaged shard file: errors that
    name the directory (the file), never IsADirectoryError or wrong weights."""
    foreign = tmp_path / "foreign.ckpt"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(FileNotFoundError, match=f"{foreign}: load_from_checkpoint.*ZeroStrategy"):
        HParamNet.load_from_checkpoint(foreign)

    damaged = tmp_path / "damaged.ckpt"
    shutil.copytree(saved["out"] / "model.ckpt", damaged)
    shard = damaged / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ds_strategy.CheckpointError, match=f"{shard}: truncated"):
        HParamNet.load_from_checkpoint(damaged)


def test_the_reader_is_wrapped_once() -> None:
    """Registering again (each import path of ours does) keeps one wrapper around
    Lightning's own reader."""
    from lightning.fabric.utilities import cloud_io
    from lightning.pytorch.core import saving

    from ds_strategy._lightning_hook import register_strategies

    register_strategies()
    register_strategies()
    assert saving.pl_load._ds_strategy_wraps is cloud_io._load
