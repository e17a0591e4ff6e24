"""The building blocks of gradient compression: packed signs, error-compensated 1-bit
compression and its all-reduce, top-k selection with error feedback."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from ds_strategy.core.collectives import Comm
from ds_strategy.core.compression import (
    TopK,
    compress_signs,
    compressed_all_reduce,
    decompress_signs,
    pack_signs,
    unpack_signs,
)
from tests.distributed import run_ranks


@pytest.mark.parametrize("n", [1, 7, 8, 9, 64, 1001])
def test_signs_pack_eight_to_a_byte_and_come_back(n: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    x[0] = 0.0  # the sign of zero is +1
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n / 8)
    expected = torch.where(x >= 0, 1.0, -1.0)
    assert torch.equal(unpack_signs(packed, n), expected)
    assert int(pack_signs(torch.tensor([1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, 1.0]))) == 0x81


def test_sign_compression_keeps_what_it_loses_as_the_error() -> None:
    g = torch.Generator().manual_seed(0)
    x, error = torch.randn(64, generator=g), torch.randn(64, generator=g) * 0.1
    before = x + error
    packed, scale = compress_signs(x, error)
    sent = decompress_signs(packed, scale, 64)
    assert torch.allclose(sent + error, before, atol=1e-6)  # compensation: nothing lost
    assert scale.item() == pytest.approx(before.norm().item() / 8)  # rms: norm / sqrt(64)
    assert sent.norm().item() == pytest.approx(before.norm().item(), rel=1e-5)


def test_top_k_error_feedback_conserves_the_gradient() -> None:
    g = torch.Generator().manual_seed(1)
    topk = TopK(100, 0.05)
    sent_total, grad_total = torch.zeros(100), torch.zeros(100)
    for _ in range(6):
        grad = torch.randn(100, generator=g)
        grad_total += grad
        indices, values = topk.select(grad)
        assert indices.numel() == values.numel() == 5
        sent_total.index_add_(0, indices, values)
    # everything added was either sent or is still in the residual
    assert torch.allclose(sent_total + topk.residual, grad_total, atol=1e-5)
    assert topk.residual[indices].abs().max() == 0


def test_top_k_at_ratio_one_sends_everything_and_keeps_nothing() -> None:
    grad = torch.randn(10)
    indices, values = TopK(10, 1.0).select(grad)
    dense = torch.zeros(10).index_add_(0, indices, values)
    assert torch.equal(dense, grad)


def test_momentum_correction_masks_the_sent_entries() -> None:
    topk = TopK(4, 0.25, momentum=0.9)
    indices, values = topk.select(torch.tensor([0.1, -3.0, 0.2, 0.0]))
    assert indices.tolist() == [1] and values.tolist() == [-3.0]
    assert topk.velocity is not None and topk.velocity[1] == 0  # factor masking
    # the entries not sent keep their velocity: next step u = 0.9 u + g, v += u
    indices, values = topk.select(torch.zeros(4))
    assert indices.tolist() == [2] and values.item() == pytest.approx(0.2 + 0.9 * 0.2)


def _reduce(rank: int, world: int, steps: int) -> Any:
    comm = Comm()
    n = 8 * world * 64
    g = torch.Generator().manual_seed(rank)
    worker, server = torch.zeros(n), torch.zeros(n // world)
    sent, exact = torch.zeros(n), torch.zeros(n)
    for _ in range(steps):
        x = torch.randn(n, generator=g)
        out = compressed_all_reduce(x, worker, server, comm)
        mean = x.clone()
        torch.distributed.all_reduce(mean)
        sent += out
        exact += mean / world
    return {"sent": sent, "exact": exact, "worker": worker, "server": server, "comm": comm}


def test_compressed_all_reduce_is_the_mean_up_to_the_errors_it_keeps() -> None:
    world, steps = 2, 5
    results = run_ranks(_reduce, world, steps)
    # every rank gets the same result
    assert torch.equal(results[0]["sent"], results[1]["sent"])
    # what was applied plus what the workers and servers still hold is the exact sum of means
    held = sum(r["worker"] for r in results) / world + torch.cat([r["server"] for r in results])
    assert torch.allclose(results[0]["sent"] + held, results[0]["exact"], atol=1e-4)
    # bytes per step, scales included: at most 1/16 of an fp32 ring all-reduce's
    n = 8 * world * 64
    report = results[0]["comm"].take_report()
    dense = 2 * (world - 1) / world * n * 4
    assert report["total"] / steps <= dense / 16
    assert set(report) == {"onebit", "total"}
