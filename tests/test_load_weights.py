"""``engine.load_weights``: pretrained weights straight into the shards of a model built on the
meta device, as Hugging Face's ``save_pretrained`` writes them (sharded index, any dtype, tied
weights), each rank reading its own shard's bytes; buffers the files lack computed as the
model's own initialisation computes them, or refused by name.

A tiny Llama (2 layers, width 32) is saved once per test module; every weight is really
sharded (``stage3_param_persistence_threshold: 0``, small buckets).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel  # noqa: E402

import ds_strategy  # noqa: E402
from ds_strategy.core.checkpoint.errors import CheckpointError  # noqa: E402
from ds_strategy.core.checkpoint.weights_source import open_weights  # noqa: E402
from tests.distributed import WorkerError, run_ranks, run_ranks_each  # noqa: E402

VOCAB = 64


def llama_config(tied: bool = False) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )


def zero_config(stage: int, **extra: Any) -> dict[str, Any]:
    zc = {"stage": stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 500}
    zc.update(extra.pop("zero", {}))
    return {"zero_optimization": zc, "train_micro_batch_size_per_gpu": 2, **extra}


@pytest.fixture(scope="module")
def pretrained() -> dict[str, str]:
    """Directories as save_pretrained writes them: fp32 in shards, bf16 in one file, tied."""
    root = Path(tempfile.mkdtemp(prefix="pretrained-"))
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config())
    model.save_pretrained(root / "fp32", max_shard_size="20KB")
    model.to(torch.bfloat16).save_pretrained(root / "bf16")
    torch.save(model.float().state_dict(), root / "weights.bin")
    torch.manual_seed(1)
    LlamaForCausalLM(llama_config(tied=True)).save_pretrained(root / "tied")
    return {k: str(root / k) for k in ("fp32", "bf16", "tied", "weights.bin")}


def _meta_llama(tied: bool = False, cls: type = LlamaForCausalLM) -> nn.Module:
    with torch.device("meta"):
        return cls(llama_config(tied))


def _plain(path: str, tied: bool = False) -> nn.Module:
    if path.endswith(".bin"):
        model = LlamaForCausalLM(llama_config(tied))
        model.load_state_dict(torch.load(path, weights_only=True))
        return model
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)


def load_and_compare(
    rank: int, world: int, path: str, config: dict[str, Any], tied: bool = False
) -> dict[str, Any]:
    """The engine's weights against the plain model's (from_pretrained), and both first losses."""
    model = _meta_llama(tied)
    engine = ds_strategy.initialize(model, torch.optim.AdamW(model.parameters(), 1e-3), config)
    result = engine.load_weights(path)
    full = engine.full_state_dict()
    plain = _plain(path, tied)
    torch.manual_seed(10 + rank)
    tokens = torch.randint(0, VOCAB, (2, 12))
    loss = engine(input_ids=tokens, labels=tokens).loss.float().item()
    expect = plain(input_ids=tokens, labels=tokens).loss.item()
    engine.backward(engine(input_ids=tokens, labels=tokens).loss)
    engine.step()  # the loaded shards train
    state = plain.state_dict()
    out = {
        "unequal": [k for k in state if not torch.equal(full[k], state[k].float())],
        "keys": sorted(full) == sorted(state),
        "losses": (loss, expect),
        "missing": result.missing,
        "unexpected": result.unexpected,
        "inv_freq": engine.module.model.rotary_emb.inv_freq.tolist(),
        "plain_inv_freq": plain.model.rotary_emb.inv_freq.tolist(),
    }
    engine.destroy()  # (its swap threads, with NVMe offload)
    return out


def write_inputs(root: Path, pretrained: dict[str, str]) -> dict[str, str]:
    """The files the refusal and buffer cases read, under ``root``."""
    from safetensors.torch import save_file

    state = _plain(pretrained["fp32"]).state_dict()
    bad = root / "refused"
    for name in ("missing", "shape", "header", "outside", "empty"):
        (bad / name).mkdir(parents=True)
    save_file({k: v for k, v in state.items() if "layers.1.mlp.up_proj" not in k},
              str(bad / "missing" / "model.safetensors"))  # fmt: skip
    wrong = dict(state, **{"model.norm.weight": torch.ones(33)})
    save_file(wrong, str(bad / "shape" / "model.safetensors"))
    (bad / "header" / "model.safetensors").write_bytes(b"\xff" * 64)
    index = {"weight_map": {"lm_head.weight": "../model.safetensors"}}
    (bad / "outside" / "model.safetensors.index.json").write_text(json.dumps(index))
    buffers = root / "buffers"
    buffers.mkdir()
    for persistent in (False, True):
        kept = Rotary(persistent).state_dict()
        save_file(dict(kept), str(buffers / f"persistent{int(persistent)}.safetensors"))
    (root / "swap").mkdir()
    return {"refused": str(bad), "buffers": str(buffers), "swap": str(root / "swap")}


FORMATS = [
    ("bf16", 3, {}),  # a bf16 file into fp32 shards: the bf16 values, cast
    ("weights.bin", 1, {}),  # a torch.save'd state dict, at stage 1
    ("tied", 2, {"bf16": {"enabled": True}}),  # tied embeddings; fp32 masters under bf16
]


@pytest.fixture(scope="module")
def runs(pretrained: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every 2-rank case below, in one call of the ranks (transformers imported once)."""
    inputs = write_inputs(tmp_path_factory.mktemp("inputs"), pretrained)
    fp32 = pretrained["fp32"]
    calls: dict[str, tuple[Any, tuple]] = {
        "fp32": (load_and_compare, (fp32, zero_config(3))),
        "bytes": (bytes_read, (fp32,)),
        "nvme": (nvme_load, (fp32, inputs["swap"])),
        "base": (base_from_head, (fp32,)),
        "buffers": (unset_buffer, (inputs["buffers"],)),
        "refused": (refusals, (inputs["refused"],)),
    }
    for source, stage, extra in FORMATS:
        config = zero_config(stage, **extra)
        calls[source] = (load_and_compare, (pretrained[source], config, source == "tied"))
    results = run_ranks_each(list(calls.values()), 2)
    return dict(zip(calls, results, strict=True))


