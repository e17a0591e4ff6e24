"""The flops profile as DeepSpeed prints it: the summary, the top modules per depth
(aggregated by module type, as DeepSpeed does) and the detailed per-module tree."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import TypedDict

__all__ = ["FlopsReport", "ModuleProfile", "format_profile", "si"]


class ModuleProfile(TypedDict):
    """One module's share of the profiled forward (its children included)."""

    type: str
    depth: int
    params: int
    flops: int
    macs: int
    latency_s: float


class ProfileBase(TypedDict):
    """What a profile states of the run and of the model's forward."""

    step: int
    world_size: int
    dp_size: int
    mp_size: int
    batch_size: int
    params: int
    fwd_flops: int
    fwd_macs: int
    recompute_fwd_factor: float
    peak_tflops: float
    peak_source: str
    modules: dict[str, ModuleProfile]  # by named_modules() name, the root as ""


class StageInfo(TypedDict, total=False):
    """A pipeline stage's profile only: the stage and the micro-batches of its step."""

    pipeline_stage: int
    micro_batches: int


class ProfileRates(TypedDict):
    """Latencies, FLOPS and MFU; forward and backward apart only outside a pipeline."""

    bwd_flops: float
    train_flops: float
    fwd_latency_s: float | None
    bwd_latency_s: float | None
    fwd_bwd_latency_s: float
    step_latency_s: float
    iter_latency_s: float
    fwd_tflops: float | None
    bwd_tflops: float | None
    fwd_bwd_tflops: float
    achieved_tflops: float
    mfu: float
    samples_per_second: float
    latency_step: int


class FlopsReport(ProfileBase, StageInfo, ProfileRates):
    """One profiled step, as :class:`~ds_strategy.core.profiling.flops.FlopsProfiler` keeps it."""


_LINE = "{:<70}  {:<8}"
_UNITS = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"))


def si(value: float, unit: str = "", places: int = 2) -> str:
    """``si(3.2e9, "MACs")`` -> ``'3.2 GMACs'``; seconds as s / ms / us."""
    if unit == "s":
        for scale, name in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
            if abs(value) >= scale:
                return f"{round(value / scale, places):g} {name}"
        return f"{round(value * 1e6, places):g} us"
    for scale, prefix in _UNITS:
        if abs(value) >= scale:
            return f"{round(value / scale, places):g} {prefix}{unit}"
    return f"{round(value, places):g} {unit}".rstrip()


def _summary(r: FlopsReport) -> list[str]:
    f = r["recompute_fwd_factor"]
    rows = [
        ("world size:", r["world_size"]),
        ("data parallel size:", r["dp_size"]),
        ("model parallel size:", r["mp_size"]),
        ("batch size per GPU:", r["batch_size"]),
        ("params per GPU:", si(r["params"])),
        ("params of model = params per GPU * mp_size:", si(r["params"] * r["mp_size"])),
        ("fwd MACs per GPU:", si(r["fwd_macs"], "MACs")),
        ("fwd flops per GPU:", si(r["fwd_flops"])),
        ("fwd flops of model = fwd flops per GPU * mp_size:", si(r["fwd_flops"] * r["mp_size"])),
    ]
    if "pipeline_stage" in r:  # forward and backward interleaved: one latency for both
        m = r["micro_batches"]
        rows += [
            ("pipeline stage:", r["pipeline_stage"]),
            ("micro-batches per step:", m),
            ("fwd+bwd latency (the schedule, every micro-batch):", si(r["fwd_bwd_latency_s"], "s")),
            (
                f"fwd+bwd FLOPS per GPU = {3 + f:g} * fwd flops per GPU * {m} / fwd+bwd latency:",
                si(r["fwd_bwd_tflops"] * 1e12, "FLOPS"),
            ),
        ]
    else:
        fwd, fwd_tf = r["fwd_latency_s"], r["fwd_tflops"]
        bwd, bwd_tf = r["bwd_latency_s"], r["bwd_tflops"]
        # outside a pipeline forward and backward are timed apart
        assert fwd is not None and fwd_tf is not None and bwd is not None and bwd_tf is not None
        rows += [
            ("fwd latency:", si(fwd, "s")),
            (
                "fwd FLOPS per GPU = fwd flops per GPU / fwd latency:",
                si(fwd_tf * 1e12, "FLOPS"),
            ),
            ("bwd latency:", si(bwd, "s")),
            (
                f"bwd FLOPS per GPU = {2 + f:g} * fwd flops per GPU / bwd latency:",
                si(bwd_tf * 1e12, "FLOPS"),
            ),
            (
                f"fwd+bwd FLOPS per GPU = {3 + f:g} * fwd flops per GPU / (fwd+bwd latency):",
                si(r["fwd_bwd_tflops"] * 1e12, "FLOPS"),
            ),
        ]
    times = f" * {r['micro_batches']}" if "pipeline_stage" in r else ""  # per micro-batch
    rows += [
        ("step latency:", si(r["step_latency_s"], "s")),
        ("iter latency:", si(r["iter_latency_s"], "s")),
        (
            f"FLOPS per GPU = train flops per GPU{times} / iter latency:",
            si(r["achieved_tflops"] * 1e12, "FLOPS"),
        ),
        (f"peak per GPU ({r['peak_source']}):", si(r["peak_tflops"] * 1e12, "FLOPS")),
        (f"MFU = 3 * fwd flops per GPU{times} / iter latency / peak:", f"{r['mfu']:.2%}"),
        ("samples/second:", f"{r['samples_per_second']:.2f}"),
    ]
    return [_LINE.format(label, str(value)) for label, value in rows]


