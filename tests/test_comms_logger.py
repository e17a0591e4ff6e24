"""DeepSpeed's ``comms_logger``: per collective kind the count, message size, bytes sent (equal
to ``comm_report()``'s), time, bandwidths and straggler gap, DeepSpeed's summary table, and
nothing timed when it is off."""

from __future__ import annotations

import contextlib
import io
import time
from typing import Any

import torch
from torch import nn

import ds_strategy
from ds_strategy.config import load_config
from ds_strategy.core.collectives import Comm
from ds_strategy.core.profiling import comms
from ds_strategy.core.profiling.comms import CommsLogger, bandwidth_factors, format_summary

from .distributed import run_ranks

COLUMNS = (
    "Comm. Op",
    "Message Size",
    "Count",
    "Total Latency(ms)",
    "Avg Latency(ms)",
    "tput_avg (Gbps)",
    "busbw_avg (Gbps)",
)
REPORT_ONLY = ("total", "intra_machine", "inter_machine")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )


def _engine(logger: dict[str, Any] | None) -> ds_strategy.ZeroEngine:
    """ZeRO-3 with every weight sharded and buckets smaller than a layer."""
    zero = {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "reduce_bucket_size": 300,
        "stage3_prefetch_bucket_size": 300,
    }
    config: dict[str, Any] = {"zero_optimization": zero}
    if logger is not None:
        config["comms_logger"] = logger
    m = _model()
    return ds_strategy.initialize(m, torch.optim.AdamW(m.parameters(), lr=1e-3), config)


def _steps(engine: ds_strategy.ZeroEngine, rank: int, steps: int = 3) -> None:
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        engine.backward(engine(torch.randn(4, 16, generator=g)).square().mean())
        engine.step()


def _logged_worker(rank: int, world: int, logger: dict[str, Any]) -> dict[str, Any]:
    engine = _engine(logger)
    before = engine.comms_report()
    engine.comm_report()  # bytes of the build, before the logger existed: dropped
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _steps(engine, rank)
    sent = engine.comm_report()
    after = engine.comms_report()
    table = io.StringIO()
    with contextlib.redirect_stdout(table):
        engine.log_summary()
    engine.destroy()
    return {
        "before": before,
        "after": after,
        "sent": sent,
        "table": table.getvalue(),
        "verbose": out.getvalue(),
    }


