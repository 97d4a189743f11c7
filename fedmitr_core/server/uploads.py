"""The upload intake: validate each client upload, persist the good ones as safetensors.

Uploads arrive three ways (a Flower round, checkpoints published in a folder,
the benchmark's cache of simulated clients); all three go through one
:class:`UploadIntake`, which writes each accepted upload to ``<run>/uploads/``
the moment it is validated and keeps the account in ``upload_report.json``.
Nothing is ever unpickled.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.numpy import load_file, save_file
from torch import nn

from fedmitr_core.server.ensemble import TeacherSet
from fedmitr_core.server.state import atomic_write

UPLOAD_REPORT = "upload_report.json"
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


class UploadIntake:
    """Validates uploads, persists the accepted ones at once, and accounts for every one.

    Parameters
    ----------
    run_dir
        Accepted uploads go to ``<run_dir>/uploads/``, the account to
        ``<run_dir>/upload_report.json`` (:meth:`write_report`).
    spec
        Name -> (shape, dtype) of the expected architecture (:func:`expected_spec`).
    num_classes
        Length of every ``label-counts``.
    """

    def __init__(self, run_dir: Path, spec: ArraySpec, num_classes: int) -> None:
        self.run_dir, self.folder = run_dir, run_dir / "uploads"
        self.spec, self.num_classes = spec, num_classes
        self.accepted: list[dict[str, Any]] = []
        self.rejected: list[dict[str, Any]] = []
        self.failed: list[dict[str, Any]] = []

    def take(self, client_id: str, arrays: Mapping[str, Any], metrics: Mapping[str, Any],
             node: int | None = None) -> list[str]:
        """Validate one upload and persist it if good; return the reasons it was rejected."""
        problems = validate_upload(arrays, metrics, self.spec, self.num_classes)
        if problems:
            self.reject(client_id, problems, node)
            return problems
        n = int(metrics["num-examples"])
        persist_upload(self.folder, Upload(
            client_id=client_id, arrays=dict(arrays), num_examples=n,
            label_counts=np.asarray(metrics["label-counts"], dtype=np.int64),
            metrics=dict(metrics)))
        self.accepted.append({"client-id": client_id, **_node(node), "num-examples": n})
        return []

    def reject(self, client_id: str, problems: list[str], node: int | None = None) -> None:
        """Record an upload refused before or by validation."""
        self.rejected.append({"client-id": client_id, **_node(node), "reasons": problems})

    def fail(self, node: int, reason: str) -> None:
        """Record a client that failed or stayed silent."""
        self.failed.append({"node-id": node, "reason": reason})

    def write_report(self, **extra: Any) -> dict[str, Any]:
        """Write ``upload_report.json`` (accepted, rejected, failed, ``extra``); return it."""
        report = {"accepted": self.accepted, "rejected": self.rejected, "failed": self.failed,
                  **extra}
        text = json.dumps(report, indent=1)
        atomic_write(self.run_dir / UPLOAD_REPORT, lambda p: p.write_text(text, encoding="utf-8"))
        return report


def _node(node: int | None) -> dict[str, int]:
    return {} if node is None else {"node-id": int(node)}


def read_upload_report(run_dir: Path) -> dict[str, Any]:
    """``<run_dir>/upload_report.json``, or ``{}`` when there is none."""
    path = run_dir / UPLOAD_REPORT
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
