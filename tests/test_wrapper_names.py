"""A model given to the engine inside ``torch.compile`` (or ``DataParallel``) is saved under
its own names: ``full_state_dict``, ``save_weights``, checkpoints and ``consolidate`` drop the
wrapper's ``_orig_mod.`` / ``module.``, so a compiled run's weights and checkpoints load into
the plain model and the plain model's into a compiled one; a user's own submodule named
``module`` keeps its name (2 gloo ranks; ``core/names.py``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import ds_strategy
from ds_strategy.demos.gpt import GPT, GPTConfig
from tests.distributed import run_ranks
from tests.models import lm_loss

STAGES = (1, 3)


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=64, d=32, heads=2, layers=2, seq=16))


def config(stage: int) -> dict[str, Any]:
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    return {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero}


def engine_of(model: nn.Module, stage: int) -> Any:
    return ds_strategy.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=0.01), config(stage)
    )


def one_step(engine: Any, rank: int) -> None:
    tokens = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(1))
    engine.backward(lm_loss(engine, tokens[rank * 2 : rank * 2 + 2]))
    engine.step()


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def loads(load: Callable[[], Any]) -> bool:
    """False where names do not match (every rank raises alike: the load is collective)."""
    try:
        load()
    except (RuntimeError, ValueError):
        return False
    return True


def compiled_worker(rank: int, world: int, tmp: str, stage: int) -> dict[str, Any]:
    """Train a compiled GPT a step and save it; load that into a plain engine, and a plain
    engine's checkpoint into a compiled one; export its weights both ways."""
    root = Path(tmp) / f"stage{stage}"
    compiled = engine_of(torch.compile(gpt(), backend="eager"), stage)
    one_step(compiled, rank)
    trained = compiled.full_state_dict()
    plain_loads = rank != 0 or loads(lambda: gpt().load_state_dict(trained, strict=True))
    compiled.save_checkpoint(root / "from_compiled")
    compiled.save_weights(root / "weights.safetensors")
    compiled.destroy()

    plain = engine_of(gpt(), stage)
    into_plain = loads(lambda: plain.load_checkpoint(root / "from_compiled"))
    into_plain = into_plain and same(plain.full_state_dict(), trained)
    one_step(plain, rank)
    stepped = plain.full_state_dict()
    plain.save_checkpoint(root / "from_plain")
    plain.destroy()

    again = engine_of(torch.compile(gpt(), backend="eager"), stage)
    into_compiled = loads(lambda: again.load_checkpoint(root / "from_plain"))
    into_compiled = into_compiled and same(again.full_state_dict(), stepped)
    again.destroy()
    torch._dynamo.reset()  # the pool's ranks run other tests next: no compiled code left
    out = {"into_plain": into_plain, "into_compiled": into_compiled, "plain_loads": plain_loads}
    if rank == 0:
        out["keys"] = sorted(trained)
        out["file_keys"] = sorted(load_file(root / "weights.safetensors"))
        merged = ds_strategy.consolidate(root / "from_compiled", root / "merged.safetensors")
        out["consolidated"] = sorted(load_file(merged))
    return out


@pytest.fixture(scope="module")
def compiled_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, Any]]]:
    tmp = str(tmp_path_factory.mktemp("wrapped"))
    return {s: run_ranks(compiled_worker, 2, tmp, s) for s in STAGES}


@pytest.mark.parametrize("stage", STAGES)
def test_a_compiled_models_weights_have_the_plain_models_names(
    compiled_runs: dict[int, list[dict[str, Any]]], stage: int
) -> None:
    r0 = compiled_runs[stage][0]
    want = sorted(gpt().state_dict())
    assert r0["keys"] == want  # no '_orig_mod.' on any of them
    assert r0["plain_loads"]  # load_state_dict(strict=True) into the plain GPT
    assert r0["file_keys"] == want  # save_weights' file


