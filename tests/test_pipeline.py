"""Pipeline stages x ZeRO data parallelism on 4 CPU ranks train to the weights of
single-process training on the full batch; partitioning and bad specs; tied weights;
full_state_dict and checkpoints across stages."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import ds_strategy
from ds_strategy.config import ConfigError
from ds_strategy.core.activation_checkpointing import checkpointed_modules
from ds_strategy.core.mesh import ParallelMesh
from ds_strategy.core.pipeline import Mesh, bubble_fraction, partition_layers, split_batch
from ds_strategy.core.pipeline.loop import PipelineLoop, refusing, schedule_does
from tests.distributed import run_ranks

STEPS, MICRO, ACCUM, CLIP, D_IN = 3, 2, 4, 0.5, 6


def mlp(layers: int = 8, width: int = 6) -> nn.Sequential:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for i in range(layers):
        mods += [nn.Linear(D_IN if i == 0 else width, width), nn.Tanh()]
    return nn.Sequential(*mods)


class Embed(nn.Module):
    def __init__(self, vocab: int, d: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.emb(tokens)


class Head(nn.Module):
    def __init__(self, embed: Embed) -> None:
        super().__init__()
        self.weight = embed.emb.weight  # tied with the embedding

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.weight.t()


def tied_lm(vocab: int = 11, d: int = 6) -> nn.Sequential:
    torch.manual_seed(0)
    emb = Embed(vocab, d)
    return nn.Sequential(emb, nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d), Head(emb))


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y)


def lm_ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _data(world_dp: int, kind: str = "mlp") -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    n = MICRO * ACCUM * world_dp
    if kind == "lm":
        return [
            (torch.randint(0, 11, (n, 5), generator=g), torch.randint(0, 11, (n, 5), generator=g))
            for _ in range(STEPS)
        ]
    return [
        (torch.randn(n, D_IN, generator=g), torch.randn(n, 6, generator=g)) for _ in range(STEPS)
    ]


def _reference(model: nn.Module, data: list, loss_fn) -> dict:  # noqa: ANN001
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in data:
        loss_fn(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _config(stages: int, schedule: str, zero: int) -> dict:
    return {
        "pipeline": {"stages": stages, "schedule": schedule},
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": zero, "reduce_bucket_size": 50},
    }


def _diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), set(a) ^ set(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def train_worker(rank: int, world: int, cases: list[tuple[int, str, int, str]]) -> dict:
    out = {}
    for stages, schedule, zero, kind in cases:
        model, loss_fn = (tied_lm(), lm_ce) if kind == "lm" else (mlp(), mse)
        dp = world // stages
        data = _data(dp, kind)
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        reference = copy.deepcopy(model)
        ref = _reference(reference, data, loss_fn)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        config = _config(stages, schedule, zero)
        if kind == "mlp-ac":
            config["activation_checkpointing"] = {"enabled": True, "every": 2}
        engine = ds_strategy.initialize(model, opt, config, loss_fn=loss_fn)
        assert engine.num_stages == stages and engine.data_parallel_size == dp
        per = MICRO * ACCUM
        r = engine.data_parallel_rank
        losses = []
        for x, y in data:
            losses.append(
                float(engine.train_batch(x[r * per : (r + 1) * per], y[r * per : (r + 1) * per]))
            )
        full = engine.full_state_dict()
        x, y = data[0]
        with torch.no_grad():
            ref_eval = float(loss_fn(reference(x), y))
        evaluated = float(engine.eval_batch(x[r * per : (r + 1) * per], y[r * per : (r + 1) * per]))
        out[(stages, schedule, zero, kind)] = {
            "diff": _diff(full, ref),
            "moved": _diff(ref, initial),
            "keys": list(full),
            "ref_keys": list(ref),
            "losses": losses,
            "eval": (evaluated, ref_eval),
            "stage": engine.stage_id,
            "norm": engine.get_global_grad_norm(),
            "checkpointed": len(checkpointed_modules(engine.module)),
        }
        engine.destroy()
    return out


CASES = [
    (2, "gpipe", 1, "mlp"),
    (2, "1f1b", 2, "mlp"),
    (4, "1f1b", 1, "mlp"),
    (2, "1f1b", 1, "lm"),
    (2, "gpipe", 2, "lm"),
    (2, "interleaved_1f1b", 1, "mlp"),
    (2, "1f1b", 2, "mlp-ac"),
]


def all_worker(rank: int, world: int, path: str) -> dict:
    # one set of 4 processes for the whole module: spawning ranks costs more than the runs
    return {
        "train": train_worker(rank, world, CASES),
        "checkpoint": checkpoint_worker(rank, world, path),
        "errors": errors_worker(rank, world),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    path = tmp_path_factory.mktemp("pipeline") / "ckpt"
    out = run_ranks(all_worker, 4, str(path), timeout=300)
    for res in out:
        res["path"] = path
    return out


@pytest.fixture(scope="module")
def trained(results: list[dict]) -> list[dict]:
    return [r["train"] for r in results]


@pytest.mark.parametrize("case", CASES, ids=[f"P{c[0]}-{c[1]}-zero{c[2]}-{c[3]}" for c in CASES])
def test_pipeline_matches_single_process(trained: list[dict], case: tuple) -> None:
    for rank, res in enumerate(trained):
        got = res[case]
        assert got["diff"] <= 2e-5, f"rank {rank}: max |w - reference| = {got['diff']:.3g}"
        assert got["keys"] == got["ref_keys"]
        # every rank returns the same global loss, and training lowers it
        assert got["losses"] == trained[0][case]["losses"]
        assert got["norm"] == pytest.approx(trained[0][case]["norm"], rel=1e-6)
    assert trained[0][case]["losses"][-1] < trained[0][case]["losses"][0]
    assert trained[0][case]["moved"] > 1e-2  # equal weights mean nothing if nothing trained
    evaluated, ref_eval = trained[0][case]["eval"]
    assert evaluated == pytest.approx(ref_eval, abs=1e-5)
    # every 2nd of a stage's 8 layers runs under activation checkpointing
    assert all(res[case]["checkpointed"] == (4 if case[3] == "mlp-ac" else 0) for res in trained)
    assert sorted({res[case]["stage"] for res in trained}) == list(range(case[0]))


def test_partition_methods() -> None:
    layers = list(mlp())
    assert partition_layers(layers, 2, "uniform") == [0, 8, 16]
    assert partition_layers(layers, 4, "type:Linear") == [0, 4, 8, 12, 16]
    big = [nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 50), nn.Tanh(), nn.Linear(50, 2)]
    # the heaviest layer gets a stage to itself
    assert partition_layers(big, 3, "parameters") == [0, 2, 4, 5]
    with pytest.raises(ConfigError, match="partition_method"):
        partition_layers(layers, 2, "best")
    with pytest.raises(ConfigError, match="fewer than"):
        partition_layers(layers, 4, "type:Conv")
    with pytest.raises(ValueError, match="at least 20 layers"):
        partition_layers(layers, 20, "uniform")


def test_theoretical_bubble() -> None:
    assert bubble_fraction("gpipe", 4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction("1f1b", 2, 8) == pytest.approx(1 / 9)
    assert bubble_fraction("interleaved_1f1b", 4, 8, chunks=2) < bubble_fraction("1f1b", 4, 8)


def errors_worker(rank: int, world: int) -> dict:
    out = {}

    def attempt(name: str, fn) -> None:  # noqa: ANN001
        try:
            fn()
            out[name] = "no error"
        except (ValueError, TypeError, ConfigError) as e:
            out[name] = f"{type(e).__name__}: {e}"

    opt = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731
    attempt(
        "not_sequential",
        lambda: ds_strategy.initialize(nn.Linear(2, 2), None, _config(2, "1f1b", 1), loss_fn=mse),
    )
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    attempt(
        "not_divisible",
        lambda: ds_strategy.initialize(m, opt(m), _config(3, "1f1b", 1), loss_fn=mse),
    )
    m = nn.Sequential(nn.Linear(2, 2))
    attempt(
        "too_few_layers",
        lambda: ds_strategy.initialize(m, opt(m), _config(2, "1f1b", 1), loss_fn=mse),
    )
    m = mlp()
    lm = tied_lm()
    attempt(
        "zero3_tied",
        lambda: ds_strategy.initialize(lm, opt(lm), _config(2, "1f1b", 3), loss_fn=mse),
    )
    attempt("no_loss_fn", lambda: ds_strategy.initialize(m, opt(m), _config(2, "1f1b", 1)))
    engine = ds_strategy.initialize(m, opt(m), _config(2, "gpipe", 1), loss_fn=mse)
    attempt("bad_batch", lambda: engine.train_batch(torch.randn(7, D_IN), torch.randn(7, 6)))
    engine.destroy()
    return out


def test_bad_specs_are_clear_errors(results: list[dict]) -> None:
    res = results[0]["errors"]
    assert "nn.Sequential" in res["not_sequential"]
    assert "not divisible by 3" in res["not_divisible"]
    assert "need at least 2 layers" in res["too_few_layers"]
    assert "tied across stages" in res["zero3_tied"] and "stage 1 or 2" in res["zero3_tied"]
    assert "loss_fn" in res["no_loss_fn"]
    assert "got 7 samples" in res["bad_batch"]
    for other in results[1:]:  # every rank raised (no rank left waiting in the schedule)
        assert other["errors"]["bad_batch"].startswith("ValueError")


def checkpoint_worker(rank: int, world: int, path: str) -> dict:
    data = _data(2)
    cfg = _config(2, "1f1b", 1)
    per = MICRO * ACCUM

    def build() -> ds_strategy.PipelineEngine:
        model = mlp()
        return ds_strategy.initialize(
            model, torch.optim.AdamW(model.parameters(), lr=1e-2), cfg, loss_fn=mse
        )

    a = build()
    r = a.data_parallel_rank
    shard = [(x[r * per : (r + 1) * per], y[r * per : (r + 1) * per]) for x, y in data]
    a.train_batch(*shard[0])
    a.save_checkpoint(path, client_state={"step": 1})
    saved = a.full_state_dict()
    a.train_batch(*shard[1])
    after_a = a.full_state_dict()
    a.destroy()
    b = build()
    state = b.load_checkpoint(path)
    b.train_batch(*shard[1])
    out = {"diff": _diff(b.full_state_dict(), after_a), "state": state}
    out["moved"] = _diff(after_a, saved)
    b.destroy()
    return out


def test_checkpoint_resumes_across_stages(results: list[dict]) -> None:
    for res in results:
        assert res["checkpoint"]["diff"] <= 1e-6
        assert res["checkpoint"]["moved"] > 1e-3  # the step after loading changed the weights
        assert res["checkpoint"]["state"] == {"step": 1}
    assert sorted(p.name for p in results[0]["path"].iterdir()) == ["stage_0", "stage_1"]


def test_zero_engine_refuses_a_pipeline_config() -> None:
    # a front end that builds a ZeroEngine must not silently drop the pipeline section
    model = mlp(2)
    with pytest.raises(ValueError, match="loss_fn"):
        ds_strategy.ZeroEngine(
            model, torch.optim.SGD(model.parameters(), lr=0.1), {"pipeline": {"stages": 2}}
        )


def test_mesh_rank_layout() -> None:
    # DeepSpeed's pipe/data order: the data-parallel index varies fastest
    mesh = Mesh(pp_size=2, dp_size=3, rank=4, pp_group=None, dp_group=None)
    assert (mesh.stage, mesh.dp_rank, mesh.world_size) == (1, 1, 6)
    assert mesh.pp_ranks() == [1, 4]
    assert mesh.dp_ranks() == [3, 4, 5]
    assert mesh.global_rank(0, 2) == 2
    assert mesh.coordinates == {"pp": 1, "dp": 1, "tp": 0}
    # with tensor parallelism the tensor-parallel index varies fastest: s*(D*T) + d*T + t
    mesh = Mesh(pp_size=2, dp_size=2, rank=6, pp_group=None, dp_group=None, tp_size=2)
    assert mesh.coordinates == {"pp": 1, "dp": 1, "tp": 0}
    assert (mesh.pp_ranks(), mesh.dp_ranks(), mesh.world_size) == ([2, 6], [4, 6], 8)


@pytest.mark.parametrize(("pp", "dp", "tp"), [(1, 4, 1), (2, 3, 1), (2, 2, 2), (1, 2, 3)])
def test_a_rank_place_without_groups_is_the_mesh_one(pp: int, dp: int, tp: int) -> None:
    # what a front end's data sampler reads: the data-parallel rank and size
    for rank in range(pp * dp * tp):
        mesh = Mesh(pp, dp, rank, None, None, tp_size=tp)
        place = ParallelMesh.place(rank, pp * dp * tp, tp, pp)
        assert (place.coordinates, place.dp) == (mesh.coordinates, mesh.dp_size)


def test_split_batch_takes_inputs_and_targets_only() -> None:
    x, y = torch.zeros(2), torch.ones(2)
    assert split_batch((x, y), "train batch") == (x, y)
    assert split_batch([x, y], "train batch") == (x, y)
    for bad in ((x, y, x), {"x": x}, x):
        with pytest.raises(TypeError, match=r"^val batch: .* must be \(inputs, targets\); got"):
            split_batch(bad, "val batch")


class _StandIn:
    """What PipelineLoop uses of a PipelineEngine: its stage, the two steps, the skip count."""

    def __init__(self) -> None:
        self.module = nn.Linear(1, 1)
        self.skipped_steps, self.calls = 0, []
        self.skip_next = False

    def train_batch(self, x: object, y: object) -> torch.Tensor:
        self.calls.append(("train", self.module.training, x, y))
        self.skipped_steps += self.skip_next
        return torch.tensor(1.0)

    def eval_batch(self, x: object, y: object) -> torch.Tensor:
        self.calls.append(("eval", self.module.training, x, y))
        return torch.tensor(2.0)


def test_pipeline_loop_runs_each_step_in_its_mode_and_notes_a_skip() -> None:
    engine = _StandIn()
    loop = PipelineLoop(engine)
    assert float(loop.run_batch("val", (1, 2))) == 2.0
    engine.skip_next = True
    assert float(loop.run_batch("train", [3, 4])) == 1.0 and loop.step_was_skipped
    engine.skip_next = False
    loop.run(True, 5, 6)
    assert not loop.step_was_skipped
    loop.run(False, 7, 8)  # an evaluation step leaves the last training step's flag
    assert engine.calls == [
        ("eval", False, 1, 2),
        ("train", True, 3, 4),
        ("train", True, 5, 6),
        ("eval", False, 7, 8),
    ]
    with pytest.raises(TypeError, match=r"^test batch: .* must be \(inputs, targets\)"):
        loop.run_batch("test", (1, 2, 3))


def test_calls_the_schedule_makes_itself_are_refused_with_the_reason_and_fix() -> None:
    msg = schedule_does("accumulate()", "accumulate", "drop accumulate()")
    assert msg == (
        "accumulate(): under a pipeline config train_batch runs gradient_accumulation_steps "
        "micro-batches itself; drop accumulate()"
    )
    assert schedule_does("optimizer.step(closure)", "step").endswith(
        "`loss = model.train_batch(inputs, targets)` steps the optimizer"
    )

    class Front:
        no_sync = refusing("no_sync()", "no_sync", "write train_batch")

    with pytest.raises(RuntimeError, match=r"^no_sync\(\): .*once per step itself; write"):
        Front().no_sync(object(), flag=True)


# -- the stage engine's own features under a pipeline (2 ranks: 2 stages x 1) ------------------------


def _features_config(**extra: object) -> dict:
    return {**_config(2, "1f1b", 1), **extra}


def _two_stage(config: dict, loss_fn=mse) -> ds_strategy.PipelineEngine:  # noqa: ANN001
    model = mlp(4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return ds_strategy.initialize(model, opt, config, loss_fn=loss_fn)


def periodic_save_worker(root: str, async_save: bool) -> dict:
    data = _data(1)
    ckpt = {"save_dir": root, "save_interval": 2, "async_save": async_save}
    a = _two_stage(_features_config(checkpoint=ckpt))
    for x, y in data[:2]:
        a.train_batch(x, y)  # step 2 saves into <root>/stage_<k>/global_step2
    a.wait_for_checkpoint()
    at_save = a.full_state_dict()
    a.train_batch(*data[2])
    after_a = a.full_state_dict()
    a.destroy()
    b = _two_stage(_config(2, "1f1b", 1))
    b.load_checkpoint(root)  # follows <root>/stage_<k>/latest
    resumed = (b.global_steps, _diff(b.full_state_dict(), at_save))
    b.train_batch(*data[2])
    out = {
        "resumed": resumed,
        "diff": _diff(b.full_state_dict(), after_a),
        "moved": _diff(after_a, at_save),
        "steps": b.global_steps,
    }
    b.destroy()
    return out


def timing_worker() -> dict:
    engine = _two_stage(_features_config(wall_clock_breakdown=True, steps_per_print=2))
    printed: list[str] = []
    engine.engine.timers.printer = printed.append
    reports = []
    for x, y in _data(1)[:2]:
        engine.train_batch(x, y)
        reports.append(engine.timing_report())
    engine.destroy()
    return {"reports": reports, "printed": printed}


def overflow_worker() -> dict:
    factor = [1.0]

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return mse(out, y) * factor[0]

    engine = _two_stage(_features_config(max_consecutive_skipped_steps=2), loss_fn)
    data = _data(1)
    out: dict = {}
    engine.train_batch(*data[0])
    before = engine.full_state_dict()
    factor[0] = float("inf")  # every gradient of this step is inf or nan
    engine.train_batch(*data[1])
    out["skipped"] = (engine.skipped_steps, engine.global_steps, engine.get_global_grad_norm())
    out["unchanged"] = _diff(engine.full_state_dict(), before)
    try:
        engine.train_batch(*data[2])  # the second skip in a row
        out["raised"] = "no error"
    except FloatingPointError as e:
        out["raised"] = str(e)
    engine.destroy()
    return out


def features_worker(rank: int, world: int, path: str) -> dict:
    return {
        "sync_save": periodic_save_worker(f"{path}/sync", async_save=False),
        "async_save": periodic_save_worker(f"{path}/async", async_save=True),
        "timing": timing_worker(),
        "overflow": overflow_worker(),
    }


@pytest.fixture(scope="module")
def features(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    path = tmp_path_factory.mktemp("pipeline_features")
    return run_ranks(features_worker, 2, str(path), timeout=180), path


@pytest.mark.parametrize("kind", ["sync_save", "async_save"])
def test_periodic_saves_go_per_stage_and_resume(features: tuple, kind: str) -> None:
    results, path = features
    root = path / kind.partition("_")[0]
    # committed at the root once both stages had theirs (asynchronous: at the wait)
    assert (root / "latest").read_text().strip() == "global_step2"
    for k in (0, 1):
        stage = root / f"stage_{k}"
        assert (stage / "latest").read_text().strip() == "global_step2"
        assert sorted(p.name for p in stage.iterdir() if p.is_dir()) == ["global_step2"]
    for res in results:
        r = res[kind]
        assert r["resumed"] == (2, 0.0)  # the step counter and the weights of step 2
        assert r["diff"] <= 1e-6 and r["moved"] > 1e-3
        assert r["steps"] == 3


def test_wall_clock_breakdown_times_schedule_and_step(features: tuple) -> None:
    results, _ = features
    for rank, res in enumerate(results):
        first, second = res["timing"]["reports"]
        assert first == {}  # reported every steps_per_print=2 steps
        assert second["schedule_ms"] > 0 and second["step_ms"] > 0
        assert second["schedule_ms"] + second["step_ms"] <= second["iteration_ms"] * 1.01
        # every stage's data-parallel rank 0 prints its own stage's line
        assert len(res["timing"]["printed"]) == 1, rank
        assert "schedule" in res["timing"]["printed"][0]


def test_overflow_skips_on_every_rank_then_raises(features: tuple) -> None:
    results, _ = features
    for res in results:
        r = res["overflow"]
        skipped, steps, norm = r["skipped"]
        assert (skipped, steps) == (1, 2) and not math.isfinite(norm)
        assert r["unchanged"] == 0.0  # weights (and so optimizer state) of the last good step
        assert "max_consecutive_skipped_steps=2" in r["raised"]
