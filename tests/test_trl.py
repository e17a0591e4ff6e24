"""TRL's trainers through ``ds_strategy.hf.zero``, and the error a plain Trainer gives for a
``DS_STRATEGY_*`` variable it would ignore.

One launch of ``tests/hf_scripts/trl_runs.py`` on two CPU processes runs ``SFTTrainer`` and
``DPOTrainer`` plainly (DDP) and through ``zero(...)`` at ZeRO stage 3, each loading a small
Llama by its directory's name, then ``zero(GRPOTrainer)``; the rest runs in this process, as a
world of one.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("trl")

from transformers import Trainer, TrainingArguments  # noqa: E402
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer  # noqa: E402

from ds_strategy.hf import ZeroTrainer, zero  # noqa: E402
from tests.distributed import free_port, run_command  # noqa: E402
from tests.hf_scripts.trl_runs import dpo_data, save_model_directory, sft_data  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "hf_scripts" / "trl_runs.py"
TOL = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trl_model") / "tiny-llama"
    save_model_directory(path)
    return path


@pytest.fixture(scope="module")
def runs(model_dir: Path) -> dict[str, Any]:
    out = model_dir.parent / "results.pt"
    head = ["-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DS_STRATEGY_", "ACCELERATE_"))}
    env.update(OMP_NUM_THREADS="1")
    args = [str(SCRIPT), "--model", str(model_dir), "--out", str(out)]
    run_command([sys.executable, *head, *args], ROOT, env, 300, SCRIPT.name)
    return torch.load(out, weights_only=False)


@pytest.mark.slow
@pytest.mark.launcher
def test_sft_through_zero3_logs_the_losses_of_plain_trl(runs: dict[str, Any]) -> None:
    plain, zero3 = runs["sft"]["plain"], runs["sft"]["zero3"]
    assert len(plain) == len(zero3) == 4
    assert plain[0] - plain[-1] > 0.1  # it trained
    assert zero3 == pytest.approx(plain, abs=TOL)


@pytest.mark.slow
@pytest.mark.launcher
def test_dpo_through_zero3_logs_the_losses_of_plain_trl(runs: dict[str, Any]) -> None:
    plain, zero3 = runs["dpo"]["plain"]["loss"], runs["dpo"]["zero3"]["loss"]
    assert len(plain) == len(zero3) == 4
    assert plain[0] - plain[-1] > 0.05  # it trained, against a reference that did not move
    assert zero3 == pytest.approx(plain, abs=TOL)


@pytest.mark.slow
@pytest.mark.launcher
def test_dpo_reference_model_is_sharded_at_stage3(runs: dict[str, Any]) -> None:
    """Each of the 2 ranks holds half the reference model's bytes (persistence threshold 0),
    none of them in the parameters themselves; the plain run holds it whole."""
    dpo = runs["dpo"]
    whole = dpo["whole_bytes"]
    assert dpo["plain"]["ref_bytes"] == {"in_parameters": whole, "in_shards": 0}
    assert dpo["zero3"]["ref_type"] == "ZeroEngine"
    for held in dpo["zero3"]["ref_bytes_per_rank"]:
        assert held["in_parameters"] == 0
        assert whole // 2 <= held["in_shards"] <= whole // 2 + 64  # at most a little padding
    assert not dpo["zero3"]["ref_requires_grad"]
    # TRL loads the policy and the reference whole on every rank; through zero(), both are
    # built on the meta device and read into their shards (never whole anywhere)
    assert dpo["plain"]["whole_loads"] == 2 and dpo["zero3"]["whole_loads"] == 0


@pytest.mark.slow
@pytest.mark.launcher
def test_sharded_reference_log_probs_equal_the_whole_ones(runs: dict[str, Any]) -> None:
    whole, sharded = runs["dpo"]["plain"]["ref_log_probs"], runs["dpo"]["zero3"]["ref_log_probs"]
    assert whole.abs().min() > 0.1  # real log-probs of every scored token
    torch.testing.assert_close(sharded, whole, rtol=0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.launcher
def test_grpo_generates_and_trains_with_a_sharded_reference(runs: dict[str, Any]) -> None:
    grpo, whole = runs["grpo"], runs["dpo"]["whole_bytes"]
    assert grpo["steps"] == 2 and len(grpo["loss"]) == 2
    assert grpo["ref_type"] == "ZeroEngine"
    assert grpo["ref_bytes"]["in_parameters"] == 0
    assert whole // 2 <= grpo["ref_bytes"]["in_shards"] <= whole // 2 + 64


# -- in this process ----------------------------------------------------------------------------

pytestmark = pytest.mark.usefixtures("clean_accelerate")  # tests/conftest.py


def _args(cls: type, tmp_path: Path, **more: Any) -> Any:
    common = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], bf16=False, max_steps=1)
    return cls(**common, **more)


def test_zero_makes_one_class_per_trainer_class() -> None:
    made = zero(SFTTrainer)
    assert made is zero(SFTTrainer)
    assert made.__name__ == "ZeroSFTTrainer"
    assert made.__bases__ == (ZeroTrainer, SFTTrainer)
    assert zero(Trainer) is ZeroTrainer and zero(made) is made
    with pytest.raises(TypeError, match="transformers.Trainer or a subclass"):
        zero(torch.nn.Linear)  # type: ignore[arg-type]


@pytest.mark.parametrize("variable", ["DS_STRATEGY_CONFIG", "DS_STRATEGY_ZERO_STAGE"])
def test_a_zero_variable_a_plain_trl_trainer_would_ignore_is_an_error(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    monkeypatch.setenv(variable, "zero3" if variable == "DS_STRATEGY_CONFIG" else "3")
    args = _args(SFTConfig, tmp_path, max_length=16)
    with pytest.raises(ValueError, match=rf"{variable} set.*DDP.*zero\(SFTTrainer\)"):
        SFTTrainer(model=str(model_dir), args=args, train_dataset=sft_data())
    trainer = zero(SFTTrainer)(model=str(model_dir), args=args, train_dataset=sft_data())
    assert trainer.accelerator.zero_config.layout.stage == 3  # the route reads it


def test_a_plain_trainer_is_refused_too_and_runs_without_the_variables(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    monkeypatch.setenv("DS_STRATEGY_ZERO_OPTIMIZATION__OFFLOAD_PARAM__DEVICE", "cpu")
    with pytest.raises(ValueError, match="DS_STRATEGY_ZERO_OPTIMIZATION__OFFLOAD_PARAM"):
        Trainer(model=model, args=_args(TrainingArguments, tmp_path))
    monkeypatch.delenv("DS_STRATEGY_ZERO_OPTIMIZATION__OFFLOAD_PARAM__DEVICE")
    monkeypatch.setenv("DS_STRATEGY_PROGRESS", "0")  # not a ZeRO setting
    assert Trainer(model=model, args=_args(TrainingArguments, tmp_path)).model is model


def test_syncing_a_sharded_reference_model_is_refused(model_dir: Path, tmp_path: Path) -> None:
    args = _args(DPOConfig, tmp_path, max_length=16, sync_ref_model=True)
    with pytest.raises(ValueError, match="sync_ref_model=True at ZeRO stage 3"):
        zero(DPOTrainer)(model=str(model_dir), args=args, train_dataset=dpo_data(), config="zero3")
