"""Validating client uploads and persisting them as safetensors (never pickle)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.numpy import load_file, save_file
from torch import nn

from fedmitr_core.ensemble import TeacherSet

ArraySpec = dict[str, tuple[tuple[int, ...], np.dtype]]
_SAFE_ID = re.compile(r"[^A-Za-z0-9_.-]")


def expected_spec(model: nn.Module) -> ArraySpec:
    """Name -> (shape, dtype) of every tensor in ``model``'s state dict."""
    return {k: (tuple(v.shape), np.dtype(str(v.dtype).removeprefix("torch.")))
            for k, v in model.state_dict().items()}


@dataclass(frozen=True)
class Upload:
    """One client's reply: weights, label counts and what it reported."""

    client_id: str
    arrays: dict[str, np.ndarray]
    num_examples: int
    label_counts: np.ndarray
    metrics: dict[str, Any]


def validate_upload(arrays: Mapping[str, np.ndarray], metrics: Mapping[str, Any],
                    spec: ArraySpec, num_classes: int, size_slack: float = 1.0) -> list[str]:
    """Reasons to reject an upload; an empty list means it is accepted.

    Checks names, shapes, dtypes, total size (against the expected
    architecture's), finite values, ``num-examples`` and ``label-counts``.
    """
    problems: list[str] = []
    missing = sorted(set(spec) - set(arrays))
    extra = sorted(set(arrays) - set(spec))
    if missing:
        problems.append(f"missing arrays: {missing[:5]}{'...' if len(missing) > 5 else ''}")
    if extra:
        problems.append(f"unexpected arrays: {extra[:5]}{'...' if len(extra) > 5 else ''}")
    limit = sum(int(np.prod(s)) * d.itemsize for s, d in spec.values()) * (1 + size_slack)
    total = sum(int(getattr(a, "nbytes", 0)) for a in arrays.values())
    if total > limit:
        problems.append(f"upload of {total} bytes exceeds the limit of {int(limit)} bytes")
        return problems
    for name, (shape, dtype) in spec.items():
        arr = arrays.get(name)
        if arr is None:
            continue
        if not isinstance(arr, np.ndarray):
            problems.append(f"array '{name}' is not a numeric array")
            continue
        if tuple(arr.shape) != shape:
            problems.append(f"array '{name}' has shape {tuple(arr.shape)}, expected {shape}")
        elif arr.dtype != dtype:
            problems.append(f"array '{name}' has dtype {arr.dtype}, expected {dtype}")
        elif not np.isfinite(arr).all():
            problems.append(f"array '{name}' has NaN or Inf values")
    n = metrics.get("num-examples")
    counts = metrics.get("label-counts")
    if isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n == 0:
        problems.append("metric 'num-examples' is 0: the client has no training data "
                        "(empty partition)")
    elif not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n <= 0:
        problems.append(f"metric 'num-examples' must be a positive integer, got {n!r}")
    if counts is None:
        problems.append("metric 'label-counts' is missing")
    else:
        c = np.asarray(counts)
        if c.shape != (num_classes,) or not np.issubdtype(c.dtype, np.number):
            problems.append(f"metric 'label-counts' must be {num_classes} numbers, "
                            f"got shape {c.shape}")
        elif (c < 0).any() or not np.all(np.equal(np.mod(c, 1), 0)):
            problems.append("metric 'label-counts' must be non-negative integers")
        elif isinstance(n, (int, np.integer)) and int(c.sum()) != int(n):
            problems.append(f"metric 'label-counts' sums to {int(c.sum())}, "
                            f"but 'num-examples' is {n}")
    return problems


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Write ``path`` through a temporary file, fsync and an atomic rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def persist_upload(folder: Path, upload: Upload) -> Path:
    """Write ``<folder>/<client>.safetensors`` and its ``.json`` atomically."""
    folder.mkdir(parents=True, exist_ok=True)
    stem = _SAFE_ID.sub("_", upload.client_id)
    weights = folder / f"{stem}.safetensors"
    meta = {"client-id": upload.client_id, "num-examples": upload.num_examples,
            "label-counts": [int(v) for v in upload.label_counts],
            "metrics": {k: v for k, v in upload.metrics.items() if k != "label-counts"}}
    atomic_write(weights, lambda p: save_file(
        {k: np.ascontiguousarray(v) for k, v in upload.arrays.items()}, str(p)))
    atomic_write(folder / f"{stem}.json",
                  lambda p: p.write_text(json.dumps(meta, indent=1), encoding="utf-8"))
    return weights


def load_teacher_set(folder: Path, build_model: Callable[[], nn.Module]) -> TeacherSet:
    """Load every persisted upload in ``folder`` as a teacher (sorted by client id)."""
    models, counts, ids = [], [], []
    for meta_path in sorted(folder.glob("*.json")):
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        weights = meta_path.with_suffix(".safetensors")
        model = build_model()
        state = {k: torch.from_numpy(v.copy()) for k, v in load_file(str(weights)).items()}
        model.load_state_dict(state)
        models.append(model.eval())
        counts.append(meta["label-counts"])
        ids.append(meta["client-id"])
    if not models:
        raise FileNotFoundError(f"no uploads (*.json + *.safetensors) in '{folder}'")
    return TeacherSet(models=models, label_counts=np.asarray(counts, dtype=np.int64),
                      client_ids=ids)
