"""Inputs that used to train nothing or fail late now fail at once, naming the problem."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import ds_strategy
from ds_strategy.core.offload.swap import check_nvme_path


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
