"""Several models in one job through the raw API, one ``initialize`` per model: a GAN whose
generator and discriminator each have an engine (the generator's loss runs backward through
the discriminator, which is not stepping then), and an RLHF-shaped loop (an actor and a
critic trained, each with its own optimizer; a reference and a reward model frozen at ZeRO-3
without optimizers). Each equals the same loop in one process on the global batch.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ds_strategy
from ds_strategy.demos.gpt import GPT, GPTConfig
from tests.distributed import run_ranks_each
from tests.pool import fork_context

WORLD, ROWS, STEPS = 2, 4, 4  # ROWS per rank per step
NOISE, DATA = 8, 16


def zero(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": ROWS,
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,  # every weight sharded at stage 3
            "reduce_bucket_size": 200,  # several buckets, reductions in flight
        },
    }


# -- a GAN ------------------------------------------------------------------------------------


def gan() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(NOISE, 32), nn.Tanh(), nn.Linear(32, DATA))
    discriminator = nn.Sequential(nn.Linear(DATA, 32), nn.Tanh(), nn.Linear(32, 1))
    return generator, discriminator


def gan_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    real = torch.randn(WORLD * ROWS, DATA, generator=g) * 0.5 + 1.0
    return real, torch.randn(WORLD * ROWS, NOISE, generator=g)


def bce(logits: torch.Tensor, target: float) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))


def gan_steps(generator: Any, discriminator: Any, step_d: Any, step_g: Any, rows: slice) -> None:
    """Each step: the discriminator on real and (detached) fake rows, then the generator
    through the discriminator, whose gradients from that backward are not its own step's."""
    for step in range(STEPS):
        real, noise = gan_data(step)
        fake = generator(noise[rows])
        step_d(bce(discriminator(real[rows]), 1.0) + bce(discriminator(fake.detach()), 0.0))
        step_g(bce(discriminator(fake), 1.0))


def gan_reference() -> dict[str, torch.Tensor]:
    generator, discriminator = gan()
    opt_g = torch.optim.Adam(generator.parameters(), lr=1e-2)
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=1e-2)

    def step(opt: torch.optim.Optimizer) -> Any:
        def run(loss: torch.Tensor) -> None:
            opt.zero_grad()  # the discriminator's: drops what the generator's loss left
            loss.backward()
            opt.step()

        return run

    gan_steps(generator, discriminator, step(opt_d), step(opt_g), slice(None))
    return {**prefixed("g.", generator.state_dict()), **prefixed("d.", discriminator.state_dict())}


def prefixed(prefix: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {prefix + k: v.detach().clone() for k, v in state.items()}


def gan_worker(rank: int, world: int, stage: int, zero_grad: bool) -> dict[str, Any]:
    generator, discriminator = gan()
    g = ds_strategy.initialize(
        generator, torch.optim.Adam(generator.parameters(), lr=1e-2), zero(stage)
    )
    d = ds_strategy.initialize(
        discriminator, torch.optim.Adam(discriminator.parameters(), lr=1e-2), zero(stage)
    )

    def step(engine: Any) -> Any:
        def run(loss: torch.Tensor) -> None:
            if zero_grad:
                engine.zero_grad()  # as a torch loop zeroes before its backward
            engine.backward(loss)
            engine.step()

        return run

    logged: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("ds_strategy")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)  # setLevel: clears the children's cached levels
    try:
        gan_steps(g, d, step(d), step(g), slice(rank * ROWS, (rank + 1) * ROWS))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    out = {
        "weights": {**prefixed("g.", g.full_state_dict()), **prefixed("d.", d.full_state_dict())},
        "dropped": [m for m in logged if "did not start" in m],
    }
    g.destroy()
    d.destroy()
    return out


@pytest.mark.slow
def test_a_gan_with_one_engine_per_model_equals_one_process() -> None:
    reference = gan_reference()
    cases = [(stage, zero_grad) for stage in (1, 2, 3) for zero_grad in (True, False)]
    results = run_ranks_each([(gan_worker, case) for case in cases], WORLD)
    for (stage, zero_grad), per_rank in zip(cases, results, strict=True):
        for got in per_rank:
            weights = got["weights"]
            assert weights.keys() == reference.keys()
            gap = max((weights[k] - reference[k]).abs().max().item() for k in reference)
            assert gap <= 2e-5, (stage, zero_grad, gap)
            # without zero_grad() the discriminator's gradients from the generator's backward
            # are dropped before its own backward, logged the first time
            assert len(got["dropped"]) == (0 if zero_grad else 1), (stage, got["dropped"])
    initial = gan()[1].state_dict()
    assert max((reference["d." + k] - v).abs().max().item() for k, v in initial.items()) > 1e-3


