"""Single-process tests of the core's public interfaces: building an optimizer from a config
section and moving a loop's schedulers onto an engine, the root an engine wraps for a loop, and
the engine's step with an outside gradient norm and its checkpoint state."""

from __future__ import annotations

import ast
import copy
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import ds_strategy
from ds_strategy.config import ConfigError, OptimizerConfig, load_config
from ds_strategy.core.checkpoint.validate import has_optimizer_state
from ds_strategy.core.optimizers import (
    build_optimizer,
    move_schedulers,
    optimizer_class,
    optimizer_factory,
    track_optimizer_step,
)
from ds_strategy.core.root import SharedRoot
from tests.seam_reads import ENGINE, engine_members, reads

PACKAGE = Path(ds_strategy.__file__).parent

# -- optimizers from a config section ----------------------------------------------------------------


def test_optimizer_class_is_case_insensitive_and_names_the_valid_ones() -> None:
    assert optimizer_class("adamw") is torch.optim.AdamW
    assert optimizer_class("SGD") is torch.optim.SGD
    with pytest.raises(ConfigError, match="unknown optimizer 'FusedAdam'") as info:
        optimizer_class("FusedAdam")
    assert info.value.key == "optimizer.type"
    assert "is not a torch.optim optimizer" in str(info.value)
    assert "AdamW" in str(info.value) and "Optimizer," not in str(info.value)


def test_build_optimizer_keeps_param_groups() -> None:
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))
    section = load_config({"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}).optimizer
    opt = build_optimizer(section, [{"params": [a]}, {"params": [b], "lr": 0.5}])
    assert isinstance(opt, torch.optim.AdamW)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.5]


def test_unknown_params_are_named_before_anything_is_built() -> None:
    section = OptimizerConfig("AdamW", {"lr": 1e-3, "lookahead": 5, "torch_adam": True})
    for build in (lambda: optimizer_factory(section), lambda: build_optimizer(section, [])):
        with pytest.raises(ConfigError, match=r"\['lookahead'\] are not") as info:
            build()  # DeepSpeed's own params (torch_adam) are not the problem: they are mapped
        assert info.value.key == "optimizer.params"
        assert "weight_decay" in str(info.value) and "torch_adam" in str(info.value)


def test_a_rejected_value_is_a_config_error() -> None:
    factory = optimizer_factory(OptimizerConfig("SGD", {"lr": "fast"}))  # the keys are fine
    with pytest.raises(ConfigError, match="SGD rejected") as info:
        factory([nn.Parameter(torch.zeros(1))])
    assert info.value.key == "optimizer.params"
    with pytest.raises(ConfigError, match="no 'optimizer' section") as info:
        optimizer_factory(None)
    assert info.value.key == "optimizer"


def test_track_optimizer_step_is_idempotent_and_silences_the_scheduler() -> None:
    p = nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    # what the engine does: a rebuilt optimizer's step has no scheduler wrapper
    rebuilt = torch.optim.SGD([p], lr=0.1)
    sched.optimizer = rebuilt
    track_optimizer_step(rebuilt)
    wrapper = rebuilt.step
    track_optimizer_step(rebuilt)
    assert rebuilt.step is wrapper  # not wrapped twice
    p.grad = torch.ones(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()"
        rebuilt.step()
        sched.step()
    assert float(p.detach()) == pytest.approx(0.9)


def test_move_schedulers_points_them_at_the_engine_optimizer_unless_the_config_schedules() -> None:
    p = nn.Parameter(torch.ones(1))
    sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([p], lr=0.1), 1)
    engine = _engine()
    move_schedulers(engine, [sched])
    assert sched.optimizer is engine.optimizer
    assert engine.optimizer.step._wrapped_by_lr_sched  # type: ignore[attr-defined]
    scheduled = _engine(scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 2}})
    with pytest.raises(ValueError, match=r"scheduler section \(WarmupLR\).*remove the section"):
        move_schedulers(scheduled, [sched])
    move_schedulers(scheduled, [])  # no scheduler of the loop's: nothing to refuse


# -- the root an engine wraps when a loop's step runs through the forward -----------------------------


