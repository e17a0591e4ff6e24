"""Splitting a sequence of layers into contiguous pipeline stages. Pure arithmetic on the
layer list: no process group needed, so it is tested in one process.

[Note: balancing]
``"uniform"`` gives every stage the same number of layers (within one). ``"parameters"`` and
``"type:<regex>"`` give each layer a weight (its trainable parameter count, or 1 for a layer
whose class name matches and 0 otherwise) and choose the contiguous split that minimises the
heaviest stage, as DeepSpeed does; every stage gets at least one layer. Layers of weight 0
(activations, dropout) follow the layer before them.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ...config import ConfigError, type_pattern

__all__ = ["layer_weights", "partition_layers"]

_KEY = "pipeline.partition_method"


def layer_weights(layers: Sequence[nn.Module], method: str) -> list[int]:
    """The weight of each layer under ``method`` (a parameter shared by several layers
    counts in the first one only)."""
    if method == "uniform":
        return [1] * len(layers)
    if method == "parameters":
        seen: set[int] = set()
        out = []
        for layer in layers:
            n = 0
            for p in layer.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    n += p.numel()
            out.append(n)
        return out
    pattern = type_pattern(method, _KEY)
    if pattern is not None:
        return [int(pattern.search(type(layer).__name__) is not None) for layer in layers]
    raise ConfigError(
        f"{_KEY}: unknown method {method!r}; use 'parameters', 'uniform' or "
        "'type:<class name regex>'",
        key=_KEY,
    )


def _uniform(n_layers: int, parts: int) -> list[int]:
    return [i * n_layers // parts for i in range(parts + 1)]


def _min_max_split(weights: list[int], parts: int) -> list[int]:
    """Boundaries of the contiguous split into ``parts`` non-empty runs whose heaviest run
    is lightest; among equals, the latest cuts."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: lightest heaviest-run for the first i layers in k runs
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost <= best[k][i]:  # latest cut: weight-0 layers join the run before
                    best[k][i], cut[k][i] = cost, j
    bounds = [n]
    for k in range(parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def partition_layers(layers: Sequence[nn.Module], parts: int, method: str) -> list[int]:
    """``parts + 1`` boundaries: stage ``k`` holds ``layers[b[k]:b[k+1]]``.

    >>> layers = [nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 100), nn.ReLU()]
    >>> partition_layers(layers, 2, "uniform")
    [0, 2, 4]
    >>> partition_layers(layers, 2, "parameters")
    [0, 2, 4]
    """
    if parts > len(layers):
        raise ConfigError(
            f"pipeline.stages: {parts} pipeline stages need at least {parts} layers, but the "
            f"model has {len(layers)}; use fewer stages (or stages_per_rank) or split the "
            "model into more layers",
            key="pipeline.stages",
        )
    weights = layer_weights(layers, method)
    if method == "uniform":
        return _uniform(len(layers), parts)
    if method.startswith("type:") and sum(weights) < parts:
        raise ConfigError(
            f"{_KEY}: {method!r} matches {sum(weights)} layer(s), fewer than the {parts} "
            "stages; use a regex matching at least one layer per stage, or 'parameters'",
            key=_KEY,
        )
    return _min_max_split(weights, parts)