# -- an RLHF-shaped loop ----------------------------------------------------------------------

VOCAB, SEQ = 32, 8


class Scorer(nn.Module):
    """A GPT with a scalar head: the critic's value and the reward model's score per token."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT(GPTConfig(vocab=VOCAB, d=64, heads=4, layers=2, seq=SEQ))
        self.value = nn.Linear(VOCAB, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.value(self.gpt(tokens)).squeeze(-1)


def rlhf_models() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    actor = GPT(GPTConfig(vocab=VOCAB, d=64, heads=4, layers=2, seq=SEQ))
    reference = copy.deepcopy(actor)  # the policy before training, frozen
    critic, reward = Scorer(), Scorer()
    for frozen in (reference, reward):
        frozen.requires_grad_(False)
    return {"actor": actor, "critic": critic, "reference": reference, "reward": reward}


def rlhf_steps(models: dict[str, Any], step: dict[str, Any], rows: slice) -> None:
    """A PPO-shaped step: log-probabilities of the actor against the frozen reference (a KL
    penalty), the frozen reward model's score, the critic's value as the baseline."""
    for i in range(STEPS):
        g = torch.Generator().manual_seed(200 + i)
        tokens = torch.randint(0, VOCAB, (WORLD * ROWS, SEQ + 1), generator=g)[rows]
        inputs, targets = tokens[:, :-1], tokens[:, 1:, None]
        with torch.no_grad():
            ref_logp = models["reference"](inputs).log_softmax(-1).gather(-1, targets)
            reward = models["reward"](inputs).mean(-1)
        logp = models["actor"](inputs).log_softmax(-1).gather(-1, targets)
        value = models["critic"](inputs).mean(-1)
        advantage = (reward - value).detach()
        step["actor"](-(advantage[:, None, None] * logp).mean() + 0.1 * (logp - ref_logp).mean())
        step["critic"](((value - reward) ** 2).mean())


def rlhf_optimizers(models: dict[str, nn.Module]) -> dict[str, torch.optim.Optimizer]:
    return {
        "actor": torch.optim.Adam(models["actor"].parameters(), lr=1e-3),
        "critic": torch.optim.SGD(models["critic"].parameters(), lr=0.1, momentum=0.9),
    }


def rlhf_reference() -> dict[str, dict[str, torch.Tensor]]:
    models = rlhf_models()
    opts = rlhf_optimizers(models)

    def stepper(opt: torch.optim.Optimizer) -> Any:
        def run(loss: torch.Tensor) -> None:
            opt.zero_grad()
            loss.backward()
            opt.step()

        return run

    rlhf_steps(models, {k: stepper(o) for k, o in opts.items()}, slice(None))
    return {k: prefixed("", m.state_dict()) for k, m in models.items()}


def rlhf_worker(rank: int, world: int) -> dict[str, Any]:
    models = rlhf_models()
    full_bytes = {k: sum(p.numel() * 4 for p in m.parameters()) for k, m in models.items()}
    opts = rlhf_optimizers(models)
    engines = {
        "actor": ds_strategy.initialize(models["actor"], opts["actor"], zero(3)),
        "critic": ds_strategy.initialize(models["critic"], opts["critic"], zero(2)),
        # frozen, sharded for evaluation: no optimizer
        "reference": ds_strategy.initialize(models["reference"], None, zero(3)),
        "reward": ds_strategy.initialize(models["reward"], None, zero(3)),
    }

    def stepper(engine: Any) -> Any:
        def run(loss: torch.Tensor) -> None:
            engine.backward(loss)
            engine.step()

        return run

    rlhf_steps(
        engines,
        {k: stepper(engines[k]) for k in ("actor", "critic")},
        slice(rank * ROWS, (rank + 1) * ROWS),
    )
    out = {
        "weights": {k: prefixed("", e.full_state_dict()) for k, e in engines.items()},
        "memory": {k: e.memory_report() for k, e in engines.items()},
        "full_bytes": full_bytes,
    }
    for e in engines.values():
        e.destroy()
    return out


@pytest.mark.slow
def test_an_rlhf_loop_with_frozen_zero3_models_equals_one_process() -> None:
    reference = rlhf_reference()
    (per_rank,) = run_ranks_each([(rlhf_worker, ())], WORLD)
    for got in per_rank:
        for name, expected in reference.items():
            weights = got["weights"][name]
            assert weights.keys() == expected.keys(), name
            gap = max((weights[k] - expected[k]).abs().max().item() for k in expected)
            assert gap <= 2e-5, (name, gap)
        for name in ("reference", "reward"):  # frozen at ZeRO-3: about 1/N of the bytes each
            memory = got["memory"][name]
            assert memory["params"] == pytest.approx(got["full_bytes"][name] / WORLD, rel=0.01)
            assert memory["grads"] == memory["optimizer_state"] == 0, memory
        actor = got["memory"]["actor"]
        assert actor["optimizer_state"] > 0 and actor["params"] < got["full_bytes"]["actor"]
    # the loop trained: the actor moved away from the frozen reference
    moved = reference["actor"]
    assert max((moved[k] - reference["reference"][k]).abs().max().item() for k in moved) > 1e-3


def sharing_worker(rank: int, world: int, stage: int) -> dict[str, Any]:
    shared = nn.Linear(4, 4)
    a = nn.Sequential(shared, nn.Linear(4, 2))
    b = nn.Sequential(shared, nn.Linear(4, 1))
    config = zero(stage)
    first = ds_strategy.initialize(a, torch.optim.SGD(a.parameters(), lr=0.1), config)
    out: dict[str, Any] = {}
    try:
        ds_strategy.initialize(b, torch.optim.SGD(b.parameters(), lr=0.1), config)
    except ValueError as e:
        out["shared"] = str(e)
    # a constructor that raised claims nothing, even while its error (and through its
    # traceback the half-built engine) is kept: the same model then builds
    lone = nn.Linear(3, 3)
    try:
        ds_strategy.initialize(lone, torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1), config)
    except ValueError as e:
        kept = e
        out["bad"] = str(e)
    ds_strategy.initialize(lone, torch.optim.SGD(lone.parameters(), lr=0.1), config).destroy()
    del kept
    first.destroy()  # releases its parameters: b may now have an engine of its own
    second = ds_strategy.initialize(b, torch.optim.SGD(b.parameters(), lr=0.1), config)
    second.destroy()
    return out


def test_two_engines_over_one_parameter_are_refused_naming_it() -> None:
    for got in run_ranks_each([(sharing_worker, (s,)) for s in (1, 3)], 1):
        message = got[0]["shared"]
        assert "parameter '0.weight' of Sequential already belongs to another engine" in message
        assert "copy.deepcopy" in message and "destroy()" in message
        assert "belong to the model" in got[0]["bad"]


# -- a container whose own forward never runs -------------------------------------------------


def parts() -> nn.ModuleDict:
    torch.manual_seed(1)
    return nn.ModuleDict(
        {
            "enc": nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 16)),
            "dec": nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8)),
        }
    )


def parts_steps(model: Any, step: Any, rows: slice) -> list[float]:
    """The loop calls the container's members, never the container."""
    losses = []
    for i in range(STEPS):
        x = torch.randn(WORLD * ROWS, 8, generator=torch.Generator().manual_seed(300 + i))[rows]
        with torch.no_grad():  # an evaluation pass between steps, as a loop's logging does
            model["dec"](model["enc"](x))
        loss = (model["dec"](model["enc"](x)) - x).square().mean()
        step(loss)
        losses.append(float(loss.detach()))
    return losses


