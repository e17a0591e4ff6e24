"""ZeRO-3 on 2 simulated machines x 2 ranks, with the link between the machines slowed: flat
collectives against hierarchical ones (``topology.hierarchical``), MiCS (``mics_shard_size``
2: sharded inside each machine, replicated across), ZeRO++ (hpZ + qwZ + qgZ), and ZeRO++
with hierarchical collectives. The same demo GPT, every parameter sharded; per layout: the median
step time (slowest rank), each rank's inter- and intra-machine bytes per step
(``comm_report()``) and its peak model-state memory (``memory_report()["peak"]``).

    python benchmarks/bench_topology.py
    python benchmarks/bench_topology.py --delay-us-per-kb 0 --steps 20

[Note: the slowed link]
Four processes on one host share one fast loopback, so nothing is slower across the
simulated machines unless the benchmark makes it so. Each rank wraps its own
``torch.distributed`` collectives: a call on a group with members on more than one machine
(``topology.ranks_per_machine`` = 2: ranks 0-1 and 2-3) first sleeps ``--delay-us-per-kb``
microseconds per KB of the tensor this rank hands over. The default, 10 us per KB (about
100 MB/s, a congested 1 Gbit/s link shared by the ranks of a machine), makes crossing bytes
cost what they cost between real machines; inside a machine the delay is zero. The delay is
the benchmark's own: the engine is not told about it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ds_strategy  # noqa: E402
from benchmarks._ranks import run  # noqa: E402
from ds_strategy.demos.gpt import GPT, GPTConfig  # noqa: E402
from recipes.data import CharCorpus  # noqa: E402

# the tests' fixed text (this project's README as it was at one release), not the live README
CORPUS = Path(__file__).resolve().parent.parent / "tests" / "data" / "corpus.txt"

PER_MACHINE = 2
ZERO_PP = {"zero_hpz_partition_size": 2, "zero_quantized_weights": True,
           "zero_quantized_gradients": True}  # fmt: skip
LAYOUTS: dict[str, tuple[dict[str, Any], bool]] = {
    "flat": ({}, False),
    "hierarchical": ({}, True),
    "MiCS": ({"mics_shard_size": PER_MACHINE}, False),
    "ZeRO++": (ZERO_PP, False),
    "ZeRO++ + hier.": (ZERO_PP, True),
}
_NAMES = ("all_reduce", "broadcast", "all_to_all_single", "all_gather_into_tensor",
          "reduce_scatter_tensor", "all_gather_single", "reduce_scatter_single")  # fmt: skip


def _slow_the_link(delay_s_per_byte: float) -> None:
    """See the note: calls on groups spanning machines sleep for the bytes they hand over."""
    for name in _NAMES:
        if not hasattr(dist, name):
            continue
        original = getattr(dist, name)

        def slowed(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            group = kwargs.get("group") or dist.group.WORLD
            machines = {r // PER_MACHINE for r in dist.get_process_group_ranks(group)}
            if len(machines) > 1:
                tensor = next(a for a in args if isinstance(a, torch.Tensor))
                time.sleep(tensor.numel() * tensor.element_size() * delay_s_per_byte)
            return _original(*args, **kwargs)

        setattr(dist, name, slowed)


def _train(rank: int, world: int, layout: str, args: argparse.Namespace) -> dict[str, Any]:
    _slow_the_link(args.delay_us_per_kb * 1e-6 / 1024)
    zero, hierarchical = LAYOUTS[layout]
    corpus = CharCorpus(CORPUS, args.seq, 7)
    torch.manual_seed(0)
    model = GPT(GPTConfig(corpus.vocab, args.d, args.layers, args.heads, args.seq))
    config = {
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
        "topology": {"ranks_per_machine": PER_MACHINE, "hierarchical": hierarchical},
        "gradient_clipping": 1.0,
    }
    engine = ds_strategy.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-3), config)
    order = torch.randperm(len(corpus), generator=torch.Generator().manual_seed(1))
    per = args.batch // world
    times, losses = [], []
    for step in range(args.steps):
        if step == 2:  # after the first steps (their set-up), measure
            engine.comm_report()
            engine.reset_peak_memory()
        rows = order[(step * args.batch + rank * per) % len(order) :][:per]
        batch = torch.stack([corpus[int(i)] for i in rows])
        dist.barrier()
        t0 = time.perf_counter()
        logits = engine(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        engine.backward(loss)
        engine.step()
        elapsed = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's
        times.append(float(elapsed))
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    report = engine.comm_report()
    measured = args.steps - 2
    return {
        "ms": statistics.median(times[2:]) * 1e3,
        "inter": report["inter_machine"] / measured,
        "intra": report["intra_machine"] / measured,
        "peak": engine.memory_report()["peak"],
        "loss": sum(losses[-5:]) / 5,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--delay-us-per-kb", type=float, default=10.0)
    args = parser.parse_args()
    print(
        f"demo GPT d={args.d} layers={args.layers} seq={args.seq}, ZeRO-3, AdamW, global batch "
        f"{args.batch}, 4 ranks as 2 machines x 2, link between machines slowed by "
        f"{args.delay_us_per_kb:g} us/KB; per rank (rank 0), per step after step 2:"
    )
    print(
        f"{'layout':<16} {'step ms':>8} {'inter KB':>9} {'intra KB':>9} {'inter vs flat':>14} "
        f"{'peak MB':>8} {'loss':>7}"
    )
    flat = None
    for layout in LAYOUTS:
        r = run(_train, 4, layout, args)[0]
        flat = flat or r
        print(
            f"{layout:<16} {r['ms']:>8.1f} {r['inter'] / 1e3:>9.1f} {r['intra'] / 1e3:>9.1f} "
            f"{r['inter'] / flat['inter']:>14.3f} {r['peak'] / 1e6:>8.2f} {r['loss']:>7.3f}"
        )


if __name__ == "__main__":
    main()
