"""``ds_strategy.estimate`` / ``ds-strategy estimate``: the per-rank memory estimate against
what the engine really holds on CPU, and the command's table and recommendation."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import ds_strategy
from ds_strategy.cli import main as cli
from ds_strategy.core.memory import live_tensor_bytes
from ds_strategy.demos.gpt import GPT, GPTConfig
from ds_strategy.estimate import (
    CANDIDATES,
    ModelFacts,
    estimate,
    estimate_all,
    fits,
    model_facts,
    parse_bytes,
    parse_count,
    pipeline_facts,
    recommend,
    worst_per_candidate,
)

from .distributed import run_ranks

THRESHOLD = 1000  # stage3_param_persistence_threshold: biases and norms stay whole
LIVE_CHECKED = {("fp32", 1), ("bf16", 3)}  # also counted from the live tensors
PREFETCH = 20_000  # about one block: the gathered peak is the root and two blocks


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, d: int = 48, layers: int = 3, vocab: int = 97) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def make_net() -> Net:
    return Net()


def hf_like(hidden: int = 64) -> Net:
    """A model that carries its hidden size in ``config``, as a Hugging Face model does."""
    net = Net(d=hidden)
    net.config = SimpleNamespace(hidden_size=hidden)
    return net


def measure_worker(rank: int, world: int) -> dict:
    out = {}
    for precision in ("fp32", "bf16"):
        for stage in (1, 2, 3):
            torch.manual_seed(0)
            count_live = (precision, stage) in LIVE_CHECKED  # a heap walk each: keep few
            before = live_tensor_bytes() if count_live else 0
            model = Net()
            config = {
                "zero_optimization": {
                    "stage": stage,
                    "stage3_param_persistence_threshold": THRESHOLD,
                    "stage3_prefetch_bucket_size": PREFETCH,
                },
                "bf16": {"enabled": precision == "bf16"},
                "train_micro_batch_size_per_gpu": 4,
            }
            engine = ds_strategy.initialize(
                model, torch.optim.AdamW(model.parameters(), lr=1e-3), config
            )
            idx = torch.randint(0, 97, (4, 16), generator=torch.Generator().manual_seed(rank))
            loss = engine(idx).float().logsumexp(-1).mean()
            engine.backward(loss)
            engine.step()  # the optimizer state exists after the first step
            del loss
            live = None
            if count_live:
                live = live_tensor_bytes() - before - idx.numel() * idx.element_size()
            out[(precision, stage)] = {"report": engine.memory_report(), "live": live}
            engine.destroy()
            del engine, model
    return out


def test_estimate_matches_measured_memory() -> None:
    """Stages 1-3 x fp32/bf16 at world 2: the estimate's model state is within 10% of the
    engine's report and of the bytes of live tensors; stage 3's gathered peak stays within
    the estimate's gather term."""
    world = 2
    facts = model_facts(make_net, persistence_threshold=THRESHOLD)
    assert facts.params == sum(p.numel() for p in Net().parameters())
    assert facts.persistent > 0 and facts.largest_unit > 0  # the model exercises both terms
    results = run_ranks(measure_worker, world, timeout=120)
    assert sum(r["live"] is not None for r in results[0].values()) == len(LIVE_CHECKED)
    for rank in range(world):
        for (precision, stage), got in results[rank].items():
            est = estimate(facts, world, stage, "none", precision, prefetch_numel=PREFETCH)
            report = got["report"]
            where = f"rank {rank} {precision} stage {stage}"
            assert report["total"] == pytest.approx(est.model_state, rel=0.10), where
            if got["live"] is not None:
                assert got["live"] == pytest.approx(est.model_state, rel=0.10), where
            # Under mixed precision the report files the fp32 master shard with the params.
            held = report["params"] + report["optimizer_state"]
            assert held == pytest.approx(est.device["params"] + est.device["optimizer"], rel=0.10)
            assert report["grads"] == pytest.approx(est.device["grads"], rel=0.10), where
            if stage == 3:
                elem = 4 if precision == "fp32" else 2
                floor = (facts.root_unit + facts.largest_unit) * elem  # root + one block
                assert floor <= report["peak_gathered_params"] <= est.device["gathered"], where


