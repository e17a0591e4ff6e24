"""On a CUDA device (tests marked ``gpu``, skipped where none is present): every stage, in one
process, trains to the weights of plain PyTorch on the same device, with the engine's
buffers and step on that device."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.loops import parity_config, train_engine, train_reference
from tests.models import ToyLM, batches

pytestmark = pytest.mark.gpu

STEPS, ACCUM, BATCH, CLIP = 6, 2, 8, 0.5


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_stage_trains_on_cuda_like_plain_pytorch(stage: int) -> None:
    torch.manual_seed(0)
    base = ToyLM().cuda()
    data = [b.cuda() for b in batches(STEPS, ACCUM, BATCH)]
    ref = train_reference(copy.deepcopy(base), "adamw", data, STEPS, ACCUM, CLIP)
    config = parity_config(stage, ACCUM, CLIP)
    engine = train_engine(copy.deepcopy(base), "adamw", config, data, 0, 1, STEPS)
    assert engine.device.type == "cuda"
    assert engine.global_steps == STEPS
    got = engine.full_state_dict()
    assert got.keys() == ref.keys()
    diff = max(float((got[k].cpu().float() - ref[k].cpu().float()).abs().max()) for k in ref)
    moved = max(float((ref[k] - base.state_dict()[k]).abs().max()) for k in ref)
    # TF32 and kernel choice differ between the two paths only in rounding; training moved
    # the weights by orders of magnitude more
    assert diff < 1e-4 and moved > 1e-2, (diff, moved)
