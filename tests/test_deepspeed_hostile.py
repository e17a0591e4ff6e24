"""A DeepSpeed-format checkpoint is checked before it is trusted: each hostile checkpoint below
(one of DeepSpeed's own fixtures, altered) is refused with a :class:`ds_strategy.CheckpointError`
naming the file and what is wrong, by the engine's ``load_checkpoint`` and by ``ds-strategy
consolidate`` (one line, exit status 2, nothing written), quickly and without allocating what
it declares: each path runs every case in one child process under a 3 GB address-space limit,
with a generous per-case alarm as a hang guard. The untouched fixture loads there too, so a
refusal is the check's, not the limit's."""

from __future__ import annotations

import collections
import contextlib
import io
import json
import logging
import os
import re
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ds_strategy
from ds_strategy.cli import main as cli
from ds_strategy.core.checkpoint.deepspeed import export
from ds_strategy.core.checkpoint.deepspeed.pickles import (
    FragmentAddress,
    LossScalerState,
    ZeroStage,
    load_pickle,
)
from tests.distributed import run_commands
from tests.test_deepspeed_consolidate import DATA, TAG, _copy, _edit, _model_files

sys.path.insert(0, str(DATA))
from make_fixtures import model  # noqa: E402

sys.path.remove(str(DATA))

ADDRESS_SPACE = 3 << 30  # bytes; a child peaks near 0.7 GB (torch, the package, every case)
HANG_S = 30  # per case: a hang guard, not a timing (a refusal takes well under a second)
OPTIM = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"
VIAS = ("engine", "cli")  # the two paths, one child process each


class _Forged:
    """A tensor pickled as ``torch.save`` pickles one, but with a size and stride of our
    choosing over ``data``'s bytes."""

    def __init__(self, data: torch.Tensor, size: tuple[int, ...], stride: tuple[int, ...]) -> None:
        self.data, self.size, self.stride = data, size, stride

    def __reduce__(self) -> Any:
        storage = torch.storage.TypedStorage(
            wrap_storage=self.data.untyped_storage(), dtype=self.data.dtype, _internal=True
        )
        args = (storage, 0, self.size, self.stride, False, collections.OrderedDict())
        return (torch._utils._rebuild_tensor_v2, args)


def _as_deepspeed(value: Any) -> Any:
    """What ``load_pickle`` read, its records as the DeepSpeed classes they were pickled as."""
    if isinstance(value, dict):
        return type(value)((k, _as_deepspeed(v)) for k, v in value.items())
    if isinstance(value, list):
        return [_as_deepspeed(v) for v in value]
    if isinstance(value, ZeroStage):
        return export.ZeroStageEnum(int(value))
    if isinstance(value, LossScalerState):
        dynamic = "scale_window" in vars(value)
        cls = export.DynamicLossScaler if dynamic else export.LossScaler
        return export._record(cls, **vars(value))
    if isinstance(value, FragmentAddress):
        return export._record(export.FragmentAddress, **vars(value))
    return value


def _edit_optim(path: Path, **changes: Any) -> None:
    """Change keys of an optimizer-state file's ``optimizer_state_dict``, written back under
    DeepSpeed's class names (as DeepSpeed wrote it)."""
    body = _as_deepspeed(load_pickle(path, trust_checkpoint=True, mmap=False))
    body["optimizer_state_dict"].update(changes)
    export._save(body, path)


# -- the hostile checkpoints: each (directory, tag, what the refusal says) ---------------------


def _duplicate_optim(root: Path) -> tuple[Path, str | None, str]:
    """A bf16 run's tag directory with a fp32 run's rank-1 file beside its own."""
    ckpt = _copy("s2_bf16", root)
    shutil.copy(DATA / "s2_fp32" / "ckpt" / TAG / OPTIM.format(1), ckpt / TAG)
    said = rf"two .*optim_states files for rank 1, bf16_{OPTIM.format(1)} and {OPTIM.format(1)}"
    return ckpt, None, said


def _save_and_victim(root: Path) -> tuple[Path, Path]:
    """A save directory (s2_fp32) beside another run's (s3_fp32, the victim)."""
    return _copy("s2_fp32", root), _copy("s3_fp32", root)


def _latest_relative(root: Path) -> tuple[Path, str | None, str]:
    save, _ = _save_and_victim(root)
    (save / "latest").write_text(f"../s3_fp32/{TAG}")
    return save, None, r"latest names '\.\./s3_fp32/global_step4', which is not a tag directory"


def _latest_absolute(root: Path) -> tuple[Path, str | None, str]:
    save, victim = _save_and_victim(root)
    (save / "latest").write_text(str(victim / TAG))
    return save, None, r"latest names '/.*/s3_fp32/global_step4', which is not a tag directory"


def _tag_symlink(root: Path) -> tuple[Path, str | None, str]:
    save, victim = _save_and_victim(root)
    shutil.rmtree(save / TAG)
    (save / TAG).symlink_to(victim / TAG, target_is_directory=True)
    return save, None, r"s2_fp32/global_step4: a link to .*s3_fp32/global_step4, outside"


