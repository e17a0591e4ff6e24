"""``ds_strategy.hf.ZeroTrainer``: Hugging Face's ``Trainer`` through the ZeRO engine.

Two launches of ``tests/hf_scripts/trainer_runs.py`` on two CPU processes compare it with a
plain ``Trainer`` (DDP) on a small Llama built from a config: with transformers' own DeepSpeed
test configs ("auto" everywhere, AdamW and WarmupLR sections, CPU offload) at stages 2 and 3,
and with the Trainer's own optimizer and scheduler at stage 3, accumulation 2 and an active
``max_grad_norm``; and a run resumed from a Trainer checkpoint against the uninterrupted one.
The rest runs in this process, as a world of one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from transformers import Trainer, TrainingArguments  # noqa: E402

from ds_strategy.config import load_config  # noqa: E402
from ds_strategy.hf import ZeroTrainer  # noqa: E402
from ds_strategy.hf._args import fill_from_training_args  # noqa: E402
from tests.hf_scripts.launch import launch  # noqa: E402
from tests.hf_scripts.trainer_runs import (  # noqa: E402
    CONFIGS,
    MAX_NORM,
    Tokens,
    arguments,
    model,
)

TOL = 2e-5
STEPS = 10  # 2 epochs of 40 samples, 2 ranks x 2 per device x accumulation 2 (odd tail: 5)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def parity(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("hf_parity") / "results.pt"
    launch("torchrun", "parity", "--out", str(out))
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize(
    ("zero", "plain"),
    [
        ("zero2_sections", "plain_sections"),
        ("zero3_sections", "plain_sections"),
        ("zero3", "plain"),
        ("zero3_compiled", "plain"),
    ],
)
@pytest.mark.launcher
def test_zero_trainer_ends_at_the_plain_trainers_weights(
    parity: dict[str, Any], zero: str, plain: str
) -> None:
    z, p = parity[zero], parity[plain]
    assert z["global_step"] == p["global_step"] == STEPS
    assert max_diff(z["state"], p["state"]) <= TOL
    assert max_diff(p["state"], model().state_dict()) > 1e-2  # training moved the weights
    assert any(n > MAX_NORM for n in p["grad_norm"])  # clipping was active
    assert z["grad_norm"] == pytest.approx(p["grad_norm"], rel=1e-5)
    assert z["loss"] == pytest.approx(p["loss"], rel=1e-5)
    assert z["eval_loss"] == pytest.approx(p["eval_loss"], rel=1e-5)


@pytest.mark.launcher
def test_torch_compile_arguments_compile_each_decoder_layer(parity: dict[str, Any]) -> None:
    """TrainingArguments(torch_compile=True, torch_compile_backend=..., torch_compile_mode=...)
    reach the engine's compile section; each Llama decoder layer (a ZeRO-3 unit) is compiled,
    with no graph break."""
    compiled = parity["zero3_compiled"]
    assert compiled["compile"] == (True, "aot_eager", "max-autotune-no-cudagraphs")
    report = compiled["report"]
    assert report["compiled_units"] == 2  # the model's two decoder layers
    assert report["graphs"] > 0 and report["graph_breaks"] == 0, report


@pytest.mark.launcher
def test_auto_values_are_filled_as_transformers_fills_them(parity: dict[str, Any]) -> None:
    for name in ("zero2_config", "zero3_config"):
        cfg = parity[name]
        assert cfg["optimizer"] == {
            "lr": 1e-2,
            "betas": [0.9, 0.99],
            "eps": 1e-8,
            "weight_decay": 0.01,
        }
        assert cfg["scheduler"] == {
            "warmup_min_lr": 0,
            "warmup_max_lr": 1e-2,
            "warmup_num_steps": 1,
        }
        assert cfg["batch"] == (8, 2) and cfg["accumulation"] == 2
        assert cfg["clipping"] == MAX_NORM
    # ds_config_zero2.json writes its bucket size; ds_config_zero3.json's follow hidden_size 32
    assert parity["zero2_config"]["buckets"][0] == 200_000_000
    assert parity["zero3_config"]["buckets"] == (32 * 32, int(0.9 * 32 * 32), 10 * 32)
    assert parity["zero2_config"]["offload"] == ("cpu", "none")
    assert parity["zero3_config"]["offload"] == ("cpu", "cpu")


@pytest.mark.launcher
def test_saved_model_loads_with_from_pretrained(parity: dict[str, Any]) -> None:
    assert "model.safetensors" in parity["saved_files"]
    assert not any(f.endswith(".bin") and "model" in f for f in parity["saved_files"])
    predicted, reloaded = parity["predicted"], parity["reloaded"]
    assert predicted.shape == reloaded.shape == (8, 16, 64)
    torch.testing.assert_close(predicted.float(), reloaded.float(), atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("hf_resume") / "results.pt"
    launch("accelerate", "resume", "--stage", "3", "--out", str(out))
    return torch.load(out, weights_only=False)


@pytest.mark.launcher
def test_resumed_run_equals_the_uninterrupted_one(resumed: dict[str, Any]) -> None:
    assert {"model.safetensors", "trainer_state.json", "zero_checkpoint"} <= set(
        resumed["checkpoint_files"]
    )
    assert "optimizer.pt" not in resumed["checkpoint_files"]  # the engine's shards instead
    assert resumed["resumed_step"] == STEPS
    assert max_diff(resumed["resumed"], resumed["whole"]) <= TOL
    whole, again = resumed["whole_log"], resumed["resumed_log"]
    assert again["loss"][5:] == pytest.approx(whole["loss"][5:], rel=1e-6)  # after checkpoint-5
    assert again["lr"] == pytest.approx(whole["lr"])  # the config's WarmupDecayLR, resumed


@pytest.fixture(scope="module")
def split_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One launch on two processes: the Llama through ZeroTrainer with its layers split
    (tensor parallelism) and with its sequences split (sequence parallelism); and a plain
    Trainer in this process, which both must equal (the two ranks read the same batches)."""
    root = tmp_path_factory.mktemp("hf_split")
    launch("torchrun", "split", "--out", str(root / "results.pt"))
    plain = Trainer(
        model=model(),
        args=arguments(str(root / "plain")),
        train_dataset=Tokens(40, 1),
        eval_dataset=Tokens(8, 2),
    )
    plain.train()
    reference = {
        "state": plain.model.state_dict(),
        "loss": [e["loss"] for e in plain.state.log_history if "loss" in e],
        "eval_loss": plain.evaluate()["eval_loss"],
        "global_step": plain.state.global_step,
        "total_batch": plain.get_total_train_batch_size(plain.args),
    }
    return {**torch.load(root / "results.pt", weights_only=False), "plain": reference}