class _Stepper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.body = nn.Linear(2, 2)
        self.register_buffer("seen", torch.zeros(1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale


def test_shared_root_has_the_module_tables_without_a_prefix() -> None:
    module = _Stepper()
    root = SharedRoot(module)
    assert (
        list(root.state_dict())
        == list(module.state_dict())
        == ["scale", "body.weight", "body.bias"]
    )
    assert [n for n, _ in root.named_buffers()] == ["seen"]
    assert list(root.children()) == [module.body]  # the module itself is no child
    root.scale = nn.Parameter(torch.full((1,), 2.0))  # one table: set on either, seen by both
    assert module.scale is root.scale
    x = torch.ones(1, 2)
    assert torch.equal(root(x), module(x))
    root.eval()
    assert not module.training and not module.body.training and not root.training
    root.train()
    assert module.training and module.body.training


def test_has_optimizer_state_reads_the_checkpoint_metadata(tmp_path: Path) -> None:
    engine = _engine()
    engine.save_checkpoint(tmp_path / "full")
    engine.save_checkpoint(tmp_path / "weights", include_optimizer=False)
    assert has_optimizer_state(tmp_path / "full")
    assert not has_optimizer_state(tmp_path / "weights")
    assert has_optimizer_state(tmp_path / "missing")  # unreadable: the load names the problem


# -- the engine's step with an outside norm, and its checkpoint state --------------------------------


def _engine(clip: float = 0.0, **extra: object) -> ds_strategy.ZeroEngine:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    config = {"zero_optimization": {"stage": 1}, "gradient_clipping": clip, **extra}
    return ds_strategy.initialize(model, opt, config)


def _backward(engine: ds_strategy.ZeroEngine) -> None:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    engine.backward(engine(x).square().sum())


def test_step_clips_by_the_norm_it_is_given() -> None:
    engine = _engine(clip=1.0)
    before = copy.deepcopy(engine.full_state_dict())
    _backward(engine)
    own = engine.reduced_grad_norm()
    assert engine.reduced_grad_norm() == own  # once per boundary
    grads = {id(pc.tensor): pc.grad().clone() for pc in engine.optimizer_pieces}
    engine.step(grad_norm=10 * own)  # the norm of a larger model this engine is part of
    assert engine.get_global_grad_norm() == pytest.approx(10 * own)
    coef = 1.0 / (10 * own + 1e-6)
    after = engine.full_state_dict()
    moved = sum(float((after[k] - before[k]).abs().sum()) for k in after)
    want = sum(float(g.abs().sum()) for g in grads.values()) * coef  # SGD, lr 1
    assert moved == pytest.approx(want, rel=1e-5)


def test_step_skips_on_a_non_finite_outside_norm() -> None:
    engine = _engine(max_consecutive_skipped_steps=2)
    before = copy.deepcopy(engine.full_state_dict())
    _backward(engine)
    engine.step(grad_norm=float("nan"))
    assert (engine.skipped_steps, engine.global_steps) == (1, 1)
    assert all(torch.equal(v, before[k]) for k, v in engine.full_state_dict().items())
    _backward(engine)
    with pytest.raises(FloatingPointError, match="max_consecutive_skipped_steps=2"):
        engine.step(grad_norm=float("inf"))
    engine.set_gradient_accumulation_boundary(False)
    with pytest.raises(RuntimeError, match="between accumulation boundaries"):
        engine.step(grad_norm=1.0)


def test_checkpoint_state_round_trip() -> None:
    engine = _engine()
    sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, 1, gamma=0.5)
    engine.lr_scheduler = sched
    for _ in range(2):
        _backward(engine)
        engine.step()
    state = engine.checkpoint_state()
    assert state["global_steps"] == 2 and state["micro_steps"] == 2
    assert state["skipped_steps"] == 0 and state["loss_scaler"] is None
    assert state["lr_scheduler"]["last_epoch"] == 2
    fresh = _engine()
    fresh.lr_scheduler = torch.optim.lr_scheduler.StepLR(fresh.optimizer, 1, gamma=0.5)
    fresh.restore_checkpoint_state(state, lr_scheduler=False)
    assert fresh.global_steps == 2 and fresh.lr_scheduler.last_epoch == 0
    fresh.restore_checkpoint_state(state)
    assert fresh.lr_scheduler.get_last_lr() == sched.get_last_lr() == [0.25]
    # the optimizer's pieces: what it updates on this rank, all of it in a world of one
    pieces = fresh.optimizer_pieces
    held = {id(t) for g in fresh.optimizer.param_groups for t in g["params"]}
    assert {id(pc.tensor) for pc in pieces} == held
    assert sum(pc.tensor.numel() for pc in pieces) == 4 * 3 + 3


def test_both_engines_answer_the_training_engine_calls() -> None:
    """Front ends save, load, export and destroy either engine through the same calls."""
    import inspect

    from ds_strategy.core.pipeline import PipelineEngine
    from ds_strategy.core.training import TrainingEngine

    calls = ["save_checkpoint", "load_checkpoint", "full_state_dict", "save_weights"]
    calls += ["wait_for_checkpoint", "destroy"]
    for cls in (ds_strategy.ZeroEngine, PipelineEngine):
        for name in calls:
            want = list(inspect.signature(getattr(TrainingEngine, name)).parameters.values())
            have = inspect.signature(getattr(cls, name)).parameters
            positional = list(have)
            for i, p in enumerate(want):
                assert p.name in have, f"{cls.__name__}.{name} lacks {p.name}"
                got = have[p.name]
                assert (got.kind, got.default) == (p.kind, p.default), f"{cls.__name__}.{name}"
                if p.kind is p.POSITIONAL_OR_KEYWORD:
                    assert positional[i] == p.name, f"{cls.__name__}.{name}: {p.name} moved"


# -- the checkpoint seam -----------------------------------------------------------------------------


def _seam_members() -> set[str]:
    from ds_strategy.core.checkpoint.seam import CheckpointedEngine

    names = set(getattr(CheckpointedEngine, "__annotations__", {}))
    names |= {n for n in vars(CheckpointedEngine) if not n.startswith("_")}
    return names


def test_checkpoint_code_reads_only_the_seam_of_an_engine() -> None:
    """Every ``engine.<name>`` the checkpoint modules read is a member of the protocol (so the
    protocol is the whole list); they read no underscore attribute, and no flat group or
    sharding plan at all: the engine's records carry each piece's place."""
    found = reads(PACKAGE / "core" / "checkpoint")
    members = engine_members(found)
    assert members and members <= _seam_members(), sorted(members - _seam_members())
    assert [str(r) for r in found if r.private] == []
    assert [str(r) for r in found if r.kind != ENGINE] == []
    # what the engine's layout is read from, none of it reached another way
    names = set()
    for path in (PACKAGE / "core" / "checkpoint").glob("*.py"):
        names |= {
            n.attr for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute)
        }
    assert names & {"plan", "groups", "layout", "master", "tensor_parallel", "states"} == set()


