"""``lightning.Fabric`` with the ZeRO strategy on 2 CPU processes (gloo), against ``ddp``:
the same loop (``no_backward_sync`` accumulation, ``clip_gradients``, a user-stepped lr
scheduler), ``fabric.save``/``fabric.load`` resume, and ``fabric.init_module()``; and a GAN
set up as two models and as one model with two optimizers."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.lightning_scripts.launch import max_diff, run_for_results

pytest.importorskip("lightning")

TOL = 2e-5
# launcher: Fabric runs as a 2-process script
pytestmark = [pytest.mark.timeout(300), pytest.mark.launcher]


@pytest.fixture(scope="module")
def fabric_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_for_results("fabric_parity.py", tmp_path_factory.mktemp("fabric_parity"))


def test_fabric_splits_each_sequence_over_the_ranks(fabric_runs: dict[str, Any]) -> None:
    """``sequence_parallel_size=2`` through Fabric's strategy: the same losses and weights as
    one process on the whole sequences (the key bias left out: see ``tests/tp_common.py``)."""
    from tests.test_tensor_parallel import key_bias
    from tests.tp_common import gpt, loss_of, tokens

    model = gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(4):
        loss = loss_of(model, tokens()[4 * step : 4 * step + 4])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    got = fabric_runs["split_sequences"]
    assert got["losses"] == pytest.approx(losses, abs=1e-5)
    for name, want in model.state_dict().items():
        diff = (got["weights"][name] - want).abs()
        if name.endswith("qkv.bias"):
            diff = diff[~key_bias(diff)]
        assert diff.max() <= 2e-5, name


@pytest.mark.parametrize("name, stage", [("zero1", 1), ("zero3", 3)])
def test_fabric_matches_ddp(fabric_runs: dict[str, Any], name: str, stage: int) -> None:
    ddp, zero = fabric_runs["ddp"], fabric_runs[name]
    assert zero["stage"] == stage  # "zero1" came from Fabric's registry
    assert max_diff(zero["weights"], ddp["weights"]) <= TOL
    assert zero["lr"] == pytest.approx(ddp["lr"])


def test_clip_gradients_returns_the_global_norm(fabric_runs: dict[str, Any]) -> None:
    ddp = fabric_runs["ddp"]["norms"]
    assert max(ddp) > 1.0 > min(ddp)  # max_norm=1.0 clipped some steps, not all
    for name in ("zero1", "zero3"):
        assert fabric_runs[name]["norms"] == pytest.approx(ddp, rel=1e-5)


def test_a_compiled_model_trains_as_the_eager_one(fabric_runs: dict[str, Any]) -> None:
    """fabric.setup(torch.compile(model)) under ZeRO-3 with every weight sharded: Fabric
    compiles what the strategy built, the gathers run eagerly between the graphs, and the
    weights end where the eager run's do."""
    compiled, eager = fabric_runs["zero3_compiled"], fabric_runs["zero3"]
    assert compiled["graphs"] > 0 and eager["graphs"] == 0
    assert max_diff(compiled["weights"], eager["weights"]) <= 1e-6
    assert compiled["norms"] == pytest.approx(eager["norms"], rel=1e-5)


def test_zero3_shards_under_fabric(fabric_runs: dict[str, Any]) -> None:
    assert fabric_runs["zero3"]["local_numel"] == 0
    assert fabric_runs["zero1"]["local_numel"] == fabric_runs["ddp"]["local_numel"]


def test_fabric_save_load_resumes_exactly(fabric_runs: dict[str, Any]) -> None:
    """fabric.save after epoch 0 (a directory), fabric.load into a fresh Fabric and a
    perturbed model: model, optimizer, scheduler and the plain 'epoch' entry come back."""
    assert fabric_runs["ckpt_is_dir"]
    resumed, whole = fabric_runs["resume3"], fabric_runs["zero3"]
    assert resumed["epoch"] == 0
    assert max_diff(resumed["weights"], whole["weights"]) <= TOL
    assert resumed["lr"] == pytest.approx(whole["lr"])
    assert resumed["norms"] == pytest.approx(whole["norms"][-len(resumed["norms"]) :], rel=1e-5)


def test_fabric_init_module_on_meta(fabric_runs: dict[str, Any]) -> None:
    assert fabric_runs["init_module_device"] == "meta"
    weights = fabric_runs["init_module_weights"]
    assert weights["body.2.weight"].shape == (32, 32)
    assert all(
        bool(torch.isfinite(v).all()) and v.abs().sum() > 0
        for k, v in weights.items()
        if "weight" in k
    )


@pytest.fixture(scope="module")
def gan_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_for_results("fabric_gan.py", tmp_path_factory.mktemp("fabric_gan"))


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("shape", ["two models", "one model, two optimizers"])
def test_a_gan_matches_ddp_and_resumes_from_one_save(
    gan_runs: dict[str, Any], stage: int, shape: str
) -> None:
    """fabric.setup(generator, opt_g) and fabric.setup(discriminator, opt_d), or
    fabric.setup(gan, opt_g, opt_d): an engine per model or per optimizer; the generator's
    loss through the discriminator adds nothing to its next step. One fabric.save of both
    models and optimizers half-way, loaded into a fresh set-up, finishes the same run."""
    one = shape.startswith("one")
    zero = gan_runs[f"zero{stage}" + ("_one_model" if one else "")]
    assert zero["engines"] == [stage, stage]
    assert max_diff(zero["weights"], gan_runs["ddp"]["weights"]) <= 2e-5
    assert max_diff(zero["resumed"], zero["weights"]) <= 2e-5
    assert zero["resumed_step"] == 3  # the plain entry travelled with the models
    ckpt = gan_runs["out"] / f"{stage}_{one}"
    names = ["model.optimizer_0", "model.optimizer_1"] if one else ["d", "g"]
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(["engines.json", *names])
    if not one:
        assert "fabric.backward(loss, model=model)" in zero["no_model"]