def test_offload_moves_terms_and_sharding_shrinks_them() -> None:
    facts = ModelFacts(params=10**9)
    for precision in ("fp32", "bf16", "fp16"):
        rows = {(e.stage, e.offload): e for e in estimate_all(facts, 8, (precision,))}
        assert set(rows) == set(CANDIDATES)
        # Offload moves bytes off the device without changing the model state's total.
        for (stage, offload), e in rows.items():
            assert e.model_state == pytest.approx(rows[(stage, "none")].model_state)
            if offload != "none":
                assert e.device_total < rows[(stage, "none")].device_total
        totals = [rows[(s, "none")].device_total for s in range(4)]
        assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4
    with pytest.raises(ValueError, match="stage 3"):
        estimate(facts, 8, 2, "cpu+params")
    with pytest.raises(ValueError, match="precision"):
        estimate(facts, 8, 2, "none", "int8")


def test_recommendation_is_the_cheapest_that_fits() -> None:
    facts = ModelFacts(params=parse_count("7B"))
    estimates = estimate_all(facts, 8)
    order = [c for c in CANDIDATES]
    seen = []
    for gpu in ("200GB", "80GB", "40GB", "30GB", "20GB", "10GB", "4GB"):
        best = recommend(estimates, parse_bytes(gpu), precision="bf16")
        assert best is not None, gpu
        assert fits(best, parse_bytes(gpu), None, 8)
        rank = order.index((best.stage, best.offload))
        for cheaper in order[:rank]:  # every cheaper candidate really does not fit
            e = next(
                x for x in estimates if (x.stage, x.offload) == cheaper and x.precision == "bf16"
            )
            assert not fits(e, parse_bytes(gpu), None, 8), (gpu, cheaper)
        seen.append(rank)
    assert seen == sorted(seen) and len(set(seen)) >= 5  # less memory, costlier configs
    assert recommend(estimates, parse_bytes("1GB"), precision="bf16") is None
    # Host memory limits CPU offload: 8 ranks x 10.5 GB of optimizer state needs 84 GB.
    tight = recommend(estimates, parse_bytes("20GB"), parse_bytes("50GB"), 8, "bf16")
    assert tight is not None and tight.cpu * 8 <= parse_bytes("50GB")


def test_parsing() -> None:
    assert parse_bytes("80GB") == 80e9
    assert parse_bytes("24GiB") == 24 * 2**30
    assert parse_count("7e9") == parse_count("7B") == 7_000_000_000
    assert parse_count("350M") == 350_000_000
    for bad in ("80 furlongs", "lots"):
        with pytest.raises(ValueError, match="memory size"):
            parse_bytes(bad)
    with pytest.raises(ValueError, match="parameter count"):
        parse_count("7x")