def test_inference_code_reads_no_underscore_attribute_of_an_engine_group_or_plan() -> None:
    found = reads(PACKAGE / "core" / "inference")
    assert [str(r) for r in found if r.private] == []


def test_the_seam_walker_follows_names_bound_from_an_engine(tmp_path: Path) -> None:
    (tmp_path / "code.py").write_text(
        "def save(engine, groups: list[FlatParamGroup], n):\n"
        "    plan = engine.plan\n"
        "    for g in plan.groups:\n"
        "        g._master.view(-1)\n"
        "    info = engine.tensor_parallel.params.get(n) if n else None\n"
        "    for i, h in enumerate(groups):\n"
        "        h.layout.pieces(0)\n"
        "    return info.full_runs, groups.copy(), self.engine.checkpoint_comm.rank\n"
    )
    found = reads(tmp_path)
    chains = {(r.kind, ".".join(r.chain)) for r in found}
    assert ("engine", "plan.groups.[]._master.view") in chains
    assert ("engine", "tensor_parallel.params.get.().full_runs") in chains
    assert ("group", "layout.pieces") in chains
    assert ("engine", "checkpoint_comm.rank") in chains
    assert not any("copy" in c for _, c in chains)  # the list's own method, not a group's
    assert [str(r).split(": ")[1] for r in found if r.private] == [
        "engine.plan.groups.[]._master",
        "engine.plan.groups.[]._master.view",
    ]
    assert engine_members(found) == {"plan", "tensor_parallel", "checkpoint_comm"}


def test_an_engine_has_every_member_of_the_checkpoint_seam() -> None:
    model = nn.Linear(4, 4)
    engine = ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {})
    try:
        missing = [n for n in sorted(_seam_members()) if not hasattr(engine, n)]
        assert missing == []
    finally:
        engine.destroy()


def test_checkpoint_entry_keys_are_records_with_the_on_disk_names() -> None:
    from ds_strategy.core.checkpoint.keys import EntryKey

    cases = {
        "model/blocks.0.attn.weight": EntryKey("model", "blocks.0.attn.weight"),
        "buffer/norm.running_mean": EntryKey("buffer", "norm.running_mean"),
        "optim/head.weight/exp_avg": EntryKey("optim", "head.weight", "exp_avg"),
        "optim_scalar/head.weight/step": EntryKey("optim_scalar", "head.weight", "step"),
        "compression/w/residual": EntryKey("compression", "w", "residual"),
    }
    for text, entry in cases.items():
        assert EntryKey.parse(text) == entry and entry.text == text
    for other in ("engine", "rng/0", "optim_groups", "client_state", "optim/no_state"):
        assert EntryKey.parse(other) is None
    assert EntryKey("model", "a.w").under("b.w").text == "model/b.w"
