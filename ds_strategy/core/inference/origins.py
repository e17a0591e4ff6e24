"""Which tensor of the weights each parameter of the (split, quantized) model comes from.

A parameter is looked up under every name it has in the model (a tied weight has several: a
Hugging Face checkpoint keeps the embedding and drops the tied ``lm_head.weight``), then with
the model's ``base_model_prefix`` removed or added (a ``LlamaModel`` checkpoint loaded into a
``LlamaForCausalLM``). A quantized layer's ``qweight`` / ``scales`` / ``zeros`` come from the
full-precision weight of the layer it replaced, quantized on load, or, from weights saved
quantized (``engine.save_quantized``), under their own names. Shapes are checked against the
weights before anything is read, and every missing or mismatched name is reported at once.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TypedDict

import torch
from torch import nn

from ..quant.export import QUANT_META
from ..quant.modules import QuantPlan
from .building import ModelFileError
from .placement import Origin
from .sources import WeightSource
from .tp import Split

__all__ = ["QuantMeta", "origins_for", "quant_metadata"]

_KINDS = ("qweight", "scales", "zeros")


class QuantMeta(TypedDict):
    """A quantized export's metadata entry, as :func:`quant_metadata` checked it."""

    bits: int
    group_size: int
    symmetric: bool
    modules: list[str]


# key -> (accepts the value, what it must be); JSON's types as they are, no coercion
_QUANT_SCHEMA: dict[str, tuple[Callable[[object], bool], str]] = {
    "bits": (lambda v: type(v) is int and v in (4, 8), "8 or 4"),
    "group_size": (lambda v: type(v) is int and v >= 1, "an integer >= 1"),
    "symmetric": (lambda v: type(v) is bool, "true or false (a JSON boolean)"),
    "modules": (
        lambda v: isinstance(v, list) and all(isinstance(m, str) for m in v),
        "a list of module names",
    ),
}


def quant_metadata(source: WeightSource) -> QuantMeta | None:
    """The scheme and layers of weights saved quantized (``engine.save_quantized``), checked:
    ``bits`` 8 or 4, ``group_size`` a positive integer, ``symmetric`` a JSON boolean,
    ``modules`` a list of names, and each module's stored tensors agreeing with the scheme
    (zero-points exactly when asymmetric); None for full-precision weights. Errors name the
    file and the key."""
    text = source.metadata.get(QUANT_META)
    if text is None:
        return None
    where = f"{getattr(source, 'where', 'the weights')}: metadata {QUANT_META!r}"
    try:
        meta = json.loads(text)
    except (json.JSONDecodeError, TypeError) as err:
        raise ModelFileError(f"{where} is not valid JSON ({err})") from None
    if not isinstance(meta, dict):
        raise ModelFileError(f"{where}: expected an object, got {type(meta).__name__}")
    for key, (ok, wanted) in _QUANT_SCHEMA.items():
        if key not in meta:
            raise ModelFileError(f"{where}: no {key!r} entry")
        if not ok(meta[key]):
            raise ModelFileError(f"{where}: {key} must be {wanted}, got {meta[key]!r}")
    unlisted = sorted(
        {n[: -len(".qweight")] for n in source.names() if n.endswith(".qweight")}
        - set(meta["modules"])
    )
    if unlisted:
        raise ModelFileError(
            f"{where}: modules does not list {unlisted[0]!r}, whose quantized weight "
            f"({unlisted[0]}.qweight) the file stores; the metadata does not match the tensors"
        )
    for module in meta["modules"]:
        if f"{module}.qweight" not in source:  # a tied layer, stored once under another name
            continue
        has_zeros = f"{module}.zeros" in source
        if meta["symmetric"] == has_zeros:
            raise ModelFileError(
                f"{where}: symmetric is {str(meta['symmetric']).lower()} but {module!r} "
                + ("stores zero-points" if has_zeros else "stores no zero-points")
                + "; the metadata does not match the tensors (edited?)"
            )
    return QuantMeta(
        bits=meta["bits"],
        group_size=meta["group_size"],
        symmetric=meta["symmetric"],
        modules=meta["modules"],
    )


