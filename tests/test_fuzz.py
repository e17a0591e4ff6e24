"""Property-based tests (Hypothesis) over everything that reads input a user did not write:
the config loader, a model directory's files (``.safetensors`` files and their metadata, a
sharded model's index, the quantized-export metadata, ``ds_model.json``) and the command line.

Every input either loads or raises the project's own error type naming the file or the key
(``ConfigError``, ``ModelFileError``, ``UntrustedContentError``; a usage error, exit 2, naming
the option on the command line); no other exception escapes, and no example runs longer than
``LIMIT_S`` (a hang fails the test). Each test runs a fixed, seeded number of examples in the
normal suite and many more under the ``slow`` marker (``DS_STRATEGY_FUZZ_EXAMPLES`` sets
both, to chase a finding).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import struct
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf
from safetensors.torch import save_file

from ds_strategy import cli
from ds_strategy.config import ConfigError, config_schema, load_config
from ds_strategy.core.checkpoint.trust import UntrustedContentError
from ds_strategy.core.inference.building import CARD, ModelFileError, load_model
from ds_strategy.core.inference.origins import quant_metadata
from ds_strategy.core.inference.sources import SafetensorsSource, open_source
from ds_strategy.core.quant.export import QUANT_META

LIMIT_S = 10.0  # per example; generous for a loaded machine, far below a hang


def _examples(quick: int, many: int) -> list[Any]:
    forced = os.environ.get("DS_STRATEGY_FUZZ_EXAMPLES")
    if forced:
        quick = many = int(forced)
    return [
        pytest.param(quick, id=f"{quick}-examples"),
        pytest.param(many, id=f"{many}-examples", marks=pytest.mark.slow),
    ]


class Hang(BaseException):  # noqa: N818 - not an Exception: no `except Exception` may swallow it
    """An example ran past ``LIMIT_S``."""


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`Hang` in the test after ``seconds``; the outer timer (pytest-timeout's,
    if it runs one) is put back with what it had left."""

    def expire(signum: int, frame: Any) -> None:
        raise Hang(f"an example ran past {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    started = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - started), 0.01))


def _fuzz(strategy: st.SearchStrategy[Any], examples: int, check: Callable[[Any], None]) -> None:
    """Run ``check`` on ``examples`` values of ``strategy``, each under the time limit; seeded
    (derandomized), so a run is repeatable, and with no example database."""

    @settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def run(value: Any) -> None:
        with _time_limit(LIMIT_S), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            check(value)

    run()


# -- values a hostile or careless file holds ------------------------------------------------

_NUMBERS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2, 3, 8, 2**31, 2**53 + 1, 2**63, 10**400 // 10**300]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.5, 1e-3, 1e308, -1e308, float("inf"), float("nan"), 1e-320]),
)
_WORDS = st.one_of(
    st.sampled_from(["", "auto", "cpu", "nvme", "none", "true", "false", "1e3", "inf", "nan"]),
    st.text(max_size=8),
)
_SCALARS = st.one_of(st.none(), st.booleans(), _NUMBERS, _WORDS)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)


def _keys_in(data: Any) -> set[str]:
    """Every mapping key anywhere in ``data``."""
    if isinstance(data, dict):
        out = {str(k) for k in data}
        for v in data.values():
            out |= _keys_in(v)
        return out
    if isinstance(data, list):
        return set().union(*(_keys_in(v) for v in data)) if data else set()
    return set()


# -- the config loader ---------------------------------------------------------------------


def _leaves(node: Any, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    out = []
    for key, value in node.items():
        if isinstance(value, dict):
            out.append((prefix + (key,), value))  # a whole section replaced is a case too
            out += _leaves(value, prefix + (key,))
        else:
            out.append((prefix + (key,), value))
    return out


_SCHEMA = _leaves(OmegaConf.to_container(config_schema()))


def _typo(key: str) -> st.SearchStrategy[str]:
    """``key`` with one character dropped, doubled or changed: a near miss of a real key."""
    return st.integers(0, max(len(key) - 1, 0)).flatmap(
        lambda i: (
            st.sampled_from([key[:i] + key[i + 1 :], key[:i] + key[i] + key[i:]])
            | st.characters(min_codepoint=97, max_codepoint=122).map(
                lambda c: key[:i] + c + key[i + 1 :]
            )
        )
    )


@st.composite
def _configs(draw: st.DrawFn) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for path, default in draw(st.lists(st.sampled_from(_SCHEMA), max_size=6)):
        value = draw(st.one_of(st.just(default), _VALUES))
        if draw(st.integers(0, 9)) == 0:  # a near miss of the key's name
            path = path[:-1] + (draw(_typo(path[-1])),)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):  # a section already replaced by a scalar
                break
            node = child
        else:
            node[path[-1]] = value
    return data