def _tag_argument(root: Path) -> tuple[Path, str | None, str]:
    save, _ = _save_and_victim(root)
    return save, f"../s3_fp32/{TAG}", r"tag '\.\./s3_fp32/global_step4' is not a tag directory"


def _huge_shapes(root: Path) -> tuple[Path, str | None, str]:
    """A first parameter of 1e12 elements declared over 1-element flat groups."""
    ckpt = _copy("s2_fp32", root)
    (path,) = _model_files(ckpt)
    (group,) = torch.load(path, weights_only=False)["param_shapes"]
    huge = collections.OrderedDict(group, **{next(iter(group)): torch.Size([10**6, 10**6])})
    _edit(path, param_shapes=[huge])
    for rank in range(2):
        optim = ckpt / TAG / OPTIM.format(rank)
        _edit_optim(optim, single_partition_of_fp32_groups=[torch.ones(1)])
    # 1e12 + the other parameters' 237 elements
    said = (
        r"model_states\.pt: param group 0 declares 1000000000237 elements but 2 rank\(s\) store 1"
    )
    return ckpt, None, said


def _stride0_fragment(root: Path) -> tuple[Path, str | None, str]:
    """Stage 3: a frozen parameter of 5e9 elements, each rank's fragment one stored element
    repeated by a stride of 0 (20 GB once joined)."""
    ckpt = _copy("s3_fp32", root)
    fragment = _Forged(torch.ones(1), (2_500_000_000,), (0,))
    for path in _model_files(ckpt):
        _edit(path, frozen_param_shapes={"frozen.weight": torch.Size([5 * 10**9])},
              frozen_param_fragments={"frozen.weight": fragment})  # fmt: skip
    said = r"zero_pp_rank_0_mp_rank_00_model_states\.pt: a tensor declares 2500000000 elements"
    return ckpt, None, said


def _tensor_past_storage(root: Path) -> tuple[Path, str | None, str]:
    """A module tensor of a million elements over a storage of four."""
    ckpt = _copy("s2_fp32", root)
    (path,) = _model_files(ckpt)
    module = torch.load(path, weights_only=False)["module"]
    first = next(iter(module))
    _edit(path, module={**module, first: _Forged(torch.ones(4), (10**6,), (1,))})
    return ckpt, None, r"mp_rank_00_model_states\.pt: cannot be read \(RuntimeError"


class _StageOfDigits:
    """DeepSpeed's ``ZeroStageEnum`` rebuilt from a string of 100,000 digits (the enum is an
    allowed record, so the unpickler calls it with whatever the file says)."""

    def __reduce__(self) -> Any:
        return (export.ZeroStageEnum, ("9" * 100_000,))


def _stage_of_digits(root: Path) -> tuple[Path, str | None, str]:
    ckpt = _copy("s2_fp32", root)
    for rank in range(2):
        _edit_optim(ckpt / TAG / OPTIM.format(rank), zero_stage=_StageOfDigits())
    return ckpt, None, rf"{OPTIM.format(0)}: cannot be read \(ValueError: Exceeds the limit"


def _stage_out_of_range(root: Path) -> tuple[Path, str | None, str]:
    """A ZeRO stage of 601 digits (the most an untrusted pickle's integer holds is ~614)."""
    ckpt = _copy("s2_fp32", root)
    for rank in range(2):
        _edit_optim(ckpt / TAG / OPTIM.format(rank), zero_stage=export.ZeroStageEnum(10**600))
    return ckpt, None, rf"{OPTIM.format(0)}: the ZeRO stage \(zero_stage\) is <an integer of"


HOSTILE: dict[str, Callable[[Path], tuple[Path, str | None, str]]] = {
    "duplicate_optim_file": _duplicate_optim,
    "latest_relative_path": _latest_relative,
    "latest_absolute_path": _latest_absolute,
    "tag_directory_symlink": _tag_symlink,
    "tag_argument_path": _tag_argument,
    "shapes_past_flat_groups": _huge_shapes,
    "stride0_frozen_fragment": _stride0_fragment,
    "tensor_past_its_storage": _tensor_past_storage,
    "zero_stage_of_digits": _stage_of_digits,
    "zero_stage_out_of_range": _stage_out_of_range,
}


# -- one child process per path, under the address-space limit --------------------------------


def _attempt(call: Callable[[], Any]) -> dict[str, Any]:
    """``call``'s outcome and wall time; past ``HANG_S`` it is interrupted as hung."""

    def hung(*_: Any) -> None:
        raise TimeoutError(f"still running after {HANG_S} s")

    signal.signal(signal.SIGALRM, hung)
    signal.alarm(HANG_S)
    start = time.perf_counter()
    try:
        result, error, message = call(), None, ""
    except Exception as e:  # noqa: BLE001 - the parent asserts which one it was
        result, error, message = None, type(e).__name__, str(e)
    finally:
        signal.alarm(0)
    seconds = time.perf_counter() - start
    return {"result": result, "error": error, "message": message[:2000], "seconds": seconds}


