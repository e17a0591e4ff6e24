"""``ds-strategy consolidate`` / ``ds_strategy.consolidate`` on DeepSpeed's own checkpoints
(``tests/data/deepspeed_checkpoints``, written by DeepSpeed), as DeepSpeed's ``zero_to_fp32.py``:
the same weights as DeepSpeed's own consolidation, Hugging Face shards and index, tied weights
under every name, frozen parameters kept or left out, another tag, one tensor in memory at a
time; and the error for a directory of neither layout."""

from __future__ import annotations

import json
import re
import shutil
import sys
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from huggingface_hub import load_torch_model, split_torch_state_dict_into_shards
from safetensors import safe_open
from safetensors.torch import load_file

import ds_strategy
from ds_strategy.cli import main as cli
from ds_strategy.core.checkpoint.deepspeed import weights as ds_weights
from ds_strategy.core.checkpoint.deepspeed.layout import DeepSpeedCheckpoint

DATA = Path(__file__).resolve().parent / "data" / "deepspeed_checkpoints"
sys.path.insert(0, str(DATA))
from make_fixtures import CASES, model  # noqa: E402

sys.path.remove(str(DATA))

TAG = "global_step4"


def _reference(case: str) -> dict[str, torch.Tensor]:
    """DeepSpeed's own ``get_fp32_state_dict_from_zero_checkpoint`` of the case."""
    return load_file(DATA / case / "consolidated.safetensors")


def _in_order(case: str) -> dict[str, torch.Tensor]:
    """The reference in zero_to_fp32's order (the fixtures have no buffers or frozen
    parameters: the trained ones, in the model's order)."""
    ref = _reference(case)
    return {name: ref[name] for name, _ in model().named_parameters()}


def _copy(case: str, tmp_path: Path) -> Path:
    shutil.copytree(DATA / case / "ckpt", tmp_path / case)
    return tmp_path / case


def _model_files(root: Path) -> list[Path]:
    """The tag's model-states files, rank 0's first."""
    tag = root / TAG
    return sorted(tag.glob("*model_states.pt"), key=lambda p: p.name.replace("mp_rank_00_", ""))


def _edit(path: Path, **changes: Any) -> None:
    """Change top-level keys of a model-states file (its content loads without DeepSpeed)."""
    state = torch.load(path, weights_only=False)
    state.update(changes)
    torch.save(state, path)


def _shard_files(directory: Path, stem: str, suffix: str) -> list[Path]:
    return sorted(directory.glob(f"{stem}-*-of-*{suffix}"))


# each fixture's checkpoint, as its framework wrote it (DeepSpeed's own API, Lightning's
# DeepSpeedStrategy, Fabric, Accelerate's save_state, the HF Trainer, AutoTP's parts)
WRITTEN = {case: "ckpt" for case in CASES} | {
    "lightning_s2": "model.ckpt",
    "fabric_s2": "model.ckpt",
    "accelerate_s2": "state",
    "accelerate_s2_config": "state",
    "hf_s2": "checkpoint",
    "tp_s1": "ckpt",
}


@pytest.mark.parametrize("case", sorted(WRITTEN))
def test_the_cli_writes_what_deepspeed_consolidates(case: str, tmp_path: Path) -> None:
    """Against get_fp32_state_dict_from_zero_checkpoint (tp_s1: ds_to_universal.py's join)."""
    out = tmp_path / "model.safetensors"
    assert cli(["consolidate", str(DATA / case / WRITTEN[case]), str(out)]) == 0
    got, ref = load_file(out), _reference(case)
    assert set(got) == set(ref)
    for name, want in ref.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], want), name  # within 1e-6: exactly, the same fp32 bits


