"""What the compression tests share: a byte counter wrapped around ``torch.distributed``, and
300 steps (or fewer) of the demo GPT on a fixed text (``tests/data/corpus.txt``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import ds_strategy

CORPUS_STEPS = 300
# a fixed text (this project's README as it was at one release): the loss figures the tests
# bound must not move whenever the README does
CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"


class Wire:
    """Bytes this rank hands to torch.distributed per collective (a broadcast counts on its
    source only), the engine's float64 bookkeeping reductions (gradient flags, norms, the
    overflow flag) apart: counted around the library itself."""

    def __init__(self) -> None:
        self.sent: dict[str, int] = {}
        for name in ("all_reduce", "broadcast", "all_to_all_single", "all_gather_into_tensor"):
            self._wrap(name)

    def _wrap(self, name: str) -> None:
        original = getattr(dist, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            tensor = args[1] if name in ("all_to_all_single", "all_gather_into_tensor") else args[0]
            src = kwargs.get("src", args[1] if len(args) > 1 else None)
            if name != "broadcast" or src == dist.get_rank():
                key = "control" if tensor.dtype == torch.float64 else name
                self.sent[key] = self.sent.get(key, 0) + tensor.numel() * tensor.element_size()
            return original(*args, **kwargs)

        setattr(dist, name, counted)


def corpus_losses(
    rank: int,
    world: int,
    gc: dict[str, Any],
    optimizer: str | dict[str, Any],
    stage: int = 1,
    clip: float = 1.0,
    zero: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    seed: int = 0,
    steps: int = CORPUS_STEPS,
    d: int = 32,
) -> list[float]:
    """The demo GPT on the characters of ``CORPUS``, 8 sequences a step over the ranks, ZeRO
    ``stage``, ``gradient_clipping`` ``clip``; the mean loss of each of the last 20 of ``steps``
    steps.
    ``optimizer``: ``"sgd"`` (momentum 0.9), ``"adamw"``, or a config ``optimizer`` section;
    ``zero``: more ``zero_optimization`` keys; ``extra``: more top-level sections; ``seed``:
    the model's initialisation; ``d``: its width."""
    from ds_strategy.demos.gpt import GPT, GPTConfig
    from recipes.data import CharCorpus

    corpus = CharCorpus(CORPUS, 32, 7)
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab=corpus.vocab, d=d, layers=2, heads=4, seq=32))
    config: dict[str, Any] = {
        "zero_optimization": {"stage": stage, **(zero or {})},
        "gradient_clipping": clip,
        "gradient_compression": gc,
        **(extra or {}),
    }
    opt: torch.optim.Optimizer | None = None
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    elif optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    else:
        config["optimizer"] = optimizer
    engine = ds_strategy.initialize(model, opt, config)
    order = torch.randperm(len(corpus), generator=torch.Generator().manual_seed(1))
    per = 8 // world
    losses = []
    for step in range(steps):
        rows = order[(step * 8 + rank * per) % len(order) :][:per]
        batch = torch.stack([corpus[int(i)] for i in rows])
        logits = engine(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    return losses[-20:]