def test_cli_table_and_recommendation(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli(["estimate", "--params", "7e9", "--world-size", "8", "--gpu-mem", "30GB"])
    out = capsys.readouterr().out
    assert rc == 0
    resting, peaks = out.split("peak of a training step")
    names = [f"zero{s}" + ("" if o == "none" else f"+{o}") for s, o in CANDIDATES]
    for table in (resting, peaks):
        rows = [line for line in table.splitlines() if line.startswith("zero")]
        assert [line.split()[0] for line in rows] == names
    m = re.search(r"recommended: (\S+) bf16 -- ([0-9.]+) GB per device", out)
    assert m, out
    best = recommend(estimate_all(ModelFacts(params=7 * 10**9), 8), 30e9, precision="bf16")
    assert best is not None and m.group(1) == best.name
    assert float(m.group(2)) <= 30
    assert f'"stage": {best.stage}' in out

    rc = cli(["estimate", "--params", "70B", "--world-size", "2", "--gpu-mem", "8GB"])
    assert rc == 1 and "nothing fits" in capsys.readouterr().out


def test_cli_model_factory_on_meta(capsys: pytest.CaptureFixture[str]) -> None:
    """A model factory is counted on the meta device, config-object factories included."""
    real = GPT(GPTConfig(layers=2, d=64, vocab=300, heads=4))
    facts = model_facts(
        "ds_strategy.demos.gpt:GPT",
        {"layers": 2, "d": 64, "vocab": 300, "heads": 4},
        persistence_threshold=0,
    )
    assert facts.params == sum(p.numel() for p in real.parameters())
    assert facts.largest_unit == sum(p.numel() for p in real.blocks[0].parameters())
    rc = cli(
        [
            "estimate",
            "--model",
            "ds_strategy.demos.gpt:GPT",
            "--model-arg",
            "layers=2",
            "--world-size",
            "2",
            "--gpu-mem",
            "1GB",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "largest block" in out and "recommended: zero0" in out
    rc = cli(["estimate", "--model", "no_such_module:build", "--world-size", "2"])
    assert rc == 2 and "cannot import" in capsys.readouterr().err
    rc = cli(["estimate", "--params", "7x", "--world-size", "2"])
    assert rc == 2 and "parameter count" in capsys.readouterr().err


def test_hpz_adds_its_secondary_copy_at_stage_3(capsys: pytest.CaptureFixture[str]) -> None:
    facts = ModelFacts(params=8_000_000)
    plain = estimate(facts, 16, 3, precision="bf16")
    hpz = estimate(facts, 16, 3, precision="bf16", hpz_partition_size=8)
    assert hpz.device["hpz_secondary"] == 2 * 8_000_000 / 8
    assert hpz.device_total == plain.device_total + 2_000_000
    assert hpz.model_state == plain.model_state  # a copy held from forward to step only
    assert "hpz_secondary" not in estimate(facts, 16, 2, hpz_partition_size=8).device
    with pytest.raises(ValueError, match="hpz_partition_size=3 must divide"):
        estimate(facts, 16, 3, hpz_partition_size=3)
    rc = cli(["estimate", "--params", "7B", "--world-size", "16", "--hpz-partition-size", "3"])
    assert rc == 2 and "--hpz-partition-size 3 must divide" in capsys.readouterr().err
    rc = cli(["estimate", "--params", "7B", "--world-size", "16", "--hpz-partition-size", "8"])
    zero3 = [line for line in capsys.readouterr().out.splitlines() if line.startswith("zero3 ")]
    # bf16 device: 7.10 GB, 1.00 GB of the units DeepSpeed's default reuse distance (1e9
    # elements) keeps gathered from forward into backward, and 1.75 GB secondary
    assert rc == 0 and zero3[0].split()[6] == "9.85"


def test_mics_shards_over_its_groups(capsys: pytest.CaptureFixture[str]) -> None:
    """MiCS divides stages 1-3 by the shard size, not the world (the live engine's report is
    compared with it in test_mics.py)."""
    facts = ModelFacts(params=8_000_000)
    for stage in (1, 2, 3):
        mics = estimate(facts, 16, stage, precision="fp32", mics_shard_size=8)
        assert mics.model_state == estimate(facts, 8, stage, precision="fp32").model_state
    assert estimate(facts, 16, 0, mics_shard_size=8) == estimate(facts, 16, 0)
    with pytest.raises(ValueError, match="mics_shard_size=3 must divide"):
        estimate(facts, 16, 3, mics_shard_size=3)
    with pytest.raises(ValueError, match="give one of them"):
        estimate(facts, 16, 3, mics_shard_size=8, hpz_partition_size=8)
    rc = cli(["estimate", "--params", "7B", "--world-size", "16", "--mics-shard-size", "3"])
    assert rc == 2 and "--mics-shard-size 3 must divide" in capsys.readouterr().err
    for flag in ([], ["--mics-shard-size", "8"]):
        assert cli(["estimate", "--params", "7B", "--world-size", "16", *flag]) == 0
    plain, mics = [
        [line.split() for line in block.splitlines() if line.startswith("zero3 ")][0]
        for block in capsys.readouterr().out.split("7.000B parameters")[1:]
    ]
    assert float(mics[6]) > float(plain[6])  # half the shards: more per rank


def test_pipeline_estimate_per_stage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Per-stage tables for a pipeline (the engines' own reports are compared with it in
    test_pipeline_build.py); the recommendation fits the largest stage."""
    args = ["--model", "ds_strategy.demos.gpt:gpt_layers", "--model-arg", "layers=4"]
    rc = cli(["estimate", *args, "--world-size", "2", "--pipeline-stages", "2", "--gpu-mem", "1GB"])
    out = capsys.readouterr().out
    assert rc == 0 and "in 2 pipeline stages" in out
    assert "pipeline stage 0: layers 0-2" in out and "pipeline stage 1: layers 3-5" in out
    assert '"pipeline": {"stages": 2}' in out
    # from a config's pipeline section: interleaved, 2 chunks per rank
    config = tmp_path / "pipe.json"
    config.write_text(json.dumps({"pipeline": {"stages": 2, "schedule": "interleaved_1f1b"}}))
    rc = cli(["estimate", *args, "--world-size", "1", "--config", str(config)])
    out = capsys.readouterr().out
    assert rc == 0 and "pipeline stage 0: layers 0, 3-4" in out  # chunks 0 and 2 of 4
    parts = pipeline_facts("ds_strategy.demos.gpt:gpt_layers", 2, kwargs={"layers": 4})
    whole = model_facts("ds_strategy.demos.gpt:GPT", {"layers": 4, "tie_embeddings": False})
    assert sum(p.facts.params for p in parts) == whole.params
    worst = worst_per_candidate([estimate_all(p.facts, 2) for p in parts])
    assert all(
        w.device_total
        == max(estimate(p.facts, 2, w.stage, w.offload, w.precision).device_total for p in parts)
        for w in worst
    )
    rc = cli(["estimate", "--params", "7B", "--world-size", "2", "--pipeline-stages", "2"])
    assert rc == 2 and "--pipeline-stages needs --model" in capsys.readouterr().err


# -- the peak of a step ---------------------------------------------------------------------

PEAK_MODEL = dict(vocab=4096, d=256, layers=4, heads=4, seq=16)
PEAK_CASES = [(s, o, "fp32") for s, o in CANDIDATES] + [
    (2, "none", "bf16"),
    (3, "cpu", "bf16"),
    (3, "nvme", "bf16"),
]
# every buffer engaged at this size: several groups and units, prefetching, step buckets
PEAK_KNOBS = dict(reduce_bucket_numel=400_000, prefetch_numel=200_000, buffer_numel=300_000)


def _peak_config(stage: int, offload: str, precision: str, nvme: str) -> dict:
    zo: dict = {
        "stage": stage,
        "stage3_param_persistence_threshold": 0,
        "reduce_bucket_size": PEAK_KNOBS["reduce_bucket_numel"],
        "stage3_prefetch_bucket_size": PEAK_KNOBS["prefetch_numel"],
    }
    device = "nvme" if offload == "nvme" else "cpu"
    tier = {"device": device, "nvme_path": nvme, "buffer_size": PEAK_KNOBS["buffer_numel"]}
    if offload != "none":
        zo["offload_optimizer"] = dict(tier, buffer_count=2)
    if offload in ("cpu+params", "nvme"):
        zo["offload_param"] = dict(tier)
    cfg: dict = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zo}
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    return cfg


def peak_worker(rank: int, world: int, nvme: str) -> dict:
    from ds_strategy.demos.gpt import gpt_loss

    out = {}
    for stage, offload, precision in PEAK_CASES:
        torch.manual_seed(0)
        model = GPT(GPTConfig(**PEAK_MODEL))
        config = _peak_config(stage, offload, precision, nvme)
        engine = ds_strategy.initialize(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), config)
        g = torch.Generator().manual_seed(rank)
        phases: dict[str, int] = {}
        for _ in range(2):  # the second step has optimizer state and a traced prefetch order
            tokens = torch.randint(0, PEAK_MODEL["vocab"], (2, PEAK_MODEL["seq"] + 1), generator=g)
            engine.reset_peak_memory()
            loss = gpt_loss(engine, tokens)
            phases["forward"] = engine.memory_report()["peak"]
            engine.reset_peak_memory()
            engine.backward(loss)
            phases["backward"] = engine.memory_report()["peak"]
            engine.reset_peak_memory()
            engine.step()
            phases["step"] = engine.memory_report()["peak"]
        out[(stage, offload, precision)] = phases
        engine.destroy()
    return out


def test_step_peak_matches_the_engines_meter_phase_by_phase(tmp_path: Path) -> None:
    """Every stage and offload tier (fp32, and bf16 for three): the step's peak in each phase
    (model state plus the gathered units, gradient buckets, fp32 copies and swap buffers the
    estimate names) is within 15% of the peak the engine's meter saw in that phase, on CPU
    ranks where all of it is host memory."""
    from ds_strategy.estimate import Knobs, step_peak

    world = 2
    facts = model_facts(lambda: GPT(GPTConfig(**PEAK_MODEL)), persistence_threshold=0)
    knobs = Knobs(
        **PEAK_KNOBS, buffer_count=2, reduce_scratch=True, shared_memory=True, cpu_only=True
    )
    results = run_ranks(peak_worker, world, str(tmp_path), timeout=300)
    for (stage, offload, precision), phases in results[0].items():
        pk = step_peak(facts, world, stage, offload, precision, knobs=knobs)
        rest = sum(t.nbytes for t in pk.terms if t.phase is None and t.tier != "nvme")
        for phase, measured in phases.items():
            held = rest + sum(t.nbytes for t in pk.terms if t.phase == phase and t.tier != "nvme")
            where = f"zero{stage} {offload} {precision} {phase}: {pk.terms}"
            assert held == pytest.approx(measured, rel=0.15), where
        assert pk.host_peak == pytest.approx(max(phases.values()), rel=0.15)


def test_cli_peak_table_on_cpu_ranks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--cpu-only`` and a config's buffer sizes: the peak table gives each configuration's
    host peak, the phase and the terms held then, with their tier."""
    from ds_strategy.estimate import Knobs, step_peak

    config = tmp_path / "ds.json"
    zo = {
        "stage": 3,
        "reduce_bucket_size": 2e7,
        "stage3_max_reuse_distance": 0,  # nothing kept gathered: the step's buffers peak
        "offload_optimizer": {
            "device": "nvme",
            "nvme_path": str(tmp_path),
            "buffer_size": 2e7,
            "buffer_count": 3,
        },
    }
    config.write_text(json.dumps({"zero_optimization": zo}))
    args = [
        "estimate",
        "--params",
        "1B",
        "--world-size",
        "2",
        "--cpu-only",
        "--config",
        str(config),
        "--precision",
        "fp32",
    ]
    assert cli(args) == 0
    out = capsys.readouterr().out.split("peak of a training step")[1]
    assert "host memory (CPU ranks)" in out
    row = next(line for line in out.splitlines() if line.startswith("zero3+nvme "))
    knobs = Knobs(
        reduce_bucket_numel=2e7,
        max_reuse_numel=0,
        buffer_numel=2e7,
        buffer_count=3,
        reduce_scratch=True,
        cpu_only=True,
    )
    pk = step_peak(ModelFacts(params=10**9), 2, 3, "nvme", "fp32", knobs=knobs)
    assert pk.peak_phase == "step"
    # the bucket stepping and the one read ahead: 2 x 2e7 elements x 16 bytes
    assert pk.host_peak == pytest.approx(2 * 2e7 * 16)
    assert row.split()[2] == f"{pk.host_peak / 1e9:.2f}"
    assert "[step] swap_buffers (host)" in row
    # the CPU tier holds Adam's state; on CPU ranks the whole model state is host memory
    row = next(line for line in out.splitlines() if line.startswith("zero3+cpu "))
    assert "optimizer (host)" in row and "params " in row


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--params", "1B", "--ranks-per-node", "0"], "--ranks-per-node must be >= 1"),
        (["--params", "1B", "--hidden-size", "0"], "--hidden-size must be at least 1, got 0"),
        (["--params", "1B", "--mics-shard-size", "0"], "--mics-shard-size must be -1 (off)"),
        (["--params", "1B", "--persistence-threshold", "-1"], "--persistence-threshold must be"),
        (["--model", "ds_strategy.demos.gpt:GPT", "--model-arg", "layers=-1"], "GPTConfig.layers"),
        (
            ["--model", "ds_strategy.demos.gpt:GPT", "--model-arg", "layers=0"],
            "--model ds_strategy.demos.gpt:GPT with {'layers': 0}: GPTConfig.layers must be",
        ),
        (["--params", "1B", "--gpu-mem", "1e400"], "--gpu-mem: a memory size must be finite"),
        (["--params", "x"], "--params: cannot read 'x' as a parameter count"),
        (["--model", "ds_strategy.demos.gpt:GPT", "--model-arg", "d=1e9"], "GPTConfig.d"),
    ],
)
def test_cli_options_out_of_range_are_usage_errors(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli(["estimate", "--world-size", "2", *args]) == 2
    assert message in capsys.readouterr().err


def test_cli_fills_auto_bucket_sizes_from_the_hidden_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Hugging Face / Accelerate DeepSpeed config says "auto" for the bucket sizes its loop
    derives from the model's hidden size: the estimate derives them alike, from --hidden-size
    or the --model's config, and says so when it has neither."""
    h = 64
    sizes = {"reduce_bucket_size": h * h, "stage3_prefetch_bucket_size": int(0.9 * h * h)}
    sizes["stage3_param_persistence_threshold"] = 10 * h
    configs = {
        "auto": {k: "auto" for k in sizes},
        "written": sizes,
        "defaults": {},
    }
    paths = {}
    for name, zero in configs.items():
        config = {
            "zero_optimization": {"stage": 3, **zero},
            "bf16": {"enabled": "auto"},
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
        }
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(config))

    def out(*args: str) -> str:
        rc = cli(["estimate", *args, "--world-size", "2", "--gpu-mem", "1GB"])
        captured = capsys.readouterr()
        assert rc in (0, 1), captured.err
        return captured.out

    params = ("--params", "50M")
    assert cli(["estimate", *params, "--world-size", "2", "--config", str(paths["auto"])]) == 2
    err = capsys.readouterr().err
    assert "zero_optimization.reduce_bucket_size, zero_optimization.stage3_prefetch" in err
    assert "are 'auto' but the estimate has no hidden size" in err and "--hidden-size" in err
    written = out(*params, "--config", str(paths["written"]))
    assert written != out(*params, "--config", str(paths["defaults"]))  # the sizes count
    assert out(*params, "--config", str(paths["auto"]), "--hidden-size", str(h)) == written
    model = ("--model", "tests.test_estimate:hf_like", "--model-arg", f"hidden={h}")
    from_model = out(*model, "--config", str(paths["written"]))
    assert out(*model, "--config", str(paths["auto"])) == from_model


# -- activations of a decoder, from its sizes -------------------------------------------------


def tiny_llama(**sizes: int) -> nn.Module:
    """A transformers Llama from a config (the CLI's --model factory)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = dict(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    config.update(sizes)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**config))


def _saved_bytes(model: nn.Module, tokens: int) -> int:
    from ds_strategy.core.activation_checkpointing import SavedTensorMeter

    ids = torch.randint(0, 1024, (1, tokens), generator=torch.Generator().manual_seed(0))
    with SavedTensorMeter(model) as meter:
        model(input_ids=ids, labels=ids)
    return meter.bytes


@pytest.mark.parametrize("sizes", [{}, {"intermediate_size": 704, "num_key_value_heads": 8}])
def test_activations_from_the_sizes_match_what_autograd_keeps(sizes: dict[str, int]) -> None:
    """The count of [Note: activations of a decoder] against the tensors a transformers Llama
    saves for backward (fp32), plain and with the loss and MLPs tiled (less the one tile a
    backward recomputes, which the forward does not keep)."""
    pytest.importorskip("transformers")
    from ds_strategy.config._schema import TilingConfig
    from ds_strategy.core.sequence import apply_tiling
    from ds_strategy.estimate import TransformerShape, activation_bytes

    model = tiny_llama(**sizes)
    shape = TransformerShape.of(model)
    assert shape is not None
    tokens, tile = 256, 32
    plain = activation_bytes(shape, tokens, dtype_bytes=4)
    assert plain == pytest.approx(_saved_bytes(model, tokens), rel=0.05)
    apply_tiling(model, TilingConfig(loss=True, mlp=True, tokens=tile))
    tiled = activation_bytes(shape, tokens, dtype_bytes=4, tiled=True, tile_tokens=tile)
    one_tile = tile * (4 * shape.intermediate * 4 + 3 * 4 * shape.vocab)
    assert tiled - one_tile == pytest.approx(_saved_bytes(model, tokens), rel=0.05)
    # a rank of a sequence split over 2 ranks holds half the tokens' activations
    assert activation_bytes(shape, tokens, dtype_bytes=4, sequence_ranks=2) == plain / 2


def test_cli_counts_activations_from_the_sequence_length(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("transformers")
    base = ["estimate", "--model", "tests.test_estimate:tiny_llama", "--world-size", "1"]
    assert cli([*base, "--seq-len", "65536", "--gpu-mem", "1GB"]) == 1  # nothing fits
    whole = capsys.readouterr().out
    assert "activations: " in whole and "model state sharded over 1 ranks" in whole
    split = [*base, "--seq-len", "65536", "--sequence-ranks", "8", "--tiled", "--gpu-mem", "1GB"]
    assert cli(split) == 0
    out = capsys.readouterr().out
    assert "over 8 rank(s) a sequence, bf16, tiled" in out and "sharded over 8 ranks" in out
    gb = [float(re.search(r"activations: ([\d.]+) GB", t).group(1)) for t in (whole, out)]
    assert gb[1] < gb[0] / 8
    assert cli([*base, "--seq-len", "1001", "--sequence-ranks", "2"]) == 2
    assert "multiple of --sequence-ranks 2" in capsys.readouterr().err
    assert cli(["estimate", "--params", "7B", "--world-size", "2", "--seq-len", "4096"]) == 2
    assert "--seq-len needs a --model whose config" in capsys.readouterr().err


def test_below_sixteen_bytes_a_parameter() -> None:
    from ds_strategy.config import load_config
    from ds_strategy.estimate import PRECISIONS, config_of

    facts = ModelFacts(params=10**9)
    names = ("bf16", "bf16-states", "bf16-low", "fp32-8bit", "fp32-muon")
    per = {name: sum(PRECISIONS[name]) for name in names}
    assert per == {"bf16": 16, "bf16-states": 12, "bf16-low": 8, "fp32-8bit": 10.03125,
                   "fp32-muon": 12}  # fmt: skip
    assert (
        load_config(config_of(estimate(facts, 8, 1, "none", "fp32-muon"))).optimizer.type == "Muon"
    )
    rows = {(e.stage, e.offload, e.precision): e for e in estimate_all(facts, 8, tuple(PRECISIONS))}
    # stage 3 on 8 ranks: 8 bytes a parameter over 8 ranks, against 16 at bf16
    assert rows[(3, "none", "bf16-low")].model_state * 2 == rows[(3, "none", "bf16")].model_state
    config = load_config(config_of(rows[(2, "none", "bf16-8bit")]))
    assert config.optimizer.type == "AdamW8bit" and config.bf16.enabled is True
    low = load_config(config_of(rows[(3, "cpu", "bf16-low")])).bf16
    assert low.bf16_master_weights_and_grads and low.bf16_optimizer_states
    # NVMe offload does not take them (the config's rules refuse it): never recommended there
    nvme = rows[(3, "nvme", "bf16-low")]
    assert not fits(nvme, 1e15, None, 8)
    assert recommend([nvme], 1e15, precision="bf16-low") is None
