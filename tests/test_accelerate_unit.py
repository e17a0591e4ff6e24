"""The Accelerate front end in one process: config from plugin / environment, "auto" and
mixed-precision resolution, and ``ZeroAccelerator`` as a world of one (clipping like torch,
boundaries from Accelerate, errors for what ZeRO cannot do). Multi-process behaviour is in
``test_accelerate_launch.py``."""

from __future__ import annotations

import copy
import math
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from accelerate.utils import ProjectConfiguration
from accelerate.utils.deepspeed import DummyOptim, DummyScheduler
from torch import nn

from ds_strategy.accelerate import ZeroAccelerator, ZeroPlugin
from ds_strategy.config import ConfigError, load_config
from ds_strategy.config._env import overrides_from_env
from ds_strategy.config.loop import LoopFacts, apply_mixed_precision, fill_auto
from ds_strategy.core.checkpoint.trust import UntrustedContentError

pytestmark = pytest.mark.usefixtures("clean_accelerate")  # tests/conftest.py


# -- config sources -------------------------------------------------------------------------------


def test_env_variables_map_to_config_keys() -> None:
    env = {
        "DS_STRATEGY_CONFIG": "ignored.yaml",
        "DS_STRATEGY_ZERO_STAGE": "3",
        "DS_STRATEGY_OFFLOAD_OPTIMIZER": "cpu",
        "DS_STRATEGY_GRADIENT_CLIPPING": "1.5",
        "DS_STRATEGY_ZERO_OPTIMIZATION__REDUCE_BUCKET_SIZE": "5e7",
        "DS_STRATEGY_OPTIMIZER__PARAMS__LR": "1e-3",
        "OTHER": "x",
    }
    assert overrides_from_env(env) == {
        "zero_optimization.stage": 3,
        "zero_optimization.offload_optimizer.device": "cpu",
        "gradient_clipping": 1.5,
        "zero_optimization.reduce_bucket_size": 5e7,  # scientific notation is a number
        "optimizer.params.lr": 1e-3,  # (plain YAML 1.1 would hand torch the string "1e-3")
    }
    env = {"DS_STRATEGY_ZERO_OPTIMIZATION__REDUCE_BUCKET_SIZE": "5e7"}
    assert ZeroPlugin().load(env).zero_optimization.reduce_bucket_size == 50_000_000


def test_plugin_reads_file_then_env_then_code(tmp_path: Path) -> None:
    path = tmp_path / "z.yaml"
    path.write_text(
        "zero_optimization:\n  stage: 1\n  reduce_bucket_size: 100\ngradient_clipping: 2.0\n"
    )
    env = {"DS_STRATEGY_CONFIG": str(path), "DS_STRATEGY_ZERO_STAGE": "2"}
    cfg = ZeroPlugin(overrides={"gradient_clipping": 0.5}).load(env)
    assert cfg.zero_optimization.stage == 2  # env over file
    assert cfg.zero_optimization.reduce_bucket_size == 100  # file
    assert cfg.gradient_clipping == 0.5  # code over both


def test_plugin_config_in_code_ignores_env_with_a_warning() -> None:
    env = {"DS_STRATEGY_ZERO_STAGE": "3"}
    with pytest.warns(UserWarning, match="DS_STRATEGY_ZERO_STAGE ignored"):
        cfg = ZeroPlugin(config={"zero_optimization": {"stage": 1}}).load(env)
    assert cfg.zero_optimization.stage == 1


def test_bad_env_variable_names_the_variable() -> None:
    with pytest.raises(
        ConfigError, match=r"DS_STRATEGY_ZERO_STAG\b.*did you mean DS_STRATEGY_ZERO_STAGE"
    ):
        ZeroPlugin().load({"DS_STRATEGY_ZERO_STAG": "3"})
    with pytest.raises(ConfigError, match="DS_STRATEGY_ZERO_STAGE.*allowed 0, 1, 2, 3"):
        ZeroPlugin().load({"DS_STRATEGY_ZERO_STAGE": "4"})
    both = {"DS_STRATEGY_ZERO_STAGE": "1", "DS_STRATEGY_ZERO_OPTIMIZATION__STAGE": "2"}
    with pytest.raises(ConfigError, match="both set zero_optimization.stage"):
        ZeroPlugin().load(both)


def test_shipped_presets_load_by_name() -> None:
    for stage in (1, 2, 3):
        cfg = ZeroPlugin(config=f"zero{stage}").load({})
        assert cfg.zero_optimization.stage == stage
        assert cfg.gradient_accumulation_steps == "auto"


