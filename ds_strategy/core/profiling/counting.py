"""One forward pass measured module by module: parameters, FLOPs and latency.

[Note: counting with FlopCounterMode, attributed to modules]
FLOPs come from ``torch.utils.flop_counter.FlopCounterMode``: it sees every aten operator
(so ``F.scaled_dot_product_attention`` inside a block, or a matmul in a custom module,
counts as well as an ``nn.Linear``) and adds each one to every module active at the time,
so a module's count includes its children's. Only operators with a flop formula count:
matmuls, convolutions, attention (each 2 FLOPs per multiply-accumulate, so MACs are half the
FLOPs); element-wise work (norms, activations, softmax, bias adds) is not counted, as in
DeepSpeed's and Megatron's figures. A ``Linear`` on ``(B, in)`` counts ``2·B·in·out``.

Parameters are counted at each module's forward pre-hook, registered after ZeRO-3's gather
hooks, so a sharded parameter shows its full shape there (released, it holds 0 elements);
a parameter is counted once however many modules share it. Latency is the wall time from a
module's pre-hook to its post-hook (the device synchronised at both on CUDA, as DeepSpeed
does), summed over the calls in this forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count
from torch.utils.hooks import RemovableHandle

__all__ = ["ForwardCount", "ModuleStats"]


def _sdpa_flops(
    q: torch.Size,
    k: torch.Size,
    v: torch.Size,
    *args: object,
    out_shape: object = None,
    **kw: object,
) -> int:
    # torch's formula for the CUDA attention kernels, whole (not halved for a causal mask,
    # as torch and Megatron count it); the counter passes the tensors' shapes, and the
    # kernel's other arguments, which the formula does not need
    return int(sdpa_flop_count(q, k, v))


# attention kernels torch's counter has no formula for (the CPU one, torch 2.13)
_EXTRA = {
    getattr(torch.ops.aten, name): _sdpa_flops
    for name in ("_scaled_dot_product_flash_attention_for_cpu",)
    if hasattr(torch.ops.aten, name)
}


@dataclass
class ModuleStats:
    """One module's share of a forward (its children included)."""

    type: str
    depth: int
    params: int = 0
    flops: int = 0
    latency_s: float = 0.0

    @property
    def macs(self) -> int:
        return self.flops // 2


class ForwardCount:
    """Context manager measuring the forwards of ``model`` run inside it; entered again, it
    adds the forwards run inside each entry (a pipeline stage counts each of its chunks).

    >>> lin = torch.nn.Linear(8, 4)
    >>> with ForwardCount(lin) as count:
    ...     _ = lin(torch.randn(3, 8))
    >>> count.stats()[""].flops  # 2 * 3 * 8 * 4
    192
    """

    def __init__(self, model: nn.Module, sync: bool = False) -> None:
        self.model = model
        self.sync = sync
        self.names = {m: name for name, m in model.named_modules()}
        self._numel: dict[int, int] = {}
        self._latency: dict[str, float] = dict.fromkeys(self.names.values(), 0.0)
        self._started: dict[nn.Module, list[float]] = {}
        self._hooks: list[RemovableHandle] = []
        self._counter: FlopCounterMode | None = None
        # the entries' counts per module and operator (torch's OpOverloadPacket), added up
        self._counts: dict[str, dict[object, int]] = {}
        self._total = 0
        self._called: set[nn.Module] = set()

    def __enter__(self) -> ForwardCount:
        for m in self.names:
            self._hooks.append(m.register_forward_pre_hook(self._pre))
            self._hooks.append(m.register_forward_hook(self._post))
        self._counter = FlopCounterMode(display=False, custom_mapping=_EXTRA)
        self._counter.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        counter, self._counter = self._counter, None
        assert counter is not None
        counter.__exit__(*exc)
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for key, ops in counter.get_flop_counts().items():
            mine = self._counts.setdefault(key, {})
            for op, n in ops.items():
                mine[op] = mine.get(op, 0) + n
        self._total += int(counter.get_total_flops())

    def _now(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _pre(self, module: nn.Module, args: tuple[object, ...]) -> None:
        for p in module.parameters(recurse=False):
            self._numel[id(p)] = max(self._numel.get(id(p), 0), p.numel())
        self._called.add(module)
        self._started.setdefault(module, []).append(self._now())

    def _post(self, module: nn.Module, args: tuple[object, ...], output: object) -> None:
        start = self._started[module].pop()
        self._latency[self.names[module]] += self._now() - start

    def _flops(self) -> dict[str, int]:
        """FlopCounterMode's per-module totals under our module names (its names are the
        root's class name, then the attribute path: ``GPT.blocks.0.qkv``)."""
        root = type(self.model).__name__
        counts = self._counts
        out = {}
        for name in self.names.values():
            key = f"{root}.{name}" if name else root
            out[name] = sum(counts.get(key, {}).values())
        return out

    def stats(self) -> dict[str, ModuleStats]:
        """Every module by its ``named_modules()`` name (the root is ``""``). A module that
        was not called (an ``nn.ModuleList``) gets its children's FLOPs and latency."""
        flops = self._flops()
        out: dict[str, ModuleStats] = {}
        for m, name in reversed(self.names.items()):  # children before their parent
            seen = {id(p): self._numel.get(id(p), p.numel()) for p in m.parameters()}
            stats = ModuleStats(
                type=type(m).__name__,
                depth=name.count(".") + 1 if name else 0,
                params=sum(seen.values()),
                flops=flops[name],
                latency_s=self._latency[name],
            )
            if m not in self._called:
                kids = [out[self.names[c]] for c in m.children() if c in self.names]
                stats.flops = sum(k.flops for k in kids)
                stats.latency_s = sum(k.latency_s for k in kids)
            out[name] = stats
        return dict(reversed(out.items()))

    @property
    def total_flops(self) -> int:
        """Every counted FLOP of the forward, inside a module or not."""
        return self._total
