"""A checkpoint that does not fit the job loading it is refused or said, never taken in
silently: another optimizer's state, a buffer of another shape, a save inside a gradient
accumulation window; and a write the file-size limit refuses names the path."""

from __future__ import annotations

import resource
import signal
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import ds_strategy
from ds_strategy.core.warnings import CheckpointWarning


class WithBuffer(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def _engine(
    opt: type[torch.optim.Optimizer] = torch.optim.AdamW, config: dict | None = None, width: int = 4
) -> ds_strategy.ZeroEngine:
    torch.manual_seed(0)
    model = WithBuffer(width)
    return ds_strategy.initialize(model, opt(model.parameters(), lr=1e-2), config or {})


def _step(engine: ds_strategy.ZeroEngine) -> None:
    engine.backward(engine(torch.randn(2, 4)).square().mean())
    engine.step()


def test_another_optimizers_state_is_refused_naming_both(tmp_path: Path) -> None:
    """AdamW's state into an SGD engine would hand SGD AdamW's lr and weight decay and leave
    its momentum empty: refused, naming both classes and the way to take the weights alone."""
    adamw = _engine(torch.optim.AdamW)
    _step(adamw)
    adamw.save_checkpoint(tmp_path / "ckpt")
    sgd = _engine(torch.optim.SGD)
    with pytest.raises(ds_strategy.CheckpointError, match=r"AdamW.*this engine's is .*SGD") as e:
        sgd.load_checkpoint(tmp_path / "ckpt")
    assert "load_optimizer=False" in str(e.value)
    assert sgd.optimizer.param_groups[0]["weight_decay"] == 0  # nothing was taken in
    sgd.load_checkpoint(tmp_path / "ckpt", load_optimizer=False)
    assert torch.equal(sgd.full_state_dict()["lin.weight"], adamw.full_state_dict()["lin.weight"])
    adam = _engine(torch.optim.Adam)  # the same state and hyper-parameters: it carries over
    adam.load_checkpoint(tmp_path / "ckpt")
    assert adam.global_steps == 1


def test_a_buffer_of_another_shape_is_a_checkpoint_error(tmp_path: Path) -> None:
    """Not torch's CheckpointException (a BaseException that ``except Exception`` misses)."""
    _engine(width=4).save_checkpoint(tmp_path / "ckpt")
    wider = _engine(width=6)
    with pytest.raises(ds_strategy.CheckpointError, match=r"buffer 'scale' has shape \[4\]"):
        wider.load_checkpoint(tmp_path / "ckpt")


def test_a_save_inside_an_accumulation_window_is_said_at_save_and_at_load(tmp_path: Path) -> None:
    """Micro-step 5 of accumulation 2: one micro-batch's gradients are not in the
    checkpoint. Both the save and the load say so; a save at a boundary says nothing."""
    config = {"gradient_accumulation_steps": 2}
    engine = _engine(config=config)
    for _ in range(4):
        _step(engine)
    with warnings.catch_warnings(record=True) as at_boundary:
        warnings.simplefilter("always")
        engine.save_checkpoint(tmp_path / "boundary")
        _engine(config=config).load_checkpoint(tmp_path / "boundary")
    assert not [w for w in at_boundary if issubclass(w.category, CheckpointWarning)]
    _step(engine)  # micro-step 5: half a window
    with pytest.warns(CheckpointWarning, match="saving a checkpoint 1 micro-batch"):
        engine.save_checkpoint(tmp_path / "inside")
    with pytest.warns(CheckpointWarning, match="loaded a checkpoint 1 micro-batch"):
        _engine(config=config).load_checkpoint(tmp_path / "inside")


def test_a_write_the_file_size_limit_refuses_names_the_path_and_the_limit(tmp_path: Path) -> None:
    engine = _engine()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # as Python starts anyway
    resource.setrlimit(resource.RLIMIT_FSIZE, (512, hard))
    try:
        with pytest.raises(ds_strategy.CheckpointWriteError) as e:
            engine.save_checkpoint(tmp_path / "ckpt")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    message = str(e.value)
    assert "file-size limit" in message and str(tmp_path / "ckpt") in message
    assert e.value.errno == 27  # EFBIG
    engine.save_checkpoint(tmp_path / "ckpt")  # with the limit lifted, the save succeeds
