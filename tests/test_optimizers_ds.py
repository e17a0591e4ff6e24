"""DeepSpeed's optimizer types from a config: the Adam flags (``adam_w_mode``, ``torch_adam``,
``bias_correction``) mapped as DeepSpeed maps them, ``Lamb`` with ``FusedLamb``'s formula and
correct under ZeRO (a parameter split between ranks gets its whole-parameter trust ratio),
and the 1-bit optimizers refused with the reason."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from torch import nn

import ds_strategy
from ds_strategy.config import ConfigError, OptimizerConfig
from ds_strategy.core.optim import Adam, Lamb
from ds_strategy.core.optimizers import build_optimizer, optimizer_class, optimizer_factory
from tests.distributed import run_ranks


def _build(type_: str, **params: Any) -> torch.optim.Optimizer:
    return build_optimizer(OptimizerConfig(type_, params), [nn.Parameter(torch.zeros(3))])


# -- config -> class -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "type_,params,cls,decoupled",
    [
        ("Adam", {}, torch.optim.AdamW, True),  # DeepSpeed: adam_w_mode defaults to true
        ("adam", {"adam_w_mode": False}, torch.optim.Adam, False),
        ("AdamW", {"adam_w_mode": False}, torch.optim.AdamW, True),  # forced for AdamW
        ("Adam", {"torch_adam": True, "adam_w_mode": False}, torch.optim.Adam, False),
        ("Adam", {"bias_correction": False}, Adam, True),
        ("Adam", {"bias_correction": False, "adam_w_mode": False}, Adam, False),
        ("ADAMW", {"bias_correction": False, "adam_w_mode": False}, Adam, True),
    ],
)
def test_adam_flags_pick_deepspeeds_class(type_: str, params: dict, cls: type, decoupled: bool):
    opt = _build(type_, lr=0.1, weight_decay=0.05, **params)
    assert type(opt) is cls
    assert opt.defaults["lr"] == 0.1 and opt.defaults["weight_decay"] == 0.05
    if cls is Adam:
        assert opt.defaults["adam_w_mode"] is decoupled
        assert opt.defaults["bias_correction"] is False


def test_adam_weight_decay_defaults_as_in_deepspeed() -> None:
    # FusedAdam's default is 0 (torch's AdamW's 0.01); torch_adam hands the params to torch
    assert _build("AdamW").defaults["weight_decay"] == 0.0
    assert _build("Adam", adam_w_mode=True).defaults["weight_decay"] == 0.0
    assert _build("AdamW", torch_adam=True).defaults["weight_decay"] == 0.01


def test_other_unknown_params_are_still_named() -> None:
    known = {"Adam": {"adam_w_mode": True}, "AdamW": {"torch_adam": True}, "Lamb": {"max_coeff": 5}}
    for type_, params in known.items():
        section = OptimizerConfig(type_, {"lr": 1e-3, "set_grad_none": True, **params})
        with pytest.raises(ConfigError, match=r"\['set_grad_none'\] are not") as info:
            optimizer_factory(section)
        assert info.value.key == "optimizer.params"
        assert "weight_decay" in str(info.value)
    with pytest.raises(ConfigError, match="adam_w_mode") as info:  # an Adam flag on Lamb
        optimizer_factory(OptimizerConfig("Lamb", {"adam_w_mode": True}))
    with pytest.raises(ConfigError, match="expected true or false") as info:
        optimizer_factory(OptimizerConfig("Adam", {"bias_correction": "no"}))
    assert info.value.key == "optimizer.params.bias_correction"
    with pytest.raises(ConfigError, match="gradient_clipping") as info:  # as DeepSpeed refuses it
        optimizer_factory(OptimizerConfig("Lamb", {"max_grad_norm": 1.0}))
    assert info.value.key == "optimizer.params.max_grad_norm"
    with pytest.raises(ValueError, match="gradient_clipping"):
        Lamb([nn.Parameter(torch.zeros(1))], max_grad_norm=1.0)


def test_lamb_is_built_from_a_config_with_its_params() -> None:
    assert optimizer_class("LAMB") is Lamb
    opt = _build("lamb", lr=0.01, max_coeff=5.0, min_coeff=0.1, bias_correction=False)
    assert type(opt) is Lamb
    assert (opt.defaults["max_coeff"], opt.defaults["min_coeff"]) == (5.0, 0.1)
    assert opt.defaults["bias_correction"] is False


@pytest.mark.parametrize(
    ("name", "cls", "freeze"),
    [("OneBitAdam", "OneBitAdam", "freeze_step"), ("OnebitAdam", "OneBitAdam", "freeze_step"),
     ("onebitlamb", "OneBitLamb", "freeze_step"), ("ONEBITLAMB", "OneBitLamb", "freeze_step"),
     ("ZeroOneAdam", "ZeroOneAdam", "var_freeze_step"),
     ("zerooneadam", "ZeroOneAdam", "var_freeze_step")],
)  # fmt: skip
def test_one_bit_optimizers_build_with_deepspeeds_keys(
    name: str, cls: str, freeze: str, caplog: pytest.LogCaptureFixture
) -> None:
    params = {"lr": 1e-3, freeze: 7, "bias_correction": False, "cuda_aware": False,
              "comm_backend_name": "nccl"}  # fmt: skip
    with caplog.at_level("WARNING", logger="ds_strategy"):
        opt = optimizer_factory(OptimizerConfig(name, params))([torch.nn.Parameter(torch.ones(3))])
    assert type(opt).__name__ == cls
    assert (opt.schedule[0] if cls == "ZeroOneAdam" else opt.freeze_step) == 7
    assert "means nothing here" in caplog.text and "comm_backend_name" in caplog.text
    with pytest.raises(ConfigError, match=f"{freeze}s"):
        optimizer_factory(OptimizerConfig(name, {f"{freeze}s": 7}))


# -- Adam without bias correction --------------------------------------------------------------


def _reference_adam(w, grads, lr, betas, eps, weight_decay, decoupled, bias_correction):
    """FusedAdam's per-element formula, in float64, written out plainly."""
    w = w.double().clone()
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    b1, b2 = betas
    wd = weight_decay
    for t, g in enumerate(grads, start=1):
        g = g.double()
        if not decoupled:
            g = g + wd * w
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        c1 = 1 - b1**t if bias_correction else 1.0
        c2 = 1 - b2**t if bias_correction else 1.0
        u = (m / c1) / (torch.sqrt(v / c2) + eps)
        if decoupled:
            u = u + wd * w
        w = w - lr * u
    return w


