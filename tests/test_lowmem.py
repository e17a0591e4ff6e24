"""Below sixteen bytes a parameter: bf16 (and fp16) master weights and bf16 optimizer states,
stepped in fp32 a chunk at a time and rounded back stochastically (core/precision/step.py).

[Note: how sharding is tested exactly]
Every rank trains on the same batch, so the averaged gradient is each rank's own gradient
(``(g + g) / 2`` is exact in any float format) and two ranks must end bitwise where one
process ends: each rank's piece of a parameter is stepped and rounded as one process steps
and rounds the whole parameter.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from unittest import mock

import pytest
import torch

import ds_strategy
from ds_strategy.config import ConfigError
from ds_strategy.core.memory import StepMemoryProbe
from ds_strategy.core.optim.lowbit import plain_state
from ds_strategy.core.optim.muon import Muon
from ds_strategy.core.optimizers import optimizer_class
from ds_strategy.core.precision.rounding import rounding_key, stochastic_round_
from ds_strategy.demos.gpt import GPT, GPTConfig
from tests.distributed import run_ranks, run_ranks_each
from tests.models import ToyLM, batches, lm_loss, make_optimizer
from tests.test_memory_peak import CFG, _loss, _merge, _model, _probed_step, _sizes, bound

BF16_LOW = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
                     "bf16_optimizer_states": True}}  # fmt: skip
BF16_STATES = {"bf16": {"enabled": True, "bf16_optimizer_states": True}}
FP16_LOW = {"fp16": {"enabled": True, "fp16_master_weights_and_grads": True,
                     "initial_scale_power": 8, "hysteresis": 1}}  # fmt: skip


# -- stochastic rounding, in one process -------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour(dtype: torch.dtype) -> None:
    x = torch.full((100_000,), 1.0 + 2**-12) * torch.tensor([1.0, -1.0]).repeat(50_000)
    out = torch.empty_like(x, dtype=dtype)
    stochastic_round_(out, x, 0, rounding_key(3, 1))
    near = x.to(dtype)
    other = torch.nextafter(near, torch.where(x > near.float(), 10.0, -10.0).to(dtype))
    assert bool(((out == near) | (out == other)).all())
    for sign in (0, 1):  # each sign's mean is the fp32 value, within the sampling error
        got = out[sign::2].double().mean()
        gap = float((other.float() - near.float()).abs()[0])
        assert abs(float(got) - float(x[sign])) < 5 * gap / (50_000**0.5)
    assert (out != near).any(), "no value rounded away from nearest"
    exact = torch.tensor([0.5, -2.0, 0.0, 3.0])  # representable: left as they are
    kept = torch.empty_like(exact, dtype=dtype)
    stochastic_round_(kept, exact, 0, 7)
    assert torch.equal(kept.float(), exact)


def test_a_piece_rounds_as_the_whole_parameter_does() -> None:
    x = torch.randn(200_000)
    whole = torch.empty_like(x, dtype=torch.bfloat16)
    stochastic_round_(whole, x, 0, 11)
    for lo, hi in ((0, 5), (65_530, 131_080), (123_457, 200_000)):  # across the noise blocks
        piece = torch.empty(hi - lo, dtype=torch.bfloat16)
        stochastic_round_(piece, x[lo:hi], lo, 11)
        assert torch.equal(piece, whole[lo:hi])
    other = torch.empty_like(whole)
    stochastic_round_(other, x, 0, 12)  # another key (step, parameter): other draws
    assert not torch.equal(other, whole)


# -- the engine: exact against one process --------------------------------------------------------


def low_worker(rank: int, world: int, stage: int, precision: dict, extra: dict) -> dict:
    torch.manual_seed(0)
    model = ToyLM()
    zc = {"stage": stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 600}
    config = _merge({"zero_optimization": zc, **precision}, extra)
    engine = ds_strategy.initialize(model, make_optimizer("adamw", model), config)
    for b in batches(4, 1, 4, seed=5):  # the same batch on every rank: see the note
        engine.backward(lm_loss(engine, b))
        engine.step()
    weights = {k: v.clone() for k, v in engine.full_state_dict().items()}
    dtypes = {str(v.dtype) for pc in engine.optimizer_pieces
              for v in engine.optimizer.state[pc.tensor].values() if v.dim() > 0}  # fmt: skip
    return {"weights": weights, "report": engine.memory_report(), "states": dtypes}


@pytest.mark.parametrize(
    "precision", [BF16_LOW, BF16_STATES, FP16_LOW], ids=["bf16-low", "bf16-states", "fp16-low"]
)
def test_two_ranks_end_bitwise_where_one_process_ends(precision: dict) -> None:
    one = {s: run_ranks(low_worker, 1, s, precision, {})[0] for s in (1, 3)}
    calls = [(low_worker, (s, precision, {})) for s in (1, 2, 3)]
    calls.append((low_worker, (3, precision, {"zero_optimization": {"sub_group_size": 97}})))
    offload = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    calls.append((low_worker, (3, precision, {"zero_optimization": offload})))
    for i, results in enumerate(run_ranks_each(calls, 2)):
        ref = one[3 if i >= 2 else 1]["weights"]
        got = results[0]["weights"]
        assert set(got) == set(ref)
        for k in ref:
            # an fp32 master is stepped in place, where a piece's alignment decides which
            # elements torch's kernel takes in its vector loop: fp32 rounding apart
            tol = 1e-6 if got[k].dtype == torch.float32 else 0.0
            assert torch.allclose(got[k], ref[k], rtol=0, atol=tol), (i, k)
    state = "torch.bfloat16" if "bf16_optimizer_states" in str(precision) else "torch.float32"
    assert one[1]["states"] == {state}


def rounding_matters_worker(rank: int, world: int, precision: dict) -> float:
    """Adam's steps of 1e-4 on weights of 1.0, a 40th of bf16's spacing there (2**-7)."""
    lin = torch.nn.Linear(4096, 1, bias=False)
    torch.nn.init.ones_(lin.weight)
    config = {"zero_optimization": {"stage": 2}, **precision}
    engine = ds_strategy.initialize(lin, torch.optim.Adam(lin.parameters(), lr=1e-4), config)
    x = torch.ones(2, 4096)
    for _ in range(40):
        engine.backward(engine(x).float().sum())  # a constant gradient: each step is -lr
        engine.step()
    return float(engine.full_state_dict()["weight"].double().mean())


def test_updates_below_bf16_resolution_are_kept_on_average() -> None:
    nearest = {"bf16": {"enabled": True, "master_weights": False}}  # torch steps bf16 itself
    kept, lost = (run_ranks(rounding_matters_worker, 2, p)[0] for p in (BF16_LOW, nearest))
    assert lost == 1.0  # rounded to nearest, 40 steps of 1e-4 vanish
    assert abs(kept - (1.0 - 40 * 1e-4)) < 3e-4, kept


# -- memory: the formula of each choice, at every point of a step ---------------------------------

CHUNK = 20_000  # sub_group_size: the step's fp32 working copies stay small


def low_memory_worker(rank: int, world: int, cases: list[tuple[int, str]]) -> dict:
    sizes = _sizes()
    g = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, CFG.vocab, (2, CFG.seq + 1), generator=g) for _ in range(4)]
    out: dict = {"sizes": sizes}
    for stage, name in cases:
        StepMemoryProbe.exclude_existing()
        model = _model()
        probe = StepMemoryProbe(model, baseline=0)
        probe.armed = False
        zc = {"stage": stage, "reduce_bucket_size": 100_000, "sub_group_size": CHUNK,
              "stage3_param_persistence_threshold": 1_000,
              "stage3_prefetch_bucket_size": sizes["block"],
              "stage3_max_live_parameters": sizes["root"] + 2 * sizes["block"]}  # fmt: skip
        precision = {"low": BF16_LOW, "states": BF16_STATES, "fp16low": FP16_LOW}.get(name, {})
        config = {"zero_optimization": zc, **precision}
        opt = _optimizer_of(name, model)
        with mock.patch("torch.compile", lambda fn, **kwargs: fn):  # torchao's step, eagerly
            engine = ds_strategy.initialize(model, opt, config)
            probe.watch_optimizer(engine.optimizer)
            _probed_step(engine, probe, data[:1])
            engine.reset_peak_memory()
            probe.armed = True
            for i in (1, 2):
                _probed_step(engine, probe, data[i : i + 1])
        out[(stage, name)] = {
            "readings": dict(probe.readings),
            "report": engine.memory_report(),
            "formula": engine._formula_bytes(),  # the start summary's and timeline's formula
        }
        probe.close()
        engine.destroy()
    return out


def _optimizer_of(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if name in ("8bit", "4bit", "fp8"):
        return _lowbit(name, model.parameters())
    if name == "muon":
        return Muon(model.parameters(), lr=0.02)
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def low_formula(stage: int, name: str, n: int) -> float:
    """Each choice's model state a rank, parameter by parameter (stage 3: the small ones,
    under 1,000 elements, stay whole). bf16 (P = G = 2): K = two bf16 moments ("low"), plus
    a 4-byte fp32 master ("states"); fp16 masters ("fp16low", P = G = 2) step two fp32
    moments. fp32 (P = G = 4): "8bit" keeps two 1-byte moments and a 4-byte scale per 256
    where torchao quantizes (4,096 elements or more), two fp32 moments elsewhere ("4bit":
    half a byte, a scale per 128; "fp8": a byte, a scale per 256, and no code map); "muon"
    one fp32 momentum for a matrix, two moments for the rest."""
    total = 0.0
    for p in _model().parameters():
        psi = p.numel()
        if name in ("low", "states", "fp16low"):
            e, k = 2, 4 if name == "low" else 8
        elif name in ("8bit", "4bit", "fp8"):
            block, code = (128, 0.5) if name == "4bit" else (256, 1.0)
            e, k = 4, 2 * (code + 4 / block) if psi >= 4096 and psi % block == 0 else 8
        else:
            e, k = 4, 4 if p.ndim == 2 else 8
        whole = stage == 3 and psi < 1_000
        params = e * psi / (n if stage == 3 and not whole else 1)
        grads = e * psi / (n if stage >= 2 else 1)
        total += params + grads + k * psi / n
    return total


@pytest.mark.slow
def test_model_state_is_the_formula_of_each_choice_at_every_point() -> None:
    cases = [(s, name) for s in (1, 2, 3) for name in ("low", "states", "fp16low")]
    cases += [(s, name) for s in (1, 2, 3) for name in ("8bit", "4bit", "fp8", "muon")]
    r = run_ranks(low_memory_worker, 2, cases)[0]
    sizes = r["sizes"]
    largest = sizes["largest"]
    for stage, name in cases:
        formula = low_formula(stage, name, 2)
        # the engine's own formula (start summary, timeline) is this one within torchao's rule
        assert abs(r[(stage, name)]["formula"] / formula - 1) < 0.02, (stage, name)
        bf16 = name in ("low", "states", "fp16low")  # two-byte weights and gradients
        allowed = bound(max(stage, 2), "bf16" if bf16 else "fp32", sizes, 2)
        # the step's fp32 working copies (weights, gradients, two moments) of one chunk, or
        # of one piece larger than a chunk, instead of mixed precision's fp32 gradient shard;
        # fp32 weights (8-bit, 4-bit, Muon) step their own gradients, read before the step
        allowed["in_step"] = 16 * max(CHUNK, largest) if bf16 else 0
        if name == "states":  # the fp32 master's step takes an fp32 copy of the gradients
            allowed["in_step"] += 4 * sizes["psi"] / 2
        if stage == 1:  # the flat gradients are in the formula; autograd's newest one is not
            allowed["in_backward"] = (2 if bf16 else 4) * largest
            allowed["after_backward"] = 0
        got = r[(stage, name)]["readings"]
        for point, value in got.items():
            limit = 1.03 * formula + allowed[point] + 64 * 1024
            assert value <= limit, (stage, name, point, value / formula, limit / formula)
        assert got["after_step"] >= 0.97 * formula, (stage, name, got["after_step"] / formula)


# -- checkpoints convert between precisions ------------------------------------------------------


def _states_by_name(engine: ds_strategy.ZeroEngine, model: torch.nn.Module) -> dict:
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict = {}
    for pc in engine.optimizer_pieces:
        st = engine.optimizer.state.get(pc.tensor, {})
        name = names[id(pc.group.params[pc.index])]
        for k, v in st.items():
            if torch.is_tensor(v) and v.shape == pc.tensor.shape:
                out.setdefault((name, k), []).append((pc.start, v.detach().clone()))
    return out


def ckpt_worker(rank: int, world: int, stage: int, precision: dict, path: str, load: bool) -> dict:
    torch.manual_seed(0)
    model = ToyLM()
    zc = {"stage": stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 600}
    engine = ds_strategy.initialize(
        model, make_optimizer("adamw", model), {"zero_optimization": zc, **precision}
    )
    if load:
        engine.load_checkpoint(path)
    else:
        for b in batches(3, 1, 4, seed=5):
            engine.backward(lm_loss(engine, b))
            engine.step()
        engine.save_checkpoint(path)
    out = {"states": _states_by_name(engine, model), "report": engine.memory_report()}
    out["weights"] = {k: v.float() for k, v in engine.full_state_dict().items()}
    engine.backward(lm_loss(engine, batches(1, 1, 4, seed=6)[0]))
    engine.step()  # and it trains on from there
    return out


def _whole(pieces: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for _, t in sorted(pieces, key=lambda p: p[0])])


def test_checkpoints_convert_between_precisions(tmp_path: Path) -> None:
    low, plain = str(tmp_path / "low"), str(tmp_path / "plain")
    bf16 = {"bf16": {"enabled": True}}
    # bf16 weights and states from 2 ranks at stage 3, into fp32 masters and states
    saved = run_ranks(ckpt_worker, 2, 3, BF16_LOW, low, False)
    loaded = run_ranks(ckpt_worker, 1, 1, bf16, low, True)[0]
    ref = run_ranks(ckpt_worker, 1, 3, BF16_LOW, str(tmp_path / "ref"), False)[0]
    for key, pieces in loaded["states"].items():
        got = _whole(pieces)
        assert got.dtype == torch.float32
        assert torch.equal(got, _whole(ref["states"][key]).float()), key
    for k, v in ref["weights"].items():
        assert torch.equal(loaded["weights"][k], v), k
    assert saved[0]["weights"].keys() == ref["weights"].keys()
    # fp32 states from one process at stage 1, into bf16 states on 2 ranks at stage 3
    first = run_ranks(ckpt_worker, 1, 1, bf16, plain, False)[0]
    into = run_ranks(ckpt_worker, 2, 3, BF16_LOW, plain, True)
    for r in into:
        for (name, k), pieces in r["states"].items():
            whole = _whole(first["states"][(name, k)])
            for start, t in pieces:
                assert t.dtype == torch.bfloat16
                assert torch.equal(t.reshape(-1), whole[start : start + t.numel()].bfloat16())
    # the loaded state is stored as bf16 at once, not at the next step: the bytes of the
    # engine that trained in bf16, half of what fp32 state over the same shards holds
    assert into[0]["report"]["optimizer_state"] == saved[0]["report"]["optimizer_state"]


# -- refusals ------------------------------------------------------------------------------------


def test_nvme_offload_with_low_precision_states_is_refused(tmp_path: Path) -> None:
    model = ToyLM()
    zc = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}
    with pytest.raises(ConfigError, match="NVMe offload") as err:
        ds_strategy.initialize(
            model, torch.optim.AdamW(model.parameters()), {"zero_optimization": zc, **BF16_LOW}
        )
    assert "remove bf16.bf16_master_weights_and_grads" in str(err.value)


def test_the_start_summary_names_the_stored_precisions() -> None:
    from ds_strategy.config import load_config
    from ds_strategy.core.precision.policy import PrecisionPolicy
    from ds_strategy.core.start_summary import _precision

    policy = PrecisionPolicy.from_config(load_config(BF16_LOW))
    assert _precision(policy, None) == (
        "bf16 (bf16 master weights, stochastic rounding, bf16 optimizer states)"
    )
    assert policy.element_bytes() == (2, 2, 4)
    states = PrecisionPolicy.from_config(load_config(BF16_STATES))
    assert _precision(states, None) == "bf16 (fp32 master weights, bf16 optimizer states)"
    assert states.element_bytes() == (2, 2, 8)
    assert PrecisionPolicy.from_config(
        load_config({"bf16": {"enabled": True}})
    ).element_bytes() == (2, 2, 12)


# -- torchao's low-bit AdamW: each rank quantizes its own shard -------------------------------

SMALL = GPTConfig(vocab=256, d=64, layers=2, heads=2, seq=16)  # weights of 4,096+ elements


def _lowbit(kind: str, params: object) -> torch.optim.Optimizer:
    import torchao.optim

    cls = {"8bit": torchao.optim.AdamW8bit, "4bit": torchao.optim.AdamW4bit,
           "fp8": torchao.optim.AdamWFp8}[kind]  # fmt: skip
    return cls(params, lr=3e-3, weight_decay=0.01)


def lowbit_worker(
    rank: int, world: int, stage: int, kind: str, extra: dict, steps: int = 3, ckpt: str = ""
) -> dict:
    # torchao compiles its step for every piece shape: eager keeps the test short, and is the
    # same arithmetic in the engine and in the one-process reference
    with mock.patch("torch.compile", lambda fn, **kwargs: fn):
        torch.manual_seed(0)
        model = GPT(SMALL)
        data = [torch.randint(0, SMALL.vocab, (2, SMALL.seq + 1), generator=g)
                for g in [torch.Generator().manual_seed(4)] for _ in range(5)]  # fmt: skip
        if stage < 0:  # the reference: torchao's optimizer in one process, no engine
            opt = _lowbit(kind, model.parameters())
            for b in data[:steps]:
                _loss(model, b).backward()
                opt.step()
                opt.zero_grad()
            return {"weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}
        zc = {"stage": stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 9000}
        config = _merge({"zero_optimization": zc}, extra)
        engine = ds_strategy.initialize(model, _lowbit(kind, model.parameters()), config)
        done = 0
        if ckpt and steps < 0:  # resume: load, then the steps left of the five
            engine.load_checkpoint(ckpt)
            done, steps = -steps, 5
        loaded = _plain_states(engine, model)
        for b in data[done:steps]:  # the same batch on every rank: see the note at the top
            engine.backward(_loss(engine, b))
            engine.step()
        if ckpt and done == 0:
            engine.save_checkpoint(ckpt)
        kinds = {
            (math.prod(pc.group.shapes[pc.index]), type(v).__name__)
            for pc in engine.optimizer_pieces
            for k, v in engine.optimizer.state[pc.tensor].items()
            if k == "exp_avg"
        }
        weights = {k: v.clone() for k, v in engine.full_state_dict().items()}
        out = {"weights": weights, "kinds": kinds, "report": engine.memory_report()}
        return {**out, "loaded": loaded, "states": _plain_states(engine, model)}


def _plain_states(engine: ds_strategy.ZeroEngine, model: torch.nn.Module) -> dict:
    """Each piece's per-element state, dequantized, by (parameter name, state, start)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for pc in engine.optimizer_pieces:
        for k, v in engine.optimizer.state.get(pc.tensor, {}).items():
            if v.shape == pc.tensor.shape:
                name = names[id(pc.group.params[pc.index])]
                out[(name, k, pc.start)] = (type(v).__name__, plain_state(v).clone())
    return out


