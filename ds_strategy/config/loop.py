"""A training loop's settings merged into a ZeRO config: the one policy every front end calls.

Front ends read their framework's settings (Lightning's and Fabric's flags, the Accelerator
and its ``DummyOptim``, ``transformers.TrainingArguments``) into plain values; what those
values do to the config (which side wins, what is refused, what ``"auto"`` becomes) is decided
here, once.

[Note: which side wins]
==================  ========================  ======================  =========================
setting             Lightning / Fabric flags  Accelerate              Hugging Face Trainer
==================  ========================  ======================  =========================
``"auto"``          the flag's value          the loop's value, else  the argument's value
                                              the key's default
left out            the flag's value          the loop's value (batch the argument's value
                                              sizes, accumulation)    (batch sizes, accumulation)
written             must agree with the       wins; the front end     must equal the argument's;
                    flag (first disagreement  tells its loop          every disagreement listed
                    raised, naming the flag)                          in one error
gradient_clipping   0 is "not set": the flag  "auto": the loop's      0 or left out: the
                    fills it; both set: must  clip, else none         Trainer's own clipping
                    agree; by norm only
precision           the flag enables its      ``mixed_precision`` as  ``mixed_precision`` as
                    format; the *other* half  the flags               the flags, and a half
                    format enabled in the                             precision the arguments
                    config is refused                                 do not ask for is refused
==================  ========================  ======================  =========================

What ``"auto"`` takes from the loop is one table (:func:`loop_fills`): the clipping norm, the
optimizer's and scheduler's settings, and the bucket sizes Accelerate's and transformers'
DeepSpeed integrations derive from the model's hidden size.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ._env import ENV_PREFIX, apply_overrides, config_from_env
from ._load import load_config
from ._schema import AUTO, ConfigError, ZeroConfig

__all__ = [
    "PRECISION_KEYS",
    "LoopFacts",
    "Said",
    "apply_compile",
    "apply_loop_flags",
    "apply_mixed_precision",
    "apply_precision",
    "blaming_precision_flag",
    "base_config",
    "check_precision",
    "code_or_env_config",
    "clipping",
    "fill_auto",
    "fill_for_estimate",
    "fill_from_arguments",
    "loop_fills",
    "model_hidden_size",
]

ConfigSource = ZeroConfig | dict[str, Any] | str | os.PathLike | None


def _given(value: Any) -> bool:
    """A value the config fixes: neither left out (None) nor ``"auto"``."""
    return value is not None and value != AUTO


# ----------------------------------------------------------------------------- what "auto" takes


@dataclass(frozen=True)
class LoopFacts:
    """What a training loop knows that fills ``"auto"`` values; ``None`` where it does not."""

    world_size: int
    gradient_accumulation_steps: int | None = None
    micro_batch_size: int | None = None
    gradient_clipping: float | None = None
    hidden_size: int | None = None
    optimizer_lr: float | None = None
    optimizer_weight_decay: float | None = None
    optimizer_betas: list[float] | None = None
    optimizer_eps: float | None = None
    # for a config scheduler's "auto" params, as Accelerate's DeepSpeed integration fills them:
    # warmup to the optimizer's lr, steps from the DummyScheduler
    base_lr: float | None = None
    warmup_num_steps: int | None = None
    total_num_steps: int | None = None


# the sizes Accelerate's and transformers' DeepSpeed integrations derive from the model's
# hidden size (transformers derives the stage-3 ones at stage 3 only)
_HIDDEN_SIZE_FILLS: dict[str, tuple[Callable[[int], int], bool]] = {
    "zero_optimization.reduce_bucket_size": (lambda h: h * h, False),
    "zero_optimization.stage3_prefetch_bucket_size": (lambda h: int(0.9 * h * h), True),
    "zero_optimization.stage3_param_persistence_threshold": (lambda h: 10 * h, True),
}


def hidden_size_keys(stage: int | None = None) -> list[str]:
    """The keys derived from the hidden size; with ``stage``, those that matter at it."""
    return [k for k, (_, stage3) in _HIDDEN_SIZE_FILLS.items() if stage in (None, 3) or not stage3]


def model_hidden_size(model: Any) -> int | None:
    """The hidden size in ``model.config`` (a Hugging Face model's): its ``hidden_size``, the
    largest of its ``hidden_sizes``, or its text config's, as transformers reads it for
    DeepSpeed's bucket sizes; None for a model without one."""
    config = getattr(model, "config", None)
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is None:
            continue
        if getattr(cfg, "hidden_size", None) is not None:
            return int(cfg.hidden_size)
        if getattr(cfg, "hidden_sizes", None):
            return int(max(cfg.hidden_sizes))
    return None


def loop_fills(facts: LoopFacts, *, stage: int | None = None) -> dict[str, Any]:
    """Dotted config key -> the loop's value for it, for every key the loop knows (the table
    of what ``"auto"`` takes); ``stage``: derive only the sizes that matter at that stage.

    >>> loop_fills(LoopFacts(world_size=1, hidden_size=4, optimizer_lr=0.1))["optimizer.params.lr"]
    0.1
    """
    fills: dict[str, Any] = {
        # "auto" clipping: none unless the loop clips, as with Accelerate
        "gradient_clipping": facts.gradient_clipping if facts.gradient_clipping is not None else 0.0
    }
    if facts.hidden_size is not None:
        for key in hidden_size_keys(stage):
            fills[key] = _HIDDEN_SIZE_FILLS[key][0](facts.hidden_size)
    for name in ("lr", "weight_decay", "betas", "eps"):
        value = getattr(facts, f"optimizer_{name}")
        if value is not None:
            fills[f"optimizer.params.{name}"] = value
    lr = facts.optimizer_lr if facts.optimizer_lr is not None else facts.base_lr
    for key, value in (
        ("warmup_min_lr", 0.0),
        ("warmup_max_lr", lr),
        ("warmup_num_steps", facts.warmup_num_steps),
        ("total_num_steps", facts.total_num_steps),
    ):
        if value is not None:
            fills[f"scheduler.params.{key}"] = value
    return fills


# ----------------------------------------------------------------------------- Accelerate


def fill_auto(cfg: ZeroConfig, facts: LoopFacts) -> ZeroConfig:
    """Fill every ``"auto"`` from ``facts`` (else the key's default) and settle the batch sizes;
    values written in the config win (Accelerate's policy in the note above).

    >>> cfg = load_config({"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
    ...                    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"})
    >>> r = fill_auto(cfg, LoopFacts(world_size=2, gradient_accumulation_steps=4,
    ...                              micro_batch_size=8))
    >>> (r.train_batch_size, r.gradient_accumulation_steps, r.gradient_clipping)
    (64, 4, 0.0)
    """
    return _fill_batch_sizes(cfg, facts).resolve(facts.world_size, loop_fills(facts))


def _fill_batch_sizes(cfg: ZeroConfig, facts: LoopFacts) -> ZeroConfig:
    """The Accelerator's accumulation steps and the loader's batch size, for each of the two
    the config leaves open ("auto" or absent) and does not fix through the other two sizes
    (``train_batch_size = micro * accumulation * world``)."""
    tb, gas, mb = (
        cfg.train_batch_size,
        cfg.gradient_accumulation_steps,
        cfg.train_micro_batch_size_per_gpu,
    )
    changes: dict[str, Any] = {}
    open_gas = facts.gradient_accumulation_steps is not None and not _given(gas)
    if open_gas and not (_given(tb) and _given(mb)):
        gas = changes["gradient_accumulation_steps"] = facts.gradient_accumulation_steps
    open_mb = facts.micro_batch_size is not None and not _given(mb)
    if open_mb and not (_given(tb) and _given(gas)):
        changes["train_micro_batch_size_per_gpu"] = facts.micro_batch_size
    return cfg.replace(**changes) if changes else cfg


# ----------------------------------------------------------------------------- the HF Trainer


@dataclass(frozen=True)
class Said:
    """A value a loop's arguments give for a config key, and the argument that gave it (for
    the message when the config disagrees); ``checked=False``: filled, never compared."""

    value: Any
    argument: str
    checked: bool = True


_BATCH_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")


def fill_from_arguments(
    cfg: ZeroConfig,
    said: Mapping[str, Said],
    *,
    world_size: int,
    hidden_size: Callable[[], int | None],
    halves: Mapping[str, bool],
    source: str = "TrainingArguments",
) -> ZeroConfig:
    """``cfg`` resolved with the arguments' values, as transformers fills a DeepSpeed config
    (the Trainer's policy in the note above): ``"auto"`` takes the argument, a left-out batch
    size too, a written value must equal it; ``hidden_size`` (asked only when a size derived
    from it is ``"auto"``) and ``halves`` (whether the arguments ask for fp16 / bf16). Raises
    ``ValueError`` listing every disagreement."""
    tree = cfg.to_dict()
    fills: dict[str, Any] = {}
    absent: dict[str, Any] = {}
    mismatches: list[str] = []
    for key, arg in said.items():
        current = _lookup(tree, key)
        if isinstance(current, tuple):  # a pair (betas) compares as the list it is given as
            current = list(current)
        if key in _BATCH_KEYS and current is None:
            absent[key] = arg.value
        elif key == "gradient_clipping" and current in (0, 0.0):
            continue  # not set: the loop clips by itself
        elif current == AUTO:
            fills[key] = arg.value
        elif arg.checked and current not in (_MISSING, None) and current != arg.value:
            mismatches.append(f"- {key}={current!r} vs {source} {arg.argument}={arg.value!r}")
    fills.update(_hidden_size_fills(tree, cfg.layout.stage, hidden_size))
    for half, asked in halves.items():
        if getattr(cfg, half).enabled is True and not asked:
            mismatches.append(f"- {half}.enabled=True vs {source} {half}=False")
    if mismatches:
        listed = "\n".join(mismatches)
        raise ValueError(
            f"the ZeRO config disagrees with the {source}:\n{listed}\nset these config "
            f"values to 'auto' (they then follow the {source}) or make them agree"
        )
    if absent:
        cfg = cfg.replace(**absent)
    return cfg.resolve(world_size, fills)


def _hidden_size_fills(
    tree: dict[str, Any],
    stage: int,
    hidden_size: Callable[[], int | None],
    unknown: str = "the model's config has neither hidden_size nor hidden_sizes to derive "
    "them from; write numbers for these keys",
) -> dict[str, Any]:
    wanted = [k for k in hidden_size_keys(stage) if _lookup(tree, k) == AUTO]
    if not wanted:
        return {}
    hidden = hidden_size()
    if hidden is None:
        raise ValueError(f"{', '.join(wanted)} are 'auto' but {unknown}")
    return {k: _HIDDEN_SIZE_FILLS[k][0](hidden) for k in wanted}


def fill_for_estimate(
    cfg: ZeroConfig, world_size: int, hidden_size: int | None, unknown: str
) -> ZeroConfig:
    """``cfg`` with its ``"auto"`` values as a training loop would fill them, for a memory
    estimate made before there is a loop: the bucket sizes the Hugging Face Trainer and
    Accelerate derive from the model's hidden size from ``hidden_size`` (unknown: a
    ``ValueError`` naming them, then ``unknown``, which says how to give it), every other
    ``"auto"`` its default.

    >>> cfg = ZeroConfig.from_any({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}})
    >>> fill_for_estimate(cfg, 8, 1024, "").zero_optimization.reduce_bucket_size
    1048576
    """
    stage = cfg.layout.stage
    fills = _hidden_size_fills(cfg.to_dict(), stage, lambda: hidden_size, unknown)
    return cfg.resolve(world_size, fills)


_MISSING = object()


def _lookup(tree: dict[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


# ----------------------------------------------------------------------------- Lightning, Fabric

PRECISION_KEYS: dict[str, dict[str, Any]] = {
    # "-true": no fp32 master weights, but fp16's loss scaling needs them: 16-true is 16-mixed
    "32-true": {},
    "32": {},
    "bf16-mixed": {"bf16.enabled": True},
    "bf16": {"bf16.enabled": True},
    "bf16-true": {"bf16.enabled": True, "bf16.master_weights": False},
    "16-mixed": {"fp16.enabled": True},
    "16": {"fp16.enabled": True},
    "16-true": {"fp16.enabled": True},
}


def base_config(
    source: ConfigSource, stage: int | None, offload_optimizer: bool, offload_parameters: bool
) -> ZeroConfig:
    """The user's config with the strategy's explicit (more specific) arguments applied;
    ``stage=None`` keeps the config's stage, or DeepSpeed's default 2 when there is no config.

    >>> base_config(None, None, False, False).zero_optimization.stage
    2
    >>> cfg = base_config({"zero_optimization": {"stage": 1}}, 3, True, True)
    >>> cfg.zero_optimization.stage, cfg.zero_optimization.offload_param.device
    (3, 'cpu')
    """
    cfg = load_config(source)
    changes: dict[str, Any] = {}
    if stage is not None or source is None:
        changes["zero_optimization.stage"] = 2 if stage is None else stage
    if offload_optimizer:
        changes["zero_optimization.offload_optimizer.device"] = "cpu"
    if offload_parameters:
        changes["zero_optimization.offload_param.device"] = "cpu"
    return cfg.replace(**changes) if changes else cfg


def code_or_env_config(
    source: Any, environ: Mapping[str, str], overrides: Mapping[str, Any], said: str
) -> ZeroConfig:
    """The config a loop object (``said``: ``ZeroPlugin``) was given in code, or, when
    ``source`` is ``None``, the environment's (``DS_STRATEGY_CONFIG``, then each other
    ``DS_STRATEGY_*`` variable); then ``overrides``, dotted keys. A config in code ignores the
    environment, with a warning naming the variables ignored.

    >>> code_or_env_config(None, {"DS_STRATEGY_ZERO_STAGE": "3"}, {}, "X").zero_optimization.stage
    3
    """
    if source is None:
        cfg = config_from_env(environ)
    else:
        ignored = sorted(n for n in environ if n.startswith(ENV_PREFIX))
        if ignored:
            warnings.warn(
                f"{', '.join(ignored)} ignored: {said}(config=...) was given in code; "
                "pass config=None to read the config from the environment",
                UserWarning,
                stacklevel=3,
            )
        cfg = load_config(source)
    return apply_overrides(cfg, dict(overrides), False, f"{said}.overrides")


def check_precision(precision: str, front: str) -> str:
    """``precision`` if the engine has a mapping for it, else an error naming the valid flags.

    >>> check_precision("bf16-mixed", "Trainer")
    'bf16-mixed'
    """
    if precision not in PRECISION_KEYS:
        supported = ", ".join(repr(p) for p in PRECISION_KEYS if "-" in p)
        raise ValueError(
            f"{front}(precision={precision!r}) is not supported by the ZeRO strategy, which owns "
            f"precision through its config; use one of {supported}"
        )
    return precision


def apply_precision(cfg: ZeroConfig, precision: str, said: str) -> ZeroConfig:
    """``cfg`` with the sections ``precision`` enables (``"auto"`` ones follow it); a flag enabling
    the *other* half-precision format is an error naming the flag (``said``)."""
    changes = dict(PRECISION_KEYS[precision])
    key = next(iter(changes)).split(".")[0] if changes else None
    for section in ("fp16", "bf16"):
        enabled = getattr(cfg, section).enabled
        if key is not None and section != key and enabled is True:
            raise ConfigError(
                f"{section}.enabled is true in the ZeRO config but {said} enables {key}; make "
                f"them agree: set {section}.enabled to false or choose a matching precision",
                key=f"{section}.enabled",
            )
        if enabled == AUTO:
            changes.setdefault(f"{section}.enabled", section == key)
    return cfg.replace(**changes) if changes else cfg


_MIXED_PRECISION = {"no": "32-true", "fp16": "16-mixed", "bf16": "bf16-mixed"}


def apply_mixed_precision(cfg: ZeroConfig, mixed_precision: str) -> ZeroConfig:
    """Accelerate's ``mixed_precision`` ("no"/"fp16"/"bf16") applied as :func:`apply_precision`.

    >>> apply_mixed_precision(load_config({"bf16": {"enabled": "auto"}}), "bf16").bf16.enabled
    True
    """
    mp = str(mixed_precision)
    if mp not in _MIXED_PRECISION:
        raise ValueError(
            f"mixed_precision={mp!r} is not supported by ds_strategy; use one of "
            f"{', '.join(repr(p) for p in _MIXED_PRECISION)}"
        )
    return apply_precision(cfg, _MIXED_PRECISION[mp], f"Accelerate's mixed_precision {mp!r}")


def apply_compile(
    cfg: ZeroConfig,
    backend: str,
    options: Mapping[str, Any],
    said: str = "Accelerate's dynamo_backend",
) -> ZeroConfig:
    """A loop's ``torch.compile`` request (``backend``, ``"no"`` for none; ``options``, its
    other keywords, ``None`` for unset) as the config's ``compile`` section, so the engine
    compiles block by block; the config's ``compile.kwargs`` win, another backend is refused.

    >>> cfg = apply_compile(ZeroConfig(), "INDUCTOR", {"mode": "default", "dynamic": None})
    >>> cfg.compile.enabled, cfg.compile.backend, cfg.compile.kwargs
    (True, 'inductor', {'mode': 'default'})
    """
    backend = backend.lower()
    if backend == "no":
        return cfg
    if cfg.compile.enabled and cfg.compile.backend != backend:
        raise ValueError(
            f"compile.backend={cfg.compile.backend!r} in the ZeRO config vs {said} "
            f"{backend!r}: keep one of them"
        )
    kwargs = {k: v for k, v in options.items() if k != "backend" and v is not None}
    return cfg.replace(
        **{
            "compile.enabled": True,
            "compile.backend": backend,
            "compile.kwargs": {**kwargs, **cfg.compile.kwargs},
        }
    )


def _check_accumulation(cfg: ZeroConfig, accumulate: int, world_size: int, front: str) -> None:
    """The loop's accumulation must match the config's (given or implied by its batch sizes)."""
    given = cfg.gradient_accumulation_steps
    sizes = (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu)
    flag = f"{front}(accumulate_grad_batches={accumulate})"
    if _given(given):
        if given != accumulate:
            raise ValueError(
                f"the ZeRO config sets gradient_accumulation_steps={given} but {flag}: they must "
                f"agree; set {front}(accumulate_grad_batches={given}) or remove "
                "gradient_accumulation_steps from the config"
            )
    elif all(_given(s) for s in sizes):
        implied = cfg.resolve(world_size).gradient_accumulation_steps
        if implied != accumulate:
            raise ValueError(
                f"the ZeRO config's batch sizes imply gradient_accumulation_steps={implied} "
                f"(train_batch_size={sizes[0]} = train_micro_batch_size_per_gpu={sizes[1]} x "
                f"{implied} x world size {world_size}) but {flag}; set "
                f"{front}(accumulate_grad_batches={implied}) or change the config's batch sizes"
            )


def clipping(
    cfg: ZeroConfig, clip_val: float | None, algorithm: str | None, front: str = "Trainer"
) -> float:
    """The loop's clipping norm, checked against the config's ``gradient_clipping``."""
    algorithm = getattr(algorithm, "value", algorithm)  # Lightning passes a str enum
    if algorithm is not None and str(algorithm).lower() == "value":
        raise ValueError(
            f"{front}(gradient_clip_algorithm='value') is not supported: ZeRO clips gradients by "
            f"their global norm (config key gradient_clipping); use "
            f"{front}(gradient_clip_algorithm='norm') or leave gradient_clip_algorithm unset"
        )
    wanted = float(clip_val or 0.0)
    given = cfg.gradient_clipping
    if given == AUTO:
        return wanted
    if wanted > 0 and given > 0 and given != wanted:
        raise ValueError(
            f"the ZeRO config sets gradient_clipping={given} but {front}(gradient_clip_val="
            f"{clip_val}): they must agree; set {front}(gradient_clip_val={given}) or remove "
            "gradient_clipping from the config"
        )
    # 0 in the config is also DeepSpeed's default: it means "not set", so the flag fills it
    return wanted if wanted > 0 else given


def apply_loop_flags(
    cfg: ZeroConfig,
    *,
    world_size: int,
    precision: str = "32-true",
    accumulate: int | None = 1,
    clip_val: float | None = None,
    clip_algorithm: str | None = None,
    front: str = "Trainer",
) -> ZeroConfig:
    """``cfg`` with the loop's flags written in, once checked against it (``front`` names the
    loop object in errors); ``accumulate=None`` (evaluation only) leaves accumulation and clipping.

    >>> cfg = apply_loop_flags(ZeroConfig(), world_size=2, accumulate=2, clip_val=1.0)
    >>> cfg.gradient_accumulation_steps, cfg.gradient_clipping
    (2, 1.0)
    """
    if accumulate is not None:
        _check_accumulation(cfg, accumulate, world_size, front)
        clip = clipping(cfg, clip_val, clip_algorithm, front)
        cfg = cfg.replace(gradient_accumulation_steps=accumulate, gradient_clipping=clip)
    return apply_precision(
        cfg, check_precision(precision, front), f"{front}(precision={precision!r})"
    )


@contextmanager
def blaming_precision_flag(cfg: ZeroConfig, front: str, precision: str) -> Iterator[None]:
    """Around building an engine from ``cfg``: a ``ValueError`` about the ``fp16``/``bf16``
    section that ``front(precision=...)`` enabled names that flag, the loop's side of it."""
    try:
        yield
    except ValueError as err:
        for key in ("fp16", "bf16"):
            if getattr(cfg, key).enabled is True:
                raise ValueError(
                    f"{front}(precision={precision!r}) sets {key}.enabled=true in the ZeRO "
                    f"config, which the engine rejected: {err}"
                ) from err
        raise