# -- resolution -----------------------------------------------------------------------------------


def test_mixed_precision_maps_onto_the_config() -> None:
    default = load_config({})
    assert apply_mixed_precision(default, "fp16").fp16.enabled is True
    assert apply_mixed_precision(default, "bf16").bf16.enabled is True
    no = apply_mixed_precision(load_config({"fp16": {"enabled": "auto"}}), "no")
    assert no.fp16.enabled is False and no.bf16.enabled is False
    # a section the config enables stays enabled
    assert apply_mixed_precision(load_config({"bf16": {"enabled": True}}), "no").bf16.enabled
    with pytest.raises(ConfigError, match="bf16.enabled is true.*'fp16'"):
        apply_mixed_precision(load_config({"bf16": {"enabled": True}}), "fp16")
    with pytest.raises(ValueError, match="fp8"):
        apply_mixed_precision(default, "fp8")


def test_auto_values_filled_and_explicit_values_kept() -> None:
    cfg = load_config(
        {
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": 4,
            "gradient_clipping": "auto",
            "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "eps": "auto"}},
        }
    )
    facts = LoopFacts(
        world_size=2,
        gradient_accumulation_steps=2,
        micro_batch_size=8,
        gradient_clipping=1.0,
        hidden_size=10,
        optimizer_lr=0.1,
    )
    r = fill_auto(cfg, facts)
    assert r.gradient_accumulation_steps == 4  # written in the config: it wins
    assert (r.train_micro_batch_size_per_gpu, r.train_batch_size) == (8, 64)
    assert r.gradient_clipping == 1.0
    assert r.zero_optimization.reduce_bucket_size == 100
    assert r.zero_optimization.stage3_param_persistence_threshold == 100_000  # not "auto"
    assert r.optimizer.params == {"lr": 0.1}  # "auto" eps dropped: AdamW's default
    # absent keys take the Accelerator's values too ...
    r = fill_auto(load_config({}), facts)
    assert (r.gradient_accumulation_steps, r.train_micro_batch_size_per_gpu) == (2, 8)
    # ... unless the config fixes them through the other two sizes (as DeepSpeed computes them)
    r = fill_auto(load_config({"train_batch_size": 48, "train_micro_batch_size_per_gpu": 4}), facts)
    assert r.gradient_accumulation_steps == 6


# -- ZeroAccelerator in one process ---------------------------------------------------------------


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7), nn.Tanh(), nn.Linear(7, 2))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 5, generator=g), torch.randn(4, 2, generator=g)) for _ in range(n)]


def _accelerator(stage: int = 3, **kwargs: object) -> ZeroAccelerator:
    config = {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    return ZeroAccelerator(config=config, **kwargs)


@pytest.mark.parametrize("stage", [0, 3])
def test_clip_grad_norm_clips_like_torch(stage: int) -> None:
    reference = _model()
    model = copy.deepcopy(reference)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    accelerator = _accelerator(stage)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
    for x, y in _batches(3):
        nn.functional.mse_loss(reference(x), y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        ref_opt.step()
        ref_opt.zero_grad()
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        norm = accelerator.clip_grad_norm_(model.parameters(), 0.05)
        optimizer.step()
        optimizer.zero_grad()
        assert ref_norm > 0.05  # clipping is active
        assert norm.item() == pytest.approx(ref_norm.item(), rel=1e-6)
    state = accelerator.get_state_dict(model)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=1e-6)
    assert set(accelerator.get_state_dict(model, unwrap=False)) == {f"module.{k}" for k in state}


def test_boundaries_follow_accelerate_including_the_end_of_the_loader() -> None:
    """5 batches, accumulation 2: Accelerate syncs after batches 2, 4 and 5 (end of loader)."""
    accelerator = _accelerator(gradient_accumulation_steps=2)
    model = _model()
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(*map(torch.cat, zip(*_batches(5), strict=True))),
        batch_size=4,
    )
    model, optimizer, loader = accelerator.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1), loader
    )
    synced = []
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            synced.append(accelerator.sync_gradients)
            optimizer.step()
            optimizer.zero_grad()
    assert synced == [False, True, False, True, True]
    engine = accelerator.zero_engine
    assert (engine.global_steps, engine.micro_steps) == (3, 5)
    assert engine.config.train_micro_batch_size_per_gpu == 4


