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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from ..model_factory import build_with, import_factory, params_on_meta

__all__ = [
    "CharTokenizer",
    "DirectoryLoader",
    "LoadedModel",
    "load_model",
    "params_on_meta",
    "write_model_card",
]

CARD = "ds_model.json"


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
        return "".join(self.chars[i] for i in ids)


@dataclass
class LoadedModel:
    model: nn.Module
    weights: Path | None  # where its weights are, when the spec said
    tokenizer: Any = None


def write_model_card(
    directory: str | Path,
    factory: str,
    kwargs: dict[str, Any],
    *,
    weights: str = "model.safetensors",
    chars: str | None = None,
) -> Path:
    """``directory/ds_model.json``: how to build the model whose weights are ``weights`` there
    (``factory``: ``'package.module:callable'``; ``chars``: a character tokenizer's alphabet)."""
    card: dict[str, Any] = {"factory": factory, "kwargs": kwargs, "weights": weights}
    if chars is not None:
        card["tokenizer"] = {"type": "chars", "chars": chars}
    path = Path(directory) / CARD
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(card, indent=1))
    return path


DirectoryLoader = Callable[[Path], "LoadedModel | None"]


def load_model(spec: Any, loaders: Sequence[DirectoryLoader] = ()) -> LoadedModel:
    """See the module docstring; errors name what was given and what is accepted.
    ``loaders``: more kinds of model directory (``ds_strategy.hf`` adds Hugging Face's), each
    returning ``None`` for a directory it does not know."""
    if isinstance(spec, nn.Module):
        return LoadedModel(spec, None)
    if isinstance(spec, (str, Path)):
        path = Path(spec)
        if path.is_dir() and (path / CARD).is_file():
            return _from_card(path)
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


def _build(factory: Callable[..., Any], kwargs: dict[str, Any]) -> nn.Module:
    return build_with(factory, kwargs, params_on_meta)


def _from_card(path: Path) -> LoadedModel:
    card = json.loads((path / CARD).read_text())
    for key in ("factory", "kwargs"):
        if key not in card:
            raise ValueError(f"{path / CARD}: no {key!r} entry")
    model = _build(import_factory(card["factory"], f"{path / CARD} factory"), card["kwargs"])
    tok = card.get("tokenizer") or {}
    tokenizer = CharTokenizer(tok["chars"]) if tok.get("type") == "chars" else None
    return LoadedModel(model, path / card.get("weights", "model.safetensors"), tokenizer)