def _consolidate(args: list[str]) -> tuple[int, str]:
    """``ds-strategy consolidate`` in this process: its exit status and what it printed on
    stderr (a traceback would be an exception out of it)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = cli(["consolidate", *args])
    return status, err.getvalue()


def _load(engine: Any, path: str, tag: str | None) -> None:
    engine.load_checkpoint(path, tag)


def refuse_all(spec_path: str) -> None:
    """The child: every case of the spec through one path; prints each outcome as JSON."""
    spec = json.loads(Path(spec_path).read_text())
    logging.basicConfig(handlers=[logging.NullHandler()])  # progress lines stay out of stderr
    out: dict[str, Any] = {}
    if spec["via"] == "engine":
        config = json.loads((DATA / "s2_fp32" / "config.json").read_text())
        engine = ds_strategy.initialize(model(), None, config)
        for case, c in spec["cases"].items():
            out[case] = _attempt(lambda c=c: _load(engine, c["path"], c["tag"]))
    else:
        for case, c in spec["cases"].items():
            args = [c["path"], c["output"], *(["--tag", c["tag"]] if c["tag"] else [])]
            out[case] = _attempt(lambda a=args: _consolidate(a))
    print("RESULTS " + json.dumps(out))


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Each hostile case, and ``intact`` (the fixture as DeepSpeed wrote it): its directory,
    tag, output file for consolidate and what the refusal says."""
    root = tmp_path_factory.mktemp("hostile")
    intact = str(DATA / "s2_fp32" / "ckpt")
    found = {"intact": {"path": intact, "tag": None, "output": str(root / "intact.safetensors")}}
    for case, build in HOSTILE.items():
        (root / case).mkdir()
        path, tag, said = build(root / case)
        output = str(root / case / "model.safetensors")
        found[case] = {"path": str(path), "tag": tag, "output": output, "said": said}
    return found


@pytest.fixture(scope="module")
def outcomes(
    cases: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Any]]:
    """Each path's outcome of every case: the engine's and the CLI's child, side by side."""
    tmp, root = tmp_path_factory.mktemp("children"), Path(__file__).resolve().parents[1]
    limit = f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({ADDRESS_SPACE}, -1))"
    cmds = []
    for via in VIAS:
        spec = tmp / f"{via}.json"
        spec.write_text(json.dumps({"via": via, "cases": cases}))
        child = f"from tests.test_deepspeed_hostile import refuse_all; refuse_all({str(spec)!r})"
        cmds.append([sys.executable, "-c", f"{limit}; {child}"])
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    outputs = run_commands(cmds, root, env, len(cases) * HANG_S + 120, "hostile checkpoints")
    found = {}
    for via, output in zip(VIAS, outputs, strict=True):
        lines = [ln for ln in output.splitlines() if ln.startswith("RESULTS ")]
        assert lines, f"the {via} child printed no results: {output[-3000:]}"
        found[via] = json.loads(lines[-1][len("RESULTS ") :])
    return found


@pytest.fixture(scope="module")
def by_engine(outcomes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return outcomes["engine"]


@pytest.fixture(scope="module")
def by_cli(outcomes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return outcomes["cli"]


def _said(outcome: dict[str, Any]) -> str:
    return f"{outcome['error']}: {outcome['message'][:600]} ({outcome['seconds']:.2f} s)"


def test_the_intact_checkpoint_loads_under_the_same_limit(
    cases: dict[str, Any], by_engine: dict[str, Any], by_cli: dict[str, Any]
) -> None:
    assert by_engine["intact"]["error"] is None, _said(by_engine["intact"])
    assert by_cli["intact"]["error"] is None, _said(by_cli["intact"])
    assert by_cli["intact"]["result"][0] == 0
    assert Path(cases["intact"]["output"]).is_file()


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_the_engine_refuses_naming_the_file(
    case: str, cases: dict[str, Any], by_engine: dict[str, Any]
) -> None:
    outcome = by_engine[case]
    assert outcome["error"] == "CheckpointError", _said(outcome)
    assert re.search(cases[case]["said"], outcome["message"]), _said(outcome)
    assert outcome["seconds"] < HANG_S  # a hang guard; the report gives the real times


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_consolidate_refuses_in_one_line_writing_nothing(
    case: str, cases: dict[str, Any], by_cli: dict[str, Any]
) -> None:
    outcome = by_cli[case]
    assert outcome["error"] is None, _said(outcome)  # an exception out of main: a traceback
    status, stderr = outcome["result"]
    assert status == 2, stderr
    assert stderr.count("\n") == 1 and stderr.startswith("ds-strategy consolidate: "), stderr
    assert re.search(cases[case]["said"], stderr), stderr
    assert not Path(cases[case]["output"]).exists()
    assert outcome["seconds"] < HANG_S