@pytest.mark.parametrize("kind", ["8bit", "4bit"])
def test_lowbit_state_reshards_through_a_checkpoint(kind: str, tmp_path: Path) -> None:
    pytest.importorskip("torchao")
    ckpt = str(tmp_path / "ckpt")
    saved = run_ranks(lowbit_worker, 2, 3, kind, {}, 3, ckpt)  # 3 steps on 2 ranks, stage 3
    resumed = run_ranks(lowbit_worker, 1, 1, kind, {}, -3, ckpt)[0]  # + 2 in one process
    # loaded quantized again, to the same values: rank r's pieces of stage 3 are slices of
    # the one process's whole parameters
    for (name, k, _), (cls, value) in resumed["loaded"].items():
        assert cls == {"8bit": "OptimState8bit", "4bit": "OptimState4bit"}[kind] or (
            value.numel() < 4096 or value.numel() % 128
        ), (name, cls)
        for r in saved:
            for (n2, k2, s2), (_, v2) in r["states"].items():
                if (n2, k2) == (name, k):
                    flat = value.reshape(-1)[s2 : s2 + v2.numel()]
                    # the same codes; each block's scale within an fp32 rounding
                    assert torch.allclose(flat, v2.reshape(-1), rtol=3e-7, atol=0), (name, k)
    # resumed, the run ends where torchao's uninterrupted one does. Within 1e-5: the query and
    # key biases' gradients are float noise around zero (attention is shift-invariant), which
    # Adam turns into steps of about lr, and the engine's kernels make other noise than a
    # plain model's after five steps
    ref = run_ranks(lowbit_worker, 1, -1, kind, {}, 5)[0]["weights"]
    for k, v in ref.items():
        assert torch.allclose(resumed["weights"][k], v, rtol=0, atol=1e-5), k


