"""``lightning.Trainer`` with several optimizers under ``ZeroStrategy`` (one engine per
optimizer, manual optimization): a GAN against ``ddp_find_unused_parameters_true`` on 2 CPU
processes, and its checkpoint resumed in one process under another stage.

``tests/lightning_scripts/trainer_gan.py`` runs the fits; see its docstring for the loops.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.lightning_scripts.launch import max_diff, run_for_results, run_script

pytest.importorskip("lightning")

TOL = 2e-5
pytestmark = [pytest.mark.timeout(300), pytest.mark.launcher]


@pytest.fixture(scope="module")
def gan(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("trainer_gan")
    results = run_for_results("trainer_gan.py", out)
    run_script("trainer_gan.py", out, args=("resume",), ranks=1)
    results["resumed"] = torch.load(out / "resumed.pt", weights_only=False)
    return results


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_gan_with_two_optimizers_matches_ddp(gan: dict[str, Any], stage: int) -> None:
    """toggle_optimizer, the discriminator accumulating two batches by hand and clipped, a
    scheduler per optimizer, a frozen submodule: three engines, DDP's weights and counters."""
    zero, ddp = gan[f"zero{stage}"], gan["ddp"]
    assert zero["engines"] == 3  # generator, discriminator, the frozen prior
    assert max_diff(zero["weights"], ddp["weights"]) <= TOL
    assert zero["global_step"] == ddp["global_step"] == 12  # 8 generator + 4 discriminator steps
    assert zero["before_steps"] == ddp["before_steps"] == 12  # the hook before each step
    assert zero["lr"] == pytest.approx(ddp["lr"])
    assert zero["val_d"] == pytest.approx(ddp["val_d"], rel=1e-5)


def test_offload_of_every_engine_matches_ddp(gan: dict[str, Any]) -> None:
    """ZeRO-3 with parameters and optimizer state offloaded to CPU, for each optimizer."""
    assert max_diff(gan["zero3_offload"]["weights"], gan["ddp"]["weights"]) <= TOL
    assert gan["zero3_offload"]["offloaded"] == [("cpu", "cpu")] * 3


def test_without_toggling_gradients_add_up_until_zero_grad_as_under_ddp(
    gan: dict[str, Any],
) -> None:
    """The generator's loss reaches the discriminator's parameters; its zero_grad() drops
    that before the discriminator's own backward, on the engine as on DDP's module."""
    assert max_diff(gan["zero3_plain"]["weights"], gan["ddp_plain"]["weights"]) <= TOL
    # the two loops differ (accumulation, toggling): each comparison means something
    assert max_diff(gan["ddp_plain"]["weights"], gan["ddp"]["weights"]) > 1e-2


def test_bf16_matches_ddp_bf16_and_fp16_needs_one_loss_scale_per_backward(
    gan: dict[str, Any],
) -> None:
    bf16_gap = max_diff(gan["zero3_bf16"]["weights"], gan["ddp_bf16"]["weights"])
    precision_gap = max_diff(gan["ddp_bf16"]["weights"], gan["ddp"]["weights"])
    assert bf16_gap <= 2e-3 and bf16_gap < precision_gap / 10, (bf16_gap, precision_gap)
    # fp16 with toggling: each backward reaches one engine and its loss scale
    assert max_diff(gan["zero2_fp16"]["weights"], gan["ddp"]["weights"]) <= 2e-3
    assert "toggle_optimizer" in gan["fp16_untoggled"] and "own loss scale" in gan["fp16_untoggled"]


def test_resumed_at_another_world_size_and_stage_ends_where_the_run_ends(
    gan: dict[str, Any],
) -> None:
    """The ZeRO-3, 2-process run's epoch-0 checkpoint (every engine under one commit point)
    resumed by one process under ZeRO-2 with the global batch unchanged."""
    resumed, zero3 = gan["resumed"], gan["zero3"]
    assert max_diff(resumed["weights"], zero3["weights"]) <= TOL
    assert resumed["global_step"] == zero3["global_step"]
    assert resumed["lr"] == pytest.approx(zero3["lr"])  # both schedulers restored
    ckpt = next((gan["out"] / "zero3" / "ckpt").glob("epoch=0-*"))
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "engines.json",
        "frozen",
        "optimizer_0",
        "optimizer_1",
    ]


def test_the_checkpoint_of_several_engines_validates_and_consolidates(gan: dict[str, Any]) -> None:
    """trainer.validate(ckpt_path=...) reads every engine's part into one evaluation engine;
    ds_strategy.consolidate writes one file with every submodule's weights."""
    resumed, zero3 = gan["resumed"], gan["zero3"]
    assert resumed["validated"]["val_d"] == pytest.approx(zero3["val_d"], rel=1e-5)
    assert max_diff(resumed["consolidated"], zero3["weights"]) == 0.0


# -- errors that name the fix (one process, no launcher) ----------------------------------------


def test_an_optimizer_over_part_of_a_submodule_is_refused_naming_the_fix() -> None:
    from ds_strategy.core.several import split_by_optimizer

    module = nn.Module()
    module.a = nn.Linear(2, 2)
    module.b = nn.Linear(2, 2)
    module.frozen = nn.Linear(2, 2).requires_grad_(False)
    opts = [torch.optim.SGD(module.a.parameters(), lr=1), torch.optim.SGD(module.b.parameters())]
    assert split_by_optimizer(module, opts) == ([["a"], ["b"]], ["frozen"])
    mixed = [torch.optim.SGD([module.a.weight], lr=1), torch.optim.SGD([module.a.bias], lr=1)]
    with pytest.raises(ValueError, match=r"Module.a holds parameters of optimizers \[0, 1\]"):
        split_by_optimizer(module, mixed)
    shared = [torch.optim.SGD(module.a.parameters(), lr=1)] * 2
    with pytest.raises(ValueError, match="in optimizers 0 and 1"):
        split_by_optimizer(module, shared)
    module.scale = nn.Parameter(torch.ones(1))
    with pytest.raises(ValueError, match=r"holds the parameters \['scale'\] itself"):
        split_by_optimizer(module, opts)