def test_a_sharded_fp32_directory_loads_into_zero3_bit_for_bit_with_the_same_first_loss(
    runs: dict[str, Any],
) -> None:
    for res in runs["fp32"]:
        assert res["keys"] and res["unequal"] == [], res["unequal"]
        assert res["losses"][0] == pytest.approx(res["losses"][1], abs=1e-6)
        assert res["missing"] == [] and res["unexpected"] == []
        # computed by the model's own initialisation (the files do not hold it), never zero
        assert res["inv_freq"] == res["plain_inv_freq"] and min(res["inv_freq"]) > 0


@pytest.mark.parametrize("source,stage,extra", FORMATS)
def test_other_formats_stages_and_tied_weights_load_exactly(
    runs: dict[str, Any], source: str, stage: int, extra: dict[str, Any]
) -> None:
    for res in runs[source]:
        assert res["keys"] and res["unequal"] == [], res["unequal"]
        tol = 5e-2 if extra else 1e-6  # the engine computes in bf16 there
        assert res["losses"][0] == pytest.approx(res["losses"][1], abs=tol)


def bytes_read(rank: int, world: int, path: str) -> tuple[int, int]:
    """Bytes this rank's load read from the files, and the files' tensor bytes."""
    read = [0]
    real = os.preadv

    def counting(fd: int, buffers: Any, offset: int) -> int:
        n = real(fd, buffers, offset)
        read[0] += n
        return n

    model = _meta_llama()
    engine = ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), 0.1), zero_config(3))
    os.preadv = counting
    try:
        engine.load_weights(path)
    finally:
        os.preadv = real
    with open_weights(path) as source:
        total = sum(
            torch.Size(source.shape(n)).numel() * source.dtype(n).itemsize for n in source.names
        )
    return read[0], total


def test_each_rank_reads_only_its_own_shards_bytes(runs: dict[str, Any]) -> None:
    results = runs["bytes"]
    total = results[0][1]
    # half the weights each (+ the few buffers' bytes, which every rank reads whole: none here)
    for read, _ in results:
        assert abs(read - total / 2) <= 0.01 * total, (read, total)
    assert sum(r for r, _ in results) == pytest.approx(total, rel=0.01)


def nvme_load(rank: int, world: int, path: str, swap: str) -> dict[str, Any]:
    offload = {"device": "nvme", "nvme_path": swap}
    config = zero_config(3, zero={"offload_param": offload, "offload_optimizer": offload})
    return load_and_compare(rank, world, path, config)


def test_with_nvme_offload_the_weights_go_into_the_swap_files(runs: dict[str, Any]) -> None:
    for res in runs["nvme"]:
        assert res["keys"] and res["unequal"] == [], res["unequal"]
        assert res["losses"][0] == pytest.approx(res["losses"][1], abs=1e-6)


def base_from_head(rank: int, world: int, path: str) -> list[str]:
    """A LlamaModel (no head) from a LlamaForCausalLM directory: names across the prefix."""
    model = _meta_llama(cls=LlamaModel)
    engine = ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), 0.1), zero_config(3))
    result = engine.load_weights(path)
    full = engine.full_state_dict()
    plain = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).model.state_dict()
    assert result.unexpected == ["lm_head.weight"], result.unexpected
    return [k for k, v in plain.items() if not torch.equal(full[k], v)]


