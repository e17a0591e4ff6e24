"""``init_inference`` in one process: every kind of model and weights it takes, the KV cache,
quantized exports read back as stored, each bad input an error naming the fix; and, on two
ranks, that building a sharded model never allocates the whole of it (peak RSS)."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.nn import functional as F

import ds_strategy
from ds_strategy.core.inference.building import CharTokenizer
from ds_strategy.core.inference.sources import open_source
from ds_strategy.core.model_factory import params_on_meta
from ds_strategy.core.quant import QuantizedEmbedding, QuantizedLinear
from ds_strategy.demos.gpt import GPT, GPTConfig
from tests.distributed import run_ranks
from tests.inference_common import GPT_KWARGS, corpus_tokens, write_gpt
from tests.models import ToyLM

CFG = GPTConfig(**GPT_KWARGS)


@pytest.fixture(scope="module")
def gpt_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gpt(tmp_path_factory.mktemp("gpt") / "model")


def _reference(directory: Path) -> GPT:
    from safetensors.torch import load_file

    model = GPT(CFG).eval()
    model.load_state_dict(load_file(directory / "model.safetensors"), strict=False)
    return model


def test_the_kv_cache_computes_the_full_forward() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=50, d=32, layers=2, heads=4, seq=32)).eval()
    idx = torch.randint(0, 50, (2, 20))
    cache = model.new_cache()
    with torch.no_grad():
        parts = [model(idx[:, :8], cache), model(idx[:, 8:15], cache)]
        parts += [model(idx[:, i : i + 1], cache) for i in range(15, 20)]
        assert torch.allclose(torch.cat(parts, 1), model(idx), atol=1e-5)
    assert cache.length == 20
    with pytest.raises(ValueError, match="GPTConfig.seq"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_a_model_directory_a_file_and_a_module_with_its_weights(gpt_dir: Path) -> None:
    ref = _reference(gpt_dir)
    x = corpus_tokens(CFG.vocab, 2 * 20).view(2, 20)
    with torch.no_grad():
        want = ref(x)
    # a training config (batch sizes for some world size) serves as it is
    training = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}
    from_dir = ds_strategy.init_inference(gpt_dir, training)
    from_file = ds_strategy.init_inference(
        lambda: GPT(CFG), checkpoint=gpt_dir / "model.safetensors"
    )
    module = _reference(gpt_dir)
    from_module = ds_strategy.init_inference(module)
    for engine in (from_dir, from_file, from_module):
        assert torch.equal(engine(x), want)
    assert all(p.is_meta is False for p in from_module.module.parameters())
    assert from_module.module.head.weight is from_module.module.wte.weight  # still tied
    # the engine's cached loop equals greedy decoding of the plain model without a cache
    prompt = x[:, :6]
    tokens = prompt
    with torch.no_grad():
        for _ in range(20):
            tokens = torch.cat([tokens, ref(tokens)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(from_dir.generate(prompt, 20), tokens)
    text = from_dir.generate_text("ZeRO", 10)
    assert text.startswith("ZeRO") and len(text) == 14


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("stage", [0, 3])
def test_save_quantized_stays_quantized_on_disk_and_loads_as_stored(
    gpt_dir: Path, tmp_path: Path, bits: int, stage: int
) -> None:
    config = {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine = ds_strategy.init_inference(gpt_dir, config, quantization=bits)
    x = corpus_tokens(CFG.vocab, 2 * 16, 40).view(2, 16)
    out = engine(x)
    path = engine.save_quantized(tmp_path / f"int{bits}.safetensors")
    with safe_open(str(path), "pt") as f:
        assert f.get_tensor("blocks.0.fc.qweight").dtype == (
            torch.int8 if bits == 8 else torch.uint8
        )
        keys = set(f.keys())  # noqa: SIM118 - safe_open is not a container
        assert "blocks.0.fc.weight" not in keys
        assert "wte.qweight" in keys and "head.qweight" not in keys  # tied: once
    fp32_size = (gpt_dir / "model.safetensors").stat().st_size
    assert path.stat().st_size <= (0.27 if bits == 8 else 0.16) * fp32_size
    for reload_stage in (0, 3):
        again = ds_strategy.init_inference(
            lambda: GPT(CFG),
            {"zero_optimization": {"stage": reload_stage, "stage3_param_persistence_threshold": 0}},
            checkpoint=path,
        )
        assert isinstance(again.module.blocks[0].fc, QuantizedLinear)
        assert isinstance(again.module.wte, QuantizedEmbedding)
        assert torch.equal(again(x), out)
    with pytest.raises(ValueError, match="saved quantized with bits"):
        ds_strategy.init_inference(lambda: GPT(CFG), quantization=12 - bits, checkpoint=path)


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_bf16_serves_plain_sharded_and_quantized(gpt_dir: Path, bits: int | None) -> None:
    """bf16 compute (quantized layers keep their scales in it too): logits close to fp32's."""
    x = corpus_tokens(CFG.vocab, 2 * 16, 60).view(2, 16)
    ref = ds_strategy.init_inference(gpt_dir)(x).flatten()
    bound = {None: 0.9999, 8: 0.999, 4: 0.97}[bits]
    for stage in (0, 3):
        config = {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
        engine = ds_strategy.init_inference(gpt_dir, config, dtype="bf16", quantization=bits)
        out = engine(x)
        assert out.dtype == torch.bfloat16
        assert F.cosine_similarity(out.float().flatten(), ref, 0) >= bound
        assert engine.generate(x[:, :4], 6).shape == (2, 10)


def test_the_toy_model_with_attention_ties_and_a_block_used_twice(tmp_path: Path) -> None:
    """Everything ``tests/models.ToyLM`` does to an engine (an attention module reading its
    projection's weight, a tied head, a block called twice, a frozen layer, a buffer)."""
    torch.manual_seed(1)
    model = ToyLM(vocab=64, d=32)
    # frozen, as the engine's: nn.MultiheadAttention takes its fused path only then, which
    # rounds differently (7.6e-6 here)
    model.eval().requires_grad_(False)
    x = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        want = model(x)
    state = {k: v for k, v in model.state_dict().items() if k != "head.weight"}
    save_file(state, str(tmp_path / "toy.safetensors"))
    for config in (
        None,
        {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}},
    ):
        engine = ds_strategy.init_inference(
            lambda: ToyLM(vocab=64, d=32), config, checkpoint=tmp_path / "toy.safetensors"
        )
        assert torch.equal(engine(x), want)
        assert torch.equal(engine.module.scale, torch.tensor(0.5))