def _equals_the_plain_trainer(zero: dict[str, Any], plain: dict[str, Any]) -> None:
    assert max_diff(zero["state"], plain["state"]) <= TOL
    assert zero["loss"] == pytest.approx(plain["loss"], rel=1e-5)
    assert zero["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-5)


@pytest.mark.launcher
def test_tensor_parallel_trainer_equals_a_plain_trainer_in_one_process(
    split_runs: dict[str, Any],
) -> None:
    """Llama at D=1 x T=2 (ZeRO-2)."""
    assert split_runs["tp"]["mesh"] == {"pp": 0, "dp": 0, "tp": 0}
    _equals_the_plain_trainer(split_runs["tp"], split_runs["plain"])


@pytest.mark.launcher
def test_sequence_parallel_trainer_equals_a_plain_trainer_in_one_process(
    split_runs: dict[str, Any],
) -> None:
    """Llama with each sequence split over both processes (``parallelism_config`` sp_size=2,
    ZeRO-3, tiled loss and MLPs): the same steps, losses, weights and evaluation loss."""
    zero, plain = split_runs["sp"], split_runs["plain"]
    assert zero["global_step"] == plain["global_step"]
    assert zero["total_batch"] == plain["total_batch"]  # one data-parallel rank
    _equals_the_plain_trainer(zero, plain)


# -- in this process ----------------------------------------------------------------------------

pytestmark = pytest.mark.usefixtures("clean_accelerate")  # tests/conftest.py


def fill(config: dict[str, Any], args: TrainingArguments, hidden: int | None = 32) -> Any:
    m = SimpleNamespace(config=SimpleNamespace(hidden_size=hidden))
    return fill_from_training_args(
        load_config(config), args, world_size=2, model=m, num_training_steps=100
    )


def test_values_written_in_the_config_must_agree_with_the_arguments(tmp_path: Path) -> None:
    args = arguments(str(tmp_path), warmup_steps=5)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "betas": [0.9, 0.999]}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
        "gradient_clipping": 1.0,
    }
    with pytest.raises(ValueError) as e:
        fill(config, args)
    message = str(e.value)
    for said in (
        "train_micro_batch_size_per_gpu=4 vs TrainingArguments per_device_train_batch_size=2",
        "optimizer.params.lr=0.1 vs TrainingArguments learning_rate=0.01",
        "optimizer.params.betas=[0.9, 0.999] vs TrainingArguments adam_beta1+adam_beta2=[0.9, 0.99]",
        "gradient_clipping=1.0 vs TrainingArguments max_grad_norm=0.5",
        "'auto'",
    ):
        assert said in message
    assert "warmup_num_steps" not in message  # 5 = 5