def _run(opt_cls, w0, grads, **kw):
    w = nn.Parameter(w0.clone())
    opt = opt_cls([w], **kw)
    for g in grads:
        w.grad = g.clone()
        opt.step()
    return w.detach()


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_adam_without_bias_correction_matches_a_reference(decoupled: bool) -> None:
    torch.manual_seed(0)
    w0 = torch.randn(40)
    grads = [torch.randn(40) for _ in range(6)]
    kw = dict(lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    got = _run(Adam, w0, grads, bias_correction=False, adam_w_mode=decoupled, **kw)
    ref = _reference_adam(w0, grads, **kw, decoupled=decoupled, bias_correction=False)
    assert torch.allclose(got.double(), ref, atol=1e-6, rtol=0)
    # and the switch matters: with bias correction the first steps are much larger
    corrected = _reference_adam(w0, grads, **kw, decoupled=decoupled, bias_correction=True)
    assert (corrected - ref).abs().max() > 1e-2
    # with bias correction the class is torch's Adam / AdamW
    torch_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    ours = _run(Adam, w0, grads, bias_correction=True, adam_w_mode=decoupled, **kw)
    theirs = _run(torch_cls, w0, grads, **kw)
    assert torch.allclose(ours, theirs, atol=1e-6, rtol=0)


def test_engine_keeps_bias_correction_off_through_the_rebuild() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    ref_model = copy.deepcopy(model)
    params = {"lr": 0.05, "weight_decay": 0.1, "bias_correction": False, "adam_w_mode": False}
    config = {"zero_optimization": {"stage": 1}, "optimizer": {"type": "Adam", "params": params}}
    engine = ds_strategy.initialize(model, None, config)
    assert type(engine.optimizer) is Adam
    assert engine.optimizer.param_groups[0]["adam_w_mode"] is False
    ref = Adam(ref_model.parameters(), **params)
    for _ in range(3):
        x = torch.randn(6, 4)
        engine.backward(engine(x).square().mean())
        engine.step()
        ref_model(x).square().mean().backward()
        ref.step()
        ref.zero_grad()
    got = engine.full_state_dict()
    for k, v in ref_model.state_dict().items():
        assert torch.allclose(got[k], v, atol=1e-6), k


# -- LAMB, one process ---------------------------------------------------------------------------


def _reference_lamb(ws, grads_per_step, lr, betas, eps, wd, bias_correction, hi, lo, inside):
    """DeepSpeed's fused_lamb_cuda_kernel.cu per parameter, in float64, written out plainly."""
    ws = [w.double().clone() for w in ws]
    ms = [torch.zeros_like(w) for w in ws]
    vs = [torch.zeros_like(w) for w in ws]
    b1, b2 = betas
    for t, grads in enumerate(grads_per_step, start=1):
        for i, g in enumerate(grads):
            g = g.double()
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            denom = torch.sqrt(vs[i] + eps) if inside else torch.sqrt(vs[i]) + eps
            u = ms[i] / denom + wd * ws[i]
            w_norm, u_norm = float(ws[i].norm()), float(u.norm())
            coeff = 1.0
            if w_norm != 0 and u_norm != 0:
                coeff = min(max(w_norm / u_norm, lo), hi)
            step = lr * math.sqrt(1 - b2**t) / (1 - b1**t) if bias_correction else lr
            ws[i] = ws[i] - step * coeff * u
    return ws


@pytest.mark.parametrize(
    "bias_correction,inside", [(True, False), (False, False), (True, True)], ids=str
)
def test_lamb_matches_deepspeeds_formula(bias_correction: bool, inside: bool) -> None:
    torch.manual_seed(0)
    # an ordinary weight, one whose ratio hits max_coeff, one min_coeff, one all zero (ratio 1)
    w0 = [torch.randn(6, 5), 100 * torch.randn(8), 1e-4 * torch.randn(7), torch.zeros(4)]
    # the zero weight gets zero gradients: both norms stay 0, and so does the weight
    grads = [[torch.randn_like(w) for w in w0[:3]] + [torch.zeros(4)] for _ in range(5)]
    kw = dict(lr=0.02, betas=(0.9, 0.99), eps=1e-6, wd=0.0, bias_correction=bias_correction)
    ref = _reference_lamb(w0, grads, **kw, hi=10.0, lo=0.01, inside=inside)
    ws = [nn.Parameter(w.clone()) for w in w0]
    opt = Lamb(
        ws, lr=0.02, betas=(0.9, 0.99), eps=1e-6, bias_correction=bias_correction,
        eps_inside_sqrt=inside,
    )  # fmt: skip
    for step in grads:
        for w, g in zip(ws, step, strict=True):
            w.grad = g.clone()
        opt.step()
    for w, r in zip(ws, ref, strict=True):
        assert torch.allclose(w.detach().double(), r, rtol=1e-5, atol=1e-7)
    coeffs = opt.get_lamb_coeffs()
    assert coeffs[1] == pytest.approx(10.0) and coeffs[2] == pytest.approx(0.01)
    assert coeffs[3] == 1.0 and 0.01 < coeffs[0] < 10.0


def test_lamb_weight_decay_and_param_groups_match_the_reference() -> None:
    torch.manual_seed(1)
    w0 = [torch.randn(5, 3), torch.randn(3)]
    grads = [[torch.randn_like(w) for w in w0] for _ in range(4)]
    ws = [nn.Parameter(w.clone()) for w in w0]
    opt = Lamb([{"params": ws[:1], "weight_decay": 0.1}, {"params": ws[1:]}], lr=0.05)
    for step in grads:
        for w, g in zip(ws, step, strict=True):
            w.grad = g.clone()
        opt.step()
    common = dict(lr=0.05, betas=(0.9, 0.999), eps=1e-8, bias_correction=True, hi=10.0, lo=0.01)
    ref0 = _reference_lamb(w0[:1], [s[:1] for s in grads], wd=0.1, inside=False, **common)
    ref1 = _reference_lamb(w0[1:], [s[1:] for s in grads], wd=0.0, inside=False, **common)
    assert torch.allclose(ws[0].detach().double(), ref0[0], rtol=1e-5, atol=1e-7)
    assert torch.allclose(ws[1].detach().double(), ref1[0], rtol=1e-5, atol=1e-7)


# -- LAMB under ZeRO ----------------------------------------------------------------------------

STEPS, GLOBAL_BATCH = 10, 12
LAMB = {"lr": 0.02, "weight_decay": 0.01, "betas": (0.9, 0.99)}


class _Tiny(nn.Module):
    """66 trainable elements in odd sizes (so shards of 2 and 3 ranks split parameters) and
    a layer that never gets a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 3)
        self.unused = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(GLOBAL_BATCH, 5, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g))
            for _ in range(STEPS)]  # fmt: skip


def _groups(model: nn.Module) -> list[dict]:
    """Two groups, so per-group hyper-parameters have to survive the rebuild over shards."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0, "max_coeff": 0.5}]


def _reference(model: nn.Module, grouped: bool) -> dict[str, torch.Tensor]:
    opt = Lamb(_groups(model) if grouped else model.parameters(), **LAMB)
    for x, y in _data():
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model.state_dict()


def _engine(model: nn.Module, stage: int, from_config: bool, rank: int, world: int) -> dict:
    config: dict[str, Any] = {
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 40,
            "stage3_param_persistence_threshold": 0,
        }
    }
    if from_config:
        config["optimizer"] = {"type": "Lamb", "params": LAMB}
        engine = ds_strategy.initialize(model, None, config)
    else:
        engine = ds_strategy.initialize(model, Lamb(_groups(model), **LAMB), config)
    assert type(engine.optimizer) is Lamb
    split = [
        i for g in engine.plan.groups for i in range(len(g.params)) if len(g.layout.owners(i)) > 1
    ]
    per = GLOBAL_BATCH // world
    for x, y in _data():
        local = slice(rank * per, (rank + 1) * per)
        engine.backward(nn.functional.mse_loss(engine(x[local]), y[local]))
        engine.step()
    return {"weights": engine.full_state_dict(), "split": len(split)}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _nvme_refusal(model: nn.Module, swap_dir: str) -> str:
    offload = {"device": "nvme", "nvme_path": swap_dir}
    config = {"zero_optimization": {"stage": 2, "offload_optimizer": offload}}
    try:
        ds_strategy.initialize(model, Lamb(model.parameters()), config)
    except ValueError as err:
        return str(err)
    return "built"


