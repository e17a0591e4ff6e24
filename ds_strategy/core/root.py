"""The root an engine wraps when a loop runs its step through the model's forward.

[Note: the root wrapper]
Under ZeRO-3 the root unit is gathered for the whole forward. A loop that runs a step as a
method redirected through the forward (Lightning's ``training_step``) wants the model's own
parameters gathered for the whole step, so the engine wraps a :class:`SharedRoot` whose
forward calls the model. It shares the model's parameter, buffer and submodule tables instead
of holding the model as a child, so every name the engine reports is a key of the model's
``state_dict()``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["SharedRoot"]


class SharedRoot(nn.Module):
    """``module``'s tables under no prefix, with a forward that calls ``module``.

    >>> net = nn.Sequential(nn.Linear(2, 2))
    >>> list(SharedRoot(net).state_dict()) == list(net.state_dict())
    True
    """

    module: nn.Module

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "module", module)  # not a child: its tables are ours
        self._parameters = module._parameters
        self._buffers = module._buffers
        self._non_persistent_buffers_set = module._non_persistent_buffers_set
        self._modules = module._modules

    def forward(self, *args: object, **kwargs: object) -> Any:  # the model's own output
        return self.module(*args, **kwargs)

    def train(self, mode: bool = True) -> SharedRoot:
        self.module.train(mode)  # not a child, so nn.Module.train would miss its own flag
        self.training = mode
        return self