@pytest.mark.parametrize("stage", STAGES)
def test_checkpoints_move_between_compiled_and_plain_engines(
    compiled_runs: dict[int, list[dict[str, Any]]], stage: int
) -> None:
    for r in compiled_runs[stage]:
        assert r["into_plain"] and r["into_compiled"]  # the weights as saved, on every rank
    # the plain GPT's keys, less the tied head (a checkpoint holds a tied weight once)
    plain = set(gpt().state_dict()) - {"head.weight"}
    assert set(compiled_runs[stage][0]["consolidated"]) == plain


class Holder(nn.Module):
    """A user's model whose layer is an attribute named like a wrapper's."""

    def __init__(self, attr: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        setattr(self, attr, nn.Linear(4, 3))
        self.out = nn.Linear(3, 2)


def named_like_wrappers_worker(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """A ``module`` submodule inside ``DataParallel``, and a checkpoint whose names carry
    ``_orig_mod.`` as one saved from a compiled model before names were unwrapped."""
    wrapped = engine_of(nn.DataParallel(Holder("module")), 3)
    keys = sorted(wrapped.full_state_dict())
    wrapped.save_checkpoint(Path(tmp) / "dp")
    wrapped.destroy()
    old = engine_of(Holder("_orig_mod"), 1)  # on disk as an older compiled save wrote it
    old.save_checkpoint(Path(tmp) / "old")
    old.destroy()
    out: dict[str, Any] = {"keys": keys}
    if rank == 0:
        dp = ds_strategy.consolidate(Path(tmp) / "dp", Path(tmp) / "dp.safetensors")
        out["dp"] = sorted(load_file(dp))
        merged = ds_strategy.consolidate(Path(tmp) / "old", Path(tmp) / "old.safetensors")
        out["old"] = sorted(load_file(merged))
    return out


def test_only_a_wrappers_attribute_is_dropped(tmp_path: Path) -> None:
    results = run_ranks(named_like_wrappers_worker, 2, str(tmp_path))
    want = ["module.bias", "module.weight", "out.bias", "out.weight"]
    for r in results:
        assert r["keys"] == want  # DataParallel's 'module.' dropped, the user's kept
    assert results[0]["dp"] == want
    # consolidate drops '_orig_mod.' from an older compiled model's checkpoint
    assert results[0]["old"] == ["bias", "out.bias", "out.weight", "weight"]


def test_names_map_by_the_module_tree() -> None:
    from ds_strategy.core.names import plain_names, saved_name

    inner = Holder("module")
    inner.out = torch.compile(inner.out, backend="eager")  # a compiled submodule
    plain = plain_names(nn.DataParallel(torch.compile(inner, backend="eager")))
    assert plain("module._orig_mod.module.weight") == "module.weight"
    assert plain("module._orig_mod.out._orig_mod.bias") == "out.bias"
    assert plain_names(Holder("module"))("module.weight") == "module.weight"
    assert saved_name("_orig_mod.blocks.0._orig_mod.w") == "blocks.0.w"


class OlderSave(nn.Module):
    """The GPT under ``_orig_mod``: checkpoint names as a compiled model's were saved before
    names were unwrapped."""

    def __init__(self) -> None:
        super().__init__()
        self._orig_mod = gpt()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self._orig_mod(idx)


def older_save_worker(rank: int, world: int, tmp: str) -> dict[str, bool]:
    older = engine_of(OlderSave(), 3)
    one_step(older, rank)
    want = {k.removeprefix("_orig_mod."): v for k, v in older.full_state_dict().items()}
    older.save_checkpoint(Path(tmp) / "older")
    older.destroy()
    out = {}
    for name, model in (("plain", gpt()), ("compiled", torch.compile(gpt(), backend="eager"))):
        engine = engine_of(model, 1)
        out[name] = loads(lambda e=engine: e.load_checkpoint(Path(tmp) / "older"))
        out[name] = out[name] and same(engine.full_state_dict(), want)
        out[name] = out[name] and len(engine.optimizer.state) > 0  # Adam's moments too
        engine.destroy()
    return out


def test_an_older_compiled_checkpoint_loads_into_plain_and_compiled_models(
    tmp_path: Path,
) -> None:
    for r in run_ranks(older_save_worker, 2, str(tmp_path)):
        assert r == {"plain": True, "compiled": True}
