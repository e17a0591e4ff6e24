"""The core's paths on exactly what the package's own requirements install (no extra, no test
tool): .ci/floors runs it in the venv the README's first command made.

    torchrun --nproc-per-node=2 .ci/core_paths.py train OUT   # 2 ranks: train and save
    python .ci/core_paths.py load OUT                          # 1 process: load and check
    python .ci/core_paths.py breakdown                         # a plain script's reports

``train`` runs ZeRO-1, 2 and 3, ZeRO-3 with parameters and optimizer state offloaded to CPU
and to NVMe (files under OUT), two engines saved under one commit point and a 2-stage
pipeline, each for a few steps of the demo GPT, and saves each with its consolidated weights
beside it. ``load`` resumes every checkpoint in one process at another ZeRO stage, checks the
weights equal what the two ranks held, trains a step, and consolidates the NVMe run's
checkpoint. Every mismatch is an error; the script prints one line per path it checked.
``breakdown`` is a plain script that configures no logging and asks for
``wall_clock_breakdown`` and ``steps_per_print``: .ci/floors reads their lines on its stdout.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import ds_strategy
from ds_strategy.core.checkpoint.engines import load_engines, save_engines
from ds_strategy.demos.gpt import GPT, GPTConfig, as_sequential, gpt_loss

SMALL = GPTConfig(vocab=64, d=32, layers=2, heads=4, seq=16, tie_embeddings=False)
SHARD_ALL = {"stage3_param_persistence_threshold": 0, "reduce_bucket_size": 2048}


def _cases(out: Path) -> dict[str, dict]:
    nvme = str(out / "nvme")
    return {
        "zero1": {"stage": 1},
        "zero2": {"stage": 2},
        "zero3": {"stage": 3, **SHARD_ALL},
        "zero3_cpu": {
            "stage": 3,
            **SHARD_ALL,
            "offload_param": {"device": "cpu"},
            "offload_optimizer": {"device": "cpu"},
        },
        "zero3_nvme": {
            "stage": 3,
            **SHARD_ALL,
            "offload_param": {"device": "nvme", "nvme_path": nvme},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
        },
    }


def _model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(SMALL)


def _batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, SMALL.vocab, (4, SMALL.seq + 1), generator=g)


def _engine(model: torch.nn.Module, zero: dict, **extra: object) -> ds_strategy.ZeroEngine:
    config = {"zero_optimization": zero, "train_micro_batch_size_per_gpu": 4, **extra}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ds_strategy.initialize(model, opt, config)
    assert isinstance(engine, ds_strategy.ZeroEngine), type(engine)
    return engine


def _train(engine: ds_strategy.ZeroEngine, steps: int) -> float:
    loss = torch.tensor(0.0)
    for step in range(steps):
        loss = gpt_loss(engine, _batch(step, engine.rank))
        engine.backward(loss)
        engine.step()
    return float(loss.detach())


def _expect(engine: object, path: Path) -> None:
    """The consolidated weights, as every rank's engine holds them now (rank 0 writes)."""
    state = {k: v.contiguous() for k, v in engine.full_state_dict().items()}  # type: ignore[attr-defined]
    if torch.distributed.get_rank() == 0:
        save_file(state, str(path))


