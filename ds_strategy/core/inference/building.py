"""What ``init_inference`` is given as a model, turned into a model whose parameters are on the
meta device, plus where its weights are and how to tokenize its text.

Accepted: an ``nn.Module`` (its own weights, or a model built on the meta device with the
weights given separately), a callable building one, ``'package.module:factory'``, a Hugging
Face model directory (``config.json`` and safetensors weights: built by ``ds_strategy.hf``,
the only module that imports transformers), or a ds_strategy model directory: ``ds_model.json``
naming a factory, its keyword arguments, the weights file and the tokenizer (see
:func:`write_model_card`; the example training job writes one).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from ..checkpoint.trust import UntrustedContentError
from ..model_factory import build_failure, build_with, import_factory, params_on_meta

__all__ = [
    "CharTokenizer",
    "DirectoryLoader",
    "LoadedModel",
    "ModelFileError",
    "TextTokenizer",
    "load_model",
    "params_on_meta",
    "write_model_card",
]

CARD = "ds_model.json"


class ModelFileError(ValueError):
    """A file of a model directory or of weights is malformed, unsafe or does not match the rest.

    Such files are ``ds_model.json``, an index, or a ``.safetensors`` file and its metadata.
    The message names the file and, where there is one, the key.
    """


class CharTokenizer:
    """One token per character of a fixed alphabet (the demo GPT's)."""

    def __init__(self, chars: str) -> None:
        self.chars = chars
        self._index = {c: i for i, c in enumerate(chars)}

    def encode(self, text: str) -> list[int]:
        missing = sorted({c for c in text if c not in self._index})
        if missing:
            raise ValueError(f"the prompt has characters this model never saw: {missing!r}")
        return [self._index[c] for c in text]

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``; an id past the alphabet (a model whose vocabulary is larger
        than its tokenizer's) decodes as U+FFFD, the replacement character."""
        n = len(self.chars)
        return "".join(self.chars[i] if 0 <= i < n else "\ufffd" for i in ids)


class Encoded(Protocol):
    """What a Hugging Face tokenizer returns for one text: its token ids."""

    input_ids: torch.Tensor


class TextTokenizer(Protocol):
    """What inference asks of a Hugging Face tokenizer: encode a text, decode ids."""

    def __call__(self, text: str, *, return_tensors: str) -> Encoded: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str | list[str]: ...


@dataclass
class LoadedModel:
    model: nn.Module
    weights: Path | None  # where its weights are, when the spec said
    tokenizer: CharTokenizer | TextTokenizer | None = None


def write_model_card(
    directory: str | Path,
    factory: str,
    kwargs: Mapping[str, object],
    *,
    weights: str = "model.safetensors",
    chars: str | None = None,
) -> Path:
    """``directory/ds_model.json``: how to build the model whose weights are ``weights`` there
    (``factory``: ``'package.module:callable'``; ``chars``: a character tokenizer's alphabet)."""
    card: dict[str, object] = {"factory": factory, "kwargs": kwargs, "weights": weights}
    if chars is not None:
        card["tokenizer"] = {"type": "chars", "chars": chars}
    path = Path(directory) / CARD
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(card, indent=1))
    return path


DirectoryLoader = Callable[[Path], "LoadedModel | None"]


ModelSpec = nn.Module | str | Path | Callable[..., nn.Module]
"""What ``init_inference`` accepts as a model (see the module docstring)."""


def load_model(
    spec: ModelSpec, loaders: Sequence[DirectoryLoader] = (), trust_remote_code: bool = False
) -> LoadedModel:
    """See the module docstring; errors name what was given and what is accepted.
    ``loaders``: more kinds of model directory (``ds_strategy.hf`` adds Hugging Face's), each
    returning ``None`` for a directory it does not know. ``trust_remote_code``: a model
    directory's card may name a factory outside ``ds_strategy`` (see :func:`card_factory`)."""
    if isinstance(spec, nn.Module):
        return LoadedModel(spec, None)
    if isinstance(spec, (str, Path)):
        path = Path(spec)
        if path.is_dir() and (path / CARD).is_file():
            return _from_card(path, trust_remote_code)
        for loader in loaders if path.is_dir() else ():
            loaded = loader(path)
            if loaded is not None:
                return loaded
        if isinstance(spec, str) and ":" in spec and not path.exists():
            return LoadedModel(_build(import_factory(spec, "model"), {}), None)
        raise ValueError(
            f"model {str(spec)!r}: not a model directory (no {CARD} or config.json there) nor "
            "'package.module:factory'; pass an nn.Module, a factory, a Hugging Face model "
            f"directory or a directory with {CARD}"
        )
    if callable(spec):
        return LoadedModel(_build(spec, {}), None)
    raise TypeError(
        f"model: expected an nn.Module, a callable or a path, got {type(spec).__name__}"
    )


def _build(factory: Callable[..., object], kwargs: Mapping[str, object]) -> nn.Module:
    return build_with(factory, kwargs, params_on_meta)


def inside(directory: Path, name: object, what: str) -> Path:
    """``directory / name`` when it stays inside ``directory`` once resolved (symbolic links
    followed): a model directory names files of its own, never ``../other`` or ``/etc``."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise ModelFileError(
            f"{what}: expected a file name inside {str(directory)!r}, got {name!r}"
        )
    root = directory.resolve()
    try:
        target = (directory / name).resolve()
    except OSError as err:  # a name too long, a loop of symbolic links
        raise ModelFileError(f"{what}: cannot resolve {name!r} ({err.strerror or err})") from None
    if target != root and root not in target.parents:
        raise ModelFileError(
            f"{what}: {name!r} points outside the model directory {str(root)!r}; a model "
            "directory may only name files inside it"
        )
    return target


def card_factory(
    card_path: Path, factory: object, trust_remote_code: bool
) -> Callable[..., object]:
    """The card's factory. ds_strategy's own (``ds_strategy.*``) are always allowed; any other
    module is code that whoever wrote the directory chose, imported and run only with the
    user's consent (``trust_remote_code=True``, as transformers asks for a model's own code)."""
    what = f"{card_path} factory"
    if not isinstance(factory, str):
        raise ModelFileError(f"{what}: expected 'package.module:factory', got {factory!r}")
    module = factory.partition(":")[0]
    if not (module == "ds_strategy" or module.startswith("ds_strategy.")) and not trust_remote_code:
        raise UntrustedContentError(
            f"{what} {factory!r} is code from outside ds_strategy, which loading this directory "
            "would import and run; if you trust the directory's source, pass "
            "trust_remote_code=True to init_inference (--trust-remote-code on the command line)"
        )
    try:
        return import_factory(factory, what)
    except ValueError as err:  # import_factory's message names the card's factory already
        raise ModelFileError(str(err)) from None


def _from_card(path: Path, trust_remote_code: bool = False) -> LoadedModel:
    card_path = path / CARD
    try:
        card = json.loads(card_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelFileError(f"{card_path}: not valid JSON ({err})") from None
    if not isinstance(card, dict):
        raise ModelFileError(f"{card_path}: expected a JSON object, got {type(card).__name__}")
    for key in ("factory", "kwargs"):
        if key not in card:
            raise ModelFileError(f"{card_path}: no {key!r} entry")
    if not isinstance(card["kwargs"], dict):
        raise ModelFileError(f"{card_path} kwargs: expected an object, got {card['kwargs']!r}")
    weights = inside(path, card.get("weights", "model.safetensors"), f"{card_path} weights")
    factory = card_factory(card_path, card["factory"], trust_remote_code)
    try:
        model = _build(factory, card["kwargs"])
    except (TypeError, ValueError, OverflowError, RuntimeError, MemoryError) as err:
        raise ModelFileError(
            f"{card_path} kwargs: {card['factory']} could not build the model from them "
            f"({build_failure(err)})"
        ) from err
    tok = card.get("tokenizer") or {}
    if not isinstance(tok, dict):
        raise ModelFileError(f"{card_path} tokenizer: expected an object, got {tok!r}")
    chars = tok.get("chars")
    tokenizer = None
    if tok.get("type") == "chars":
        if not isinstance(chars, str):
            raise ModelFileError(f"{card_path} tokenizer.chars: expected a string, got {chars!r}")
        tokenizer = CharTokenizer(chars)
    return LoadedModel(model, weights, tokenizer)