@pytest.mark.parametrize("kind", ["8bit", "4bit", "fp8"])
def test_lowbit_states_on_two_ranks_are_torchaos_in_one_process(kind: str) -> None:
    pytest.importorskip("torchao")
    ref = run_ranks(lowbit_worker, 1, -1, kind, {})[0]["weights"]
    calls = [(lowbit_worker, (s, kind, {})) for s in (1, 2, 3)]
    if kind == "8bit":  # with the optimizer state and the parameters offloaded to the CPU
        offload = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
        calls.append((lowbit_worker, (3, kind, {"zero_optimization": offload})))
    for stage, results in zip((1, 2, 3, 3), run_ranks_each(calls, 2), strict=False):
        got = results[0]
        for k, v in ref.items():
            assert torch.allclose(got["weights"][k], v, rtol=0, atol=1e-6), (stage, k)
        # quantized exactly where torchao quantizes the whole parameter
        for numel, name in got["kinds"]:
            assert (name != "Tensor") == (numel >= 4096 and numel % 128 == 0), (numel, name)
        assert any(name != "Tensor" for _, name in got["kinds"])


def config_lowbit_worker(rank: int, world: int) -> dict:
    with mock.patch("torch.compile", lambda fn, **kwargs: fn):
        torch.manual_seed(0)
        model = GPT(SMALL)
        config = {
            "zero_optimization": {"stage": 2},
            "optimizer": {"type": "AdamW8bit", "params": {"lr": 1e-3}},
        }
        engine = ds_strategy.initialize(model, None, config)
        batch = torch.randint(0, SMALL.vocab, (2, SMALL.seq + 1))
        engine.backward(_loss(engine, batch))
        engine.step()
        numel = sum(p.numel() for p in GPT(SMALL).parameters())
        return {
            "type": type(engine.optimizer).__name__,
            "state": engine.memory_report()["optimizer_state"],
            "fp32_state": 8 * numel / world,
        }