def _names_a_key(err: ConfigError, data: dict[str, Any]) -> bool:
    text = str(err)
    return err.key is not None or any(k and k in text for k in _keys_in(data))


@pytest.mark.parametrize("examples", _examples(150, 500))
def test_every_config_loads_or_raises_a_config_error_naming_the_key(examples: int) -> None:
    def check(data: dict[str, Any]) -> None:
        try:
            cfg = load_config(data)
        except ConfigError as err:
            assert _names_a_key(err, data), f"{err!s} names no key of {data!r}"
            return
        for world_size in (1, 2, 8):
            try:
                cfg.resolve(world_size=world_size)
            except ConfigError as err:
                assert _names_a_key(err, data), f"{err!s} names no key of {data!r}"

    _fuzz(_configs(), examples, check)


_FILE_TEXT = st.one_of(
    st.binary(max_size=64),
    _configs().map(lambda d: json.dumps(d, allow_nan=True).encode()),
    _configs().map(lambda d: json.dumps(d, allow_nan=True).encode()[:-3]),  # cut short
    st.sampled_from([b'{"a": 1, "a": 2}', b"[1, 2]", b"null", b"{: }", b"\xff\xfe", b"a: [1"]),
)


@pytest.mark.parametrize("examples", _examples(60, 200))
def test_every_config_file_loads_or_raises_a_config_error_naming_the_file(
    examples: int, tmp_path: Path
) -> None:
    def check(case: tuple[str, bytes]) -> None:
        suffix, content = case
        path = tmp_path / f"config{suffix}"
        path.write_bytes(content)
        try:
            load_config(path)
        except ConfigError as err:
            assert str(path) in str(err), str(err)

    _fuzz(st.tuples(st.sampled_from([".json", ".yaml"]), _FILE_TEXT), examples, check)


# -- a .safetensors file: its header, its tensors and its metadata --------------------------


def _base_file() -> bytes:
    """A small, valid .safetensors file: three dtypes, a 0-d tensor, string metadata."""
    tensors = {
        "w": torch.arange(12, dtype=torch.float32).reshape(4, 3),
        "b": torch.arange(3, dtype=torch.int64),
        "h": torch.ones(2, 2, dtype=torch.bfloat16),
        "s": torch.tensor(0.5),
    }
    with contextlib.ExitStack() as stack:
        import tempfile

        where = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "base.safetensors"
        save_file(tensors, str(where), metadata={"format": "pt"})
        return where.read_bytes()


_BASE = _base_file()
_HEADER_LEN = struct.unpack("<Q", _BASE[:8])[0]
_HEADER = json.loads(_BASE[8 : 8 + _HEADER_LEN])

_DTYPES = st.one_of(
    st.sampled_from(
        ["F32", "F16", "BF16", "F64", "I64", "I32", "I8", "U8", "BOOL", "U16", "U32", "U64"]
        + ["F8_E4M3", "F8_E5M2", "C64", "F4", "Q4", "", "f32"]
    ),
    _VALUES,
)
_INTS = st.one_of(st.integers(-4, 64), st.sampled_from([2**31, 2**63 - 1, 2**64]), _VALUES)


@st.composite
def _safetensors_bytes(draw: st.DrawFn) -> bytes:
    how = draw(st.sampled_from(["header", "header", "bytes", "truncate", "length"]))
    if how == "bytes":  # bytes changed anywhere, mostly in the header
        data = bytearray(_BASE)
        for _ in range(draw(st.integers(1, 4))):
            pos = draw(st.integers(0, min(len(data) - 1, 8 + _HEADER_LEN + 16)))
            data[pos] = draw(st.integers(0, 255))
        return bytes(data)
    if how == "truncate":
        return _BASE[: draw(st.integers(0, len(_BASE) - 1))]
    if how == "length":  # the header's length prefix
        return struct.pack("<Q", draw(st.integers(0, 2**64 - 1))) + _BASE[8:]
    header = json.loads(json.dumps(_HEADER))
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(sorted(header)))
        if name == "__metadata__":
            header[name] = draw(st.one_of(st.dictionaries(_WORDS, _WORDS, max_size=3), _VALUES))
            continue
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra", "whole"]))
        if not isinstance(header[name], dict):  # replaced as a whole by an earlier change
            header[name] = {}
        entry = header[name]
        if field == "dtype":
            entry["dtype"] = draw(_DTYPES)
        elif field == "shape":
            entry["shape"] = draw(st.one_of(st.lists(_INTS, max_size=3), _VALUES))
        elif field == "data_offsets":
            entry["data_offsets"] = draw(st.one_of(st.lists(_INTS, max_size=3), _VALUES))
        elif field == "extra":
            entry[draw(st.text(max_size=6))] = draw(_VALUES)
        else:
            header[name] = draw(_VALUES)
    text = json.dumps(header, allow_nan=True).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + _BASE[8 + _HEADER_LEN :]


