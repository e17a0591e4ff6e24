"""``consolidate``'s options on our own checkpoints (``--tag``, ``--max-shard-size``,
``--exclude-frozen-parameters``) and the shard writer's rules against Hugging Face's own
(``huggingface_hub.split_torch_state_dict_into_shards``, which ``save_pretrained`` calls)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from huggingface_hub import split_torch_state_dict_into_shards
from huggingface_hub.serialization._base import parse_size_to_int
from safetensors.torch import load_file

import ds_strategy
from ds_strategy.cli import main as cli
from ds_strategy.core.checkpoint.weights_shards import WeightEntry, parse_size, plan_shards

FROZEN = "0.bias"


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2))
    net[0].bias.requires_grad_(False)
    return net


def _cpu(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in state.items()}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One process trains a model with a frozen parameter at ZeRO-2, saving tag ``a`` after one
    step, ``b`` (the latest) after two, and ``fresh`` before any step."""
    root = tmp_path_factory.mktemp("own") / "run"
    net = _model()
    opt = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=0.05)
    engine = ds_strategy.initialize(
        net, opt, {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}
    )
    engine.save_checkpoint(root / "unstepped", tag="fresh")
    states = {}
    g = torch.Generator().manual_seed(3)
    for tag in ("a", "b"):
        loss = engine(torch.randn(4, 4, generator=g)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        engine.save_checkpoint(root, tag=tag)
        states[tag] = _cpu(engine.full_state_dict())
    engine.save_checkpoint(root / "weights_only", include_optimizer=False)
    engine.destroy()
    assert not torch.equal(states["a"]["2.weight"], states["b"]["2.weight"])
    return {"root": root, "states": states}


def _equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v.to(got[k].dtype)), k


def test_exclude_frozen_parameters_leaves_out_weights_without_optimizer_state(
    run: dict[str, Any], tmp_path: Path
) -> None:
    want = run["states"]["b"]
    out = tmp_path / "all.safetensors"
    assert cli(["consolidate", str(run["root"]), str(out)]) == 0
    _equal(load_file(out), want)  # buffers, the frozen bias, the trained weights
    out = tmp_path / "trained.safetensors"
    assert cli(["consolidate", str(run["root"]), str(out), "--exclude-frozen-parameters"]) == 0
    got = load_file(out)
    assert FROZEN not in got and "1.running_mean" in got  # buffers are kept, as zero_to_fp32
    _equal(got, {k: v for k, v in want.items() if k != FROZEN})


@pytest.mark.parametrize(
    ("where", "said"),
    [
        ("weights_only", r"saved without optimizer state.*does not record which parameters"),
        ("unstepped", r"optimizer state for no parameter.*does not record which parameters"),
    ],
)
def test_exclude_frozen_needs_a_checkpoint_that_records_them(
    run: dict[str, Any], tmp_path: Path, where: str, said: str
) -> None:
    out = tmp_path / "model.safetensors"
    with pytest.raises(ValueError, match=said):
        ds_strategy.consolidate(run["root"] / where, out, exclude_frozen_parameters=True)
    assert not out.exists()
    ds_strategy.consolidate(run["root"] / where, out)  # without the option it exports
    assert FROZEN in load_file(out)


def test_tag_exports_another_checkpoint_of_the_root(run: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    assert cli(["consolidate", str(run["root"]), str(out), "--tag", "a"]) == 0
    _equal(load_file(out), run["states"]["a"])
    ds_strategy.consolidate(run["root"], out, tag="b")
    _equal(load_file(out), run["states"]["b"])


def test_our_checkpoint_in_shards(run: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    index_file = ds_strategy.consolidate(run["root"], out, max_shard_size=60)
    assert index_file == tmp_path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n >= 3 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(tmp_path / name))
    want = run["states"]["b"]
    _equal(state, want)
    in_order = {k: state[k] for k in sorted(state, key=lambda k: (k not in _buffers(), k))}
    split = split_torch_state_dict_into_shards(in_order, max_shard_size=60)
    assert index == {"metadata": split.metadata, "weight_map": split.tensor_to_filename}


def _buffers() -> set[str]:
    return {name for name, _ in _model().named_buffers()}


@pytest.mark.parametrize("text", ["5GB", "500MB", "10KB", "1.5GB", " 2 TB ", "0.5KB", "7kb"])
def test_sizes_read_as_hugging_face_reads_them(text: str) -> None:
    assert parse_size(text) == parse_size_to_int(text)


def test_sizes_in_bytes_and_binary_units() -> None:
    assert parse_size(1000) == parse_size("1000") == 1000
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("3MiB") == 3 * 2**20
    for bad in ("5XB", "GB", "", 0, -1, "0KB", 2.5, True):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("limit", [10, 12, 6, 1])
def test_shards_fill_as_hugging_face_fills_them(limit: int) -> None:
    """huggingface_hub's own example (sizes 6, 6, 2, 6, 2, 2 under 10 give [6], [6+2],
    [6+2+2]), a tensor over the limit in the middle, and tied names."""
    sizes = [6, 6, 2, 6, 11, 2, 2, 3]
    state = {f"w{i}": torch.zeros(n, dtype=torch.int8) for i, n in enumerate(sizes)}
    state["tied_a"], state["tied_b"] = state["w4"], state["w1"]
    entries = [WeightEntry(k, torch.int8, (n,)) for k, n in zip(state, sizes, strict=False)]
    entries += [WeightEntry("tied_a", torch.int8, (11,), "w4")]
    entries += [WeightEntry("tied_b", torch.int8, (6,), "w1")]
    got = [[e.name for e in shard] for shard in plan_shards(entries, limit)]
    split = split_torch_state_dict_into_shards(state, max_shard_size=limit)
    assert got == list(split.filename_to_tensors.values())