def test_step_was_skipped_reads_the_engine() -> None:
    accelerator = _accelerator()
    model = _model()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    engine = accelerator.zero_engine
    real_step = engine.step

    def overflowing_step() -> None:  # what the engine does on an fp16 overflow
        engine.skipped_steps = getattr(engine, "skipped_steps", 0) + 1
        engine.zero_grad()
        engine.micro_steps += 1

    (x, y), (x2, y2) = _batches(2)
    accelerator.backward(nn.functional.mse_loss(model(x), y))
    engine.step = overflowing_step
    optimizer.step()
    assert optimizer.step_was_skipped and accelerator.optimizer_step_was_skipped
    engine.step = real_step
    accelerator.backward(nn.functional.mse_loss(model(x2), y2))
    optimizer.step()
    assert not optimizer.step_was_skipped


def test_engine_owned_scheduler_from_dummy_scheduler() -> None:
    model = _model()
    params = list(model.parameters())
    dummy = DummyOptim(params, lr=0.1)
    sched = DummyScheduler(
        dummy, lr_scheduler_callable=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    )
    config = {
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "SGD", "params": {"lr": "auto"}},
    }
    accelerator = ZeroAccelerator(config=config)
    model, optimizer, scheduler = accelerator.prepare(model, dummy, sched)
    for x, y in _batches(2):
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        scheduler.step()  # a no-op: the engine steps it once per optimizer step
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)


def test_mixed_precision_reaches_the_engine() -> None:
    accelerator = _accelerator(mixed_precision="bf16")
    assert accelerator.zero_config.bf16.enabled is True
    model = _model()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    engine = accelerator.zero_engine
    assert engine.config.bf16.enabled is True
    assert engine.precision.param_dtype == torch.bfloat16
    x, y = next(iter(_batches(1)))
    out = model(x)
    assert out.dtype == torch.float32  # fp32 in, fp32 out; bf16 inside
    accelerator.backward(nn.functional.mse_loss(out, y))
    optimizer.step()
    assert all(v.dtype == torch.float32 for v in accelerator.get_state_dict(model).values())


def test_save_and_load_state_with_automatic_naming(tmp_path: Path) -> None:
    project = ProjectConfiguration(tmp_path, automatic_checkpoint_naming=True, total_limit=1)
    accelerator = _accelerator(project_config=project)
    model = _model()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    batches = _batches(3)
    for i, (x, y) in enumerate(batches[:2]):
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        accelerator.save_state()
        if i == 1:
            expected = accelerator.get_state_dict(model)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["checkpoint_1"]  # total_limit=1 removed checkpoint_0
    x, y = batches[2]
    accelerator.backward(nn.functional.mse_loss(model(x), y))
    optimizer.step()
    accelerator.load_state()  # the latest: checkpoint_1
    state = accelerator.get_state_dict(model)
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    assert accelerator.zero_engine.global_steps == 2


class _Tracker:
    """An object registered for checkpointing whose state holds a non-plain object."""

    def __init__(self) -> None:
        self.seen = Fraction(0)

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.seen = state["seen"]


def test_load_state_unpickles_registered_objects_only_when_trusted(tmp_path: Path) -> None:
    accelerator = _accelerator()
    model = _model()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    tracker = _Tracker()
    tracker.seen = Fraction(3, 7)
    accelerator.register_for_checkpointing(tracker)
    accelerator.save_state(tmp_path / "ckpt")
    tracker.seen = Fraction(0)
    with pytest.raises(UntrustedContentError, match="fractions.Fraction"):
        accelerator.load_state(tmp_path / "ckpt")
    assert tracker.seen == 0
    accelerator.load_state(tmp_path / "ckpt", trust_checkpoint=True)
    assert tracker.seen == Fraction(3, 7)


def test_what_zero_cannot_do_raises_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    accelerator = _accelerator(gradient_accumulation_steps=2)
    model = _model()
    with pytest.raises(ValueError, match="without an optimizer but with trainable parameters"):
        accelerator.prepare(model)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="clip_grad_value_"):
        accelerator.clip_grad_value_(model.parameters(), 1.0)
    (x, y) = _batches(1)[0]
    with accelerator.accumulate(model):  # first micro-step of two: not a boundary
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        with pytest.raises(RuntimeError, match="not an accumulation boundary"):
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(ValueError, match="all the model's gradients"):
        accelerator.clip_grad_norm_(list(model.parameters())[:1], 1.0)
    with pytest.raises(ValueError, match="L2"):
        accelerator.clip_grad_norm_(model.parameters(), 1.0, norm_type=1)
    with pytest.raises(TypeError, match="inputs"):
        accelerator.backward(nn.functional.mse_loss(model(x), y), inputs=[x])
    with pytest.raises(ValueError, match="closure"):
        optimizer.step(lambda: 0.0)