def test_the_config_names_torchaos_optimizers(tmp_path: Path) -> None:
    pytest.importorskip("torchao")
    r = run_ranks(config_lowbit_worker, 2)[0]
    assert r["type"] == "AdamW8bit"
    # codes and scales of the large weights, fp32 moments of the small ones
    assert r["state"] < 0.3 * r["fp32_state"], r
    model = ToyLM()
    config = {"zero_optimization": {"stage": 3, "offload_optimizer": {
        "device": "nvme", "nvme_path": str(tmp_path)}}}  # fmt: skip
    import torchao.optim

    with pytest.raises(ConfigError, match="AdamW8bit keeps quantized optimizer state"):
        ds_strategy.initialize(model, torchao.optim.AdamW8bit(model.parameters()), config)


# -- Muon: whole matrices from the shards -----------------------------------------------------

MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95)
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)


def muon_worker(rank: int, world: int, stage: int, steps: int = 3, ckpt: str = "") -> dict:
    torch.manual_seed(0)
    model = GPT(SMALL)
    data = [torch.randint(0, SMALL.vocab, (2, SMALL.seq + 1), generator=g)
            for g in [torch.Generator().manual_seed(4)] for _ in range(steps)]  # fmt: skip
    if stage < 0:  # torch's Muon for the matrices and AdamW for the rest, one process
        mats = [p for p in model.parameters() if p.ndim == 2]
        rest = [p for p in model.parameters() if p.ndim != 2]
        opts = [torch.optim.Muon(mats, **MUON), torch.optim.AdamW(rest, **ADAMW, foreach=False)]
        for b in data:
            _loss(model, b).backward()
            for o in opts:
                o.step()
                o.zero_grad()
        return {"weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    adamw = {f"adamw_{k}": v for k, v in ADAMW.items()}
    opt = Muon(model.parameters(), **MUON, **adamw)
    zc = {"stage": stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 9000}
    engine = ds_strategy.initialize(model, opt, {"zero_optimization": zc})
    done = 0
    if ckpt and os.path.exists(ckpt):  # resume from a save after 2 steps
        engine.load_checkpoint(ckpt)
        done = 2
    for i, b in enumerate(data[done:], start=done):  # the same batch on every rank: the note
        engine.backward(_loss(engine, b))
        engine.step()
        if ckpt and i == 1 and not done:
            engine.save_checkpoint(ckpt)
    sent = engine.comm_report().get("muon", 0)
    return {"weights": {k: v.clone() for k, v in engine.full_state_dict().items()}, "sent": sent,
            "state": engine.memory_report()["optimizer_state"]}  # fmt: skip


def test_muon_on_two_ranks_is_torchs_muon_in_one_process() -> None:
    ref = run_ranks(muon_worker, 1, -1)[0]["weights"]
    calls = [(muon_worker, (s,)) for s in (0, 1, 2, 3)]
    for stage, results in zip((0, 1, 2, 3), run_ranks_each(calls, 2), strict=True):
        got = results[0]
        for k, v in ref.items():
            err = float((got["weights"][k] - v).abs().max())
            assert err <= 1e-5, (stage, k, err)
        if stage > 0:  # the matrices' updates went between the ranks
            assert got["sent"] > 0
    # Muon keeps one momentum per matrix element, AdamW two moments for the rest: sharded
    mats = sum(p.numel() for p in GPT(SMALL).parameters() if p.ndim == 2)
    rest = sum(p.numel() for p in GPT(SMALL).parameters() if p.ndim != 2)
    state = sum(r["state"] for r in results)  # stage 3's two ranks
    assert state <= (4 * mats + 8 * rest) * 1.01 + 2 * 1024, (state, 4 * mats + 8 * rest)


def test_muon_resumes_at_another_world_size_and_stage(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    run_ranks(muon_worker, 2, 3, 3, ckpt)  # saves after 2 of the 3 steps, on 2 ranks
    resumed = run_ranks(muon_worker, 1, 1, 3, ckpt)[0]["weights"]  # the 3rd step
    ref = run_ranks(muon_worker, 1, -1)[0]["weights"]
    for k, v in ref.items():
        assert float((resumed[k] - v).abs().max()) <= 1e-5, k
    assert optimizer_class("muon") is Muon  # the config's {"type": "Muon"}: this one


def torch_muon_worker(rank: int, world: int, stage: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(24, 48, bias=False), torch.nn.Tanh(), torch.nn.Linear(48, 24, bias=False)
    )
    opt = torch.optim.Muon(model.parameters(), **MUON)
    x = torch.randn(8, 24, generator=torch.Generator().manual_seed(2))
    if stage < 0:
        for _ in range(3):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    zc = {"stage": stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 500}
    engine = ds_strategy.initialize(model, opt, {"zero_optimization": zc})
    for _ in range(3):  # the same batch on every rank
        engine.backward(engine(x).square().mean())
        engine.step()
    return {k: v.clone() for k, v in engine.full_state_dict().items()}


def test_a_torch_muon_given_to_the_engine_steps_as_in_one_process() -> None:
    ref = run_ranks(torch_muon_worker, 1, -1)[0]
    for got in (run_ranks(torch_muon_worker, 2, s)[0] for s in (1, 3)):
        for k, v in ref.items():
            assert float((got[k] - v).abs().max()) <= 1e-5, k


# -- convergence: 300 steps on the docs corpus ---------------------------------------------------

ADAMW_SECTION = {"type": "AdamW", "params": {"lr": 3e-3}}


def converge_worker(rank: int, world: int, name: str) -> list[float]:
    from tests.compression_common import corpus_losses

    extra = {"bf16-low": BF16_LOW, "bf16-states": BF16_STATES}.get(name, {})
    section = {**ADAMW_SECTION, "type": "AdamW8bit"} if name == "8bit" else ADAMW_SECTION
    with mock.patch("torch.compile", lambda fn, **kwargs: fn):  # torchao's step, eagerly
        return corpus_losses(
            rank, world, {"method": "none"}, section, stage=3, extra=extra, steps=300, d=64
        )


@pytest.mark.slow
def test_bf16_states_and_8bit_adamw_end_within_2_percent_of_fp32_adamw() -> None:
    pytest.importorskip("torchao")
    names = ["fp32", "bf16-states", "bf16-low", "8bit"]
    runs = run_ranks_each([(converge_worker, (n,)) for n in names], 2)
    final = {n: sum(r[0]) / len(r[0]) for n, r in zip(names, runs, strict=True)}
    for name in names[1:]:
        assert abs(final[name] / final["fp32"] - 1) <= 0.02, final
    assert final["fp32"] < 3.0, final  # it learned: the characters' entropy is about 4.3
