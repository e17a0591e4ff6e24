"""The shard writer's rules against Hugging Face's own
(``huggingface_hub.split_torch_state_dict_into_shards``, which ``save_pretrained`` calls)."""

from __future__ import annotations

import pytest
import torch
from huggingface_hub import split_torch_state_dict_into_shards
from huggingface_hub.serialization._base import parse_size_to_int

from ds_strategy.core.checkpoint.weights_shards import WeightEntry, parse_size, plan_shards


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
