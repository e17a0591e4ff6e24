"""One model with several optimizers (a GAN whose ``LightningModule`` holds the generator and
the discriminator, each with its Adam): one :class:`~ds_strategy.ZeroEngine` per optimizer, for
Lightning's Trainer and Fabric's ``setup(model, opt_g, opt_d)``; and for several models each
with its own engine (Accelerate's ``prepare(gen, opt_g, disc, opt_d)``), which optimizer goes
with which model and which engines a loss reaches. Nothing here touches a framework: front ends map their hooks onto it.

[Note: one engine per optimizer]
Each optimizer gets an engine over the model's top-level submodules that hold its parameters,
gathered in a ``_Part`` that shares them (so every name an engine reports is a key of the
model's ``state_dict()``); submodules with parameters no optimizer holds (a frozen reference)
get one more engine, built for evaluation. The loop calls the model or its submodules, never a
part, so a part's own forward never runs (a ``ModuleDict``: under ZeRO-3 each submodule is a
unit, see ``core/zero/units.py`` and the note on a unit called outside the root in
``core/zero/stage3.py``); under mixed precision each submodule casts its inputs and outputs as
the engine's forward would. The loop keeps the semantics it has under DDP:

- gradients add up over backward calls until ``optimizer.zero_grad()`` or that optimizer's
  step (the engines keep gradients another engine's backward left, and ``zero_grad()``
  reaches the engine), so a generator loss through the discriminator lands there exactly as
  under DDP, and accumulation by hand works;
- Lightning's ``toggle_optimizer(opt)`` turns ``requires_grad`` off for the other parts'
  parameters until ``untoggle_optimizer`` (:meth:`SeveralEngines.toggle`; Lightning's own only
  reaches the engines' shards), so a toggled-out model gets no gradient, as under DDP;
- under fp16 each backward must reach one optimizer's parameters (a toggled one), since each
  engine scales its own loss.

Checkpoints hold every engine under one commit point (``checkpoint/engines.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from .checkpoint.weights_file import write_weights
from .engine import ZeroEngine
from .loop import PendingClip, clipped_engine, load_all, save_all

__all__ = [
    "PendingSteps",
    "SeveralEngines",
    "backward_of_models",
    "engines_reached",
    "holds_gradients",
    "pair_optimizers",
    "param_groups",
    "split_by_optimizer",
]

FROZEN = "frozen"


class _Part(nn.ModuleDict):
    """Some of a model's submodules, shared (not copied): what one engine wraps. A
    ``ModuleDict`` has no forward, so under ZeRO-3 each submodule is a unit of its own."""

    def __init__(self, module: nn.Module, names: list[str]) -> None:
        children: dict[str, nn.Module] = {}
        for name in names:
            child = module._modules[name]
            assert child is not None  # names of module.named_children(), which skips None
            children[name] = child
        super().__init__(children)


def split_by_optimizer(
    module: nn.Module, optimizers: list[Optimizer]
) -> tuple[list[list[str]], list[str]]:
    """The top-level submodules holding each optimizer's parameters, and the frozen ones
    (parameters in no optimizer); anything else is an error naming the fix."""
    owner: dict[int, int] = {}
    for i, opt in enumerate(optimizers):
        for group in opt.param_groups:
            for p in group["params"]:
                if owner.setdefault(id(p), i) != i:
                    raise ValueError(
                        f"a parameter is in optimizers {owner[id(p)]} and {i}: each optimizer "
                        "gets its own engine, which owns its parameters' shards; give each "
                        "parameter to one optimizer"
                    )
    model = type(module).__name__
    direct = [n for n, p in module._parameters.items() if p is not None]
    if direct:
        raise ValueError(
            f"the LightningModule holds the parameters {direct} itself: with several "
            "optimizers ZeroStrategy gives each optimizer the submodules its parameters live "
            "in; move them into a submodule (self.generator = nn.Sequential(...))"
        )
    parts: list[list[str]] = [[] for _ in optimizers]
    frozen: list[str] = []
    placed: set[int] = set()
    for name, child in module.named_children():
        params = list(child.parameters())
        which = sorted({owner[id(p)] for p in params if id(p) in owner})
        if len(which) > 1:
            raise ValueError(
                f"{model}.{name} holds parameters of optimizers {which}: with several "
                "optimizers each optimizer gets an engine over whole top-level submodules; "
                "split it into one submodule per optimizer"
            )
        placed.update(id(p) for p in params)
        if which:
            parts[which[0]].append(name)
        elif params:
            frozen.append(name)
    for i, names in enumerate(parts):
        held = [p for g in optimizers[i].param_groups for p in g["params"]]
        if not names or any(id(p) not in placed for p in held):
            raise ValueError(
                f"optimizer {i} holds parameters that are not in {model}'s submodules: build "
                "each optimizer over the model's own parameters "
                "(torch.optim.Adam(self.generator.parameters()))"
            )
    return parts, frozen


def param_groups(optimizer: object) -> list[dict[str, Any]]:
    """A torch optimizer's param groups, or a stand-in's (Accelerate's ``DummyOptim``: an
    object with ``params``, parameters or groups) as groups. A group is torch's plain dict."""
    if isinstance(optimizer, Optimizer):
        return optimizer.param_groups
    params = list(getattr(optimizer, "params", []))
    return params if params and isinstance(params[0], dict) else [{"params": params}]


