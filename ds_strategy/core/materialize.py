"""Materialise parameters created on the meta device, a few modules at a time.

Parameters on the meta device cannot take real storage in place (``set_data`` refuses the
device change), so each one is replaced by a new ``nn.Parameter`` in every module that holds
it; tied weights stay tied because the same old object maps to the same new one. The map
old -> new lets the engine rebuild an optimizer that was built on the meta parameters.

[Note: buffers on the meta device]
A buffer has no ``reset_parameters``: its value comes from the module's constructor (a rotary
embedding's ``inv_freq``, a causal mask), which on the meta device computed nothing. A buffer
is therefore given storage filled with a mark no computation produces (NaN; an integer type's
minimum), then the module's initialisation runs (``param_init_fn``, else the model's own: a
transformers model's ``_init_weights``, which computes ``inv_freq``; else
``reset_parameters``). A buffer still holding only the mark is *unset*: the engine records its
name, a pretrained load may fill it from the files, and a forward while one is still unset is
refused by name. A silent zero would train wrong without an error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

__all__ = [
    "MARK",
    "has_meta",
    "loaded_later",
    "materialize_modules",
    "own_init",
    "refuse_unset_forward",
    "unset_buffers",
]

# on a module marked by ds_strategy.pretrained: (path, strict), the weights its engine reads
MARK = "_ds_strategy_pretrained"

ParamInit = Callable[[nn.Module], None]


def has_meta(module: nn.Module) -> bool:
    return any(t.device.type == "meta" for t in [*module.parameters(), *module.buffers()])


def own_init(model: nn.Module) -> ParamInit | None:
    """The model's own initialisation of one module, where it has one: for the modules inside
    a transformers model (``model`` itself or a submodule, as in a LightningModule holding
    one), that model's ``_init_weights`` (what ``from_pretrained`` runs for what the files
    lack); for the others, ``reset_parameters``. None when ``model`` holds no such model."""
    owners: dict[int, ParamInit] = {}
    for outer in model.modules():  # outer first: a model nested in another initialises its own
        fn = getattr(outer, "_init_weights", None)
        if callable(fn) and hasattr(outer, "config"):
            owners.update((id(m), fn) for m in outer.modules())
    if not owners:
        return None

    def init(m: nn.Module) -> None:
        fn = owners.get(id(m))
        if fn is not None:
            fn(m)
        else:
            _init(m, None, type(m).__name__)

    return init


def loaded_later(model: nn.Module) -> set[int]:
    """The ids of the modules whose parameters a strict pretrained load overwrites once the
    engine is built (inside a module marked by ``ds_strategy.pretrained``): they need storage
    but no initialisation, and under ZeRO-3 no broadcast (``zero/builders.py``)."""
    out: set[int] = set()
    for m in model.modules():
        mark = m.__dict__.get(MARK)
        if mark is not None and mark[1]:
            out.update(id(sub) for sub in m.modules())
    return out


def _marked_like(b: torch.Tensor, device: torch.device) -> torch.Tensor:
    if b.dtype.is_floating_point or b.dtype.is_complex:
        return torch.full_like(b, float("nan"), device=device)
    if b.dtype == torch.bool:
        return torch.zeros_like(b, device=device)  # no mark possible: taken as computed
    return torch.full_like(b, torch.iinfo(b.dtype).min, device=device)


def _is_marked(b: torch.Tensor) -> bool:
    if b.numel() == 0 or b.device.type == "meta" or b.dtype == torch.bool:
        return False
    if b.dtype.is_floating_point or b.dtype.is_complex:
        return bool(torch.isnan(b).all())
    return bool((b == torch.iinfo(b.dtype).min).all())


def unset_buffers(model: nn.Module, names: list[str]) -> list[str]:
    """Which of the buffers ``names`` still hold only the mark of an unset buffer (see the
    note)."""
    if not names:
        return []
    live = dict(model.named_buffers(remove_duplicate=False))
    return [n for n in names if n in live and _is_marked(live[n])]


def _post_order(modules: Iterable[nn.Module]) -> list[nn.Module]:
    # Children first: a parent's reset_parameters may override its children's defaults
    # (nn.MultiheadAttention zeroes out_proj.bias), exactly as in eager construction.
    seen: set[int] = set()
    out: list[nn.Module] = []
    for m in reversed(list(modules)):
        if id(m) not in seen:
            seen.add(id(m))
            out.append(m)
    return out


def materialize_modules(
    modules: Iterable[nn.Module],
    device: torch.device,
    replaced: dict[int, nn.Parameter],
    param_init_fn: ParamInit | None = None,
    names: dict[int, str] | None = None,
    init: bool = True,
    unset: list[str] | None = None,
    later: set[int] | None = None,
) -> None:
    """Give real storage on ``device`` to the meta parameters and buffers held directly by
    ``modules`` and initialise them (``param_init_fn(module)``, else ``reset_parameters()``;
    ``init=False``: leave them uninitialised, for values about to be loaded). The qualified
    names of buffers no initialisation computed are appended to ``unset`` (see the note).
    The modules in ``later`` (see :func:`loaded_later`) get storage only; those holding
    buffers are initialised for them."""
    for m in _post_order(modules):
        direct = [*m._parameters.values(), *m._buffers.values()]
        if not any(t is not None and t.device.type == "meta" for t in direct):
            continue
        for name, p in list(m._parameters.items()):
            if p is None or p.device.type != "meta":
                continue
            new = replaced.get(id(p))
            if new is None:
                new = nn.Parameter(
                    torch.empty_like(p, device=device), requires_grad=p.requires_grad
                )
                replaced[id(p)] = new
            m._parameters[name] = new
        marked = []
        for name, b in list(m._buffers.items()):
            if b is not None and b.device.type == "meta":
                m._buffers[name] = _marked_like(b, device)
                marked.append(name)
        where = (names or {}).get(id(m), type(m).__name__)
        if init and (later is None or id(m) not in later or marked):
            _init(m, param_init_fn, where)
        if unset is not None:
            prefix = "" if where == "<root>" else where + "."
            unset.extend(prefix + n for n in marked if _is_marked(m.get_buffer(n)))


def _init(m: nn.Module, param_init_fn: ParamInit | None, where: str) -> None:
    if param_init_fn is not None:
        with torch.no_grad():
            param_init_fn(m)
    elif callable(getattr(m, "reset_parameters", None)):
        with torch.no_grad():
            m.reset_parameters()  # type: ignore[operator]
    elif any(True for _ in m.parameters(recurse=False)):
        raise ValueError(
            f"module '{where}' ({type(m).__name__}) has parameters on the meta device but no "
            "reset_parameters() to initialise them; pass param_init_fn=fn to "
            "ds_strategy.initialize, where fn(module) initialises module's own parameters"
        )


def refuse_unset_forward(model: nn.Module, names: list[str]) -> None:
    """Until the buffers ``names`` are set (loaded, or computed by the user), a forward of
    ``model`` raises naming them (see the note); the check goes once they are."""
    if not names:
        return

    def check(module: nn.Module, args: object) -> None:
        still = unset_buffers(model, names)
        if still:
            raise RuntimeError(
                f"buffer(s) {still} were built on the meta device and nothing computed them "
                "(not the model's initialisation, not a load): load them with "
                "engine.load_weights(path) when the files hold them, or pass "
                "ds_strategy.initialize(..., param_init_fn=fn) where fn(module) computes them"
            )
        handle.remove()

    handle = model.register_forward_pre_hook(check)
