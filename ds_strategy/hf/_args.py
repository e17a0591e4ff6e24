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
precision the arguments do not ask for is one more disagreement. This module only reads the
arguments; the policy is every front end's, in ``ds_strategy.config.loop``.
"""

from __future__ import annotations

from typing import Any

from ..config import ZeroConfig
from ..config.loop import Said, fill_from_arguments, model_hidden_size

__all__ = ["fill_from_training_args"]


def fill_from_training_args(
    cfg: ZeroConfig, args: Any, *, world_size: int, model: Any, num_training_steps: int
) -> ZeroConfig:
    """``cfg`` resolved for a Trainer run of ``num_training_steps`` optimizer steps (see the
    note; the policy is ``config.loop``'s). Raises ``ValueError`` listing every config value
    that disagrees with ``args``."""
    micro, steps, lr = (
        args.per_device_train_batch_size,
        args.gradient_accumulation_steps,
        args.learning_rate,
    )
    warmup = max(1, int(args.get_warmup_steps(num_training_steps)))
    said = {
        "train_micro_batch_size_per_gpu": Said(micro, "per_device_train_batch_size"),
        "gradient_accumulation_steps": Said(steps, "gradient_accumulation_steps"),
        "train_batch_size": Said(world_size * micro * steps, "train_batch_size (calculated)"),
        "gradient_clipping": Said(float(args.max_grad_norm), "max_grad_norm"),
        "optimizer.params.lr": Said(lr, "learning_rate"),
        "optimizer.params.betas": Said([args.adam_beta1, args.adam_beta2], "adam_beta1+adam_beta2"),
        "optimizer.params.eps": Said(args.adam_epsilon, "adam_epsilon"),
        "optimizer.params.weight_decay": Said(args.weight_decay, "weight_decay"),
        "scheduler.params.warmup_min_lr": Said(0, "", checked=False),
        "scheduler.params.warmup_max_lr": Said(lr, "learning_rate"),
        "scheduler.params.total_num_steps": Said(
            num_training_steps, "num_training_steps (calculated)"
        ),
        "scheduler.params.warmup_num_steps": Said(warmup, "warmup_steps"),
    }
    return fill_from_arguments(
        cfg,
        said,
        world_size=world_size,
        hidden_size=lambda: model_hidden_size(model),
        halves={half: bool(getattr(args, half)) for half in ("fp16", "bf16")},
    )
