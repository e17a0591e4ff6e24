"""``lightning.Trainer`` with ``ZeroStrategy`` on 2 CPU processes (gloo), against ``ddp``.

Each fixture runs one script from ``tests/lightning_scripts`` on 2 processes started at once
(``launch.py``, as torchrun would) with a timeout; the script saves what rank 0 saw and the tests compare.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.lightning_scripts.launch import max_diff, run_for_results

pytest.importorskip("lightning")

TOL = 2e-5
# launcher: the Trainer runs as a 2-process script
pytestmark = [pytest.mark.timeout(300), pytest.mark.launcher]


@pytest.fixture(scope="module")
def parity(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_for_results("trainer_parity.py", tmp_path_factory.mktemp("trainer_parity"))


@pytest.fixture(scope="module")
def features(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_for_results("trainer_features.py", tmp_path_factory.mktemp("trainer_features"))


# -- numerics -------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stage_matches_ddp(parity: dict[str, Any], stage: int) -> None:
    """Two epochs, accumulate_grad_batches=2, gradient_clip_val, SGD with momentum (scale-
    sensitive), two param groups and a per-step lr schedule: the same weights as DDP."""
    ddp, zero = parity["ddp"], parity[f"zero{stage}"]
    assert zero["engine_stage"] == stage
    assert max_diff(zero["weights"], ddp["weights"]) <= TOL
    assert zero["global_step"] == ddp["global_step"] == 8  # 64 samples / (4 x 2 ranks x 2)
    assert zero["lr"] == pytest.approx(ddp["lr"])  # the scheduler stepped once per step


def test_a_compiled_module_trains_as_the_eager_one(parity: dict[str, Any]) -> None:
    """trainer.fit(torch.compile(module)) under ZeRO-3 with every weight sharded: the same
    weights and clipped norms as the eager zero3 run, through compiled graphs; and so does
    the config's ``compile`` section given to ``ZeroStrategy``."""
    compiled, eager = parity["zero3_compiled"], parity["zero3"]
    assert compiled["graphs"] > 0
    assert max_diff(compiled["weights"], eager["weights"]) <= 1e-6
    assert compiled["norms"] == pytest.approx(eager["norms"], rel=1e-5)
    assert compiled["global_step"] == eager["global_step"]
    # ZeroStrategy(config={"compile": {...}}): the engine compiles unit by unit
    section = parity["zero3_config_compiled"]
    assert section["report"]["compiled_units"] == 2, section["report"]  # the body's Linears
    assert section["report"]["graphs"] > 0 and section["report"]["graph_breaks"] == 0
    assert max_diff(section["weights"], eager["weights"]) <= 1e-6
    assert section["norms"] == pytest.approx(eager["norms"], rel=1e-5)


def test_clipping_was_exercised(parity: dict[str, Any]) -> None:
    # the parity above only proves clipping if some steps clipped and others did not
    norms = parity["zero3"]["norms"]
    assert max(norms) > 1.5 > min(norms)


def test_zero3_really_shards(parity: dict[str, Any]) -> None:
    z3 = parity["zero3"]
    assert z3["local_numel"] == 0  # every parameter released between uses
    assert parity["zero2"]["local_numel"] == parity["ddp"]["local_numel"]
    full_bytes = 4 * parity["ddp"]["local_numel"]
    assert z3["memory"]["params"] <= full_bytes // 2 + 64  # this rank's half (plus padding)
    assert z3["memory"]["optimizer_state"] <= full_bytes // 2 + 64  # momentum: half as well


# -- checkpoints ----------------------------------------------------------------------------------


def test_resume_after_epoch_matches_uninterrupted(parity: dict[str, Any]) -> None:
    """A fresh Trainer and a perturbed fresh model resume from ModelCheckpoint's epoch-0
    directory: weights, optimizer (momentum), lr schedule and loop state come back."""
    resumed, whole = parity["resume3"], parity["zero3"]
    assert max_diff(resumed["weights"], whole["weights"]) <= TOL
    assert max_diff(resumed["weights"], parity["ddp"]["weights"]) <= TOL
    assert resumed["global_step"] == whole["global_step"]
    assert resumed["lr"] == pytest.approx(whole["lr"])


def test_resume_under_another_stage(parity: dict[str, Any]) -> None:
    resumed = parity["resume3as2"]  # a stage-3 checkpoint resumed with stage 2
    assert max_diff(resumed["weights"], parity["zero3"]["weights"]) <= TOL
    assert resumed["local_numel"] == parity["ddp"]["local_numel"]


def test_checkpoints_are_directories_and_top_k_deletes_them(parity: dict[str, Any]) -> None:
    assert parity["epoch_dirs"] == ["epoch=0.ckpt", "epoch=1.ckpt"]
    assert parity["epoch0_is_dir"]
    assert parity["rot_dirs"] == ["rot-epoch=1.ckpt"]  # save_top_k=1 removed epoch 0's dir
    assert not any(p.name.endswith((".tmp", ".old")) for p in (parity["out"] / "z3_rot").iterdir())