def _top(r: FlopsReport, depth_limit: int, k: int) -> list[str]:
    """Per depth, the ``k`` module types with the most params, MACs and fwd latency."""
    by_depth: dict[int, dict[str, list[float]]] = defaultdict(
        lambda: defaultdict(lambda: [0, 0, 0])
    )
    for m in r["modules"].values():
        if depth_limit < 0 or m["depth"] <= depth_limit:
            agg = by_depth[m["depth"]][m["type"]]
            agg[0] += m["params"]
            agg[1] += m["macs"]
            agg[2] += m["latency_s"]
    lines = [f"Top {k} modules in terms of params, MACs or fwd latency at different model depths:"]
    for depth in sorted(by_depth):
        types = by_depth[depth]
        lines.append(f"depth {depth}:")
        lines.append(f"    params      - {_best(types, 0, k, si)}")
        lines.append(f"    MACs        - {_best(types, 1, k, lambda v: si(v, 'MACs'))}")
        lines.append(f"    fwd latency - {_best(types, 2, k, lambda v: si(v, 's'))}")
    return lines


def _best(types: dict[str, list[float]], i: int, k: int, fmt: Callable[[float], str]) -> str:
    top = sorted(types.items(), key=lambda kv: -kv[1][i])[:k]
    return str({name: fmt(v[i]) for name, v in top})


def _tree(r: FlopsReport, depth_limit: int) -> list[str]:
    mods = r["modules"]
    total = mods[""]

    def stats(m: ModuleProfile) -> str:
        pct = lambda a, b: f"{100 * a / b:.2f}%" if b else "0.00%"  # noqa: E731
        flops = m["flops"] / m["latency_s"] if m["latency_s"] else 0.0
        return (
            f"{si(m['params'])}, {pct(m['params'], total['params'])} Params, "
            f"{si(m['macs'], 'MACs')}, {pct(m['macs'], total['macs'])} MACs, "
            f"{si(m['latency_s'], 's')}, {pct(m['latency_s'], total['latency_s'])} latency, "
            f"{si(flops, 'FLOPS')}"
        )

    lines: list[str] = []
    for name, m in mods.items():
        if depth_limit >= 0 and m["depth"] > depth_limit:
            continue
        label = f"({name.rpartition('.')[2]}): " if name else ""
        lines.append(f"{'  ' * m['depth']}{label}{m['type']}({stats(m)})")
    return lines


def format_profile(
    r: FlopsReport, module_depth: int = -1, top_modules: int = 1, detailed: bool = True
) -> str:
    """The whole printed profile of a report from :class:`FlopsProfiler`."""
    out = ["-------------------------- DeepSpeed Flops Profiler --------------------------"]
    out.append(f"Profile Summary at step {r['step']}:")
    out.append(
        "Notations:\ndata parallel size (dp_size), model parallel size(mp_size),\n"
        "number of parameters (params), number of multiply-accumulate operations(MACs),\n"
        "number of floating-point operations (flops), floating-point operations per second "
        "(FLOPS),\nfwd latency (forward propagation latency), bwd latency (backward "
        "propagation latency),\nstep (weights update latency), iter latency (sum of fwd, bwd "
        "and step latency)\n"
    )
    out += _summary(r)
    out.append(
        "\n----------------------------- Aggregated Profile per GPU -----------------------------"
    )
    out += _top(r, module_depth, top_modules)
    if detailed:
        out.append(
            "\n------------------------------ Detailed Profile per GPU ------------------------------"
        )
        out.append(
            "Each module profile is listed after its name in the following order:\nparams, "
            "percentage of total params, MACs, percentage of total MACs, fwd latency, "
            "percentage of total fwd latency, fwd FLOPS\n"
        )
        out += _tree(r, module_depth)
    out.append("------------------------------------------------------------------------------")
    return "\n".join(out)
