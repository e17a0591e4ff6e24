"""fp16 loss scaling with DeepSpeed's knobs, as a small state machine testable on its own.

[Note: the update rule]
Dynamic scaling starts at ``2 ** initial_scale_power``. An overflow (an inf/nan gradient on
any rank) skips the step; the scale is halved once ``hysteresis`` overflows have been seen
(with ``consecutive_hysteresis`` the allowance refills after every clean step, otherwise
only when the scale grows). A clean step that follows a multiple of ``loss_scale_window``
clean steps since the last overflow (or the start) doubles the scale, as DeepSpeed's
``DynamicLossScaler`` does (0.19: a window of 2 from the start doubles at the third step, then
every second), so a run resumed from a DeepSpeed checkpoint scales as DeepSpeed would have. At ``min_loss_scale`` an overflow is an error: halving is impossible and
skipping forever would silently stop training.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...config import FP16Config

__all__ = ["LossScaler", "LossScaleAtMinimumError"]


class LossScaleAtMinimumError(RuntimeError):
    pass


@dataclass
class LossScaler:
    scale: float = 1.0
    dynamic: bool = False
    window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_scale: float = 1.0
    iteration: int = 0
    last_overflow: int = -1
    hysteresis_left: int = 2

    @staticmethod
    def from_config(cfg: FP16Config) -> LossScaler:
        if cfg.loss_scale and cfg.loss_scale > 0:
            return LossScaler(scale=cfg.loss_scale)
        return LossScaler(
            scale=2.0**cfg.initial_scale_power,
            dynamic=True,
            window=cfg.loss_scale_window,
            hysteresis=cfg.hysteresis,
            consecutive_hysteresis=cfg.consecutive_hysteresis,
            min_scale=cfg.min_loss_scale,
            hysteresis_left=cfg.hysteresis,
        )

    def update(self, overflow: bool) -> None:
        """Record one optimizer step's outcome (``overflow``: it was skipped)."""
        if not self.dynamic:
            self.iteration += 1
            return
        if overflow:
            if self.hysteresis == 1 or self.hysteresis_left == 1:
                if self.scale <= self.min_scale:
                    raise LossScaleAtMinimumError(
                        f"fp16 gradients overflowed with the loss scale already at "
                        f"fp16.min_loss_scale={self.min_scale:g}; training cannot continue. "
                        "Lower the learning rate, enable gradient_clipping, or use bf16"
                    )
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            stable = self.iteration - self.last_overflow - 1  # clean steps before this one
            if stable > 0 and stable % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                self.scale *= 2
        self.iteration += 1

    def state_dict(self) -> dict:
        return dict(self.__dict__)

    def load_state_dict(self, state: dict) -> None:
        self.__dict__.update(state)
