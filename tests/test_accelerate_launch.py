"""``ZeroAccelerator`` started by ``accelerate launch`` on two CPU processes (gloo).

Each test group launches a script from ``tests/accelerate_scripts/`` with the shipped
``configs/accelerate/cpu_2proc.yaml`` on a free port, in a subprocess with a timeout; rank 0
``torch.save``s what it measured and the tests compare. The references are the same loop run
with a plain ``accelerate.Accelerator`` (DDP) in the same launch, or an uninterrupted run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.accelerate_scripts.launch import launch

# launcher: every run is an `accelerate launch`
pytestmark = pytest.mark.launcher

TOL = 2e-5
MAX_NORM = 0.3  # tests/accelerate_scripts/common.py
BOUNDARIES = 12  # 2 epochs x (5 full accumulation windows + the odd last batch)


def load(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=False)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


# -- stages 1/2/3 against plain Accelerate ------------------------------------------------------


@pytest.fixture(scope="module")
def parity(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("parity") / "results.pt"
    launch("parity.py", "--out", str(out))
    results = load(out)
    results["dir"] = out.parent
    return results


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stage_matches_plain_accelerator(parity: dict[str, Any], stage: int) -> None:
    """Same weights as DDP through a plain Accelerator, with gradient_accumulation_steps=2,
    clip_grad_norm_ at every boundary, two param groups and a LambdaLR."""
    zero, plain = parity[f"zero{stage}"], parity["plain"]
    assert max_diff(zero["state"], plain["state"]) <= TOL
    assert zero["global_steps"] == BOUNDARIES


def test_the_config_files_dynamo_section_compiles_the_model_and_trains_as_eager(
    parity: dict[str, Any], tmp_path: Path
) -> None:
    """An accelerate config file whose dynamo section asks for torch.compile (a plain
    Accelerator would compile the model): ZeroAccelerator gives it to the engine's compile
    section, each block is compiled, and training ends at the eager stage-3 run's weights."""
    from tests.accelerate_scripts.launch import CPU_CONFIG

    config = tmp_path / "cpu_2proc_dynamo.yaml"
    text = CPU_CONFIG.read_text()
    assert "dynamo_config: {}" in text
    config.write_text(
        text.replace("dynamo_config: {}", "dynamo_config:\n  dynamo_backend: AOT_EAGER")
    )
    out = tmp_path / "compiled.pt"
    launch("compiled.py", "--out", str(out), config=config)
    compiled = load(out)
    assert compiled["compile"].enabled and compiled["compile"].backend == "aot_eager"
    report = compiled["report"]
    assert report["compiled_units"] == 3, report  # the three blocks (nn.Sequential) of TinyNet
    assert report["graphs"] > 0 and report["graph_breaks"] == 0, report
    assert max_diff(compiled["state"], parity["zero3"]["state"]) <= 1e-6


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_clip_grad_norm_returns_the_global_norm(parity: dict[str, Any], stage: int) -> None:
    zero, plain = parity[f"zero{stage}"], parity["plain"]
    assert len(zero["norms"]) == len(plain["norms"]) == BOUNDARIES
    assert any(n > MAX_NORM for n in plain["norms"])  # clipping was active
    assert zero["norms"] == pytest.approx(plain["norms"], rel=1e-5)


def test_scheduler_steps_as_accelerate_steps_it(parity: dict[str, Any]) -> None:
    """Accelerate steps a scheduler num_processes times per optimizer step; so must we."""
    plain = parity["plain"]
    assert plain["lrs"][1] < plain["lrs"][0]
    for stage in (1, 2, 3):
        assert parity[f"zero{stage}"]["lrs"] == pytest.approx(plain["lrs"], rel=1e-12)


