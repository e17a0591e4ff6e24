"""Long-sequence memory tools: the loss and the MLPs computed over tiles of tokens.

[Note: tiles under checkpointing]
Each tile runs under non-reentrant ``torch.utils.checkpoint``. Forward keeps only the tile's
input, a view of the whole input (no copy). Backward recomputes one tile's intermediates at
a time and frees them before the next. At a sequence of ``S`` tokens and a vocabulary of
``V``, the logits alive at once shrink from ``S x V`` to ``tokens x V``. An MLP's
intermediates (a Llama's gate, up and their product: 3 x ``intermediate_size`` a token)
shrink the same way.

A parameter every tile uses still gets one gradient per backward: autograd sums the tiles'
contributions before the parameter's ``AccumulateGrad`` runs, so ZeRO's gradient hooks fire
once, as without tiles. Under ZeRO-3 the head and the MLPs sit inside units that stay
gathered around all their tiles (the root, a block), so tiling adds no all-gather.

[Note: the tiled loss of a transformers causal LM]
The model's own forward runs unchanged, with two of its parts swapped for the call: its
output embedding (``lm_head``) passes the hidden states through, and its ``loss_function``
gets them and computes the loss tile by tile through the real head. Everything else the
forward does (positions, caches, adapters, the sequence split's hooks) is the model's. The
returned output has ``logits=None``. A model that changes logits after the head (Gemma 2's
final soft-capping, Cohere's logit scale) is refused.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ...config import ConfigError
from ...config._schema import TilingConfig
from ..activation_checkpointing import select_modules
from .split import IGNORE_INDEX, SequenceSplit

__all__ = ["apply_tiling", "tiled_cross_entropy"]

_TILED = "_ds_strategy_tiled_forward"  # instance attribute: the forward tiling replaced
_AUTO_NAMES = ("mlp", "feed_forward")
_AFTER_HEAD = ("final_logit_softcapping", "logit_scale")  # config fields changing logits


def tiled_cross_entropy(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    shift_labels: torch.Tensor,
    tokens: int,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """The summed cross-entropy of ``head(hidden)`` against ``shift_labels``, computed
    ``tokens`` positions at a time: the whole logits never exist at once (see
    [Note: tiles under checkpointing]).

    Args:
        hidden: ``[B, S, D]`` the last hidden states.
        head: maps hidden states to logits (the output embedding).
        shift_labels: ``[B, S]`` the label each position predicts.
        tokens: positions per tile.
        ignore_index: the label that counts for nothing.

    >>> head = nn.Linear(4, 7, bias=False)
    >>> h, y = torch.randn(2, 5, 4), torch.randint(0, 7, (2, 5))
    >>> whole = nn.functional.cross_entropy(head(h).flatten(0, 1), y.flatten(), reduction="sum")
    >>> bool(torch.allclose(tiled_cross_entropy(h, head, y, tokens=2), whole))
    True
    """

    def tile_loss(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = head(h).float()
        return nn.functional.cross_entropy(
            logits.flatten(0, 1), y.flatten(), ignore_index=ignore_index, reduction="sum"
        )

    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    pieces = zip(hidden.split(tokens, dim=1), shift_labels.split(tokens, dim=1), strict=True)
    for h, y in pieces:
        if torch.is_grad_enabled():
            total = total + checkpoint(tile_loss, h, y, use_reentrant=False)
        else:
            total = total + tile_loss(h, y)
    return total


def apply_tiling(model: nn.Module, config: TilingConfig) -> None:
    """Tile what ``config`` switches on in ``model``: the loss of its transformers causal LM
    and its MLP modules.

    Args:
        model: the engine's model.
        config: the ``tiling`` section.
    """
    if config.mlp:
        modules = _mlp_modules(model, config.mlp_modules)
        if not modules:
            raise ConfigError(
                f"tiling.mlp: {config.mlp_modules!r} chose no module of "
                f"{type(model).__name__}; name its MLP class with tiling.mlp_modules="
                "'type:<class name regex>'",
                key="tiling.mlp_modules",
            )
        for name, module in modules:
            _tile_module(module, name, config.tokens)
    if config.loss:
        lm = _causal_lm(model)
        if _TILED not in lm.__dict__:  # an engine built again on the same model
            _TiledLoss(lm, config.tokens)


# -- the MLPs --------------------------------------------------------------------------------


def _mlp_modules(model: nn.Module, choice: str) -> list[tuple[str, nn.Module]]:
    names = {id(m): n for n, m in model.named_modules()}
    if choice == "blocks":
        raise ConfigError(
            "tiling.mlp_modules: 'blocks' would tile whole blocks, attention included; "
            "use 'mlp' or 'type:<class name regex>' naming the MLP class",
            key="tiling.mlp_modules",
        )
    if choice != "mlp":
        chosen = select_modules(model, choice, key="tiling.mlp_modules")
        return [(names[id(m)], m) for m in chosen]
    out: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        inside = any(name.startswith(f"{taken}.") for taken, _ in out)
        # a mixture of experts routes over the whole batch (capacity, the router's logits
        # for its auxiliary loss): not tiled by name
        experts = hasattr(module, "experts")
        if name.rsplit(".", 1)[-1] in _AUTO_NAMES and not inside and not experts:
            out.append((name, module))
    return out


def _tile_module(module: nn.Module, name: str, tokens: int) -> None:
    if _TILED in module.__dict__:
        return
    original = module.forward

    @functools.wraps(original)
    def forward(x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[-2] <= tokens:
            return original(x, *args, **kwargs)
        outs = []
        for piece in x.split(tokens, dim=-2):
            if torch.is_grad_enabled():
                run = functools.partial(original, **kwargs)  # checkpoint's own keywords aside
                out = checkpoint(run, piece, *args, use_reentrant=False)
            else:
                out = original(piece, *args, **kwargs)
            if not isinstance(out, torch.Tensor) or out.shape[:-1] != piece.shape[:-1]:
                raise ConfigError(
                    f"tiling.mlp: {name} ({type(module).__name__}) does not map each token "
                    "to one output tensor, so it cannot run over tiles of tokens; choose "
                    "other modules with tiling.mlp_modules='type:<class name regex>'",
                    key="tiling.mlp_modules",
                )
            outs.append(out)
        return torch.cat(outs, dim=-2)

    module.__dict__[_TILED] = original
    module.forward = forward  # type: ignore[method-assign]


# -- the loss ------------------------------------------------------------------------------


def _causal_lm(model: nn.Module) -> nn.Module:
    """The transformers causal LM in ``model``: a module with an output embedding and a
    ``loss_function`` (a PEFT model holds one)."""
    for m in model.modules():
        get = getattr(m, "get_output_embeddings", None)
        # the class itself defines loss_function (a PEFT model only forwards attributes)
        own = any("loss_function" in vars(c) for c in type(m).__mro__)
        if own and callable(get) and isinstance(get(), nn.Module):
            for field in _AFTER_HEAD:
                if getattr(m.config, field, None) not in (None, 1, 1.0):
                    raise ConfigError(
                        f"tiling.loss: {type(m).__name__} changes its logits after the head "
                        f"(config.{field}={getattr(m.config, field)!r}), which the tiled loss "
                        "does not do; set tiling.loss to false for this model",
                        key="tiling.loss",
                    )
            return m
    raise ConfigError(
        f"tiling.loss: {type(model).__name__} holds no transformers causal LM (a module with "
        "an output embedding and a loss_function); compute the loss of another model with "
        "ds_strategy.tiled_cross_entropy(hidden, head, shift_labels, tokens)",
        key="tiling.loss",
    )


class _TiledLoss:
    """Swaps a causal LM's head and loss for its calls with labels (see
    [Note: the tiled loss of a transformers causal LM])."""

    def __init__(self, lm: nn.Module, tokens: int) -> None:
        self.head: nn.Module = lm.get_output_embeddings()  # type: ignore[operator]
        self.tokens = tokens
        self._on = False
        self._head_forward = self.head.forward
        self._loss_function: Callable[..., torch.Tensor] = getattr(lm, "loss_function")  # noqa: B009
        self._forward = lm.forward
        self.head.forward = self._head  # type: ignore[method-assign]
        setattr(lm, "loss_function", self._loss)  # noqa: B010 - transformers' property setter

        @functools.wraps(self._forward)  # its signature: the sequence split reads it
        def forward(*args: object, **kwargs: object) -> object:
            return self._call(*args, **kwargs)

        lm.forward = forward  # type: ignore[method-assign]
        lm.__dict__[_TILED] = self._forward

    def _call(self, *args: object, **kwargs: object) -> object:
        wanted = kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None
        if not wanted or kwargs.get("logits_to_keep") not in (None, 0):
            return self._forward(*args, **kwargs)
        self._on = True
        try:
            output = self._forward(*args, **kwargs)
        finally:
            self._on = False
        items = getattr(output, "items", None)
        if items is None:
            raise ConfigError(
                "tiling.loss: the model returned a tuple (return_dict=False), whose logits "
                "slot the tiled loss cannot empty; call it with return_dict=True",
                key="tiling.loss",
            )
        fields = {k: v for k, v in items() if k != "logits"}
        rebuild: Callable[..., object] = type(output)
        return rebuild(**fields)  # logits=None: they were the hidden states

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden if self._on else self._head_forward(hidden)

    def _loss(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor | None,
        vocab_size: int,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = IGNORE_INDEX,
        shift_labels: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        if not self._on:
            return self._loss_function(
                logits,
                labels,
                vocab_size,
                num_items_in_batch=num_items_in_batch,
                ignore_index=ignore_index,
                shift_labels=shift_labels,
                **kwargs,
            )
        if shift_labels is None:
            assert labels is not None  # _call tiles only calls with labels
            shift_labels = SequenceSplit.shifted(labels, ignore_index)
        shift_labels = shift_labels.to(logits.device)
        summed = tiled_cross_entropy(
            logits, self._head_forward, shift_labels, self.tokens, ignore_index
        )
        if num_items_in_batch is None:  # the mean over labelled tokens, as transformers'
            return summed / (shift_labels != ignore_index).sum()
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(summed.device)
        return summed / num_items_in_batch
