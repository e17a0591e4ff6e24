"""Which ranks share a machine (``core/topology.py``): read from the launcher or the config's
``topology.ranks_per_machine``, and the split of ``comm_report()`` and ``wall_clock_breakdown``
into intra- and inter-machine traffic, on 4 gloo ranks posing as 2 machines x 2 (by the
override, and by two torchrun agents on this host), checked against a counter wrapped around
``torch.distributed`` that classifies each call by its group's members."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import ds_strategy
from ds_strategy.core.topology import Topology
from ds_strategy.demos.gpt import GPT, GPTConfig
from tests.distributed import free_port, run_ranks_each

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("env", "per"),
    [
        ({}, 8),  # no launcher word: one machine
        ({"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "1", "GROUP_RANK": "1"}, 4),
        (
            {
                "SLURM_NTASKS_PER_NODE": "2",
                "SLURM_LOCALID": "1",
                "SLURM_NODEID": "2",
                "SLURM_NTASKS": "8",
            },
            2,
        ),
        ({"SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8"}, 4),
        ({"SLURM_TASKS_PER_NODE": "4,4", "SLURM_NTASKS": "8"}, 4),
        # SLURM's allocation but ranks it did not start (torchrun would set LOCAL_WORLD_SIZE)
        ({"SLURM_NTASKS_PER_NODE": "3", "SLURM_NTASKS": "6"}, 8),
    ],
)
def test_ranks_per_machine_come_from_the_launcher(env: dict[str, str], per: int) -> None:
    topology = Topology.detect(8, 5, env=env)
    assert topology.ranks_per_machine == per
    assert topology.machine_of(5) == 5 // per


def test_a_single_process_is_one_machine_whatever_the_allocation() -> None:
    env = {"SLURM_NTASKS_PER_NODE": "4", "SLURM_NTASKS": "8", "LOCAL_WORLD_SIZE": "4"}
    assert Topology.detect(1, 0, env=env) == Topology(1, 1)


def test_the_config_overrides_the_launcher() -> None:
    env = {"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "3"}  # would contradict rank 5's numbering
    assert Topology.detect(8, 5, override=2, env=env).machines == 4


@pytest.mark.parametrize(
    ("env", "override", "fragment"),
    [
        ({"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "2"}, None, r"rank 5 is on local rank 2"),
        ({"LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0"}, None, r"rank 5 is on machine 0"),
        ({"SLURM_TASKS_PER_NODE": "4,2(x2)", "SLURM_NTASKS": "8"}, None, r"different number"),
        ({}, 3, r"8 ranks do not split into machines of 3 .*1, 2, 4, 8"),
    ],
)
def test_a_layout_that_does_not_add_up_is_refused(
    env: dict[str, str], override: int | None, fragment: str
) -> None:
    with pytest.raises(ValueError, match=fragment):
        Topology.detect(8, 5, override=override, env=env)


def test_the_config_key_is_checked() -> None:
    with pytest.raises(Exception, match="topology.ranks_per_machine"):
        ds_strategy.ZeroConfig.from_any({"topology": {"ranks_per_machine": 0}})
    with pytest.raises(Exception, match="did you mean 'ranks_per_machine'"):
        ds_strategy.ZeroConfig.from_any({"topology": {"ranks_per_machines": 2}})


class _GroupCounter:
    """Bytes handed to torch.distributed per call, filed by whether the call's group has
    members on more than one machine (``machine_of``), counted around the library itself."""

    def __init__(self, per: int) -> None:
        self.per = per
        self.links: dict[str, int] = {"intra": 0, "inter": 0}
        names = ("all_reduce", "broadcast", "all_to_all_single", "all_gather_into_tensor",
                 "reduce_scatter_tensor", "all_gather_single", "reduce_scatter_single")  # fmt: skip
        for name in names:
            if hasattr(dist, name):
                self._wrap(name)

    def _wrap(self, name: str) -> None:
        original = getattr(dist, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            tensor = next(a for a in args if isinstance(a, torch.Tensor))
            group = kwargs.get("group") or dist.group.WORLD
            machines = {r // self.per for r in dist.get_process_group_ranks(group)}
            link = "inter" if len(machines) > 1 else "intra"
            self.links[link] += tensor.numel() * tensor.element_size()
            return original(*args, **kwargs)

        setattr(dist, name, counted)


def _train(per: int | None, tp: int) -> dict[str, Any]:
    """Two steps of the demo GPT at ZeRO-1 (D x T = 4 / tp x tp) with the breakdown on;
    the comm report, timing report and counter of the second."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=16, d=32, layers=2, heads=4, seq=8))
    config: dict[str, Any] = {
        "zero_optimization": {"stage": 1},
        "tensor_parallel": {"autotp_size": tp},
        "wall_clock_breakdown": True,
        "steps_per_print": 1,
    }
    if per is not None:
        config["topology"] = {"ranks_per_machine": per}
    engine = ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    engine.timers.printer = lambda line: None
    gen = torch.Generator().manual_seed(engine.mesh.coordinates["dp"])
    for step in range(2):
        if step == 1:
            engine.comm_report()
            counter = _GroupCounter(engine.topology.ranks_per_machine)
        tokens = torch.randint(0, 16, (2, 9), generator=gen)
        logits = engine(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        engine.backward(loss)
        engine.step()
    return {
        "machines": engine.topology.machines,
        "report": engine.comm_report(),
        "timing": engine.timing_report(),
        "wire": dict(counter.links),  # a copy: the counter goes on counting
    }


def _ranked(rank: int, world: int, per: int | None, tp: int) -> dict[str, Any]:
    return _train(per, tp)


def _check_two_machines(r: dict[str, Any], tp: int) -> None:
    report, wire, timing = r["report"], r["wire"], r["timing"]
    assert r["machines"] == 2
    assert report["intra_machine"] + report["inter_machine"] == report["total"]
    tp_bytes = sum(v for k, v in report.items() if k.startswith("tp_"))
    if tp == 2:  # tensor-parallel pairs share a machine; data-parallel pairs do not
        assert tp_bytes > 0 and report["intra_machine"] == tp_bytes
        assert report["inter_machine"] == report["total"] - tp_bytes > 0
        assert wire["intra"] > 0 and wire["inter"] > 0
    else:  # one data-parallel group over both machines
        assert report["intra_machine"] == 0 and report["inter_machine"] == report["total"] > 0
        assert wire["intra"] == 0 and wire["inter"] > 0
    assert timing["inter_machine_ms"] > 0 and timing["inter_machine_bytes"] > 0


@pytest.fixture(scope="module")
def ranked() -> dict[tuple[int, int], list[dict[str, Any]]]:
    """The runs below (ranks per machine, tensor-parallel size), in one spawn of 4 ranks."""
    cases = [(2, 1), (2, 2), (4, 2)]
    results = run_ranks_each([(_ranked, case) for case in cases], 4)
    return dict(zip(cases, results, strict=True))


@pytest.mark.parametrize("tp", [1, 2])
def test_comm_report_splits_intra_and_inter_machine_bytes(
    ranked: dict[tuple[int, int], list[dict[str, Any]]], tp: int
) -> None:
    for r in ranked[2, tp]:
        _check_two_machines(r, tp)


def test_one_machine_sends_everything_intra(
    ranked: dict[tuple[int, int], list[dict[str, Any]]],
) -> None:
    for r in ranked[4, 2]:
        assert r["machines"] == 1 and r["report"]["inter_machine"] == 0
        assert r["report"]["intra_machine"] == r["report"]["total"] > 0
        assert r["wire"]["inter"] == 0 and r["timing"]["inter_machine_ms"] == 0


WORKER = """
import json, os, sys
sys.path.insert(0, {repo!r})
from tests.test_topology import _train
result = _train(None, 2)
# a file per rank: the agents' stdout interleaves lines the ranks print at once
with open(os.path.join({out!r}, "rank" + os.environ["RANK"] + ".json"), "w") as f:
    json.dump(result, f)
"""


@pytest.mark.launcher
def test_two_torchrun_agents_on_one_host_are_two_machines(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(repo=str(REPO), out=str(tmp_path)))
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node-rank={node}",
                "--nproc-per-node=2",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                str(script),
            ],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for node in (0, 1)
    ]
    try:
        outputs = [agent.communicate(timeout=240)[0] for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:  # a hung agent: its workers would wait forever
                agent.kill()
    for agent, out in zip(agents, outputs, strict=True):
        assert agent.returncode == 0, out[-4000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for r in results:
        _check_two_machines(r, 2)