class Rotary(nn.Module):
    """A module whose buffer only its constructor computes (no init function knows it)."""

    def __init__(self, persistent: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        freq = 1.0 / (100 ** (torch.arange(0, 4, 2, dtype=torch.float) / 4))
        self.register_buffer("freq", freq, persistent=persistent)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.freq.repeat(2)


def unset_buffer(rank: int, world: int, files: str) -> list[str]:
    """What happens to a buffer nothing computed: the forward, the load without it, with it."""
    out = []
    for persistent in (False, True):
        with torch.device("meta"):
            model = Rotary(persistent)
        engine = ds_strategy.initialize(
            model, torch.optim.SGD(model.parameters(), 0.1), zero_config(3)
        )
        try:
            engine(torch.ones(1, 4))
        except RuntimeError as e:
            out.append(f"forward: {e}")
        try:
            engine.load_weights(os.path.join(files, f"persistent{int(persistent)}.safetensors"))
            out.append(f"loaded: {engine.module.freq.tolist()} {engine(torch.ones(1, 4)).shape}")
        except CheckpointError as e:
            out.append(f"load: {e}")
    return out


def test_a_buffer_no_file_holds_and_nothing_computed_is_refused_by_name(
    runs: dict[str, Any],
) -> None:
    res = runs["buffers"][0]
    assert res[0].startswith("forward: buffer(s) ['freq'] were built on the meta device"), res
    assert res[1].startswith("load: ") and "buffer(s) ['freq'] are in no file" in res[1], res
    assert res[2].startswith("forward: ")  # persistent, but not loaded yet
    assert res[3] == "loaded: [1.0, 0.10000000149011612] torch.Size([1, 4])", res


def refusals(rank: int, world: int, root: str) -> list[str]:
    out = []
    model = _meta_llama()
    engine = ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), 0.1), zero_config(3))
    for name in ("missing", "shape", "header", "outside", "empty"):
        try:
            engine.load_weights(os.path.join(root, name))
            out.append(f"{name}: loaded")
        except CheckpointError as e:
            out.append(f"{name}: {e}")
    partial = engine.load_weights(os.path.join(root, "missing"), strict=False)
    out.append(f"strict=False missing: {partial.missing}")
    try:  # a model directory is not a checkpoint: the error says what reads it
        engine.load_checkpoint(os.path.join(root, "missing"))
    except CheckpointError as e:
        out.append(str(e))
    return out


def test_files_that_do_not_match_are_refused_naming_the_problem(runs: dict[str, Any]) -> None:
    res = runs["refused"]
    assert res[0] == res[1]
    missing, shape, header, outside, empty, partial, checkpoint = res[0]
    assert "1 parameter(s) of this model are in no file there" in missing
    assert "model.layers.1.mlp.up_proj.weight" in missing and "strict=False" in missing
    assert "'model.norm.weight' has shape [33] there and [32] in this model" in shape
    assert "not a readable safetensors file" in header and "model.safetensors" in header
    assert "which is not a file beside the index" in outside
    assert "holds no model weights as save_pretrained writes them" in empty
    assert partial == "strict=False missing: ['model.layers.1.mlp.up_proj.weight']"
    assert "not a ds_strategy checkpoint" in checkpoint
    assert checkpoint.endswith("read them into the engine with engine.load_weights(path)")


def test_a_base_model_loads_from_its_head_models_files(runs: dict[str, Any]) -> None:
    assert runs["base"] == [[], []]


def test_one_process_reads_a_file_header_and_ranges_without_a_process_group(
    pretrained: dict[str, str],
) -> None:
    plain = _plain(pretrained["fp32"]).state_dict()
    with open_weights(pretrained["fp32"]) as source:
        assert sorted(source.names) == sorted(plain)
        w = plain["model.layers.0.self_attn.q_proj.weight"].reshape(-1)
        out = torch.empty(37, dtype=torch.float64)
        source.read("model.layers.0.self_attn.q_proj.weight", 101, out)
        assert torch.equal(out, w[101:138].double())


@pytest.mark.slow
def test_several_engines_of_one_job_load_in_turn(pretrained: dict[str, str]) -> None:
    calls = [(load_and_compare, (pretrained["fp32"], zero_config(s))) for s in (0, 2)]
    for results in run_ranks_each(calls, 2):
        for res in results:
            assert res["unequal"] == [] and res["keys"]