@pytest.mark.parametrize("case", ["s2_fp32", "s3_bf16"])
def test_shards_are_written_as_hugging_face_writes_them(case: str, tmp_path: Path) -> None:
    out = tmp_path / "hf" / "model.safetensors"
    limit = "0.5KB"  # 500 bytes: 2.weight (676) alone, the rest in two more shards
    argv = ["consolidate", str(DATA / case / "ckpt"), str(out), "--max-shard-size", limit]
    assert cli(argv) == 0
    shards = _shard_files(out.parent, "model", ".safetensors")
    assert len(shards) >= 3 and not out.exists()
    n = len(shards)
    assert [p.name for p in shards] == [
        f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)
    ]
    index_file = out.parent / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    assert index_file.read_text() == json.dumps(index, indent=2, sort_keys=True) + "\n"
    # the same split as huggingface_hub's (save_pretrained's and zero_to_fp32's)
    split = split_torch_state_dict_into_shards(
        _in_order(case), filename_pattern="model{suffix}.safetensors", max_shard_size=limit
    )
    assert index == {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in _reference(case).values())
    loaded: dict[str, torch.Tensor] = {}
    for shard in shards:
        with safe_open(shard, "pt") as f:
            assert f.metadata() == {"format": "pt"}  # what from_pretrained checks
        part = load_file(shard)
        assert {index["weight_map"][k] for k in part} == {shard.name}
        assert len(part) == 1 or sum(t.nbytes for t in part.values()) <= 500
        loaded.update(part)
    ref = _reference(case)
    assert set(loaded) == set(ref) and all(torch.equal(loaded[k], ref[k]) for k in ref)
    net = model()
    load_torch_model(net, out.parent, strict=True)  # Hugging Face's loader reads the index
    assert all(torch.equal(v, ref[k]) for k, v in net.state_dict().items())


