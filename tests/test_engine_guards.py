"""Inputs that used to train nothing or fail late now fail at once, naming the problem."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import ds_strategy
from ds_strategy.core.offload.swap import check_nvme_path
from tests.distributed import run_ranks


def test_optimizer_over_another_models_parameters_is_refused() -> None:
    model, other = nn.Linear(4, 4), nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"holds 2 parameters and 0 of them belong"):
        ds_strategy.initialize(model, torch.optim.AdamW(other.parameters(), lr=1e-3), {})


def test_optimizer_holding_a_foreign_parameter_is_refused() -> None:
    model, other = nn.Linear(4, 4), nn.Linear(4, 4)
    opt = torch.optim.AdamW([*model.parameters(), other.weight], lr=1e-3)
    with pytest.raises(ValueError, match=r"holds 3 parameters and 2 of them belong"):
        ds_strategy.initialize(model, opt, {"zero_optimization": {"stage": 2}})


def test_optimizer_with_frozen_model_parameters_is_fine() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    engine = ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {})
    before = model[1].weight.detach().clone()
    engine.backward(engine(torch.randn(3, 4)).square().sum())
    engine.step()
    assert not torch.equal(before, model[1].weight.detach())


def test_model_without_trainable_parameters() -> None:
    model = nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters.*optimizer=None"):
        ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {})
    engine = ds_strategy.initialize(model, None, {"zero_optimization": {"stage": 3}})
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert torch.allclose(engine(x), x @ engine.full_state_dict()["weight"].T + model.bias)
    with pytest.raises(RuntimeError, match="built for evaluation"):
        engine.backward(engine(x).sum())


def test_latest_naming_a_missing_checkpoint_lists_the_complete_ones(tmp_path: Path) -> None:
    model = nn.Linear(4, 4)
    engine = ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {})
    engine.save_checkpoint(tmp_path, tag="step1")
    engine.save_checkpoint(tmp_path, tag="step2")
    (tmp_path / "latest").write_text("step9")
    with pytest.raises(FileNotFoundError, match=r"names 'step9'.*there: step1, step2\)"):
        engine.load_checkpoint(tmp_path)


def test_nvme_space_message_uses_a_readable_unit(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"5,000 bytes \(4\.9 KiB\)"):
        check_nvme_path(tmp_path / "missing", 5000, "ds_strategy.json", "offload_optimizer")
    with pytest.raises(FileNotFoundError, match=r"\(3\.0 GiB\)"):
        check_nvme_path(tmp_path / "missing", 3 * 2**30, "ds_strategy.json", "offload_optimizer")


def test_ranks_sharing_a_drive_are_checked_for_room_together(tmp_path: Path) -> None:
    """Two ranks of one machine swapping to one drive: each fits alone, both do not; the
    check counts both (each checking only its own need passed, then the drive filled up
    mid-build)."""
    from types import SimpleNamespace

    from ds_strategy.config import load_config
    from ds_strategy.core.offload.runtime import Offload

    free = shutil.disk_usage(tmp_path).free
    mine = free * 2 // 3  # fits alone
    check_nvme_path(tmp_path, mine, "ds_strategy.json", "offload_optimizer")
    cfg = load_config(
        {
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
            }
        }
    )
    peers = SimpleNamespace(world_size=2, all_gather_object=lambda obj: [obj, obj])
    offload = Offload.build(cfg, [], 0, peers)
    assert offload is not None
    sharing = offload._sharing(str(tmp_path), mine)
    assert sharing == (2 * mine, 2)
    with pytest.raises(OSError, match=r"for the 2 ranks of this machine that swap to this drive"):
        check_nvme_path(tmp_path, mine, "ds_strategy.json", "offload_optimizer", sharing)
    # a rank on another machine (or drive) is not counted
    elsewhere = SimpleNamespace(
        world_size=2, all_gather_object=lambda obj: [obj, (("other-host", obj[0][1]), obj[1])]
    )
    offload.comm = elsewhere
    assert offload._sharing(str(tmp_path), mine) == (mine, 1)
    check_nvme_path(tmp_path, mine, "ds_strategy.json", "offload_optimizer", (mine, 1))


# -- ranks that disagree fail together, naming the difference -------------------------------------


def disagreeing_worker(rank: int, world: int, what: str) -> str:
    torch.manual_seed(0)
    width = 8 if what == "model" and rank == 1 else 4
    model = nn.Sequential(nn.Linear(4, width), nn.Linear(width, 2))
    stage = 3 if what == "config" and rank == 1 else 2
    try:
        ds_strategy.initialize(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            {"zero_optimization": {"stage": stage}},
        )
    except ValueError as e:
        return str(e)
    return "built"


@pytest.mark.parametrize(
    "what, expected",
    [
        (
            "config",
            "rank 0 has config zero_optimization.stage = 2, rank 1 has config "
            "zero_optimization.stage = 3",
        ),
        ("model", "rank 0 has parameter 0.weight: shape [4, 4]"),
    ],
)
def test_ranks_with_different_configs_or_models_fail_together(what: str, expected: str) -> None:
    results = run_ranks(disagreeing_worker, 2, what, timeout=60)
    for message in results:  # every rank raised (none waits), with the same message
        assert expected in message, message
        assert "every rank must build the same model" in message


def test_nonfinite_skips_without_loss_scaling_stop_after_the_limit() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    engine = ds_strategy.initialize(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        {"max_consecutive_skipped_steps": 3, "bf16": {"enabled": True}},
    )
    before = engine.full_state_dict()
    x = torch.randn(2, 4)

    def step(loss_factor: float) -> None:
        engine.backward(engine(x).sum() * loss_factor)
        engine.step()

    step(float("nan"))
    step(float("nan"))
    step(1.0)  # a good step resets the count
    after_good = engine.full_state_dict()
    assert not torch.equal(after_good["weight"], before["weight"])
    step(float("inf"))
    step(float("nan"))
    with pytest.raises(FloatingPointError, match="3 optimizer steps in a row.*learning rate"):
        step(float("nan"))
    assert engine.skipped_steps == 5
    got = engine.full_state_dict()
    assert all(torch.equal(got[k], after_good[k]) for k in got)  # the last good step's
    with pytest.raises(ValueError, match="max_consecutive_skipped_steps"):
        ds_strategy.initialize(nn.Linear(2, 2), None, {"max_consecutive_skipped_steps": 0})