def _candidates(name: str, prefix: str | None) -> list[str]:
    out = [name]
    if prefix:
        if name.startswith(prefix + "."):
            out.append(name[len(prefix) + 1 :])
        else:
            out.append(f"{prefix}.{name}")
    return out


class _Resolver:
    def __init__(self, source: WeightSource, prefix: str | None) -> None:
        self.source, self.prefix = source, prefix
        self.missing: list[str] = []
        self.mismatched: list[str] = []

    def find(self, names: list[str]) -> str:
        for name in names:
            for cand in _candidates(name, self.prefix):
                if cand in self.source:
                    return cand
        self.missing.append(names[0])
        return names[0]

    def check(self, found: str, split: Split | None, want: tuple[int, ...], what: str) -> None:
        if found not in self.source:
            return
        shape = tuple(self.source.shape(found))
        local = split.local_shape(shape) if split is not None else shape
        if local != want:
            part = f" (this rank's part: {list(local)})" if local != shape else ""
            self.mismatched.append(
                f"{found}: {list(shape)}{part} in the weights, {what} {list(want)}"
            )

    def raise_if_any(self, where: str) -> None:
        problems = []
        if self.missing:
            shown = ", ".join(repr(n) for n in self.missing[:5])
            more = f" and {len(self.missing) - 5} more" if len(self.missing) > 5 else ""
            have = ", ".join(repr(n) for n in self.source.names()[:5])
            problems.append(f"missing {shown}{more} (the weights hold e.g. {have})")
        if self.mismatched:
            problems.append("shapes differ: " + "; ".join(self.mismatched[:5]))
        if problems:
            raise ValueError(
                f"{where}: the weights do not fit the model: {'; '.join(problems)}. Build the "
                "model with the configuration the weights were trained with"
            )


def origins_for(
    model: nn.Module,
    source: WeightSource,
    splits: dict[str, Split],
    aliases: dict[str, list[str]],
    quant: QuantPlan | None,
    saved_quantized: bool,
) -> dict[int, Origin]:
    """id(parameter) -> :class:`Origin`, for every parameter of ``model``. ``splits``: this
    rank's tensor-parallel part per parameter name; ``aliases``: every name of each weight
    before quantization replaced it; ``saved_quantized``: the weights hold quantized layers."""
    resolver = _Resolver(source, getattr(model, "base_model_prefix", None))
    stored: dict[int, tuple[str, str]] = {}  # id(param) -> (quantized module, kind)
    for module in quant.modules if quant is not None else ():
        m = model.get_submodule(module)
        for kind in _KINDS:
            p = getattr(m, kind, None)
            if p is not None:
                stored.setdefault(id(p), (module, kind))
    all_names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        all_names.setdefault(id(p), []).append(name)
    out: dict[int, Origin] = {}
    for name, p in model.named_parameters():
        if id(p) in stored:
            module, kind = stored[id(p)]
            assert quant is not None
            split = splits.get(f"{module}.weight")
            if not saved_quantized:  # quantized from the full-precision weight, as read
                weight = quant.weights[module]
                found = resolver.find(aliases.get(weight, [weight]))
                stored_q: torch.Tensor = model.get_submodule(module).qweight  # type: ignore[assignment]
                rows_cols = (stored_q.shape[0], stored_q.shape[1] * 8 // quant.scheme.bits)
                resolver.check(found, split, rows_cols, f"{module!r} expects")
                out[id(p)] = Origin(found, split, kind, quant.scheme)
                continue
            if (
                split is not None
                and split.dim == 1
                and kind != "qweight"
                and quant.scheme.bits == 8
            ):
                split = None  # saved with one scale per whole row: a row-wise part keeps all
        else:
            split = splits.get(name)
        found = resolver.find(all_names[id(p)])
        resolver.check(found, split, tuple(p.shape), f"{name!r} expects")
        if found in source and p.dtype.is_floating_point:
            on_disk = source.dtype(found)
            if not on_disk.is_floating_point:
                resolver.mismatched.append(
                    f"{found}: stored as {on_disk} in the weights, {name!r} is a floating-point "
                    "weight"
                )
        out[id(p)] = Origin(found, split)
    where = getattr(source, "where", None) or getattr(source, "path", None) or "the weights"
    resolver.raise_if_any(str(where))
    return out
