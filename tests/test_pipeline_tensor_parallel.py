"""Pipeline stages with tensor parallelism inside each (P=2 x T=2 on 4 gloo ranks): the demo GPT
and a transformers Llama written as layers, against single-process training on the global
batch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import ds_strategy
from ds_strategy.demos.gpt import GPT, GPTConfig, as_sequential
from tests.distributed import run_ranks, run_ranks_each
from tests.models import batches, make_optimizer
from tests.test_tensor_parallel import weights_diff

TOL = 2e-5
STEPS, ACCUM, CLIP = 10, 2, 0.5
VOCAB, SEQ = 37, 9


class _Embed(nn.Module):
    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = lm.model.embed_tokens

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens)


class _Layer(nn.Module):
    """A decoder layer with its rotary position embedding (the model computes it once)."""

    def __init__(self, layer: nn.Module, rotary: nn.Module) -> None:
        super().__init__()
        self.layer, self.rotary = layer, rotary

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        return self.layer(h, position_embeddings=self.rotary(h, positions))


class _Head(nn.Module):
    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = lm.model.norm, lm.lm_head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))


def llama_layers() -> nn.Sequential:
    """The 2-layer Llama of the Trainer tests (4 heads, 2 key/value heads) as pipeline layers."""
    from tests.hf_scripts.trainer_runs import model

    lm = model(VOCAB, SEQ)
    rotary = lm.model.rotary_emb
    return nn.Sequential(_Embed(lm), *(_Layer(x, rotary) for x in lm.model.layers), _Head(lm))


def gpt_layers() -> nn.Sequential:
    torch.manual_seed(0)
    return as_sequential(
        GPT(GPTConfig(vocab=VOCAB, d=32, layers=2, heads=4, seq=SEQ, tie_embeddings=False))
    )


MODELS = {"gpt": gpt_layers, "llama": llama_layers}


def lm_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _reference(kind: str, data: list[torch.Tensor]) -> tuple[dict[str, torch.Tensor], list]:
    """Single-process training on the global batches; the weights and each step's mean loss."""
    model = MODELS[kind]()
    opt = make_optimizer("adamw", model)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for micro in range(ACCUM):
            batch = data[step * ACCUM + micro]
            loss = lm_ce(model(batch[:, :-1]), batch[:, 1:])
            (loss / ACCUM).backward()
            total += loss.detach().item() / ACCUM
        losses.append(total)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model.state_dict(), losses


def _config(stage: int, tp: int = 2, dp: int = 1) -> dict[str, Any]:
    return {
        "pipeline": {"stages": 2, "schedule": "1f1b"},
        "tensor_parallel": {"autotp_size": tp},
        "train_micro_batch_size_per_gpu": 8 // dp,
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage},
    }


def _engine(kind: str, config: dict[str, Any]) -> Any:
    model = MODELS[kind]()
    return ds_strategy.initialize(model, make_optimizer("adamw", model), config, loss_fn=lm_ce)


def _train(engine: Any, data: list[torch.Tensor], first: int, last: int) -> list[float]:
    """Optimizer steps ``first..last-1``: this data-parallel rank's rows of each step's
    micro-batches, as the pipeline's micro-batches."""
    dp, dp_size = engine.data_parallel_rank, engine.data_parallel_size
    losses = []
    for step in range(first, last):
        micro = data[step * ACCUM : (step + 1) * ACCUM]
        per = micro[0].shape[0] // dp_size
        batch = torch.cat([m[dp * per : (dp + 1) * per] for m in micro])
        losses.append(float(engine.train_batch(batch[:, :-1], batch[:, 1:])))
    return losses


def _worker(rank: int, world: int, kind: str, stage: int, data: list[torch.Tensor]) -> Any:
    engine = _engine(kind, _config(stage))
    engine.comm_report()
    losses = _train(engine, data, 0, STEPS)
    comm = engine.comm_report()
    tp = engine.engine.tensor_parallel
    fresh = MODELS[kind]()  # this stage's layers at full size
    stage_numel = sum(p.numel() for k in engine.module._modules for p in fresh[int(k)].parameters())
    return {
        "state": engine.full_state_dict(),
        "coordinates": engine.mesh.coordinates,
        "stage_coordinates": dict(engine.engine.mesh.coordinates),
        "losses": losses,
        "norm": engine.get_global_grad_norm(),
        "memory": engine.memory_report(),
        "stage_numel": stage_numel,
        "split_numel": sum(i.numel for i in tp.params.values() if i.dim is not None),
        "comm": comm,
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, list[Any]]:
    """Every 4-rank run of this module's tests, in one spawn (results by case, then rank):
    the checkpoint's save before its resumes, the refused build last."""
    data = batches(STEPS, ACCUM, 8, seq=SEQ, vocab=VOCAB)
    path = str(tmp_path_factory.mktemp("pp_tp") / "ckpt")
    calls: dict[Any, tuple[Any, tuple]] = {
        ("gpt", 1): (_worker, ("gpt", 1, data)),
        ("llama", 2): (_worker, ("llama", 2, data)),
        "saved": (_save_run, (data, path)),
        ("resumed", 2): (_resume_run, (data, path, 2)),
        ("resumed", 1): (_resume_run, (data, path, 1)),
        ("curve", False): (_curve, (False, data)),
        ("curve", True): (_curve, (True, data)),
        "split tie": (_split_tie, ()),
    }
    return dict(zip(calls, run_ranks_each(list(calls.values()), 4), strict=True))


