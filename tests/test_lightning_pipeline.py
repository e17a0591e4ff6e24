"""ZeroStrategy with a pipeline config: a real 2-process Trainer (2 stages x 1 data-parallel
rank) against plain PyTorch on the same batches."""

from __future__ import annotations

from typing import Any

import pytest

from tests.lightning_scripts.launch import max_diff, run_for_results

# launcher: the Trainer runs as a 2-process script
pytestmark = pytest.mark.launcher


@pytest.fixture(scope="module")
def pipe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_for_results("pipeline.py", tmp_path_factory.mktemp("lightning_pipeline"))


def test_pipeline_fit_matches_plain_training(pipe: dict[str, Any]) -> None:
    assert max_diff(pipe["weights"], pipe["ref_weights"]) <= 2e-5
    assert max_diff(pipe["file"], pipe["ref_weights"]) <= 2e-5  # save_consolidated
    # and the module trains as a plain LightningModule under another strategy
    assert max_diff(pipe["single_weights"], pipe["ref_weights"]) <= 2e-5


def test_pipeline_eval_and_checkpoint(pipe: dict[str, Any]) -> None:
    assert pipe["val"] == pytest.approx(pipe["ref_val"], rel=1e-5)
    assert pipe["fresh_val"] == pytest.approx(pipe["ref_val"], rel=1e-5)


def test_pipeline_samples_by_data_parallel_rank(pipe: dict[str, Any]) -> None:
    # two ranks, two stages: one data-parallel replica, whose stages read the same samples
    assert pipe["sampler"] == {"num_replicas": 1, "rank": 0}
    assert pipe["stage"] == 0  # rank 0 runs the first stage


def test_pipeline_refuses_trainer_accumulation(pipe: dict[str, Any]) -> None:
    err = pipe["accumulate_error"]
    assert err is not None and "accumulate_grad_batches=2" in err


@pytest.mark.parametrize("flag", ["bf16-mixed", "fp16-config"])
def test_pipeline_trains_under_lightning_mixed_precision(pipe: dict[str, Any], flag: str) -> None:
    got = pipe[flag]
    assert got["enabled"] == ((True, False) if flag == "bf16-mixed" else (False, True))
    assert str(got["compute"]) == ("torch.bfloat16" if flag == "bf16-mixed" else "torch.float16")
    assert got["skipped"] == 0  # fp16's loss scale starts low enough not to overflow
    # fp32 master weights: the validation loss of fp32 training within 2%
    assert got["val"] == pytest.approx(pipe["ref_val"], rel=0.02)
    assert got["val"] != pytest.approx(pipe["ref_val"], rel=1e-6)  # it did compute in 16 bits