def test_a_rank_failing_to_read_fails_every_rank(pretrained: dict[str, str]) -> None:
    with pytest.raises(WorkerError, match="no such file or directory"):
        run_ranks(load_and_compare, 2, pretrained["fp32"] + "-nope", zero_config(3))


def trainer_from_directory(rank: int, world: int, path: str, out: str) -> dict[str, Any]:
    """ZeroTrainer(model=<directory>) against a plain Trainer on from_pretrained's model."""
    from transformers import Trainer

    from ds_strategy.hf import ZeroTrainer
    from tests.hf_scripts.trainer_runs import Tokens, arguments, logged

    def run(cls: type, model: Any, folder: str, **kw: Any) -> list[float]:
        args = arguments(os.path.join(out, folder), max_steps=3, gradient_accumulation_steps=1)
        trainer = cls(model=model, args=args, train_dataset=Tokens(24, 1), **kw)
        trainer.train()
        return logged(trainer)["loss"]

    plain = run(Trainer, _plain(path), "plain")
    config = zero_config(3)
    del config["train_micro_batch_size_per_gpu"]
    zero = run(ZeroTrainer, path, "zero", config=config)
    return {"plain": plain, "zero": zero}


@pytest.mark.slow
def test_zero_trainer_takes_a_pretrained_directory_and_trains_as_the_plain_trainer(
    pretrained: dict[str, str], tmp_path: Path
) -> None:
    res = run_ranks(trainer_from_directory, 2, pretrained["fp32"], str(tmp_path))[0]
    assert len(res["zero"]) == 3
    assert res["zero"] == pytest.approx(res["plain"], abs=2e-5), res


def accelerate_from_directory(rank: int, world: int, path: str) -> list[float]:
    """ZeroAccelerator.prepare of ds_strategy.hf.from_pretrained(dir): (its loss, plain's)."""
    from ds_strategy.accelerate import ZeroAccelerator, ZeroPlugin
    from ds_strategy.hf import from_pretrained

    accelerator = ZeroAccelerator(zero_plugin=ZeroPlugin(config=zero_config(3)), cpu=True)
    model = from_pretrained(path)
    assert all(p.is_meta for p in model.parameters())  # no rank ever holds the whole model
    model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), 0.1))
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        loss = model(input_ids=tokens, labels=tokens).loss.item()
        expect = _plain(path)(input_ids=tokens, labels=tokens).loss.item()
    return [loss, expect]


def lightning_from_directory(rank: int, world: int, path: str, root: str) -> list[float]:
    """Lightning's Trainer(strategy="zero3") on a module holding from_pretrained(dir)."""
    import lightning as L

    from ds_strategy.hf import from_pretrained
    from ds_strategy.lightning import ZeroStrategy

    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(rank))

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.llama = from_pretrained(path)
            self.first: float | None = None

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            loss = self.llama(input_ids=tokens, labels=tokens).loss
            self.first = loss.item() if self.first is None else self.first
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), 0.1)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(torch.zeros(2, 1), batch_size=1)

    module = Module()
    trainer = L.Trainer(
        strategy=ZeroStrategy(stage=3),
        accelerator="cpu",
        devices=world,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    trainer.fit(module)
    with torch.no_grad():
        expect = _plain(path)(input_ids=tokens, labels=tokens).loss.item()
    return [module.first, expect]


def fabric_from_directory(rank: int, world: int, path: str) -> list[float]:
    """Fabric's setup of from_pretrained(dir) under the ZeRO-3 strategy."""
    import lightning as L

    from ds_strategy.fabric import ZeroStrategy
    from ds_strategy.hf import from_pretrained

    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=ZeroStrategy(stage=3))
    fabric.launch()
    model = from_pretrained(path)
    model, _ = fabric.setup(model, torch.optim.SGD(model.parameters(), 0.1))
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        loss = model(input_ids=tokens, labels=tokens).loss.item()
        expect = _plain(path)(input_ids=tokens, labels=tokens).loss.item()
    return [loss, expect]


@pytest.mark.slow
@pytest.mark.parametrize("front", ["accelerate", "lightning", "fabric"])
def test_accelerate_and_lightning_take_a_meta_model_and_its_directory(
    pretrained: dict[str, str], tmp_path: Path, front: str
) -> None:
    if front == "accelerate":
        results = run_ranks(accelerate_from_directory, 2, pretrained["fp32"])
    elif front == "fabric":
        results = run_ranks(fabric_from_directory, 2, pretrained["fp32"])
    else:
        results = run_ranks(lightning_from_directory, 2, pretrained["fp32"], str(tmp_path))
    for loss, expect in results:
        assert loss == pytest.approx(expect, abs=1e-6)
