"""Where and how the work runs: device choice, bf16 autocast, seeding, timing."""

from __future__ import annotations

import contextlib
import random
import time
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Seconds:
    """Wall-clock and CPU seconds of one piece of work.

    ``cpu`` is this process's CPU time over all its threads: unlike ``wall`` it
    does not grow when other processes share the cores, so it compares methods
    run side by side. On a GPU it counts the host side only.
    """

    wall: float = 0.0
    cpu: float = 0.0

    def __add__(self, other: Seconds) -> Seconds:
        return Seconds(self.wall + other.wall, self.cpu + other.cpu)


class Stopwatch:
    """Started on creation; :meth:`elapsed` is the :class:`Seconds` since then."""

    def __init__(self) -> None:
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def elapsed(self) -> Seconds:
        """Wall-clock and CPU seconds since the stopwatch was made."""
        return Seconds(time.perf_counter() - self._wall, time.process_time() - self._cpu)