def test_auto_values_come_from_the_accelerator(parity: dict[str, Any]) -> None:
    for stage in (1, 2, 3):
        zero = parity[f"zero{stage}"]
        assert zero["resolved"] == {
            "train_micro_batch_size_per_gpu": 4,  # the dataloader's batch size
            "train_batch_size": 16,  # 4 x 2 accumulation x 2 processes
            "gradient_accumulation_steps": 2,  # the Accelerator's
            "gradient_clipping": 0.0,  # "auto": clipping only where the loop clips
            "stage": stage,
        }
        # the shipped CPU config starts two gloo processes, not two lone ones
        assert zero["distributed_type"] == "DistributedType.MULTI_CPU"
        assert zero["num_processes"] == 2


def test_state_is_really_sharded(parity: dict[str, Any]) -> None:
    full_bytes = 4 * parity["plain"]["numel"]
    assert parity["zero1"]["memory"]["grads"] >= full_bytes
    assert parity["zero2"]["memory"]["grads"] < 0.6 * full_bytes
    assert parity["zero3"]["memory"]["params"] < 0.6 * full_bytes
    assert parity["zero3"]["unwrapped"] == "TinyNet"


def test_save_model_writes_consolidated_safetensors(parity: dict[str, Any]) -> None:
    from safetensors.torch import load_file

    saved = load_file(parity["dir"] / "model_zero3" / "model.safetensors")
    plain = parity["plain"]["state"]
    assert saved.keys() == plain.keys()
    assert all(saved[k].shape == plain[k].shape for k in plain)  # full, not shards
    assert max_diff(saved, parity["zero3"]["state"]) == 0.0


