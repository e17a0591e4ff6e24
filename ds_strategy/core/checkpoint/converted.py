"""A transformers model's own weight conversions, for a pretrained load into shards.

[Note: converted names]
transformers 5 keeps some weights in another layout than its checkpoint files: a MoE
model's experts are one fused tensor per layer (``mlp.experts.gate_up_proj`` of shape
``(experts, 2 * intermediate, hidden)``), and the files on the Hub hold one tensor per expert
(``block_sparse_moe.experts.3.w1.weight``). ``from_pretrained`` converts them with the model's
conversion mapping (``transformers.conversion_mapping``): renamings, then converters that
stack the experts' tensors (``MergeModulelist(dim=0)``) and join gate and up
(``Concatenate(dim=1)``). Here the same mapping, asked of transformers, names each fused
tensor's parts in its flattened order: expert by expert, and within an expert each source
pattern's tensor in turn. The tensor is then read as a view of those parts
(``PretrainedFiles.add_view``), a run of elements at a time, so a rank reads only its own
experts' bytes. A plain renaming becomes a view of one part. Converters doing anything else
are not taken, and their targets are reported missing by name.
"""

from __future__ import annotations

import re
import sys

from torch import nn

from .weights_source import PretrainedFiles

__all__ = ["add_converted_views"]

_MERGE = [("MergeModulelist", 0)]
_MERGE_JOIN = [("MergeModulelist", 0), ("Concatenate", 1)]


def add_converted_views(source: PretrainedFiles, model: nn.Module) -> None:
    """Views in ``source`` of the tensors ``model`` names differently from its files.

    Args:
        source: the pretrained files.
        model: the model, a transformers ``PreTrainedModel`` (anything else: nothing to do).
    """
    transforms = _transforms(model)
    loading = sys.modules.get("transformers.core_model_loading")
    if not transforms or loading is None:
        return
    renamings = [t for t in transforms if isinstance(t, loading.WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, loading.WeightConverter)]
    rename_source_key = loading.rename_source_key
    state = model.state_dict(keep_vars=True)
    collected: dict[str, dict[str, list[tuple[int, str]]]] = {}
    converter_of: dict[str, object] = {}
    for name in source.names:
        target, pattern = rename_source_key(name, renamings, converters)
        if target == name or target in source:
            continue
        if pattern is None:  # renamed only
            if target in state:
                source.add_view(target, [name], source.shape(name))
            continue
        converter = next(c for c in converters if pattern in getattr(c, "source_patterns", []))
        index = _expert_index(name, pattern)
        if index is None or target not in state:
            continue
        collected.setdefault(target, {}).setdefault(pattern, []).append((index, name))
        converter_of[target] = converter
    for target, by_pattern in collected.items():
        parts = _parts(converter_of[target], by_pattern)
        if parts is not None:  # the whole's shape: the model's may be one rank's experts
            source.add_view(target, parts, _stacked_shape(source, parts, len(by_pattern)))


def _transforms(model: nn.Module) -> list[object]:
    """The model's conversion mapping, when it is a transformers model (transformers is in
    use then, and never imported here: it is the optional ``hf`` extra)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    mapping = sys.modules.get("transformers.conversion_mapping")
    if modeling is None or mapping is None or not isinstance(model, modeling.PreTrainedModel):
        return []
    return list(mapping.get_model_conversion_mapping(model))


def _expert_index(name: str, pattern: str) -> int | None:
    """The number standing for ``*`` in ``pattern`` where ``name`` matches it."""
    if "*" not in pattern:
        return None
    regex = re.escape(pattern.lstrip("^")).replace(r"\*", r"(\d+)")
    found = re.search(regex, name)
    return int(found.group(1)) if found is not None else None


def _parts(converter: object, by_pattern: dict[str, list[tuple[int, str]]]) -> list[str] | None:
    """The files' tensors of one converted target in its flattened order, or None when the
    converter does other than stack experts (and join their patterns along dimension 1),
    or an expert is missing."""
    sources: list[str] = getattr(converter, "source_patterns", [])
    ops = [
        (type(op).__name__, getattr(op, "dim", None)) for op in getattr(converter, "operations", [])
    ]
    patterns = [p for p in sources if p in by_pattern]
    if ops not in (_MERGE, _MERGE_JOIN) or len(patterns) != len(sources):
        return None
    experts = [sorted(by_pattern[p]) for p in patterns]
    count = len(experts[0])
    if any([i for i, _ in e] != list(range(count)) for e in experts):
        return None  # an expert missing, or numbered oddly
    if ops == _MERGE:
        return [n for _, n in experts[0]]
    return [experts[p][e][1] for e in range(count) for p in range(len(patterns))]


def _stacked_shape(source: PretrainedFiles, parts: list[str], patterns: int) -> tuple[int, ...]:
    """Experts stacked along a new first dimension, each expert's ``patterns`` tensors joined
    along the next."""
    first = [tuple(source.shape(p)) for p in parts[:patterns]]
    joined = (sum(s[0] for s in first), *first[0][1:])
    return (len(parts) // patterns, *joined)