def test_consolidated_exports_match_ddp(parity: dict[str, Any]) -> None:
    ddp = parity["ddp"]["weights"]
    for name in ("zero1", "zero3"):  # torch.save and safetensors files
        assert max_diff(parity["files"][name], ddp) <= TOL


def test_weights_only_checkpoint_restores_weights(parity: dict[str, Any]) -> None:
    z3 = parity["zero3"]
    assert z3["val_weights_only"][0]["val_loss"] == pytest.approx(z3["val"][0]["val_loss"])


def test_fresh_trainer_evaluates_a_checkpoint(parity: dict[str, Any]) -> None:
    """A new Trainer and an untrained model (two param groups) validate from a full and from
    a weights-only checkpoint directory; fit refuses to resume from the weights-only one."""
    trained = parity["twogroups_val"][0]["val_loss"]
    assert parity["fresh_val"][0]["val_loss"] == pytest.approx(trained, rel=1e-6)
    assert parity["fresh_val_weights_only"][0]["val_loss"] == pytest.approx(trained, rel=1e-6)
    assert parity["saved_optimizer"] == [True, False]  # weights_only leaves optimizer state out
    err = parity["resume_weights_only_error"]
    assert err is not None and "weights only" in err and "twogroups_weights.ckpt" in err


def test_model_summary_counts_sharded_parameters(parity: dict[str, Any]) -> None:
    z3 = parity["zero3"]
    total, trainable, per_layer = z3["summary"]
    plain = z3["plain_counts"]
    assert z3["released"] < plain[""]  # the live parameters really are sharded/empty
    assert total == trainable == plain[""]
    assert per_layer == [plain[name] for name in z3["summary_names"]]


# -- evaluation loops -----------------------------------------------------------------------------


def test_eval_loops_under_zero3_match_ddp(parity: dict[str, Any]) -> None:
    """validate/test (with sync_dist logging) and predict after fit reuse the trained engine."""
    ddp, z3 = parity["ddp"], parity["zero3"]
    assert z3["val"][0]["val_loss"] == pytest.approx(ddp["val"][0]["val_loss"], rel=1e-5)
    assert z3["test"][0]["test_loss"] == pytest.approx(ddp["val"][0]["val_loss"], rel=1e-5)
    pred_ddp, pred_z3 = torch.cat(ddp["pred"]), torch.cat(z3["pred"])
    assert pred_z3.shape == pred_ddp.shape == (8, 1)  # this rank's half of 16 samples
    assert (pred_z3 - pred_ddp).abs().max() <= 1e-5


# -- model construction, attention, manual optimization, CLI ---------------------------------------


def test_configure_model_builds_on_meta_and_engine_materialises(features: dict[str, Any]) -> None:
    res = features["configured"]
    assert res["devices_seen"] == ["meta"]  # configure_model ran once, on the meta device
    assert res["local_numel"] == 0  # sharded after setup: no rank holds the whole model
    assert res["memory"]["params"] <= 4 * res["full_numel"] // 2 + 64
    assert res["last_loss"] < 0.5 * res["first_loss"]  # it trained
    rank0 = torch.load(features["out"] / "configured_rank0.pt")
    rank1 = torch.load(features["out"] / "configured_rank1.pt")
    assert max_diff(rank0, rank1) == 0.0  # one initialisation, shared by the ranks


def test_init_module_builds_on_meta(features: dict[str, Any]) -> None:
    res = features["init_module"]
    assert res["device_at_init"] == "meta"
    assert res["local_numel"] == 0
    assert res["finite"]
    assert res["val"][0]["val_loss"] < 10.0


def test_multihead_attention_trains_under_zero3_like_ddp(features: dict[str, Any]) -> None:
    """nn.MultiheadAttention's forward reads its out_proj weight without calling out_proj."""
    zero, ddp = features["attn_zero3"], features["attn_ddp"]
    assert zero["local_numel"] == 0
    assert max_diff(zero["weights"], ddp["weights"]) <= TOL


def test_manual_optimization_matches_ddp(features: dict[str, Any]) -> None:
    """manual_backward, clip_gradients, optimizer.step and a scheduler, by hand."""
    zero, ddp = features["manual_zero3"], features["manual_ddp"]
    assert zero["global_step"] == ddp["global_step"] == 16
    assert max_diff(zero["weights"], ddp["weights"]) <= TOL
    assert zero["train_loss"] == pytest.approx(ddp["train_loss"], rel=1e-5)


def test_lightning_cli_builds_the_strategy_from_yaml(features: dict[str, Any]) -> None:
    cli = features["cli"]
    assert (cli["module"], cli["strategy"]) == ("ds_strategy.lightning.strategy", "ZeroStrategy")
    assert cli["stage"] == 2
    assert cli["reduce_bucket_size"] == 1000  # the nested config reached the engine
    assert cli["global_step"] == 4  # 32 samples / (batch 4 x 2 ranks)