def _read_everything(source: SafetensorsSource) -> None:
    for name in source.names():
        shape = source.shape(name)
        source.dtype(name)
        source.read(name, slice(None))
        n = 1
        for size in shape:
            n *= size
        source.read_flat(name, 0, n)


@pytest.mark.parametrize("examples", _examples(150, 500))
def test_every_safetensors_file_reads_or_raises_a_model_file_error_naming_it(
    examples: int, tmp_path: Path
) -> None:
    path = tmp_path / "model.safetensors"

    def check(content: bytes) -> None:
        path.write_bytes(content)
        try:
            source = SafetensorsSource([path], path)
            _read_everything(source)
            quant_metadata(source)
        except ModelFileError as err:
            assert str(path) in str(err), str(err)

    _fuzz(_safetensors_bytes(), examples, check)


# -- a quantized export's metadata --------------------------------------------------------


def _quant_tensors(zeros: bool) -> dict[str, torch.Tensor]:
    """A layer ``l`` saved quantized, with zero-points (asymmetric) or without."""
    tensors = {"l.qweight": torch.zeros(4, 4, dtype=torch.int8), "l.scales": torch.ones(4, 1)}
    if zeros:
        tensors["l.zeros"] = torch.zeros(4, 1)
    return tensors


_GOOD_QUANT = {"bits": 8, "group_size": 64, "symmetric": True, "modules": ["l"]}


@st.composite
def _quant_meta(draw: st.DrawFn) -> str:
    if draw(st.integers(0, 7)) == 0:
        return draw(st.text(max_size=16))
    meta: dict[str, Any] = dict(_GOOD_QUANT)
    for key in draw(st.lists(st.sampled_from([*_GOOD_QUANT, "extra"]), max_size=3)):
        how = draw(st.sampled_from(["drop", "value", "near"]))
        if how == "drop":
            meta.pop(key, None)
        elif how == "near":  # what a hand edit writes: a string, a float, a flipped flag
            meta[key] = draw(
                st.sampled_from(["false", "true", "8", 8.0, 4, 0, -1, False, True, ["m"], "l"])
            )
        else:
            meta[key] = draw(_VALUES)
    return json.dumps(meta, allow_nan=True)


@pytest.mark.parametrize("examples", _examples(100, 300))
def test_every_quantization_metadata_is_read_or_refused_naming_the_file_and_key(
    examples: int, tmp_path: Path
) -> None:
    path = tmp_path / "model.safetensors"

    def check(case: tuple[bool, str]) -> None:
        zeros, text = case
        save_file(_quant_tensors(zeros), str(path), metadata={QUANT_META: text})
        source = SafetensorsSource([path], path)
        try:
            meta = quant_metadata(source)
        except ModelFileError as err:
            assert str(path) in str(err) and QUANT_META in str(err), str(err)
            return
        assert meta is not None  # a non-empty entry is read or refused, never skipped
        assert meta["symmetric"] is (not zeros)  # what was accepted matches the tensors
        assert type(meta["bits"]) is int and type(meta["group_size"]) is int

    _fuzz(st.tuples(st.booleans(), _quant_meta()), examples, check)


# -- a sharded model's index --------------------------------------------------------------

_SHARD_NAMES = st.one_of(
    st.sampled_from(
        [
            "a.safetensors",
            "b.safetensors",
            "c.safetensors",
            "link.safetensors",
            "sub/../a.safetensors",
        ]
        + ["../outside.safetensors", "/etc/hostname", ".", "..", "", "a.safetensors\x00", "x" * 300]
    ),
    _VALUES,
)