def test_pt_shards_and_one_shard_is_the_output_itself(tmp_path: Path) -> None:
    ckpt = DATA / "s1_fp32" / "ckpt"
    out = tmp_path / "pytorch_model.bin"
    assert cli(["consolidate", str(ckpt), str(out), "--max-shard-size", "600"]) == 0
    shards = _shard_files(tmp_path, "pytorch_model", ".bin")
    index = json.loads((tmp_path / "pytorch_model.bin.index.json").read_text())
    assert len(shards) >= 2 and set(index["weight_map"].values()) == {p.name for p in shards}
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(torch.load(shard, weights_only=True))
    ref = _reference("s1_fp32")
    assert set(state) == set(ref) and all(torch.equal(state[k], ref[k]) for k in ref)
    # everything fits in one shard: the output file alone, the earlier shards and index gone
    assert cli(["consolidate", str(ckpt), str(out), "--max-shard-size", "5GB"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pytorch_model.bin"]
    assert set(torch.load(out, weights_only=True)) == set(ref)


@pytest.mark.parametrize("case", ["s2_fp32", "s3_bf16"])
def test_tied_weights_are_written_under_every_name(case: str, tmp_path: Path) -> None:
    root = _copy(case, tmp_path)
    _edit(_model_files(root)[0], shared_params={"head.weight": "4.weight", "x.bias": "0.bias"})
    out = tmp_path / "tied" / "model.safetensors"
    ds_strategy.consolidate(root, out)
    got, ref = load_file(out), _reference(case)
    assert set(got) == {*ref, "head.weight", "x.bias"}
    assert torch.equal(got["head.weight"], ref["4.weight"])
    assert torch.equal(got["x.bias"], ref["0.bias"])
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    # sharded: each other name in the shard of the name it is saved under, counted once
    index_file = ds_strategy.consolidate(root, out, max_shard_size=500)
    index = json.loads(index_file.read_text())
    state = _in_order(case)
    state["head.weight"], state["x.bias"] = state["4.weight"], state["0.bias"]  # shared
    split = split_torch_state_dict_into_shards(state, max_shard_size=500)
    assert index == {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
    shard = load_file(out.parent / index["weight_map"]["head.weight"])
    assert torch.equal(shard["head.weight"], ref["4.weight"])


def test_buffers_come_first_and_integers_stay_integers(tmp_path: Path) -> None:
    """zero_to_fp32's order (buffers, frozen, trained, tied names); a float buffer takes the
    output dtype, an integer one (``num_batches_tracked``) keeps its own."""
    root = _copy("s2_bf16", tmp_path)
    path = _model_files(root)[0]
    module = torch.load(path, weights_only=False)["module"]
    mean = torch.linspace(0, 1, 13).bfloat16()
    module.update({"norm.running_mean": mean, "norm.num_batches_tracked": torch.tensor(4)})
    _edit(path, module=module, buffer_names=["norm.running_mean", "norm.num_batches_tracked"])
    out = tmp_path / "model.pt"
    assert cli(["consolidate", str(root), str(out)]) == 0
    got = torch.load(out, weights_only=True)
    names = ["norm.running_mean", "norm.num_batches_tracked", *_in_order("s2_bf16")]
    assert list(got) == names
    assert got["norm.running_mean"].dtype == torch.float32
    assert torch.equal(got["norm.running_mean"], mean.float())
    assert got["norm.num_batches_tracked"].dtype == torch.int64
    assert got["norm.num_batches_tracked"].item() == 4


def _add_frozen(root: Path, stage: int) -> torch.Tensor:
    """A frozen parameter ``frozen.weight`` (5 x 3, bf16) in the checkpoint, as DeepSpeed saves
    one: its shape in every model-states file, the whole tensor in rank 0's at stages 0-2, each
    rank's padded partition at stage 3 (ceil(15 / 2) = 8 elements each)."""
    weight = torch.arange(15, dtype=torch.float32).view(5, 3).div(7).bfloat16()
    files = _model_files(root)
    if stage != 3:
        fragments = [weight]
    else:
        flat = torch.cat([weight.reshape(-1), torch.zeros(1, dtype=weight.dtype)])
        fragments = [flat[:8].clone(), flat[8:].clone()]
    for path, fragment in zip(files, fragments, strict=True):
        _edit(
            path,
            frozen_param_shapes={"frozen.weight": torch.Size([5, 3])},
            frozen_param_fragments={"frozen.weight": fragment},
            shared_params={"tied.frozen": "frozen.weight"},
        )
    return weight


@pytest.mark.parametrize("case", ["s2_bf16", "s3_bf16"])
def test_frozen_parameters_are_kept_or_left_out(case: str, tmp_path: Path) -> None:
    root = _copy(case, tmp_path)
    weight = _add_frozen(root, CASES[case][0])
    ref = _reference(case)
    out = tmp_path / "all.safetensors"
    assert cli(["consolidate", str(root), str(out)]) == 0
    got = load_file(out)
    assert set(got) == {*ref, "frozen.weight", "tied.frozen"}
    assert torch.equal(got["frozen.weight"], weight.float())
    assert torch.equal(got["tied.frozen"], weight.float())
    kept = load_file(ds_strategy.consolidate(root, tmp_path / "keep.safetensors", dtype=None))
    assert kept["frozen.weight"].dtype == torch.bfloat16
    assert torch.equal(kept["frozen.weight"], weight)
    out = tmp_path / "trained.safetensors"
    assert cli(["consolidate", str(root), str(out), "--exclude-frozen-parameters"]) == 0
    got = load_file(out)
    assert set(got) == set(ref)  # the frozen one and its tied name left out
    assert all(torch.equal(got[k], ref[k]) for k in ref)


def test_tag_picks_another_tag_directory(tmp_path: Path) -> None:
    root = _copy("s2_fp32", tmp_path)
    shutil.copytree(DATA / "s3_fp32" / "ckpt" / TAG, root / "from_s3")
    out = tmp_path / "model.safetensors"
    assert cli(["consolidate", str(root), str(out)]) == 0  # latest: global_step4
    assert all(torch.equal(load_file(out)[k], v) for k, v in _reference("s2_fp32").items())
    assert cli(["consolidate", str(root), str(out), "--tag", "from_s3"]) == 0
    assert all(torch.equal(load_file(out)[k], v) for k, v in _reference("s3_fp32").items())
    with pytest.raises(FileNotFoundError, match=r"no_such_tag.*ds_strategy\.json"):
        ds_strategy.consolidate(root, out, tag="no_such_tag")


def test_a_directory_of_neither_layout_is_an_error_naming_both(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("not a checkpoint")
    out = tmp_path / "model.safetensors"
    assert cli(["consolidate", str(tmp_path / "run"), str(out)]) == 2
    said = capsys.readouterr().err
    assert "neither a ds_strategy checkpoint" in said and "ds_strategy.json" in said
    assert "DeepSpeed checkpoint" in said and "mp_rank_00_model_states.pt" in said
    assert not out.exists()
    with pytest.raises(FileNotFoundError, match=r"ds_strategy\.json.*mp_rank_00_model_states"):
        ds_strategy.consolidate(tmp_path / "run", out)


def test_a_bad_shard_size_is_refused_before_reading(tmp_path: Path) -> None:
    for size in ("5XB", "0", "-3MB", "lots"):
        argv = [
            "consolidate",
            "no/such",
            str(tmp_path / "m.safetensors"),
            f"--max-shard-size={size}",
        ]
        assert cli(argv) == 2
    with pytest.raises(ValueError, match=r"max_shard_size '5XB'.*5GB"):
        ds_strategy.consolidate(
            DATA / "s1_fp32" / "ckpt", tmp_path / "m.safetensors", max_shard_size="5XB"
        )


class _Planted:
    def __reduce__(self) -> Any:
        return (print, ("ran code from the checkpoint",))


def test_a_pickled_object_needs_trust_checkpoint(tmp_path: Path) -> None:
    root = _copy("s2_fp32", tmp_path)
    _edit(_model_files(root)[0], epoch=_Planted())
    out = tmp_path / "model.safetensors"
    with pytest.raises(ds_strategy.UntrustedContentError, match="trust_checkpoint=True"):
        ds_strategy.consolidate(root, out)
    assert cli(["consolidate", str(root), str(out)]) == 2 and not out.exists()
    assert cli(["consolidate", str(root), str(out), "--trust-checkpoint"]) == 0
    assert all(torch.equal(load_file(out)[k], v) for k, v in _reference("s2_fp32").items())


class _Live:
    """How many of the tensors a function returned are alive at once, at most."""

    def __init__(self) -> None:
        self.now = self.peak = self.calls = 0

    def wrap(self, fn: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
            t = fn(*args, **kwargs)
            self.calls += 1
            self.now += 1
            self.peak = max(self.peak, self.now)
            weakref.finalize(t, self._dead)
            return t

        return counted

    def _dead(self) -> None:
        self.now -= 1


@pytest.mark.parametrize("case", ["s2_bf16", "s3_fp32"])
@pytest.mark.parametrize("shard_size", [None, 600])
def test_consolidating_holds_one_tensor_at_a_time(
    case: str, shard_size: int | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every tensor written passes through ``DeepSpeedWeights.read`` (and the partition reader
    under it), and no two of them are alive at once: the export never holds the model."""
    root = _copy(case, tmp_path)
    _add_frozen(root, CASES[case][0])
    written, partitions = _Live(), _Live()
    monkeypatch.setattr(
        ds_weights.DeepSpeedWeights, "read", written.wrap(ds_weights.DeepSpeedWeights.read)
    )
    monkeypatch.setattr(DeepSpeedCheckpoint, "read", partitions.wrap(DeepSpeedCheckpoint.read))
    out = tmp_path / "model.safetensors"
    ds_strategy.consolidate(root, out, max_shard_size=shard_size)
    names = [*_reference(case), "frozen.weight", "tied.frozen"]
    assert written.calls == len(names)  # the tied name is read again, never kept
    assert partitions.calls == len(_reference(case))
    assert written.peak == 1 and partitions.peak == 1
    files = [out] if shard_size is None else _shard_files(tmp_path, "model", ".safetensors")
    assert sorted(k for f in files for k in load_file(f)) == sorted(names)


def test_shard_names_follow_the_output_name(tmp_path: Path) -> None:
    out = tmp_path / "weights" / "ema.safetensors"
    ds_strategy.consolidate(DATA / "s1_bf16" / "ckpt", out, max_shard_size="1KB")
    names = sorted(p.name for p in out.parent.iterdir())
    assert names[-1] == "ema.safetensors.index.json"
    assert all(re.fullmatch(r"ema-\d{5}-of-\d{5}\.safetensors", n) for n in names[:-1])