# -- save_state / load_state ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def resume(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Config from the environment as `DS_STRATEGY_CONFIG=zero3 accelerate launch` (a preset's name)
    gives it; the second launch (a fresh process group) also switches to stage 2."""
    tmp = tmp_path_factory.mktemp("resume")
    ckpt = tmp / "ckpt"
    env = {
        "DS_STRATEGY_CONFIG": "zero3",
        # a tiny model: shard every parameter, not only those above 1e5 elements
        "DS_STRATEGY_ZERO_OPTIMIZATION__STAGE3_PARAM_PERSISTENCE_THRESHOLD": "0",
    }
    launch("resume.py", "--phase", "save", "--ckpt", str(ckpt), "--out", str(tmp / "a.pt"), env=env)
    env["DS_STRATEGY_ZERO_STAGE"] = "2"
    launch("resume.py", "--phase", "load", "--ckpt", str(ckpt), "--out", str(tmp / "b.pt"), env=env)
    return {**load(tmp / "a.pt"), **load(tmp / "b.pt"), "ckpt": ckpt}


def test_resumed_run_matches_uninterrupted(resume: dict[str, Any]) -> None:
    full, saved, loaded = resume["uninterrupted"], resume["save"], resume["load"]
    assert (full["stage"], saved["stage"], loaded["stage"]) == (3, 3, 2)  # from the environment
    assert max_diff(saved["state"], full["state"]) > 1e-3  # the save really was mid-training
    assert loaded["steps_after_load"] == 3
    assert loaded["lr_after_load"] == saved["lr_at_save"]
    assert loaded["log"]["norms"] == pytest.approx(full["log"]["norms"][3:], rel=1e-5)
    assert max_diff(loaded["state"], full["state"]) <= TOL
    assert loaded["global_steps"] == full["global_steps"] == BOUNDARIES


def test_save_state_writes_one_shard_per_rank(resume: dict[str, Any]) -> None:
    ckpt: Path = resume["ckpt"]
    engine_dir = ckpt / "zero_checkpoint"
    assert sorted(p.name for p in engine_dir.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert json.loads((engine_dir / "ds_strategy.json").read_text())["world_size"] == 2
    assert (ckpt / "scheduler.bin").is_file()
    assert (ckpt / "random_states_0.pkl").is_file() and (ckpt / "random_states_1.pkl").is_file()
    consolidated = ["model.safetensors", "pytorch_model.bin", "optimizer.bin"]
    assert not any((ckpt / name).exists() for name in consolidated)


# -- a Hugging Face DeepSpeed JSON ----------------------------------------------------------------

HF_ZERO3_JSON = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "none", "pin_memory": True},
        "offload_param": {"device": "none", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def test_hugging_face_deepspeed_json_runs_unmodified(tmp_path: Path) -> None:
    config = tmp_path / "ds_config_zero3.json"
    config.write_text(json.dumps(HF_ZERO3_JSON, indent=2))
    out = tmp_path / "results.pt"
    launch("hf_config.py", "--out", str(out), env={"DS_STRATEGY_CONFIG": str(config)})
    results = load(out)
    zero, plain = results["zero"], results["plain"]
    assert max_diff(zero["state"], plain["state"]) <= TOL
    warned = " ".join(zero["warnings"])
    assert "zero_optimization.sub_group_size" not in warned  # read: the rounded step's chunk
    assert "zero_optimization.stage3_gather_16bit_weights_on_model_save" in warned
    hidden = 12  # TinyNet.config.hidden_size: the sizes Accelerate derives from it
    assert zero["resolved"] == {
        "stage": 3,
        "reduce_bucket_size": hidden * hidden,
        "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
        "stage3_param_persistence_threshold": 10 * hidden,
        "fp16": False,  # "auto" under mixed_precision 'no'
        "bf16": False,
        "train_micro_batch_size_per_gpu": 4,
        "train_batch_size": 16,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.0,
    }
    # "auto" lr / weight_decay from the DummyOptim; its per-group weight decay survives
    assert zero["optimizer"] == "AdamW"
    assert zero["weight_decay"] == [0.01, 0.0]
    assert zero["lr"] == [0.02, 0.02]


# -- several models: a GAN and a frozen model in one prepare ---------------------------------------


@pytest.fixture(scope="module")
def gan(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("gan") / "results.pt"
    launch("gan.py", "--out", str(out), timeout=400)
    results = load(out)
    results["dir"] = out.parent
    return results


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_gan_prepared_in_one_call_matches_plain_accelerate(
    gan: dict[str, Any], stage: int
) -> None:
    """prepare(g, opt_g, d, opt_d, frozen, loader, scheduler): an engine per model, the
    frozen one for evaluation; accumulate(g, d) over two batches, the generator's loss through
    the discriminator left there until a boundary's zero_grad(), as plain Accelerate does."""
    zero, plain = gan[f"zero{stage}"], gan["plain"]
    assert zero["stages"] == [stage] * 3
    assert max_diff(zero["weights"], plain["weights"]) <= TOL
    assert zero["norms"] == pytest.approx(plain["norms"], rel=1e-5)
    assert len(plain["norms"]) == 3  # every boundary clipped the discriminator


def test_the_frozen_model_is_sharded_at_zero3(gan: dict[str, Any]) -> None:
    memory = {s: gan[f"zero{s}"]["memory"] for s in (2, 3)}
    frozen_bytes = (8 * 8 + 8) * 4  # nn.Linear(8, 8) in fp32
    assert memory[3]["model_2"] == frozen_bytes // 2  # half on each of the 2 ranks
    for name in ("model_0", "model_1"):  # the trained models too
        assert memory[3][name] == memory[2][name] // 2


def test_save_state_of_several_models_resumes_under_another_stage(gan: dict[str, Any]) -> None:
    """One save_state (every engine under one commit point) half-way through the ZeRO-3 run,
    loaded by a fresh ZeroAccelerator at stage 2, ends where a plain run resumed the same way
    does (gradients in flight at the save are in neither checkpoint)."""
    resumed, plain = gan["resumed"], gan["plain_resumed"]
    assert max_diff(resumed["weights"], plain["weights"]) <= TOL
    assert resumed["norms"] == pytest.approx(plain["norms"], rel=1e-5)
    engine_dir = gan["dir"] / "ckpt" / "zero_checkpoint"
    assert sorted(p.name for p in engine_dir.iterdir()) == [
        "engines.json",
        "model_0",
        "model_1",
        "model_2",
    ]