def _error(match: str, *args: Any, **kwargs: Any) -> None:
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        ds_strategy.init_inference(*args, **kwargs)
    assert match in str(info.value), str(info.value)


def test_bad_input_names_the_problem_and_the_fix(gpt_dir: Path, tmp_path: Path) -> None:
    build = lambda: GPT(CFG)  # noqa: E731
    _error("no checkpoint= was given", build)
    _error("no such file or directory", build, checkpoint=tmp_path / "nope")
    (tmp_path / "model.bin").write_bytes(b"x")
    _error("convert it to safetensors", build, checkpoint=tmp_path / "model.bin")
    wide = lambda: GPT(GPTConfig(**{**GPT_KWARGS, "d": 64}))  # noqa: E731
    _error("shapes differ: wte.weight", wide, checkpoint=gpt_dir / "model.safetensors")
    save_file({"other": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    _error("missing 'wte.weight'", build, checkpoint=tmp_path / "other.safetensors")
    _error(
        "stage 2: inference has no optimizer state", gpt_dir, {"zero_optimization": {"stage": 2}}
    )
    _error(
        "inference shards the weights one way at a time",
        gpt_dir,
        {"zero_optimization": {"stage": 3}},
        tensor_parallel=2,
    )
    _error("set bits and leave qat false", gpt_dir, quantization={"bits": 4, "qat": True})
    _error(
        "stage3_max_live_parameters=1000 is below what one forward gathers",
        gpt_dir,
        {
            "zero_optimization": {
                "stage": 3,
                "stage3_max_live_parameters": 1000,
                "stage3_param_persistence_threshold": 0,
            }
        },
    )
    _error("dtype='int8'", gpt_dir, dtype="int8")
    with pytest.raises(ValueError, match="holds full-precision weights"):
        ds_strategy.init_inference(gpt_dir).save_quantized(tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match="without a tokenizer"):
        ds_strategy.init_inference(build, checkpoint=gpt_dir / "model.safetensors").generate_text(
            "x"
        )


def test_a_sharded_hugging_face_index_is_read_across_its_files(tmp_path: Path) -> None:
    from tests.inference_common import write_llama

    directory = write_llama(tmp_path / "llama")
    single = directory / "model.safetensors"
    with safe_open(str(single), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    names = sorted(tensors)
    halves = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(directory / file))
    index = {"weight_map": {k: f for f, keys in halves.items() for k in keys}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    single.rename(tmp_path / "single.safetensors")
    source = open_source(directory, ds_strategy.Comm())
    assert sorted(source.names()) == names
    x = corpus_tokens(128, 10).view(1, 10)
    a = ds_strategy.init_inference(directory)(x).logits
    from transformers import LlamaForCausalLM

    (tmp_path / "single.safetensors").rename(single)
    (directory / "model.safetensors.index.json").unlink()
    b = LlamaForCausalLM.from_pretrained(directory).eval()(x).logits
    assert torch.allclose(a, b, atol=0)


def test_an_index_names_only_files_inside_its_directory_and_is_followed(tmp_path: Path) -> None:
    """``weight_map`` entries leading outside the model directory (``../``, absolute, a
    symbolic link) are refused before any file is opened; a tensor in two shards is read
    from the one the index names; a malformed index names its file."""
    first, second = tmp_path / "model" / "a.safetensors", tmp_path / "model" / "b.safetensors"
    first.parent.mkdir()
    save_file({"w": torch.zeros(2), "v": torch.ones(1)}, str(first))
    save_file({"w": torch.ones(2)}, str(second))  # sorts later: used to win
    other = tmp_path / "other.safetensors"
    save_file({"w": torch.full((2,), 7.0)}, str(other))
    index = first.parent / "model.safetensors.index.json"

    def source(weight_map: Any) -> Any:
        index.write_text(json.dumps({"weight_map": weight_map}))
        return open_source(first.parent, ds_strategy.Comm())

    got = source({"w": "a.safetensors", "v": "a.safetensors"})
    assert torch.equal(got.read("w", slice(None)), torch.zeros(2))
    assert sorted(got.names()) == ["v", "w"]
    (first.parent / "link.safetensors").symlink_to(other)
    for bad in ("../other.safetensors", str(other), "/etc/hostname", "link.safetensors"):
        with pytest.raises(ValueError, match=r"weight_map\['w'\]: .* points outside"):
            source({"w": bad})
    with pytest.raises(ValueError, match="names b.safetensors for 'v', which that file does not"):
        source({"w": "a.safetensors", "v": "b.safetensors"})
    with pytest.raises(ds_strategy.ModelFileError, match="names c.safetensors, which is missing"):
        source({"w": "c.safetensors"})
    for malformed in ([1], {"w": 3}, {}):
        with pytest.raises(ValueError, match="model.safetensors.index.json"):
            source(malformed)
    index.write_text("{oops")
    with pytest.raises(ValueError, match=r"index.json: not valid JSON"):
        open_source(first.parent, ds_strategy.Comm())


# -- no rank ever allocates the whole model ----------------------------------------------------

BIG = dict(vocab=256, d=512, layers=8, heads=8, seq=64)  # 25.4M parameters, 101 MB in fp32


def _anonymous_rss() -> int:
    """Resident anonymous memory (allocations; not the pages of a file read through a
    memory map, which the kernel may drop at will)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def _rss_worker(rank: int, world: int, path: str, config: Any) -> dict[str, float]:
    """The peak of this process's anonymous RSS while the engine is built, sampled every
    millisecond by a thread, above what it was before (after a first, tiny engine has done
    the imports inference makes on first use)."""
    small = GPTConfig(vocab=16, d=16, layers=1, heads=2, seq=8)
    ds_strategy.init_inference(GPT(small), config).destroy()
    with params_on_meta():  # a first build grows the heap once (25 MB here), not per model
        GPT(GPTConfig(**BIG))
    before = _anonymous_rss()
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _anonymous_rss())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        engine = ds_strategy.init_inference(lambda: GPT(GPTConfig(**BIG)), config, checkpoint=path)
    finally:
        done.set()
        sampler.join()
    peak[0] = max(peak[0], _anonymous_rss())
    held = engine.memory_report()["params"]
    engine.destroy()
    return {"peak_increase": peak[0] - before, "held": held}


@pytest.mark.launcher
def test_building_a_sharded_model_never_allocates_all_of_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ranks build a 101 MB model with ZeRO-Inference from one file: each one's peak
    anonymous RSS grows by its half plus one block's buffers (a block is whole for a moment
    while its slice is cut: measured 0.69x), far from the model. One rank building it plain
    grows by the whole model: the measure can fail."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**BIG))
    size = sum(p.numel() * 4 for p in model.parameters())
    state = {k: v for k, v in model.state_dict().items() if k != "head.weight"}
    save_file(state, str(tmp_path / "big.safetensors"))
    del model, state
    zero = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    # glibc keeps freed blocks below its (growing) mmap threshold in the heap, resident; a
    # fixed low threshold returns every freed buffer, so RSS follows what is allocated
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    sharded = run_ranks(
        _rss_worker, 2, str(tmp_path / "big.safetensors"), zero, timeout=240, fresh=True
    )
    (plain,) = run_ranks(
        _rss_worker, 1, str(tmp_path / "big.safetensors"), None, timeout=240, fresh=True
    )
    for r in sharded:
        assert r["held"] < 0.55 * size
        assert r["peak_increase"] < 0.75 * size, (r, size)
    assert plain["peak_increase"] > 0.95 * size, (plain, size)


# -- a model directory names only its own files and ds_strategy's factories -------------------


def _card_dir(tmp_path: Path, gpt_dir: Path, name: str, **card: Any) -> Path:
    """A copy of ``gpt_dir`` with its card's entries replaced by ``card``."""
    d = tmp_path / name
    d.mkdir()
    (d / "model.safetensors").write_bytes((gpt_dir / "model.safetensors").read_bytes())
    base = json.loads((gpt_dir / "ds_model.json").read_text())
    (d / "ds_model.json").write_text(json.dumps({**base, **card}))
    return d


def _hostile_dir(tmp_path: Path, gpt_dir: Path) -> tuple[Path, Path]:
    """A model directory whose card's factory runs a shell command that writes a marker."""
    marker = tmp_path / "marker"
    hostile = _card_dir(
        tmp_path,
        gpt_dir,
        "hostile",
        factory="subprocess:check_call",
        kwargs={"args": ["sh", "-c", f"echo ran > {marker}"]},
    )
    return hostile, marker


def test_a_model_directory_runs_no_outside_code_without_consent(
    gpt_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A card's factory outside ds_strategy is refused (nothing imported or run) unless the
    caller passes trust_remote_code=True; ds_strategy's own factories load as before."""
    monkeypatch.chdir(tmp_path)
    hostile, marker = _hostile_dir(tmp_path, gpt_dir)
    with pytest.raises(
        ds_strategy.UntrustedContentError, match=r"'subprocess:check_call'.*trust_remote_code=True"
    ):
        ds_strategy.init_inference(hostile)
    assert not marker.exists()
    for look_alike in ("ds_strategy_evil.models:build", "os:system"):
        d = _card_dir(tmp_path, gpt_dir, look_alike.partition(":")[0], factory=look_alike)
        with pytest.raises(ds_strategy.UntrustedContentError, match="--trust-remote-code"):
            ds_strategy.init_inference(d)
    # with consent the factory runs (and returning no model is then an error of its own)
    with pytest.raises((TypeError, ValueError)):
        ds_strategy.init_inference(hostile, trust_remote_code=True)
    assert marker.read_text().strip() == "ran"
    assert ds_strategy.init_inference(gpt_dir).module is not None  # ds_strategy.demos.gpt:GPT


def test_a_model_directory_names_only_files_inside_it(gpt_dir: Path, tmp_path: Path) -> None:
    """``weights`` in a card: ``../``, absolute paths and symbolic links leading outside the
    directory are refused, naming the entry; a malformed card names its file."""
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes((gpt_dir / "model.safetensors").read_bytes())
    for i, weights in enumerate(["../elsewhere.safetensors", str(outside), "/etc/hostname"]):
        d = _card_dir(tmp_path, gpt_dir, f"escape{i}", weights=weights)
        with pytest.raises(ValueError, match=r"ds_model.json weights: .* points outside"):
            ds_strategy.init_inference(d)
    d = _card_dir(tmp_path, gpt_dir, "link", weights="linked.safetensors")
    (d / "linked.safetensors").symlink_to(outside)
    with pytest.raises(ValueError, match="points outside the model directory"):
        ds_strategy.init_inference(d)
    d = _card_dir(tmp_path, gpt_dir, "inner", weights="sub/../model.safetensors")
    (d / "sub").mkdir()
    assert ds_strategy.init_inference(d).module is not None  # inside after resolving
    d = _card_dir(tmp_path, gpt_dir, "broken")
    (d / "ds_model.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"ds_model.json: not valid JSON"):
        ds_strategy.init_inference(d)
    d = _card_dir(tmp_path, gpt_dir, "kwargs", kwargs=[1, 2])
    with pytest.raises(ValueError, match=r"ds_model.json kwargs: expected an object"):
        ds_strategy.init_inference(d)


def test_generate_asks_for_trust_remote_code(gpt_dir: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    hostile, marker = _hostile_dir(tmp_path, gpt_dir)
    cmd = [sys.executable, "-m", "ds_strategy.cli", "generate", str(hostile), "--prompt-ids", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--trust-remote-code" in out.stderr, out.stderr
    assert not marker.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt", ""], "--prompt is empty"),
        (["--prompt-ids", "1,x"], "expected comma-separated token ids"),
        (["--prompt-ids", "1,-3"], "token ids are integers in [0, 2**63)"),
        (["--prompt-ids", "99999999999999999999"], "token ids are integers in [0, 2**63)"),
        (["--prompt-ids", "1", "--seed", "-1"], "--seed must be an integer in [0, 2**63)"),
        (["--prompt-ids", "1", "--tp", "0"], "--tp must be >= 1"),
        (
            ["--prompt-ids", "1", "--max-new-tokens", "100000"],
            "--max-new-tokens=100000 after a prompt of 1 tokens needs 100001 positions; the "
            "model has 64 (config.seq)",
        ),
        (["--prompt-ids", "1,9999"], "outside the model's vocabulary [0, 96)"),
        (["--prompt-ids", "1", "--max-new-tokens", "-1"], "--max-new-tokens must be >= 0"),
        (["--prompt-ids", "1", "--sample", "--top-k", "0"], "--top-k must be >= 1"),
        (["--prompt-ids", "1", "--sample", "--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--prompt-ids", "1", "--sample", "--top-p", "2"], "--top-p must be in (0, 1]"),
        (["--prompt-ids", "1", "--sample", "--temperature", "0"], "--temperature must be > 0"),
    ],
)
def test_generate_options_out_of_range_are_usage_errors(
    gpt_dir: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each bad option: exit 2 and a message naming it (they were tracebacks, or accepted)."""
    from ds_strategy.cli import main as cli

    assert cli(["generate", str(gpt_dir), *args]) == 2
    assert message in capsys.readouterr().err


def test_generate_checks_its_arguments_from_python(gpt_dir: Path) -> None:
    engine = ds_strategy.init_inference(gpt_dir)
    for kwargs, message in (
        ({"input_ids": torch.zeros(1, 0, dtype=torch.long)}, "a token at least"),
        ({"input_ids": torch.tensor([[0.5]])}, "integer token ids"),
        ({"input_ids": torch.tensor([[1]]), "top_p": 0.0, "do_sample": True}, "top_p"),
        ({"input_ids": torch.tensor([[1]]), "seed": 2**63}, "seed must be an integer"),
        ({"input_ids": torch.tensor([[1]]), "max_new_tokens": 64}, "needs 65 positions"),
    ):
        with pytest.raises(ValueError, match=message):
            engine.generate(**kwargs)
    ids = torch.tensor([[1, 2, 3]])
    greedy = engine.generate(ids, 6)
    # a temperature that underflows float32 (0 / 0 in the softmax) samples the argmax
    for temperature in (1e-300, 5e-324):
        assert torch.equal(engine.generate(ids, 6, do_sample=True, temperature=temperature), greedy)
    engine.destroy()
    assert CharTokenizer("ab").decode([0, 1, 7]) == "ab\ufffd"  # an id past the alphabet


def test_quantized_metadata_is_checked_against_its_schema_and_tensors(
    gpt_dir: Path, tmp_path: Path
) -> None:
    """An asymmetric int4 export whose metadata is edited (``symmetric: true``, the string
    ``"false"``, bad JSON, group size 0, a missing key) is refused naming the file and the
    key, where it loaded with its zero-points ignored; a float weight stored as int32 is
    refused at load, not at the first forward."""
    from safetensors.torch import load_file

    engine = ds_strategy.init_inference(gpt_dir, quantization={"bits": 4, "symmetric": False})
    path = engine.save_quantized(tmp_path / "int4.safetensors")
    engine.destroy()
    with safe_open(str(path), "pt") as f:
        meta = dict(f.metadata())
    tensors = load_file(str(path))
    key = "ds_strategy.quantization"
    scheme = json.loads(meta[key])
    assert scheme["symmetric"] is False and any(k.endswith(".zeros") for k in tensors)
    assert ds_strategy.init_inference(lambda: GPT(CFG), checkpoint=path).module is not None

    def edited(name: str, text: str) -> Path:
        out = tmp_path / f"{name}.safetensors"
        save_file(tensors, str(out), metadata={**meta, key: text})
        return out

    cases = {
        "symmetric": (json.dumps({**scheme, "symmetric": True}), "symmetric is true but"),
        "string": (json.dumps({**scheme, "symmetric": "false"}), "symmetric must be true or false"),
        "json": ("{bits: 4", "is not valid JSON"),
        "group": (json.dumps({**scheme, "group_size": 0}), "group_size must be an integer >= 1"),
        "missing": (json.dumps({k: v for k, v in scheme.items() if k != "bits"}), "no 'bits'"),
        "bits": (json.dumps({**scheme, "bits": 3}), "bits must be 8 or 4"),
    }
    for name, (text, message) in cases.items():
        with pytest.raises(
            ValueError, match=rf"{name}\.safetensors: metadata .*{re.escape(message)}"
        ):
            ds_strategy.init_inference(lambda: GPT(CFG), checkpoint=edited(name, text))
    plain = load_file(str(gpt_dir / "model.safetensors"))
    plain["ln_f.weight"] = plain["ln_f.weight"].to(torch.int32)
    save_file(plain, str(tmp_path / "ints.safetensors"))
    with pytest.raises(ValueError, match=r"ln_f.weight: stored as torch.int32 .* floating-point"):
        ds_strategy.init_inference(lambda: GPT(CFG), checkpoint=tmp_path / "ints.safetensors")
