"""Where and how the work runs: device choice, bf16 autocast, seeding."""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch


def set_seed(seed: int) -> torch.Generator:
    """Seed python, numpy and torch; return a torch random generator with the same seed."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when it is there, CPU otherwise."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("run config key 'device': 'cuda' asked for, but CUDA is not available")
    return torch.device(name)


def uses_bf16(device: torch.device, precision: str = "auto") -> bool:
    """Whether forwards run under bf16 autocast: ``auto`` means on CUDA only."""
    return precision == "bf16" or (precision == "auto" and device.type == "cuda")


def autocast(device: torch.device, precision: str = "auto") -> contextlib.AbstractContextManager:
    """bf16 autocast for model forwards when :func:`uses_bf16` says so.

    Only forwards run under it: the losses, the optimiser and the weights stay
    in float32.
    """
    if uses_bf16(device, precision):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


class NonFiniteLossError(FloatingPointError):
    """A loss became NaN or Inf: the method stops instead of training on it."""


def check_finite(loss: torch.Tensor, where: str) -> None:
    """Raise :class:`NonFiniteLossError` naming ``where`` when ``loss`` is NaN or Inf.

    One device sync per call; the loops that call it already read the loss
    for their progress line.
    """
    value = loss.detach()
    if not bool(torch.isfinite(value).all()):
        raise NonFiniteLossError(f"{where}: the loss is {float(value.float().mean())}; "
                                 "the method stops (check the uploads it distils from)")