@pytest.mark.parametrize(("kind", "stage"), [("gpt", 1), ("llama", 2)])
@pytest.mark.slow
def test_pp2_x_tp2_equals_single_process_training(
    runs: dict[Any, list[Any]], kind: str, stage: int
) -> None:
    data = batches(STEPS, ACCUM, 8, seq=SEQ, vocab=VOCAB)
    results = runs[kind, stage]
    expected, losses = _reference(kind, data)
    assert max((v - MODELS[kind]().state_dict()[k]).abs().max() for k, v in expected.items()) > 1e-2
    for rank, r in enumerate(results):
        assert r["coordinates"] == {"pp": rank // 2, "dp": 0, "tp": rank % 2}
        assert r["stage_coordinates"] == r["coordinates"]
        assert r["state"].keys() == expected.keys()
        assert weights_diff(r["state"], expected) <= TOL
        assert r["losses"] == pytest.approx(losses, abs=1e-5)
        assert r["norm"] > CLIP  # clipping by the whole model's norm was active
        # each tensor-parallel rank holds half of its stage's split weights (fp32, D=1)
        assert r["split_numel"] > r["stage_numel"] / 3
        held = 4 * (r["stage_numel"] - r["split_numel"] / 2)
        assert r["memory"]["params"] == pytest.approx(held, rel=0.01)
        # bytes by group: the layers' all-reduces (tp_), the stages' sends (pp_send)
        assert r["comm"]["tp_all_reduce"] > 0 and r["comm"]["pp_send"] > 0


def test_llama_layers_compute_the_model() -> None:
    from tests.hf_scripts.trainer_runs import model

    tokens = batches(1, 1, 4, seq=SEQ, vocab=VOCAB)[0]
    with torch.no_grad():
        assert torch.allclose(llama_layers()(tokens), model(VOCAB, SEQ)(tokens).logits, atol=1e-6)


def _save_run(rank: int, world: int, data: list[torch.Tensor], path: str) -> Any:
    engine = _engine("gpt", _config(1))
    _train(engine, data, 0, STEPS // 2)
    engine.save_checkpoint(path)
    _train(engine, data, STEPS // 2, STEPS)
    return engine.full_state_dict()


def _resume_run(rank: int, world: int, data: list[torch.Tensor], path: str, tp: int) -> Any:
    engine = _engine("gpt", _config(2, tp=tp, dp=2 // tp))
    engine.load_checkpoint(path)
    _train(engine, data, STEPS // 2, STEPS)
    return engine.full_state_dict()


@pytest.mark.parametrize("tp", [2, 1])
@pytest.mark.slow
def test_checkpoint_resumes_at_pp2_x_tp2_and_at_pp2_x_dp2(
    runs: dict[Any, list[Any]], tp: int
) -> None:
    """Saved at P=2 x T=2 (ZeRO-1): loaded at the same layout and at P=2 x D=2 (ZeRO-2), each
    stage's checkpoint resharded from its 2 tensor-parallel ranks to its 2 data-parallel ones;
    training goes on as if uninterrupted."""
    uninterrupted = runs["saved"][0]
    for end in runs["resumed", tp]:
        assert weights_diff(end, uninterrupted) <= TOL


def _curve(rank: int, world: int, bf16: bool, data: list[torch.Tensor]) -> Any:
    engine = _engine("gpt", _config(1) | {"bf16": {"enabled": bf16}})
    engine.comm_report()
    losses = _train(engine, data, 0, STEPS)
    return losses, engine.comm_report()["pp_send"], next(engine.module.parameters()).dtype


@pytest.mark.slow
def test_bf16_loss_curve_at_pp2_x_tp2_within_2_percent_of_fp32(runs: dict[Any, list[Any]]) -> None:
    """bf16 compute inside the stages, fp32 master weights; activations and their gradients
    cross between stages in bf16 (half the bytes)."""
    fp32, fp32_sent, fp32_dtype = runs["curve", False][0]
    bf16, bf16_sent, bf16_dtype = runs["curve", True][0]
    assert (fp32_dtype, bf16_dtype) == (torch.float32, torch.bfloat16)
    assert bf16_sent * 2 == fp32_sent
    worst = max(abs(a - b) / a for a, b in zip(fp32, bf16, strict=True))
    assert 0 < worst <= 0.02


def _refused(rank: int, world: int) -> str | None:
    try:
        _engine("gpt", _config(1))
    except ValueError as e:
        return str(e)
    return None


def test_a_world_not_divisible_by_p_times_t_is_refused() -> None:
    said = "pipeline.stages=2 x tensor_parallel.autotp_size=2 = 4 does not divide the world size 2"
    assert all(m is not None and said in m for m in run_ranks(_refused, 2))


def _split_tie(rank: int, world: int) -> str | None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    model[2].weight = model[0].weight  # one weight on both stages
    config = _config(1) | {"tensor_parallel": {"autotp_size": 2, "plan": {"0|2": "colwise"}}}
    config["train_micro_batch_size_per_gpu"] = 2
    try:
        ds_strategy.initialize(model, torch.optim.SGD(model.parameters()), config, loss_fn=lm_ce)
    except Exception as e:  # noqa: BLE001 - the owning stage's error, or the others' report of it
        return f"{type(e).__name__}: {e}"
    return None


@pytest.mark.slow
def test_a_plan_splitting_a_weight_tied_across_stages_is_refused_on_every_rank(
    runs: dict[Any, list[Any]],
) -> None:
    messages = runs["split tie"]
    assert all(m is not None for m in messages), messages
    assert all("tied across stages" in m for m in messages), messages
