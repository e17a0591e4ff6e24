"""Real public DeepSpeed JSON configs (tests/data/deepspeed_configs/, provenance in its
SOURCES.md) load unchanged and train: "a DeepSpeed user's JSON config works unchanged".

Every file must (a) load with ``ds_strategy.load_config`` and (b) build an engine on a small
model and take two optimizer steps with a finite loss, in this process as a world of one,
after its ``"auto"`` values are filled the way a front end fills them (``fill_auto`` with the
loop's facts). The only exceptions are listed in ``REFUSED`` below, each with the reason and
the fragment of the error the engine must raise: a refusal must name the feature.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ds_strategy
from ds_strategy.config import load_config
from ds_strategy.config.loop import LoopFacts, fill_auto

# DeepSpeed keys that ds_strategy does not implement warn and are ignored, by design
pytestmark = pytest.mark.filterwarnings("ignore::ds_strategy.config.UnsupportedConfigWarning")

CONFIG_DIR = Path(__file__).parent / "data" / "deepspeed_configs"
CONFIGS = sorted(CONFIG_DIR.glob("*.json"))
IDS = [p.name for p in CONFIGS]

HIDDEN = 16
MICRO_BATCH = 2  # the loader's batch size, for an "auto" or absent micro-batch size

# file name -> (why it cannot train here, a fragment of the error the engine must raise).
# The fragment is a regular expression searched in the error message: it names the feature
# and says it is refused, so an unrelated error (or a bare "unknown optimizer") fails the test.
REFUSED: dict[str, tuple[str, str]] = {
    # tutorial configs with optimizer.params.max_grad_norm, which DeepSpeed itself rejects
    # ("'max_grad_norm' is not supported as an optimizer parameter, please switch to using
    # the deepspeed parameter 'gradient_clipping'", DeepSpeed's engine.py)
    "deepspeed__docs_bert_pretraining.json": (
        "DeepSpeed rejects optimizer.params.max_grad_norm too: gradient_clipping replaces it",
        r"max_grad_norm.*gradient_clipping",
    ),
    "deepspeed__docs_curriculum_learning.json": (
        "DeepSpeed rejects optimizer.params.max_grad_norm too: gradient_clipping replaces it",
        r"max_grad_norm.*gradient_clipping",
    ),
    # not a refusal of a feature: 4-way tensor parallelism needs a multiple of 4 ranks, and
    # this test is a world of one (tests/test_tensor_parallel.py trains tensor_parallel)
    "dsexamples__tensor_parallel_hf_integration.json": (
        "autotp_size 4 needs at least 4 ranks; here the world is one process",
        r"autotp_size=4 does not divide the world size 1",
    ),
    # likewise: 2-way sequence parallelism needs a multiple of 2 ranks
    # (tests/test_sequence_parallel.py trains sequence_parallel_size)
    "dsexamples__autosp_config.json": (
        "sequence_parallel_size 2 needs at least 2 ranks; here the world is one process",
        r"sequence_parallel_size=2 = 2 does not divide the world size 1",
    ),
}


def test_corpus() -> None:
    """The corpus is there, every file is listed in SOURCES.md, and no two are identical."""
    assert len(CONFIGS) >= 45
    missing = sorted(set(REFUSED) - set(IDS))
    assert not missing, f"REFUSED names files that are not in the corpus: {missing}"
    sources = (CONFIG_DIR / "SOURCES.md").read_text()
    unlisted = [p.name for p in CONFIGS if f"`{p.name}`" not in sources]
    assert not unlisted, f"not in SOURCES.md: {unlisted}"
    contents = [p.read_bytes() for p in CONFIGS]
    assert len(set(contents)) == len(contents), "two config files have identical content"


@pytest.mark.parametrize("path", CONFIGS, ids=IDS)
def test_loads(path: Path) -> None:
    # DeepSpeed keys that are not implemented warn; only errors fail here
    load_config(path)


def _with_writable_nvme(raw: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    """NVMe offload swaps to files under an existing ``nvme_path``: point it at a new folder
    under ``tmp_path``, as a user points it at their local drive."""
    raw = copy.deepcopy(raw)
    zero = raw.get("zero_optimization")
    if isinstance(zero, dict):
        for key in ("offload_optimizer", "offload_param"):
            section = zero.get(key)
            if isinstance(section, dict) and section.get("device") == "nvme":
                (tmp_path / "nvme").mkdir(exist_ok=True)
                section["nvme_path"] = str(tmp_path / "nvme")
    return raw


MONITORS = ("tensorboard", "csv_monitor")


def _with_local_monitors(raw: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    """An enabled TensorBoard or CSV monitor writes under ``tmp_path/<section>`` instead of
    the config's ``output_path`` (a place on the machine that wrote the config)."""
    raw = copy.deepcopy(raw)
    for section in MONITORS:
        if isinstance(raw.get(section), dict) and raw[section].get("enabled") is True:
            raw[section]["output_path"] = str(tmp_path / section)
    return raw