def parts_worker(rank: int, world: int) -> dict[str, Any]:
    model = parts()
    engine = ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), zero(3))

    def step(loss: torch.Tensor) -> None:
        engine.backward(loss)
        engine.step()

    parts_steps(engine.module, step, slice(rank * ROWS, (rank + 1) * ROWS))
    runtime = engine.plan.stage3
    out = {
        "weights": prefixed("", engine.full_state_dict()),
        "recorded": len(runtime._order),
        "live": runtime.live_numel,
        "units": len(runtime.units),
    }
    engine.destroy()
    return out


def test_zero3_over_a_container_whose_forward_never_runs_equals_one_process() -> None:
    """Each unit called outside the root's forward is gathered for that call and released
    after it: the weights equal one process's, nothing stays gathered, no order is recorded."""
    model = parts()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(loss: torch.Tensor) -> None:
        opt.zero_grad()
        loss.backward()
        opt.step()

    parts_steps(model, step, slice(None))
    reference = prefixed("", model.state_dict())
    (per_rank,) = run_ranks_each([(parts_worker, ())], WORLD)
    for got in per_rank:
        assert got["units"] > 2  # the members are units of their own, sharded
        gap = max((got["weights"][k] - reference[k]).abs().max().item() for k in reference)
        assert gap <= 1e-5, gap
        assert got["live"] == 0 and got["recorded"] == 0, got


# -- several engines in one checkpoint: resumed at another world size -------------------------


def gan_engines(stage: int) -> dict[str, Any]:
    generator, discriminator = gan()
    return {
        "g": ds_strategy.initialize(
            generator, torch.optim.Adam(generator.parameters(), lr=1e-2), zero(stage)
        ),
        "d": ds_strategy.initialize(
            discriminator, torch.optim.Adam(discriminator.parameters(), lr=1e-2), zero(stage)
        ),
    }