def pair_optimizers(
    models: list[nn.Module],
    optimizers: Sequence[object],
    front: str = "ZeroAccelerator",
    call: str = "prepare()",
) -> list[int | None]:
    """For each of several models, the index of the optimizer holding its parameters (``None``:
    none does); each optimizer must hold one model's, and a model has at most one optimizer.
    ``front`` and ``call`` name the loop object and the call the models came through."""
    owner = {id(p): m for m, model in enumerate(models) for p in model.parameters()}
    pairs: list[int | None] = [None] * len(models)
    for o, opt in enumerate(optimizers):
        held = [owner.get(id(p)) for g in param_groups(opt) for p in g["params"]]
        found = {m for m in held if m is not None}
        if len(found) != 1 or None in held:
            raise ValueError(
                f"each optimizer passed to {call} must hold the parameters of one model passed "
                f"in the same call (optimizer {type(opt).__name__} holds parameters of "
                f"{len(found)} of them{' and of none' if None in held else ''})"
            )
        m = found.pop()
        if pairs[m] is not None:
            raise ValueError(
                f"two optimizers over one model ({type(models[m]).__name__}): under {front} "
                "each model has one optimizer (param groups may carry different "
                "hyper-parameters); pass each part as its own model"
            )
        pairs[m] = o
    return pairs