def _facts(raw: dict[str, Any]) -> LoopFacts:
    """What a training loop would pass: its accumulation steps (the config's, else 1), the
    loader's batch size, the optimizer's lr and weight decay, the scheduler's steps and the
    model's hidden size."""
    gas = raw.get("gradient_accumulation_steps")
    return LoopFacts(
        world_size=1,
        gradient_accumulation_steps=gas if isinstance(gas, int) else 1,
        micro_batch_size=MICRO_BATCH,
        hidden_size=HIDDEN,
        optimizer_lr=1e-3,
        optimizer_weight_decay=0.0,
        warmup_num_steps=10,
        total_num_steps=100,
    )


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN))


def _train_two_steps(path: Path, tmp_path: Path) -> tuple[list[float], bool]:
    """Build the engine and run two optimizer steps; the micro-step losses and whether the
    weights changed."""
    raw = _with_local_monitors(
        _with_writable_nvme(json.loads(path.read_text()), tmp_path), tmp_path
    )
    cfg = fill_auto(load_config(raw), _facts(raw))
    torch.manual_seed(0)
    model = _model()
    # no optimizer section: the user's script passes its own, as with DeepSpeed
    optimizer = None if cfg.optimizer is not None else torch.optim.AdamW(model.parameters())
    engine = ds_strategy.initialize(model, optimizer, cfg)
    try:
        before = {k: v.clone() for k, v in engine.full_state_dict().items()}
        rows = engine.config.train_micro_batch_size_per_gpu or MICRO_BATCH
        gen = torch.Generator().manual_seed(0)
        losses = []
        # small inputs and targets keep an fp16 loss scaled by 2**16 finite
        while engine.global_steps < 2:
            x = 0.1 * torch.randn(rows, HIDDEN, generator=gen)
            y = 0.1 * torch.randn(rows, HIDDEN, generator=gen)
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().item())
        after = engine.full_state_dict()
    finally:
        engine.destroy()
    changed = any(not torch.equal(before[k], after[k]) for k in before)
    return losses, changed


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread: a 16-wide model gains nothing from more, and on busy cores their
    waits cost milliseconds a call, which the configs with 2,048 micro-steps a step feel."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("path", CONFIGS, ids=IDS)
def test_trains_two_steps(path: Path, tmp_path: Path) -> None:
    if path.name in REFUSED:
        reason, fragment = REFUSED[path.name]
        with pytest.raises(Exception) as info:  # the message is checked below
            _train_two_steps(path, tmp_path)
        message = str(info.value)
        assert re.search(fragment, message), f"{reason}; want {fragment!r} in: {message}"
        return
    losses, changed = _train_two_steps(path, tmp_path)
    assert losses and all(math.isfinite(v) for v in losses), losses
    assert changed, "two optimizer steps left every weight unchanged"
    raw = json.loads(path.read_text())
    if raw.get("steps_per_print", 10) <= 2:  # an enabled monitor wrote the step's events
        for section in MONITORS:
            if raw.get(section, {}).get("enabled") is True:
                assert any(p.is_file() for p in (tmp_path / section).rglob("*")), section