def lamb_worker(rank: int, world: int, swap_dir: str) -> dict:
    torch.manual_seed(0)
    base = _Tiny()
    # the config's section has one group; the instance passed has two
    refs = {c: _reference(copy.deepcopy(base), grouped=not c) for c in (True, False)}
    out: dict[Any, Any] = {"moved": _max_diff(refs[True], base.state_dict())}
    for stage in (0, 1, 2, 3):
        for from_config in (True, False):
            got = _engine(copy.deepcopy(base), stage, from_config, rank, world)
            out[(stage, from_config)] = (_max_diff(got["weights"], refs[from_config]), got["split"])
    out["nvme"] = _nvme_refusal(copy.deepcopy(base), swap_dir)
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def lamb_results(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> list[dict]:
    swap_dir = str(tmp_path_factory.mktemp("swap"))
    return run_ranks(lamb_worker, request.param, swap_dir, timeout=120)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("from_config", [True, False], ids=["config", "instance"])
def test_lamb_under_zero_matches_one_process(
    lamb_results: list[dict], stage: int, from_config: bool
) -> None:
    assert lamb_results[0]["moved"] > 1e-2  # equal weights mean nothing if nothing trained
    for rank, result in enumerate(lamb_results):
        diff, split = result[(stage, from_config)]
        assert diff <= 2e-5, f"rank {rank}, stage {stage}: max |w - one process| = {diff:.3g}"
        if stage > 0:  # the case the reduction is for: a parameter on two ranks' shards
            assert split > 0, f"stage {stage}: no parameter straddles two ranks"


def test_lamb_refuses_nvme_offload_on_every_rank(lamb_results: list[dict]) -> None:
    # NVMe offload steps bucket by bucket, a different number of times per rank: the norms'
    # all-reduce would pair up wrongly (or hang), so the engine refuses it up front
    for result in lamb_results:
        assert "NVMe offload" in result["nvme"] and "Lamb" in result["nvme"], result["nvme"]