def test_left_out_sizes_come_from_the_arguments_and_clipping_stays_the_trainers(
    tmp_path: Path,
) -> None:
    cfg = fill({"zero_optimization": {"stage": 2}}, arguments(str(tmp_path)))
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (8, 2)
    assert cfg.gradient_accumulation_steps == 2
    assert cfg.gradient_clipping == 0.0  # absent: the Trainer's max_grad_norm clips, as plain
    steps = fill(
        {
            "scheduler": {
                "type": "WarmupDecayLR",
                "params": {"total_num_steps": "auto", "warmup_num_steps": "auto"},
            }
        },
        arguments(str(tmp_path), warmup_steps=0.1),  # a fraction of the run's steps
    )
    assert steps.scheduler.params == {"total_num_steps": 100, "warmup_num_steps": 10}


def test_auto_bucket_sizes_need_a_hidden_size(tmp_path: Path) -> None:
    config = {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"}}
    with pytest.raises(ValueError, match="stage3_prefetch_bucket_size.*hidden_size"):
        fill(config, arguments(str(tmp_path)), hidden=None)
    # below stage 3 the stage-3 sizes are not derived (their defaults apply), as in transformers
    cfg = fill(
        {"zero_optimization": {"stage": 2, "stage3_prefetch_bucket_size": "auto"}},
        arguments(str(tmp_path)),
        hidden=None,
    )
    assert cfg.zero_optimization.stage == 2


def test_a_half_precision_the_arguments_do_not_ask_for_is_a_disagreement(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="bf16.enabled=True vs TrainingArguments bf16=False"):
        fill({"bf16": {"enabled": True}}, arguments(str(tmp_path)))


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (
            {
                "save_only_model": True,
                "load_best_model_at_end": True,
                "eval_strategy": "steps",
                "save_strategy": "steps",
            },
            "save_only_model",
        ),
    ],
)
def test_settings_it_cannot_honour_are_refused_by_name(
    tmp_path: Path, change: dict[str, Any], named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        ZeroTrainer(model=model(), args=arguments(str(tmp_path), **change), config={})


def test_an_optimizer_section_and_a_trainer_optimizer_are_one_too_many(tmp_path: Path) -> None:
    m = model()
    trainer = ZeroTrainer(
        model=m,
        args=arguments(str(tmp_path), max_steps=1),
        train_dataset=Tokens(8, 1),
        optimizers=(torch.optim.SGD(m.parameters(), lr=0.1), None),
        config={"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}},
    )
    with pytest.raises(ValueError, match="optimizer section .*AdamW.* keep one"):
        trainer.train()


def test_evaluate_and_save_before_training(tmp_path: Path) -> None:
    """No engine yet: evaluation runs the model as it is and save_model writes it as the Trainer
    does; both agree with a plain Trainer."""
    data = Tokens(8, 2)
    zero = ZeroTrainer(
        model=model(),
        args=arguments(str(tmp_path / "z")),
        eval_dataset=data,
        config={"zero_optimization": {"stage": 3}},
    )
    loss = zero.evaluate()["eval_loss"]
    plain = Trainer(model=model(), args=arguments(str(tmp_path / "p")), eval_dataset=data)
    assert loss == pytest.approx(plain.evaluate()["eval_loss"], rel=1e-6)
    zero.save_model(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "model.safetensors").is_file()


def test_bf16_follows_the_arguments_through_transformers_bf16_config(tmp_path: Path) -> None:
    config = json.loads((CONFIGS / "transformers__tests_zero2_bf16.json").read_text())
    trainer = ZeroTrainer(
        model=model(),
        args=arguments(str(tmp_path), bf16=True, max_steps=3),
        train_dataset=Tokens(16, 1),
        config=config,
    )
    trainer.train()
    engine = trainer.accelerator.zero_engine
    assert engine.config.bf16.enabled is True and engine.config.fp16.enabled is False
    assert engine.precision.param_dtype == torch.bfloat16
    assert trainer.model.model.embed_tokens.weight.dtype == torch.bfloat16  # computes in bf16
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)


def test_load_best_model_at_end_loads_the_best_checkpoints_weights(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    trainer = ZeroTrainer(
        model=model(),
        args=arguments(
            str(tmp_path),
            max_steps=6,
            eval_strategy="steps",
            eval_steps=2,
            save_strategy="steps",
            save_steps=2,
            load_best_model_at_end=True,
            learning_rate=0.2,  # large enough that the eval loss rises again after a while
        ),
        train_dataset=Tokens(24, 1),
        eval_dataset=Tokens(8, 2),
        config={"zero_optimization": {"stage": 3}},
    )
    trainer.train()
    best = Path(trainer.state.best_model_checkpoint)
    # the checkpoint of the lowest eval loss, read from this run's own history (which step
    # that is depends on the machine's rounding); at this learning rate it is not the last
    evals = {e["step"]: e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e}
    assert sorted(evals) == [2, 4, 6], evals
    assert best.name == f"checkpoint-{min(evals, key=evals.__getitem__)}", evals
    assert best.name != "checkpoint-6", evals
    saved = load_file(str(best / "model.safetensors"))
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    assert max_diff({k: state[k] for k in saved}, saved) == 0.0
    last = load_file(str(tmp_path / "checkpoint-6" / "model.safetensors"))
    assert max_diff({k: state[k] for k in last}, last) > 1e-3  # not the last weights


def test_the_config_argument_is_config_and_zero_config_still_works_with_a_warning(
    tmp_path: Path,
) -> None:
    from ds_strategy.core.warnings import DsStrategyDeprecationWarning

    args = arguments(str(tmp_path), max_steps=1)
    trainer = ZeroTrainer(model=model(), args=args, config="zero2")
    assert trainer.zero_plugin.load({}).zero_optimization.stage == 2
    with pytest.warns(DsStrategyDeprecationWarning, match=r"zero_config=\.\.\.\) is deprecated"):
        old = ZeroTrainer(model=model(), args=args, zero_config="zero1")
    assert old.zero_plugin.load({}).zero_optimization.stage == 1
    with pytest.raises(TypeError, match="pass config= only"):
        ZeroTrainer(model=model(), args=args, config="zero1", zero_config="zero1")