def engines_reached(loss: Tensor, engines: list[ZeroEngine]) -> list[ZeroEngine]:
    """The engines whose trainable parameters a backward of ``loss`` reaches (under fp16 each
    engine scales the loss by its own loss scale, so a backward must reach one of them)."""
    of = {id(p): e for e in engines for p in e.module.parameters() if p.requires_grad}
    reached: list[ZeroEngine] = []
    seen: set[int] = set()
    todo = [loss.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        engine = of.get(id(getattr(fn, "variable", None)))
        if engine is not None and engine not in reached:
            reached.append(engine)
        todo += [nxt for nxt, _ in fn.next_functions]
    return reached


def holds_gradients(engine: ZeroEngine) -> bool:
    """Whether a backward left gradients in ``engine`` (its own, or another engine's that
    reached its parameters)."""
    return any(g.holds_grads() for g in engine.plan.groups)


def backward_of_models(
    loss: Tensor, engines: list[ZeroEngine], boundary: bool, retain_graph: bool = False
) -> list[bool]:
    """One backward of a loop training several models, an engine each (Accelerate's
    ``prepare(gen, opt_g, disc, opt_d)``): every engine's boundary set to ``boundary``, the
    backward run by one engine (under fp16 the one whose parameters the loss reaches, as each
    engine scales the loss by its own loss scale; any under fp32/bf16, which divide the loss
    alike: the first); returns which engines ran it or hold gradients from it (another
    engine's backward flowing into their parameters), for the loop to leave their step pending."""
    for engine in engines:
        engine.set_gradient_accumulation_boundary(boundary)  # stages 0/1 reduce only then
    lead = engines[0]
    if len(engines) > 1 and lead.config.fp16.enabled is True:
        reached = engines_reached(loss, engines)
        if len(reached) != 1:
            raise ValueError(
                f"under fp16 this backward reaches {len(reached)} of the prepared models' "
                "parameters: each engine scales the loss by its own loss scale, so each "
                "backward must reach one trained model (detach() what another model produced, "
                "or requires_grad_(False) on the other model around its forward), or train in "
                "bf16"
            )
        lead = reached[0]
    lead.backward(loss, retain_graph=retain_graph)
    return [e is lead or holds_gradients(e) for e in engines]


class PendingSteps:
    """The trained engines of a loop that decides each backward's accumulation boundary itself
    (Accelerate's ``sync_gradients``, a plain loop's own counter), one per model. A boundary
    backward leaves the step pending on the engines it reached, so that a clip between it and
    the optimizer's step keeps its meaning (the shards have a norm once reduced)::

        steps = PendingSteps([engine_g, engine_d])
        steps.backward(loss, boundary=i % 4 == 3, accumulation_steps=4)
        if i % 4 == 3:
            steps.clip(engine_d.module.parameters(), 1.0, 2, "clip after backward")
            steps.step(engine_d, boundary=True)
    """

    def __init__(self, engines: Iterable[ZeroEngine] = ()) -> None:
        self.pending = dict.fromkeys(engines, False)  # engine -> its step is pending

    def add(self, engine: ZeroEngine) -> None:
        self.pending[engine] = False

    @property
    def engines(self) -> list[ZeroEngine]:
        return list(self.pending)

    def backward(
        self, loss: Tensor, boundary: bool, accumulation_steps: int, retain_graph: bool = False
    ) -> None:
        """:func:`backward_of_models`, the loss divided by ``accumulation_steps`` (the loop's,
        which may change between backward calls); off a boundary each engine reached counts
        the micro-step, at one its step waits for :meth:`step`."""
        engines = self.engines
        for engine in engines:
            engine.gradient_accumulation_steps = accumulation_steps
        reached_by = backward_of_models(loss, engines, boundary, retain_graph)
        for engine, reached in zip(engines, reached_by, strict=True):
            if boundary and reached:
                self.pending[engine] = True
            elif not boundary and reached and not self.pending[engine]:
                engine.step()  # not a boundary: only counts the micro-step

    def step(self, engine: ZeroEngine, boundary: bool) -> bool | None:
        """At a boundary, ``engine``'s pending step; whether it was skipped (an fp16 overflow,
        a non-finite norm), None when no step was pending."""
        if not (boundary and self.pending[engine]):
            return None
        engine.set_gradient_accumulation_boundary(True)
        before = engine.skipped_steps
        try:
            engine.step()
        finally:
            self.pending[engine] = False
        return engine.skipped_steps != before

    def clip(
        self, parameters: Iterable[Tensor], max_norm: float, norm_type: float, unpending: str
    ) -> float:
        """Clip the engine holding ``parameters`` (:func:`~ds_strategy.core.loop.
        clipped_engine`) before its pending step; the norm before clipping. With no step
        pending its gradients are not reduced yet: a ``RuntimeError`` saying ``unpending``."""
        engines = self.engines
        engine = engines[clipped_engine(engines, parameters, max_norm, norm_type)]
        if not self.pending[engine]:
            raise RuntimeError(unpending)
        return engine.clip_grad_norm_(float(max_norm))

    def forget(self) -> None:
        """No step pending (a checkpoint was loaded)."""
        self.pending = dict.fromkeys(self.pending, False)


def _zeroing(engine: ZeroEngine) -> None:
    """``engine.optimizer.zero_grad()`` (what Lightning's optimizer calls) zeroes the engine's
    gradients too."""
    base = type(engine.optimizer)

    def zero_grad(self: Optimizer, set_to_none: bool = True) -> None:
        engine.zero_grad()

    engine.optimizer.__class__ = type(
        base.__name__,
        (base,),
        {"zero_grad": zero_grad, "__module__": base.__module__, "__qualname__": base.__qualname__},
    )


def _casting(module: nn.Module, engine: ZeroEngine) -> list[RemovableHandle]:
    """Mixed precision: ``module`` casts its inputs to the compute dtype and its outputs to
    fp32, as the engine's own forward does."""
    if not engine.precision.mixed:
        return []

    # the module's arguments and output pass through whole: only their tensors are cast
    def cast_in(
        _: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> tuple[tuple[object, ...], dict[str, object]]:
        return engine.precision.cast_inputs((args, kwargs))

    def cast_out(_: nn.Module, args: tuple[object, ...], output: object) -> object:
        return engine.precision.cast_outputs(output)

    return [
        module.register_forward_pre_hook(cast_in, with_kwargs=True),
        module.register_forward_hook(cast_out),
    ]


class SeveralEngines:
    """The engines of one model with several optimizers, in optimizer order (then the frozen
    part's): backward, each trained engine's clip request waiting for its step (``clips``),
    toggling, checkpoints and weights."""

    def __init__(
        self,
        module: nn.Module,
        optimizers: list[Optimizer],
        build: Callable[[nn.Module, Optimizer | None], ZeroEngine],
    ) -> None:
        """``build(part, optimizer)``: the engine of a part (``optimizer`` None: the frozen
        part's, for evaluation), built as the front end builds one."""
        parts, frozen = split_by_optimizer(module, optimizers)
        self.module = module
        self.engines: dict[str, ZeroEngine] = {}
        self.clips: dict[ZeroEngine, PendingClip] = {}
        self._handles: list[RemovableHandle] = []
        self._toggled: ZeroEngine | None = None
        self._trainable: dict[ZeroEngine, list[nn.Parameter]] = {}
        try:
            for i, (names, opt) in enumerate(zip(parts, optimizers, strict=True)):
                engine = self.engines[f"optimizer_{i}"] = build(_Part(module, names), opt)
                engine.keep_foreign_grads = True
                _zeroing(engine)
                self.clips[engine] = PendingClip()
            if frozen:
                part = _Part(module, frozen)
                self.engines[FROZEN] = build(part, None)  # for evaluation
            for engine in self.engines.values():
                for child in engine.module.children():
                    self._handles += _casting(child, engine)
        except BaseException:
            self.destroy()
            raise
        # the parameters toggle_optimizer turns off (after building: materialised ones)
        self._trainable = {
            e: [p for p in e.module.parameters() if p.requires_grad] for e in self.clips
        }

    @property
    def trained(self) -> list[ZeroEngine]:
        """The engines with an optimizer, in optimizer order."""
        return list(self.clips)

    def engine_of(self, optimizer: object) -> ZeroEngine:
        """The engine of ``optimizer``, or of the optimizer a wrapper holds, found by identity.

        Args:
            optimizer: an optimizer the engines built, or a framework's wrapper of one.
        """
        optimizer = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer
        for engine in self.clips:
            if engine.optimizer is optimizer:
                return engine
        raise ValueError(
            "this optimizer is not one the ZeRO strategy set up: use the optimizers it returned "
            "(self.optimizers() in a LightningModule)"
        )

    # -- toggle_optimizer -------------------------------------------------------------------

    def toggle(self, optimizer: object) -> None:
        """Only ``optimizer``'s model gets gradients until :meth:`untoggle`.

        Args:
            optimizer: as :meth:`engine_of` takes it.
        """
        self._toggled = self.engine_of(optimizer)
        for engine, params in self._trainable.items():
            for p in params:
                p.requires_grad_(engine is self._toggled)

    def untoggle(self) -> None:
        self._toggled = None
        for params in self._trainable.values():
            for p in params:
                p.requires_grad_(True)

    # -- the loop ---------------------------------------------------------------------------

    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        # args and kwargs: a framework's backward arguments, for ZeroEngine.backward
        active = [self._toggled] if self._toggled is not None else self.trained
        if len(active) > 1 and any(e.config.fp16.enabled is True for e in active):
            raise ValueError(
                "fp16 with several optimizers: each engine scales the loss by its own loss "
                "scale, so each backward must reach one optimizer's parameters; wrap each "
                "optimizer's forward, backward and step in self.toggle_optimizer(opt) ... "
                "self.untoggle_optimizer(opt), or train in bf16"
            )
        active[0].backward(loss, *args, **kwargs)  # the others keep what reaches them

    # -- checkpoints and weights ------------------------------------------------------------

    def save(self, path: Path, client_state: object, include_optimizer: bool) -> None:
        save_all(self.engines, path, client_state, include_optimizer)

    def load(self, path: Path, load_optimizer: bool, trust_checkpoint: bool) -> Any:
        # the caller's own client_state, as it saved it
        return load_all(self.engines, path, load_optimizer, trust_checkpoint)

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, Tensor]:
        """Every engine's consolidated weights, keyed and ordered like the module's
        ``state_dict()`` (the buffers of submodules without parameters included). Collective;
        ``rank0_only``: the other ranks get ``{}``."""
        state: dict[str, Tensor] = {}
        for engine in self.engines.values():
            state.update(engine.full_state_dict(rank0_only=rank0_only))
        if rank0_only and next(iter(self.engines.values())).rank != 0:
            return {}
        own = self.module.state_dict()
        return {k: state[k] if k in state else v.detach().clone() for k, v in own.items()}

    def save_weights(self, path: str | Path) -> Path:
        """Collective: rank 0 writes :meth:`full_state_dict` to one file."""
        state = self.full_state_dict(rank0_only=True)
        first = next(iter(self.engines.values()))
        if first.rank == 0:
            write_weights(state, Path(path))
        first.comm.barrier()
        return Path(path)

    def destroy(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.untoggle()
        for engine in self.engines.values():
            engine.destroy()
        self.engines.clear()
        self.clips.clear()
