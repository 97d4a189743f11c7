"""Crash-safe server state: synthetic pools, distillation checkpoints, finished methods.

Everything lives under ``<run>/state/<method>/`` (synthetic pools, which methods
that share a pool share, under ``<run>/state/pools/``) and is written atomically
(temporary file, fsync, rename), so a server killed at any moment leaves
either the previous file or the new one. A restarted server
(``resume-from=<run>``) reuses what is there: a finished method is not run
again, a persisted pool is not inverted again, and distillation continues from
its last checkpoint with the same random state, so the result equals an
uninterrupted run's. Pools and models are safetensors; checkpoints hold only
tensors and numbers and are loaded with ``weights_only=True``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from fedmitr_core.runtime import Seconds
from fedmitr_core.synthesis.pool import SyntheticPool

CHECKPOINT_FILE = "distill.pt"


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Write ``path`` through a temporary file, fsync and an atomic rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def save_pool(path: Path, pool: SyntheticPool, rng: torch.Generator,
              seconds: Seconds | None = None) -> None:
    """A pool, the random state right after it was made and the seconds it took."""
    seconds = seconds or Seconds()
    tensors = {k: v.contiguous() for k, v in pool.tensors().items()}
    tensors["rng_state"] = rng.get_state()
    tensors["seconds"] = torch.tensor(seconds.wall, dtype=torch.float64)
    tensors["cpu_seconds"] = torch.tensor(seconds.cpu, dtype=torch.float64)
    atomic_write(path, lambda p: save_file(tensors, str(p)))


def load_pool(path: Path, rng: torch.Generator) -> tuple[SyntheticPool, Seconds]:
    """The pool saved at ``path`` and the seconds it took to make.

    ``rng`` is set to the random state saved with it. A pool saved before CPU
    seconds were kept reads as 0 CPU seconds.
    """
    tensors = load_file(str(path))
    rng.set_state(tensors.pop("rng_state"))
    zero = torch.tensor(0.0)
    seconds = Seconds(float(tensors.pop("seconds", zero)), float(tensors.pop("cpu_seconds", zero)))
    return SyntheticPool(**{f.name: tensors[f.name] for f in fields(SyntheticPool)}), seconds


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """A distillation checkpoint (tensors, numbers and their dicts/lists only)."""
    atomic_write(path, lambda p: torch.save(state, str(p)))


def load_checkpoint(path: Path) -> dict[str, Any] | None:
    """The checkpoint at ``path``, or None when there is none."""
    if not path.is_file():
        return None
    return torch.load(str(path), map_location="cpu", weights_only=True)


def save_method_result(folder: Path, model: torch.nn.Module, details: dict[str, Any]) -> None:
    """A finished method's model and details (written last: marks the method done)."""
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    atomic_write(folder / "model.safetensors", lambda p: save_file(state, str(p)))
    atomic_write(folder / "result.json",
                 lambda p: p.write_text(json.dumps(details, default=float), encoding="utf-8"))


def load_method_result(folder: Path, new_model: Callable[[], torch.nn.Module]
                       ) -> tuple[torch.nn.Module, dict[str, Any]] | None:
    """A finished method's model and details, or None when it did not finish."""
    if not (folder / "result.json").is_file():
        return None
    model = new_model()
    model.load_state_dict(load_file(str(folder / "model.safetensors")))
    details = json.loads((folder / "result.json").read_text(encoding="utf-8"))
    return model.eval(), details
