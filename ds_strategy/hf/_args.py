"""A ZeRO config's ``"auto"`` values filled from ``transformers.TrainingArguments``, as
transformers fills a DeepSpeed config for its ``Trainer`` (``HfTrainerDeepSpeedConfig``).

[Note: what is filled, and what must agree]
At the start of ``train()`` (when the number of optimizer steps is known):

==============================================  ============================================
config key                                      from
==============================================  ============================================
train_micro_batch_size_per_gpu                  per_device_train_batch_size
gradient_accumulation_steps                     gradient_accumulation_steps
train_batch_size                                world size x the two above
gradient_clipping                               max_grad_norm
optimizer.params.lr / betas / eps /             learning_rate / [adam_beta1, adam_beta2] /
weight_decay                                    adam_epsilon / weight_decay
scheduler.params.warmup_min_lr / warmup_max_lr  0 / learning_rate
scheduler.params.total_num_steps                the run's optimizer steps
scheduler.params.warmup_num_steps               max(1, args.get_warmup_steps(total))
zero_optimization.reduce_bucket_size            hidden_size ** 2 (the model config's)
stage3_prefetch_bucket_size /                   0.9 * hidden_size ** 2 / 10 * hidden_size
stage3_param_persistence_threshold              (stage 3 only)
==============================================  ============================================

A value written in the config (not ``"auto"``) must equal the argument's, or ``train()`` stops
with every disagreement listed, as transformers does. Two differences, both because the loop
here is the Trainer's own: the batch sizes are filled when the config leaves them out, and a
config without ``gradient_clipping`` (or with 0) leaves clipping to the Trainer's
``max_grad_norm``, exactly as a plain ``Trainer`` clips. ``fp16``/``bf16`` follow the
arguments' precision through Accelerate's ``mixed_precision``; a config enabling a half
precision the arguments do not ask for is one more disagreement.
"""

from __future__ import annotations

from typing import Any

from ..config import AUTO, ZeroConfig

__all__ = ["fill_from_training_args"]

_MISSING = object()


def fill_from_training_args(
    cfg: ZeroConfig, args: Any, *, world_size: int, model: Any, num_training_steps: int
) -> ZeroConfig:
    """``cfg`` resolved for a Trainer run of ``num_training_steps`` optimizer steps (see the
    note). Raises ``ValueError`` listing every config value that disagrees with ``args``."""
    tree = cfg.to_dict()
    fills: dict[str, Any] = {}
    absent: dict[str, Any] = {}  # batch sizes the config leaves out: the Trainer's
    mismatches: list[str] = []

    def match(key: str, value: Any, argument: str, *, must: bool = True) -> None:
        current = _lookup(tree, key)
        if isinstance(current, tuple):  # a pair (betas) compares as the list it is given as
            current = list(current)
        if current == AUTO:
            fills[key] = value
        elif must and current is not _MISSING and current is not None and current != value:
            mismatches.append(f"- {key}={current!r} vs TrainingArguments {argument}={value!r}")

    micro, steps = args.per_device_train_batch_size, args.gradient_accumulation_steps
    for key, value, argument in (
        ("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size"),
        ("gradient_accumulation_steps", steps, "gradient_accumulation_steps"),
        ("train_batch_size", world_size * micro * steps, "train_batch_size (calculated)"),
    ):
        if _lookup(tree, key) is None:
            absent[key] = value
        else:
            match(key, value, argument)
    if _lookup(tree, "gradient_clipping") not in (0, 0.0):
        match("gradient_clipping", float(args.max_grad_norm), "max_grad_norm")
    lr = args.learning_rate
    match("optimizer.params.lr", lr, "learning_rate")
    match("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1+adam_beta2")
    match("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    match("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    match("scheduler.params.warmup_min_lr", 0, "", must=False)
    match("scheduler.params.warmup_max_lr", lr, "learning_rate")
    match("scheduler.params.total_num_steps", num_training_steps, "num_training_steps (calculated)")
    warmup = max(1, int(args.get_warmup_steps(num_training_steps)))
    match("scheduler.params.warmup_num_steps", warmup, "warmup_steps")
    _fill_bucket_sizes(tree, fills, cfg.zero_optimization.stage, model)
    for half in ("fp16", "bf16"):
        if getattr(cfg, half).enabled is True and not getattr(args, half):
            mismatches.append(f"- {half}.enabled=True vs TrainingArguments {half}=False")
    if mismatches:
        listed = "\n".join(mismatches)
        raise ValueError(
            f"the ZeRO config disagrees with the TrainingArguments:\n{listed}\nset these config "
            "values to 'auto' (they then follow the TrainingArguments) or make them agree"
        )
    if absent:
        cfg = cfg.replace(**absent)
    return cfg.resolve(world_size, fills)


def _fill_bucket_sizes(tree: dict, fills: dict[str, Any], stage: int, model: Any) -> None:
    keys = {
        "zero_optimization.reduce_bucket_size": lambda h: h * h,
        "zero_optimization.stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
        "zero_optimization.stage3_param_persistence_threshold": lambda h: 10 * h,
    }
    wanted = [
        k
        for k in keys
        if _lookup(tree, k) == AUTO and (stage == 3 or k.endswith("reduce_bucket_size"))
    ]
    if not wanted:
        return
    hidden = hidden_size(getattr(model, "config", None))
    if hidden is None:
        raise ValueError(
            f"{', '.join(wanted)} are 'auto' but the model's config has neither hidden_size nor "
            "hidden_sizes to derive them from; write numbers for these keys"
        )
    for key in wanted:
        fills[key] = keys[key](hidden)


def hidden_size(config: Any) -> int | None:
    """The model config's ``hidden_size`` (the largest of ``hidden_sizes``), or its text
    config's, as transformers reads it for DeepSpeed's bucket sizes."""
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is None:
            continue
        if getattr(cfg, "hidden_size", None) is not None:
            return int(cfg.hidden_size)
        if getattr(cfg, "hidden_sizes", None):
            return int(max(cfg.hidden_sizes))
    return None


def _lookup(tree: dict, dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node