def test_config_and_launch_conflicts_raise_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    with_optimizer = {"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}
    accelerator = ZeroAccelerator(config=with_optimizer)
    with pytest.raises(ValueError, match="'optimizer' section.*DummyOptim"):
        accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with_scheduler = {"scheduler": {"type": "WarmupLR", "params": {}}}
    accelerator = ZeroAccelerator(config=with_scheduler)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    callable_sched = DummyScheduler(opt, lr_scheduler_callable=lambda o: None)
    with pytest.raises(ValueError, match="scheduler section \\(WarmupLR\\).*keep one"):
        accelerator.prepare(model, opt, callable_sched)
    with pytest.raises(ValueError, match="FSDP"):
        ZeroAccelerator(fsdp_plugin=object())
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ValueError, match="ACCELERATE_USE_DEEPSPEED.*DS_STRATEGY_CONFIG"):
        ZeroAccelerator()


def test_config_scheduler_with_auto_values_from_dummy_scheduler() -> None:
    """A DeepSpeed JSON's scheduler section, "auto" values and all, as Hugging Face tools
    write it: warmup to the optimizer's lr over the DummyScheduler's steps, stepped by the
    engine; preparing another scheduler on top is an error."""
    model = _model()
    auto = dict.fromkeys(["warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps"])
    config = {
        "scheduler": {"type": "WarmupDecayLR", "params": {k: "auto" for k in auto}},
        "zero_optimization": {"stage": 2},
    }
    accelerator = ZeroAccelerator(config=config)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = DummyScheduler(opt, total_num_steps=6, warmup_num_steps=3)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    engine = accelerator.zero_engine
    assert type(engine.lr_scheduler).__name__ == "WarmupDecayLR"
    lrs = []
    for x, y in _batches(6):
        lrs.append(engine.get_lr()[0])
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        sched.step()  # a no-op: the engine steps its own scheduler
        opt.zero_grad()
    # log warmup 0 -> 0.1 over 3 steps, then linear decay to 0 at step 6
    assert lrs == pytest.approx([0.0, 0.1 * math.log(2) / math.log(3), 0.1, 0.1, 0.2 / 3, 0.1 / 3])
    with pytest.raises(ValueError, match="already schedules"):
        accelerator.prepare(torch.optim.lr_scheduler.StepLR(opt.optimizer, 1))


def test_zero_config_can_be_replaced_until_prepare_and_inference_needs_no_engine() -> None:
    accelerator = ZeroAccelerator(config={"zero_optimization": {"stage": 1}})
    accelerator.zero_config = accelerator.zero_config.replace(**{"zero_optimization.stage": 2})
    model = nn.Linear(4, 2)
    # evaluation_mode (inference, as Trainer.evaluate before training asks): placed, not wrapped
    assert accelerator.prepare_model(model, evaluation_mode=True) is model
    assert accelerator.zero_engine is None
    with pytest.raises(ValueError, match="together"):
        accelerator.prepare_model(model)
    engine, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert engine.stage == 2
    with pytest.raises(ValueError, match="after prepare"):
        accelerator.zero_config = accelerator.zero_config


def test_several_models_pair_each_optimizer_with_its_model_or_say_why_not() -> None:
    accelerator = _accelerator()
    a, b, frozen = _model(), _model(), _model().requires_grad_(False)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="two optimizers over one model"):
        accelerator.prepare(a, opt_a, torch.optim.SGD(a.parameters(), lr=0.1), frozen)
    with pytest.raises(ValueError, match="hold the parameters of one model"):
        both = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
        accelerator.prepare(a, b, both)
    with pytest.raises(ValueError, match="freeze it"):
        accelerator.prepare(b, frozen)  # b is trainable and came without its optimizer
    # in any order, in one call or several
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    ref, eb, wb, ea, wa = accelerator.prepare(frozen, b, opt_b, a, opt_a)
    assert [type(m).__name__ for m in (ref, eb, ea)] == ["ZeroEngine"] * 3
    assert wb.engine is eb and wa.engine is ea and not ref.trainable
    accelerator.free_memory()