def gan_step_range(engines: dict[str, Any], steps: range, rank: int, world: int) -> None:
    rows = slice(rank * WORLD * ROWS // world, (rank + 1) * WORLD * ROWS // world)
    g, d = engines["g"], engines["d"]
    for step in steps:
        real, noise = gan_data(step)
        fake = g(noise[rows])
        for engine, loss in (
            (d, bce(d(real[rows]), 1.0) + bce(d(fake.detach()), 0.0)),
            (g, None),
        ):
            if loss is None:
                loss = bce(d(fake), 1.0)
            engine.zero_grad()
            engine.backward(loss)
            engine.step()


def save_engines_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    from ds_strategy.core.checkpoint.engines import save_engines

    engines = gan_engines(3)
    gan_step_range(engines, range(2), rank, world)
    save_engines(engines, root, client_state={"step": 2})
    gan_step_range(engines, range(2, STEPS), rank, world)  # the uninterrupted run
    out = {k: prefixed("", e.full_state_dict()) for k, e in engines.items()}
    for e in engines.values():
        e.destroy()
    return out


def load_engines_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    from ds_strategy.core.checkpoint.engines import load_engines

    engines = gan_engines(2)
    out: dict[str, Any] = {}
    try:  # the engines must be the ones saved
        load_engines({"g": engines["g"]}, root)
    except ds_strategy.CheckpointError as e:
        out["mismatch"] = str(e)
    out["client"] = load_engines(engines, root)
    gan_step_range(engines, range(2, STEPS), rank, world)
    out["weights"] = {k: prefixed("", e.full_state_dict()) for k, e in engines.items()}
    for e in engines.values():
        e.destroy()
    return out


@pytest.mark.slow
def test_several_engines_save_as_one_checkpoint_and_resume_at_another_world_size(
    tmp_path: Any,
) -> None:
    root = str(tmp_path / "gan")
    uninterrupted = run_ranks_each([(save_engines_worker, (root,))], WORLD)[0][0]
    manifest = (tmp_path / "gan" / "engines.json").read_text()
    assert '"save1"' in manifest and sorted(p.name for p in (tmp_path / "gan").iterdir()) == [
        "d",
        "engines.json",
        "g",
    ]
    resumed = run_ranks_each([(load_engines_worker, (root,))], 1)[0][0]  # 2 ranks -> 1, ZeRO-2
    assert resumed["client"] == {"step": 2}
    assert "holds the models ['g', 'd'], this job has ['g']" in resumed["mismatch"]
    for name in ("g", "d"):
        want, got = uninterrupted[name], resumed["weights"][name]
        assert max((got[k] - want[k]).abs().max().item() for k in want) <= 2e-5, name


# -- a save of several engines killed at every filesystem change --------------------------------


def killed_engines_job(root: str, queue: Any) -> None:
    """One process: state A saved, state B saved with a kill before each filesystem change in
    turn (in a forked child); after each kill the parent loads: both models at A or both at B,
    never one at each."""
    import warnings
    from pathlib import Path

    from ds_strategy.core.checkpoint.engines import load_engines, save_engines
    from tests.test_checkpoint_faults import each_kill_point

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    root_p = Path(root)
    writer, reader = gan_engines(2), gan_engines(2)
    gan_step_range(writer, range(1), 0, 1)
    save_engines(writer, root_p)
    a = {k: prefixed("", e.full_state_dict()) for k, e in writer.items()}
    gan_step_range(writer, range(1, 2), 0, 1)
    b = {k: prefixed("", e.full_state_dict()) for k, e in writer.items()}
    results = []
    for step, killed in each_kill_point(root_p, lambda: save_engines(writer, root_p), 400):
        load_engines(reader, root_p)
        got = {k: prefixed("", e.full_state_dict()) for k, e in reader.items()}
        which = [
            n
            for n, want in (("A", a), ("B", b))
            if all(torch.equal(got[m][k], want[m][k]) for m in want for k in want[m])
        ]
        results.append({"step": step, "killed": killed, "loaded": which})
    queue.put(results)


@pytest.mark.launcher
def test_a_save_of_several_engines_killed_at_every_step_loads_one_whole_save(
    tmp_path: Any,
) -> None:

    ctx = fork_context()
    queue = ctx.Queue()
    proc = ctx.Process(target=killed_engines_job, args=(str(tmp_path / "root"), queue))
    proc.start()
    results = queue.get(timeout=400)
    proc.join(timeout=30)
    assert len(results) > 20 and not results[-1]["killed"], results[-1]  # all kill points
    for r in results:
        assert r["loaded"] in (["A"], ["B"]), r  # one whole save, never a model of each
    assert results[0]["loaded"] == ["A"] and results[-1]["loaded"] == ["B"]