@st.composite
def _indexes(draw: st.DrawFn) -> bytes:
    how = draw(st.sampled_from(["map", "map", "map", "raw", "json"]))
    if how == "raw":
        return draw(st.binary(max_size=32))
    if how == "json":
        return json.dumps(draw(_VALUES), allow_nan=True).encode()
    weight_map = draw(
        st.dictionaries(
            st.one_of(st.sampled_from(["x", "y", "z", "q", ""]), st.text(max_size=4)),
            _SHARD_NAMES,
            max_size=4,
        )
    )
    body: dict[str, Any] = {"weight_map": weight_map}
    if draw(st.booleans()):
        body["metadata"] = draw(_VALUES)
    return json.dumps(body, allow_nan=True).encode()


@pytest.mark.parametrize("examples", _examples(150, 500))
def test_every_index_loads_or_raises_a_model_file_error_naming_it(
    examples: int, tmp_path: Path
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    save_file({"x": torch.ones(2), "y": torch.zeros(3)}, str(model / "a.safetensors"))
    save_file({"z": torch.ones(1)}, str(model / "b.safetensors"))
    save_file({"q": torch.ones(1)}, str(tmp_path / "outside.safetensors"))
    (model / "link.safetensors").symlink_to(tmp_path / "outside.safetensors")
    index = model / "model.safetensors.index.json"
    truth = {  # (shard as an index may name it, tensor) -> its value
        (shard, name): value
        for shards, tensors in (
            (("a.safetensors", "sub/../a.safetensors"), {"x": torch.ones(2), "y": torch.zeros(3)}),
            (("b.safetensors",), {"z": torch.ones(1)}),
        )
        for shard in shards
        for name, value in tensors.items()
    }

    def check(content: bytes) -> None:
        index.write_bytes(content)
        try:
            source = open_source(model, comm=None)  # type: ignore[arg-type]
        except ModelFileError as err:
            assert str(index) in str(err), str(err)
            return
        assert isinstance(source, SafetensorsSource)
        _read_everything(source)
        entries = json.loads(content)["weight_map"]
        assert set(source.names()) == set(entries)  # only what the index names, ...
        for name in source.names():  # ... each from the shard its entry names
            assert torch.equal(source.read(name, slice(None)), truth[(entries[name], name)])

    _fuzz(_indexes(), examples, check)


# -- a model directory's ds_model.json ----------------------------------------------------

_FACTORIES = st.one_of(
    st.sampled_from(
        [
            "ds_strategy.demos.gpt:GPT",
            "ds_strategy.demos.gpt:GPTConfig",
            "ds_strategy.demos.gpt:nope",
        ]
        + ["ds_strategy.nope:GPT", "ds_strategy", "os:system", "subprocess:check_call", ""]
    ),
    _VALUES,
)
_GPT_ARGS = st.fixed_dictionaries(
    {},
    optional={
        "vocab": st.one_of(st.integers(-2, 96), _SCALARS),
        "d": st.one_of(st.sampled_from([8, 16, 32, 2**40]), st.integers(-2, 64), _SCALARS),
        "heads": st.one_of(st.integers(-1, 8), _SCALARS),
        "layers": st.one_of(st.integers(-1, 3), _SCALARS),
        "seq": st.one_of(st.integers(-1, 64), _SCALARS),
        "extra": _VALUES,
    },
)


@st.composite
def _cards(draw: st.DrawFn) -> bytes:
    if draw(st.integers(0, 7)) == 0:
        return draw(st.binary(max_size=32))
    card: dict[str, Any] = {
        "factory": draw(_FACTORIES),
        "kwargs": draw(st.one_of(_GPT_ARGS, _VALUES)),
    }
    if draw(st.booleans()):
        card["weights"] = draw(_SHARD_NAMES)
    if draw(st.booleans()):
        card["tokenizer"] = draw(
            st.one_of(st.fixed_dictionaries({"type": st.just("chars"), "chars": _SCALARS}), _VALUES)
        )
    for key in draw(st.lists(st.sampled_from(["factory", "kwargs"]), max_size=1)):
        del card[key]
    return json.dumps(card, allow_nan=True).encode()


@pytest.mark.parametrize("examples", _examples(100, 300))
def test_every_model_card_loads_or_raises_naming_the_card(examples: int, tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    card = model / CARD

    def check(content: bytes) -> None:
        card.write_bytes(content)
        try:
            loaded = load_model(str(model))
        except (ModelFileError, UntrustedContentError) as err:
            assert str(card) in str(err), str(err)
            return
        assert isinstance(loaded.model, torch.nn.Module)
        assert loaded.weights is not None and model.resolve() in loaded.weights.parents

    _fuzz(_cards(), examples, check)


# -- the command line ---------------------------------------------------------------------

_ARG_VALUES = st.one_of(
    st.sampled_from(["0", "1", "-1", "2", "8", "1e400", "nan", "inf", "-inf", "1.5", "abc"]),
    st.sampled_from(["80GB", "24GiB", "7B", "350M", "1e9", "", " ", "1e-9", "2**70", "10" * 12]),
    st.text(max_size=6),
)
_ESTIMATE_OPTIONS = [
    "--gpu-mem",
    "--cpu-mem",
    "--ranks-per-node",
    "--activations",
    "--precision",
    "--hpz-partition-size",
    "--mics-shard-size",
    "--pipeline-stages",
    "--partition-method",
    "--stages-per-rank",
    "--persistence-threshold",
]
_MODEL_ARGS = st.one_of(
    st.tuples(  # depth kept small: a deep model is slow to build, not wrong
        st.just("layers"), st.sampled_from(["2", "0", "-1", "'x'", "1.5", "True"])
    ),
    st.tuples(
        st.sampled_from(["vocab", "d", "heads", "seq", "nope", ""]),
        st.one_of(st.sampled_from(["2", "8", "0", "-1", "1e9", "2**40", "'x'", "None"]), _WORDS),
    ),
).map(lambda kv: f"{kv[0]}={kv[1]}")


@st.composite
def _estimate_argv(draw: st.DrawFn) -> list[str]:
    argv = ["estimate", "--world-size", draw(_ARG_VALUES)]
    if draw(st.booleans()):
        argv += ["--params", draw(_ARG_VALUES)]
    else:
        argv += ["--model", draw(st.sampled_from(["ds_strategy.demos.gpt:GPT", "nope:x", "x"]))]
        for item in draw(st.lists(_MODEL_ARGS, max_size=3)):
            argv += ["--model-arg", item]
    for option in draw(st.lists(st.sampled_from(_ESTIMATE_OPTIONS), max_size=4, unique=True)):
        argv += [option, draw(_ARG_VALUES)]
    if draw(st.booleans()):
        argv.append("--cpu-only")
    return argv


_GENERATE_OPTIONS = [
    "--prompt",
    "--prompt-ids",
    "--bits",
    "--group-size",
    "--tp",
    "--offload",
    "--dtype",
    "--max-new-tokens",
    "--temperature",
    "--top-k",
    "--top-p",
    "--seed",
]


@st.composite
def _generate_argv(draw: st.DrawFn) -> list[str]:
    argv = ["generate", "no/such/model"]
    for option in draw(st.lists(st.sampled_from(_GENERATE_OPTIONS), max_size=5, unique=True)):
        argv += [option, draw(_ARG_VALUES)]
    for flag in draw(st.lists(st.sampled_from(["--zero3", "--sample", "--json"]), max_size=2)):
        argv.append(flag)
    return argv


@st.composite
def _consolidate_argv(draw: st.DrawFn) -> list[str]:
    source = draw(st.sampled_from(["no/such/checkpoint", "garbage", ""]))
    out = draw(st.sampled_from(["out.safetensors", "out.pt", "out.bin", "out.txt", "", "."]))
    argv = ["consolidate", source, out]
    if draw(st.booleans()):
        argv += ["--dtype", draw(st.one_of(st.sampled_from(["fp32", "keep", "fp8"]), _WORDS))]
    return argv


def _run_cli(argv: list[str]) -> tuple[Any, str, str]:
    """``ds-strategy ARGV`` in this process: (exit code, stdout, stderr); argparse's usage
    errors exit with 2."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as exit_:
            code = exit_.code
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("examples", _examples(120, 400))
def test_every_command_line_runs_or_is_a_usage_error_naming_the_option(
    examples: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "x.distcp").write_bytes(b"\x80\x04 not a checkpoint")

    def check(argv: list[str]) -> None:
        code, _, message = _run_cli(argv)
        assert code in (0, 1, 2), (argv, code, message)
        if code == 2:
            # an option, argparse's usage line, or the positional argument at fault
            assert re.search(r"--[a-z]|usage:|output '|checkpoint '|no/such/|garbage", message), (
                argv,
                message,
            )

    strategy = st.one_of(_estimate_argv(), _generate_argv(), _consolidate_argv())
    _fuzz(strategy, examples, check)


@st.composite
def _generate_on_a_model(draw: st.DrawFn) -> list[str]:
    """``ds-strategy generate`` on a real (tiny) model: the checks that need the model
    (vocabulary, positions) and the sampling itself."""
    if draw(st.booleans()):
        argv = ["--prompt", draw(st.one_of(st.sampled_from(["ab", "", "ZeRO", "\u2603"]), _WORDS))]
    else:
        ids = st.one_of(st.integers(-2, 100), st.sampled_from([2**63, 10**30]))
        argv = ["--prompt-ids", ",".join(str(i) for i in draw(st.lists(ids, max_size=4)))]
    argv += ["--max-new-tokens", str(draw(st.one_of(st.integers(-1, 70), st.just(10**6))))]
    numbers = st.one_of(
        st.sampled_from(["0", "1", "-1", "1e-300", "5e-324", "1e308", "inf", "nan", "0.5"]),
        st.integers(-3, 200).map(str),
    )
    for option in draw(
        st.lists(st.sampled_from(["--temperature", "--top-k", "--top-p", "--seed"]), unique=True)
    ):
        argv += [option, draw(numbers)]
    if draw(st.booleans()):
        argv.append("--sample")
    return argv


@pytest.mark.parametrize("examples", _examples(25, 120))
def test_every_generation_runs_or_is_a_usage_error_naming_the_option(
    examples: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from tests.inference_common import write_gpt

    model = write_gpt(tmp_path_factory.mktemp("fuzz_generate") / "model")

    def check(options: list[str]) -> None:
        code, out, message = _run_cli(["generate", str(model), *options])
        assert code in (0, 2), (options, code, message)
        if code == 2:
            assert re.search(r"--[a-z]|usage:", message), (options, message)
        else:
            assert out.strip(), options

    _fuzz(_generate_on_a_model(), examples, check)


# -- a DeepSpeed checkpoint's own records ------------------------------------------------------

_DIMS = st.one_of(
    st.integers(min_value=-2, max_value=12), st.sampled_from([0, 2**31, 10**12, 2**63 - 1])
)


@st.composite
def _deepspeed_records(draw: st.DrawFn) -> dict[str, Any]:
    """Changes to a stage-2 or stage-3 checkpoint's model-states records: each parameter's
    declared shape, the counters, the stage and the partition count."""
    out: dict[str, Any] = {"stage": draw(st.sampled_from(["s2_fp32", "s3_fp32"]))}
    out["shapes"] = draw(st.lists(st.lists(_DIMS, max_size=3), min_size=1, max_size=4))
    out["global_steps"] = draw(st.one_of(_NUMBERS, _WORDS))
    out["partition_count"] = draw(st.one_of(_DIMS, st.lists(_DIMS, max_size=3)))
    out["zero_stage"] = draw(st.one_of(_DIMS, _WORDS))
    return out


@pytest.mark.parametrize("examples", _examples(12, 80))
def test_every_deepspeed_checkpoint_record_consolidates_or_is_a_checkpoint_error(
    examples: int, tmp_path: Path
) -> None:
    """Declared shapes, counters, stage and partition count of one of DeepSpeed's own
    checkpoints, changed: ``consolidate`` writes the weights or raises the package's error
    naming the file, in time and without allocating what a record declares."""
    from ds_strategy import CheckpointError, consolidate
    from tests.test_deepspeed_consolidate import DATA, TAG, _model_files
    from tests.test_deepspeed_hostile import _edit_optim

    def check(records: dict[str, Any]) -> None:
        root = tmp_path / "ckpt"
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(DATA / records["stage"] / "ckpt", root)
        for path in _model_files(root):
            state = torch.load(path, weights_only=False)
            names = [n for g in state["param_shapes"] for n in g]
            shapes = records["shapes"]
            declared = {n: shapes[i % len(shapes)] for i, n in enumerate(names)}
            state.update(param_shapes=[declared], global_steps=records["global_steps"])
            torch.save(state, path)
        for path in (root / TAG).glob("*optim_states.pt"):  # DeepSpeed's classes inside
            _edit_optim(path, partition_count=records["partition_count"])
            _edit_optim(path, zero_stage=records["zero_stage"])
        out = tmp_path / "out.safetensors"
        try:
            consolidate(root, out)
        except (CheckpointError, UntrustedContentError) as e:
            assert str(root) in str(e), str(e)

    _fuzz(_deepspeed_records(), examples, check)
