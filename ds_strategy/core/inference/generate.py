"""Token generation for the inference engine.

[Note: every rank takes the same steps]
Under ZeRO-Inference each forward gathers every layer's parameters, a collective: all ranks
must run the same number of forwards, whatever their prompts. Greedy decoding of the same
logits picks the same tokens everywhere; sampling draws from a generator seeded alike on every
rank (the seed is broadcast from rank 0; a plain replica, in step with no other rank, keeps
its own); with an end-of-sequence token, the ranks stop when
all of them are done (one small all-reduce per token). Under tensor parallelism every rank
computes the same logits, so the same rules keep the ranks in step.

A Hugging Face model generates with its own ``generate`` (its KV cache, its sampling
options), called with ``synced_gpus`` under ZeRO-Inference as DeepSpeed's ZeRO-3 users call
it. Any other model that returns logits ``(batch, positions, vocab)`` generates with the loop
below, reusing keys and values when the model offers a cache (``model.new_cache()`` and a
``cache=`` argument, as the demo GPT does), else recomputing the whole prefix every token.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TypeGuard

import torch
from torch import nn
from torch.nn import functional as F

from ..collectives import Comm

__all__ = ["agreed_seed", "options_problem", "sample_loop", "pick"]


def _whole(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def options_problem(
    max_new_tokens: object,
    top_k: object,
    top_p: object,
    temperature: object,
    sampling: bool,
    name: Callable[[str], str] = str,
    seed: object = None,
) -> str | None:
    """What is wrong with generation options, naming the option as ``name`` spells it (the
    command line's ``--top-k`` for ``top_k``); None: nothing. ``temperature`` is checked only
    when ``sampling``."""
    if not _whole(max_new_tokens) or max_new_tokens < 0:
        return f"{name('max_new_tokens')} must be >= 0 (an integer), got {max_new_tokens!r}"
    if top_k is not None and (not _whole(top_k) or top_k < 1):
        return f"{name('top_k')} must be >= 1 (an integer), got {top_k!r}"
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        return f"{name('top_p')} must be in (0, 1], got {top_p!r}"
    if sampling and not (isinstance(temperature, (int, float)) and temperature > 0):
        return f"{name('temperature')} must be > 0 when sampling, got {temperature!r}"
    if seed is not None and not (_whole(seed) and 0 <= seed < 2**63):
        return f"{name('seed')} must be an integer in [0, 2**63), got {seed!r}"
    return None


def agreed_seed(comm: Comm | None, seed: int | None) -> int:
    """``seed``, or a random one: rank 0's, the same on every rank of ``comm`` (none: this
    rank's own)."""
    value = torch.tensor([seed if seed is not None else int(torch.randint(0, 2**31 - 1, ()))])
    if comm is not None:
        comm.broadcast(value, 0)
    return int(value.item())


def pick(
    logits: torch.Tensor,
    do_sample: bool,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """The next token of each row of ``logits`` (batch, vocab): the argmax, or a draw from the
    softmax at ``temperature`` restricted to the ``top_k`` most likely tokens and to the
    smallest set whose probabilities reach ``top_p``."""
    if not do_sample:
        return logits.argmax(-1)
    if not temperature > 0:
        raise ValueError(f"temperature={temperature}: must be > 0 when sampling")
    # in float64 from the largest score down: a tiny temperature (1e-300 is 0 in float32)
    # gives -inf and 0, never 0 / 0 or inf - inf
    scores = logits.double()
    scores = (scores - scores.max(-1, keepdim=True).values) / temperature
    if top_k is not None and top_k > 0:
        kth = scores.topk(min(top_k, scores.shape[-1]), dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        ordered, order = scores.sort(dim=-1, descending=True)
        mass = ordered.softmax(-1).cumsum(-1)
        drop = mass - ordered.softmax(-1) >= top_p  # keep the tokens until the mass reaches p
        scores = scores.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    probs = F.softmax(scores, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _new_cache(module: nn.Module) -> object:
    """The model's key/value cache, when it offers one (``new_cache()`` and a ``cache=``
    argument); None: the loop recomputes the whole prefix every token."""
    new_cache = getattr(module, "new_cache", None)
    if not callable(new_cache) or "cache" not in inspect.signature(module.forward).parameters:
        return None
    return new_cache()


def sample_loop(
    forward: Callable[..., torch.Tensor],  # the logits (batch, positions, vocab)
    module: nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    eos_token_id: int | None = None,
    all_done: Callable[[bool], bool] | None = None,
) -> torch.Tensor:
    """``input_ids`` followed by up to ``max_new_tokens`` generated tokens, up to the step
    where every row has produced ``eos_token_id`` (rows done earlier are padded with it).
    ``all_done(mine)``: whether every rank is done; until then this rank keeps taking steps
    without adding tokens."""
    gen = None
    if do_sample:
        gen = torch.Generator(device=input_ids.device).manual_seed(seed)
    cache = _new_cache(module)
    tokens = input_ids
    finished = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
    step_input, done = tokens, False
    for _ in range(max_new_tokens):
        # a rank already done still runs the step (its collectives), appending nothing
        logits = forward(step_input, cache=cache) if cache is not None else forward(tokens)
        if not done:
            nxt = pick(logits[:, -1], do_sample, temperature, top_k, top_p, gen)
            if eos_token_id is not None:
                nxt = torch.where(finished, torch.full_like(nxt, eos_token_id), nxt)
                finished |= nxt == eos_token_id
                done = bool(finished.all())
            tokens = torch.cat([tokens, nxt[:, None]], dim=1)
            step_input = nxt[:, None]
        if eos_token_id is not None and (all_done(done) if all_done is not None else done):
            break
    return tokens