def _sent_since(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """The logger's bytes sent per kind between two reports (kinds with none left out)."""
    was = {k: v["sent_bytes"] for k, v in before["ops"].items()}
    now = {k: v["sent_bytes"] - was.get(k, 0) for k, v in after["ops"].items()}
    return {k: v for k, v in now.items() if v}


def test_zero3_bytes_counts_bandwidths_stragglers_and_the_table() -> None:
    results = run_ranks(_logged_worker, 2, {"enabled": True, "verbose": True}, timeout=180)
    for rank, r in enumerate(results):
        ops, sent = r["after"]["ops"], r["sent"]
        assert r["after"]["enabled"] and r["after"]["ranks"] == 2
        # the logger's bytes per kind are comm_report()'s, kind by kind
        reported = {k: v for k, v in sent.items() if k not in REPORT_ONLY and v}
        assert _sent_since(r["before"], r["after"]) == reported, rank
        assert reported["all_gather"] > 0 and reported["reduce_scatter"] > 0
        for kind in ("all_gather", "reduce_scatter"):
            k = ops[kind]
            assert k["count"] > r["before"]["ops"].get(kind, {"count": 0})["count"]
            assert k["op"] == kind
            # every collective of the steps was waited for: each has its latency
            assert sum(s["count"] for s in k["sizes"].values()) == k["count"]
            assert sum(s * v["count"] for s, v in k["sizes"].items()) == k["msg_bytes"]
            assert k["total_ms"] > 0 and k["algbw_gbps"] > 0
            # two ranks: busbw = algbw * (n-1)/n for these two
            assert abs(k["busbw_gbps"] - k["algbw_gbps"] / 2) < 1e-9 * k["algbw_gbps"] + 1e-12
            # an all-gather or reduce-scatter sends (n-1)/n of its message
            assert k["sent_bytes"] * 2 == k["msg_bytes"]
        for kind, k in ops.items():
            assert len(k["rank_total_ms"]) == 2 and k["straggler_ms"] >= 0, kind
            spread = max(k["rank_total_ms"]) - min(k["rank_total_ms"])
            assert abs(k["straggler_ms"] - spread) < 1e-9
            # the gap is the same figure on every rank
            assert k["straggler_ms"] == results[1 - rank]["after"]["ops"][kind]["straggler_ms"]
        # rank 0 prints DeepSpeed's table and each collective as it completes; rank 1 nothing
        if rank == 0:
            header = r["table"].splitlines()[0]
            assert header.split("  ")[0] == "Comm. Op"
            assert all(c in header for c in COLUMNS)
            assert "Breakdown with straggler effect" in r["table"]
            assert "\nall_gather\n" in r["table"] and "\nreduce_scatter\n" in r["table"]
            lines = [x for x in r["verbose"].splitlines() if "| comm op: " in x]
            assert any("comm op: reduce_scatter" in x and "busbw (Gbps)" in x for x in lines)
            assert len(lines) == sum(k["count"] for k in ops.values()) - sum(
                k["count"] for k in r["before"]["ops"].values()
            )
        else:
            assert r["table"] == "" and "comm op" not in r["verbose"]


def test_prof_ops_logs_only_the_kinds_named() -> None:
    logger = {"enabled": True, "prof_all": False, "prof_ops": ["all_gather"]}
    for rank, r in enumerate(run_ranks(_logged_worker, 2, logger, timeout=180)):
        assert set(r["after"]["ops"]) == {"all_gather"}, rank
        assert r["sent"]["reduce_scatter"] > 0  # still sent, not logged
        since = _sent_since(r["before"], r["after"])
        assert since == {"all_gather": r["sent"]["all_gather"]}
        assert r["verbose"] == ""  # verbose is off


def _disabled_worker(rank: int, world: int) -> dict[str, Any]:
    made: list[int] = []
    original = comms.Timing.__init__

    def counted(self: Any, *args: Any) -> None:
        made.append(1)
        original(self, *args)

    comms.Timing.__init__ = counted  # type: ignore[method-assign]
    try:
        engine = _engine(None)
        _steps(engine, rank, 2)
        sent = engine.comm_report()
        report = engine.comms_report()
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            engine.log_summary()
        engine.destroy()
    finally:
        comms.Timing.__init__ = original  # type: ignore[method-assign]
    return {"timings": len(made), "report": report, "sent": sent, "printed": out.getvalue()}


def test_disabled_times_nothing() -> None:
    for r in run_ranks(_disabled_worker, 2, timeout=180):
        assert r["sent"]["all_gather"] > 0  # collectives ran ...
        assert r["timings"] == 0  # ... and not one carried a timing
        assert r["report"] == {"enabled": False, "ranks": 0, "ops": {}}
        assert r["printed"] == ""


def _async_worker(rank: int, world: int) -> dict[str, Any]:
    comm = Comm()
    comm.comms_logger = CommsLogger(rank=rank)
    full, shard = torch.zeros(2 * 1000), torch.full((1000,), float(rank))
    work = comm.all_gather(full, shard, async_op=True)
    issued = comm.comms_logger.report(lambda mine: [mine])
    time.sleep(0.05)
    work.wait()
    return {"issued": issued, "done": comm.comms_logger.report(comm.all_gather_object)}


def test_an_async_collective_is_timed_from_issue_to_completion() -> None:
    for r in run_ranks(_async_worker, 2, timeout=60):
        issued, done = r["issued"]["ops"]["all_gather"], r["done"]["ops"]["all_gather"]
        assert issued["count"] == 1 and issued["sizes"] == {} and issued["total_ms"] == 0
        assert done["sizes"][8000]["count"] == 1
        assert done["total_ms"] >= 50  # the sleep between issue and wait is inside


def test_bandwidth_formulas_are_deepspeeds() -> None:
    assert bandwidth_factors("all_reduce", 8) == (2.0, 2 * 7 / 8)
    assert bandwidth_factors("reduce_scatter", 4) == (1.0, 3 / 4)
    assert bandwidth_factors("all_to_all", 4) == (1.0, 3 / 4)
    assert bandwidth_factors("broadcast", 4) == (1.0, 1.0)
    logger = CommsLogger()
    timing = logger.issue("control", "all_reduce", 1000, 1000, 2)
    assert timing is not None
    timing()
    k = logger.report(lambda mine: [mine, {"control": 1.0}])["ops"]["control"]
    # all_reduce: algbw 2S/t, busbw S/t * 2(n-1)/n
    assert abs(k["algbw_gbps"] - 2 * 1000 * 8 / (k["total_ms"] / 1e3) / 1e9) < 1e-6
    assert abs(k["busbw_gbps"] - k["algbw_gbps"] / 2) < 1e-9
    assert k["straggler_ms"] == max(k["rank_total_ms"]) - min(k["rank_total_ms"])
    table = format_summary({"ops": {"control": k}}).splitlines()
    assert table[0].split()[:2] == ["Comm.", "Op"] and table[1] == "control"
    assert table[2].split()[:3] == ["1000", "B", "1"]


def test_debug_splits_kinds_by_caller() -> None:
    logger = CommsLogger(debug=True)

    def reduce_gradients() -> None:
        t = logger.issue("all_reduce", "all_reduce", 8, 8, 2)
        assert t is not None
        t()

    reduce_gradients()
    ops = logger.report(lambda mine: [mine])["ops"]
    assert list(ops) == ["all_reduce | [Caller Func: reduce_gradients]"]


def test_config_section_is_typed() -> None:
    cfg = load_config({"comms_logger": {"enabled": True, "prof_all": False, "prof_ops": ["x"]}})
    assert cfg.comms_logger.enabled and not cfg.comms_logger.prof_all
    assert cfg.comms_logger.prof_ops == ["x"] and not cfg.comms_logger.verbose
    assert load_config({}).comms_logger.enabled is False