def train(out: Path) -> None:
    (out / "nvme").mkdir(parents=True, exist_ok=True)  # a drive's directory, as a user gives it
    for name, zero in _cases(out).items():
        engine = _engine(_model(), zero)
        loss = _train(engine, 3)
        assert torch.isfinite(torch.tensor(loss)), (name, loss)
        engine.save_checkpoint(out / name)
        _expect(engine, out / f"{name}.expected.safetensors")
        engine.destroy()
        if engine.rank == 0:
            print(f"+ {name}: 3 steps on 2 ranks, loss {loss:.3f}, saved", flush=True)

    # two engines (a generator and a critic, say) under one commit point
    first, second = _engine(_model(1), {"stage": 3, **SHARD_ALL}), _engine(_model(2), {"stage": 2})
    _train(first, 2)
    _train(second, 2)
    save_engines({"first": first, "second": second}, out / "several")
    _expect(first, out / "several_first.expected.safetensors")
    _expect(second, out / "several_second.expected.safetensors")
    for engine in (first, second):
        engine.destroy()
    if torch.distributed.get_rank() == 0:
        print("+ several engines: saved under one commit point", flush=True)

    # a 2-stage pipeline (1F1B) over the same GPT as layers
    torch.manual_seed(0)
    layers = as_sequential(GPT(SMALL))
    pipe = ds_strategy.initialize(
        layers,
        torch.optim.AdamW(layers.parameters(), lr=1e-3),
        {
            "pipeline": {"stages": 2, "schedule": "1f1b"},
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 2,
            "zero_optimization": {"stage": 1},
        },
        loss_fn=lambda logits, y: torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
        ),
    )
    for step in range(2):
        tokens = _batch(step, 0)
        loss = pipe.train_batch(tokens[:, :-1], tokens[:, 1:])
    pipe.save_checkpoint(out / "pipe")
    _expect(pipe, out / "pipe.expected.safetensors")
    pipe.destroy()
    if torch.distributed.get_rank() == 0:
        print(f"+ pipeline: 2 stages, 2 steps, loss {float(loss):.3f}, saved", flush=True)


def _same(engine: object, expected: Path, what: str) -> None:
    want = load_file(str(expected))
    got = engine.full_state_dict()  # type: ignore[attr-defined]
    if set(got) != set(want):
        raise SystemExit(f"{what}: keys differ: {sorted(set(got) ^ set(want))}")
    for key, value in want.items():
        if not torch.equal(got[key], value):
            raise SystemExit(f"{what}: {key} differs from what the two ranks held")


def load(out: Path) -> None:
    for name in _cases(out):
        engine = _engine(_model(7), {"stage": 1})  # another seed: the load must overwrite it
        engine.load_checkpoint(out / name)
        _same(engine, out / f"{name}.expected.safetensors", name)
        _train(engine, 1)
        engine.destroy()
        print(f"+ {name}: resumed in 1 process at ZeRO-1, weights equal, a step trained")

    first, second = _engine(_model(8), {"stage": 1}), _engine(_model(9), {"stage": 3, **SHARD_ALL})
    load_engines({"first": first, "second": second}, out / "several")
    _same(first, out / "several_first.expected.safetensors", "several engines (first)")
    _same(second, out / "several_second.expected.safetensors", "several engines (second)")
    print("+ several engines: resumed in 1 process, both engines' weights equal")

    torch.manual_seed(7)
    whole = _engine(as_sequential(GPT(SMALL)), {"stage": 2})
    whole.load_checkpoint(out / "pipe")
    _same(whole, out / "pipe.expected.safetensors", "pipeline")
    print("+ pipeline: its 2 stages' checkpoint loaded as one model in 1 process")

    written = ds_strategy.consolidate(out / "zero3_nvme", out / "zero3_nvme.safetensors")
    want = load_file(str(out / "zero3_nvme.expected.safetensors"))
    got = load_file(str(written))
    if set(got) != set(want) or any(not torch.equal(got[k], want[k]) for k in want):
        raise SystemExit("consolidate: the file differs from what the two ranks held")
    print("+ consolidate: the NVMe run's checkpoint as one safetensors file, equal")


def breakdown() -> None:
    config = {"wall_clock_breakdown": True, "steps_per_print": 1}
    engine = _engine(_model(), {"stage": 3, **SHARD_ALL}, **config)
    _train(engine, 2)
    engine.destroy()


if __name__ == "__main__":
    if sys.argv[1:] == ["breakdown"]:
        breakdown()
    elif len(sys.argv) == 3 and sys.argv[1] in ("train", "load"):
        {"train": train, "load": load}[sys.argv[1]](Path(sys.argv[2]))
    else:
        raise SystemExit(__doc__)
