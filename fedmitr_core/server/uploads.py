"""The upload intake: validate each client upload, persist the good ones as safetensors.

Uploads arrive three ways (a Flower round, checkpoints published in a folder,
the benchmark's cache of simulated clients); all three go through one
:class:`UploadIntake`, which writes each accepted upload to ``<run>/uploads/``
the moment it is validated and keeps the account in ``upload_report.json``.
Nothing is ever unpickled.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.numpy import load_file, save_file

from fedmitr_core.models.token_stats import STATS_NAMES, TokenStats
from fedmitr_core.server.ensemble import TeacherSet
from fedmitr_core.server.state import atomic_write

UPLOAD_REPORT = "upload_report.json"
# More examples than any client holds, small enough that every sum over
# clients stays exact in int64 and float64.
MAX_COUNT = 2**40
ArraySpec = dict[str, tuple[tuple[int, ...], np.dtype]]
_SAFE_ID = re.compile(r"[^A-Za-z0-9_.-]")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_PARTITION_ID = re.compile(r"^partition-(\d+)")
_REASON_CHARS = 300
STATS_SUFFIX = ".stats.safetensors"
# Far beyond any token moment a trained ViT produces, small enough that the
# prior's squared distances stay finite in float32.
MAX_STAT = 1e6


def partition_client_id(partition: int, node: int | None = None) -> str:
    """The client id of a simulated client: ``partition-<n>``, then its node if known."""
    return f"partition-{partition:04d}" + ("" if node is None else f"-node-{node}")


def partition_of(client_id: str) -> int | None:
    """The partition a client id names (see :func:`partition_client_id`), else ``None``."""
    match = _PARTITION_ID.match(client_id)
    return None if match is None else int(match.group(1))


def expected_spec(state: Mapping[str, Any]) -> ArraySpec:
    """Name -> (shape, dtype) of every tensor in a state dict (torch or numpy)."""
    return {k: (tuple(v.shape), np.dtype(str(v.dtype).removeprefix("torch.")))
            for k, v in state.items()}


def size_limit(spec: ArraySpec, slack: float = 1.0) -> int:
    """The most bytes an upload of ``spec`` may hold: its size times ``1 + slack``."""
    return int(sum(int(np.prod(s)) * d.itemsize for s, d in spec.values()) * (1 + slack))


def magnitude_bounds(reference: Mapping[str, Any], ratio: float) -> dict[str, float]:
    """Per tensor, the largest plausible ``|w|``: ``ratio * max(max |w0|, 1)``.

    ``reference`` is the initial model every client starts from. Training
    moves weights, but not by orders of magnitude (honest uploads on digits
    stay within 10x; docs/faults.md); the floor of 1 covers tensors that start
    at zero, such as biases.
    """
    return {k: ratio * max(float(np.abs(_numpy(v)).max(initial=0.0)), 1.0)
            for k, v in reference.items()}


def _numpy(value: Any) -> np.ndarray:
    return value.detach().cpu().float().numpy() if isinstance(value, torch.Tensor) \
        else np.asarray(value)


def short_reason(text: str, limit: int = _REASON_CHARS) -> str:
    """``text`` without terminal colour codes; of a traceback only its last line; cut short."""
    lines = [line.strip() for line in _ANSI.sub("", str(text)).splitlines() if line.strip()]
    if not lines:
        return ""
    line = lines[-1] if any(line.startswith("Traceback") for line in lines) \
        else " ".join(lines)
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _count(value: Any) -> int | None:
    """``value`` as an int in ``[0, MAX_COUNT]`` if it is a whole number there, else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, np.integer)):
        number = int(value)
    elif isinstance(value, (float, np.floating)) and math.isfinite(value) \
            and float(value).is_integer():
        number = int(value)
    else:
        return None
    return number if 0 <= number <= MAX_COUNT else None


def _shown(value: Any) -> str:
    return short_reason(repr(value), 80)


@dataclass(frozen=True)
class Upload:
    """One client's reply: weights, label counts and what it reported."""

    client_id: str
    arrays: dict[str, np.ndarray]
    num_examples: int
    label_counts: np.ndarray
    metrics: dict[str, Any]
    token_stats: dict[str, np.ndarray] | None = None


def check_counts(metrics: Mapping[str, Any], num_classes: int) -> list[str]:
    """Problems with ``num-examples`` and ``label-counts``, checked in Python ints.

    Every count must be a whole number in ``[0, MAX_COUNT]`` before anything
    converts it to a fixed-width type.
    """
    problems: list[str] = []
    raw_n = metrics.get("num-examples")
    n = _count(raw_n)
    if n == 0:
        problems.append("metric 'num-examples' is 0: the client has no training data "
                        "(empty partition)")
    elif n is None:
        problems.append(f"metric 'num-examples' must be a positive integer up to 2**40, "
                        f"got {_shown(raw_n)}")
    raw = metrics.get("label-counts")
    if raw is None:
        return problems + ["metric 'label-counts' is missing"]
    values = list(raw) if isinstance(raw, (list, tuple, np.ndarray)) else None
    if values is None or len(values) != num_classes:
        length = len(values) if values is not None else type(raw).__name__
        return problems + [f"metric 'label-counts' must be {num_classes} numbers, got {length}"]
    counts = [_count(v) for v in values]
    if any(c is None for c in counts):
        bad = next(v for v, c in zip(values, counts, strict=True) if c is None)
        return problems + [f"metric 'label-counts' must be non-negative integers up to 2**40, "
                           f"got {_shown(bad)}"]
    total = sum(c for c in counts if c is not None)
    if n is not None and total != n:
        problems.append(f"metric 'label-counts' sums to {total}, but 'num-examples' is {n}")
    return problems


def validate_upload(arrays: Mapping[str, np.ndarray], metrics: Mapping[str, Any],
                    spec: ArraySpec, num_classes: int, size_slack: float = 1.0,
                    bounds: Mapping[str, float] | None = None) -> list[str]:
    """Reasons to reject an upload; an empty list means it is accepted.

    Checks names, shapes, dtypes, total size (against the expected
    architecture's), finite values, magnitudes against ``bounds``
    (:func:`magnitude_bounds`; ``None`` skips them), ``num-examples`` and
    ``label-counts`` (:func:`check_counts`).
    """
    problems: list[str] = []
    missing = sorted(set(spec) - set(arrays))
    extra = sorted(set(arrays) - set(spec))
    if missing:
        problems.append(f"missing arrays: {missing[:5]}{'...' if len(missing) > 5 else ''}")
    if extra:
        problems.append(f"unexpected arrays: {[_shown(k) for k in extra[:5]]}"
                        f"{'...' if len(extra) > 5 else ''}")
    limit = size_limit(spec, size_slack)
    total = sum(int(getattr(a, "nbytes", 0)) for a in arrays.values())
    if total > limit:
        problems.append(f"upload of {total} bytes exceeds the limit of {limit} bytes")
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
        elif bounds is not None and name in bounds and arr.size:
            peak = float(np.abs(arr).max())
            if peak > bounds[name]:
                problems.append(f"array '{name}' has values up to {peak:.3g}, beyond the "
                                f"plausible {bounds[name]:.3g} ('max-weight-ratio' times "
                                "the initial model's magnitude)")
    return problems + check_counts(metrics, num_classes)


def stats_shape_of(reference: Mapping[str, Any]) -> tuple[int, int]:
    """``(depth + 1, D)``: the token-statistics shape of the ViT whose state is ``reference``."""
    blocks = {int(k.split(".")[1]) for k in reference if k.startswith("blocks.")}
    return len(blocks) + 1, int(reference["cls_token"].shape[-1])


def stats_size_limit(shape: tuple[int, int]) -> int:
    """The most bytes a token-statistics upload of ``shape`` may hold (2 float32 arrays)."""
    return 2 * shape[0] * shape[1] * 4


def validate_token_stats(stats: Mapping[str, Any], metrics: Mapping[str, Any],
                         shape: tuple[int, int], num_examples: int) -> list[str]:
    """Reasons to refuse a client's token statistics; an empty list means they are kept.

    Exactly ``mean`` and ``var``, float32 arrays of ``shape``, finite and within
    ``MAX_STAT``, variances >= 0, and ``token-stats-images`` a whole number in
    ``[1, num-examples]``.
    """
    names = set(stats)
    if names != set(STATS_NAMES):
        return [f"token statistics must be exactly {list(STATS_NAMES)}, got "
                f"{[_shown(k) for k in sorted(names)[:5]]}"]
    problems: list[str] = []
    for name in STATS_NAMES:
        arr = stats[name]
        if not isinstance(arr, np.ndarray):
            problems.append(f"token statistic '{name}' is not a numeric array")
        elif tuple(arr.shape) != shape:
            problems.append(f"token statistic '{name}' has shape {tuple(arr.shape)}, "
                            f"expected {shape}")
        elif arr.dtype != np.float32:
            problems.append(f"token statistic '{name}' has dtype {arr.dtype}, expected float32")
        elif not np.isfinite(arr).all():
            problems.append(f"token statistic '{name}' has NaN or Inf values")
        elif float(np.abs(arr).max(initial=0.0)) > MAX_STAT:
            problems.append(f"token statistic '{name}' has values up to "
                            f"{float(np.abs(arr).max()):.3g}, beyond {MAX_STAT:.0e}")
        elif name == "var" and float(arr.min()) < 0:
            problems.append(f"token statistic 'var' has negative values (min {arr.min():.3g})")
    raw = metrics.get("token-stats-images")
    images = _count(raw)
    if images is None or not 1 <= images <= num_examples:
        problems.append(f"metric 'token-stats-images' must be an integer in "
                        f"[1, num-examples={num_examples}], got {_shown(raw)}")
    return problems


def persist_upload(folder: Path, upload: Upload) -> Path:
    """Write ``<folder>/<client>.safetensors`` (and ``.stats.safetensors``), then its ``.json``.

    Each file is written atomically; the ``.json`` last, so an upload is only
    ever read back whole.
    """
    folder.mkdir(parents=True, exist_ok=True)
    stem = _SAFE_ID.sub("_", upload.client_id)
    weights = folder / f"{stem}.safetensors"
    meta = {"client-id": upload.client_id, "num-examples": upload.num_examples,
            "label-counts": [int(v) for v in upload.label_counts],
            "token-stats": upload.token_stats is not None,
            "metrics": {k: v for k, v in upload.metrics.items() if k != "label-counts"}}
    atomic_write(weights, lambda p: save_file(
        {k: np.ascontiguousarray(v) for k, v in upload.arrays.items()}, str(p)))
    stats = stats_file(weights)
    if upload.token_stats is not None:
        atomic_write(stats, lambda p: save_file(
            {k: np.ascontiguousarray(v) for k, v in upload.token_stats.items()}, str(p)))
    else:
        stats.unlink(missing_ok=True)
    atomic_write(folder / f"{stem}.json",
                  lambda p: p.write_text(json.dumps(meta, indent=1), encoding="utf-8"))
    return weights


def stats_file(weights: Path) -> Path:
    """Where the token statistics of the upload or checkpoint ``weights`` live."""
    return weights.with_name(weights.name.removesuffix(".safetensors") + STATS_SUFFIX)


def load_teacher_set(folder: Path, build_model: Callable[[], torch.nn.Module]) -> TeacherSet:
    """Load every persisted upload in ``folder`` as a teacher (sorted by client id).

    A teacher's token statistics come with it when its upload had them.
    """
    models, counts, ids, stats = [], [], [], []
    for meta_path in sorted(folder.glob("*.json")):
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        weights = meta_path.with_suffix(".safetensors")
        model = build_model()
        state = {k: torch.from_numpy(v.copy()) for k, v in load_file(str(weights)).items()}
        model.load_state_dict(state)
        models.append(model.eval())
        counts.append(meta["label-counts"])
        ids.append(meta["client-id"])
        stats.append(_read_stats(stats_file(weights), meta) if meta.get("token-stats")
                     else None)
    if not models:
        raise FileNotFoundError(f"no uploads (*.json + *.safetensors) in '{folder}'")
    return TeacherSet(models=models, label_counts=np.asarray(counts, dtype=np.int64),
                      client_ids=ids, token_stats=stats)


def _read_stats(path: Path, meta: Mapping[str, Any]) -> TokenStats:
    arrays = load_file(str(path))
    return TokenStats(mean=torch.from_numpy(arrays["mean"].copy()),
                      var=torch.from_numpy(arrays["var"].copy()),
                      num_images=int(meta["metrics"]["token-stats-images"]))


def _privacy_spent(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The ε and δ a private client reports (recorded, never a reason to refuse)."""
    spent = {}
    for key in ("dp-epsilon", "dp-delta"):
        value = metrics.get(key)
        if isinstance(value, int | float) and math.isfinite(value) and value >= 0:
            spent[key] = float(value)
    return spent


class UploadIntake:
    """Validates uploads, persists the accepted ones at once, and accounts for every one.

    Nothing a client sends can raise out of :meth:`take`: whatever cannot be
    validated or persisted is rejected with its reason. The account,
    ``upload_report.json``, is rewritten after every upload, so a run folder
    is resumable from the first reply on.

    Parameters
    ----------
    run_dir
        Accepted uploads go to ``<run_dir>/uploads/``, the account to
        ``<run_dir>/upload_report.json``.
    reference
        The initial model's state dict: it fixes the expected names, shapes and
        dtypes, and the plausible magnitudes (:func:`magnitude_bounds`).
    num_classes
        Length of every ``label-counts``.
    max_weight_ratio
        Run-config key ``max-weight-ratio``; ``0`` checks no magnitudes.
    """

    def __init__(self, run_dir: Path, reference: Mapping[str, Any], num_classes: int,
                 max_weight_ratio: float = 0.0) -> None:
        self.run_dir, self.folder = run_dir, run_dir / "uploads"
        self.spec, self.num_classes = expected_spec(reference), num_classes
        self.bounds = magnitude_bounds(reference, max_weight_ratio) if max_weight_ratio > 0 \
            else None
        self.size_limit = size_limit(self.spec)
        self.stats_shape = stats_shape_of(reference)
        self.stats_size_limit = stats_size_limit(self.stats_shape)
        self.accepted: list[dict[str, Any]] = []
        self.rejected: list[dict[str, Any]] = []
        self.failed: list[dict[str, Any]] = []
        self.extra: dict[str, Any] = {}

    def take(self, client_id: str, arrays: Mapping[str, Any], metrics: Mapping[str, Any],
             node: int | None = None, token_stats: Mapping[str, Any] | None = None,
             stats_refusal: str = "") -> list[str]:
        """Validate one upload and persist it if good; return the reasons it was rejected.

        ``token_stats`` that fail validation (or were refused before decoding,
        ``stats_refusal``) are dropped, not the upload: the teacher joins without
        them (the prior skips it), and the account says why.
        """
        try:
            problems = validate_upload(arrays, metrics, self.spec, self.num_classes,
                                       bounds=self.bounds)
        except Exception as err:  # noqa: BLE001 - a client's input never stops the server
            problems = [f"upload could not be validated: {short_reason(repr(err))}"]
        if problems:
            self.reject(client_id, problems, node)
            return problems
        n = int(metrics["num-examples"])
        stats, stats_note = (None, short_reason(f"refused: {stats_refusal}")) if stats_refusal \
            else self._checked_stats(token_stats, metrics, n)
        try:
            persist_upload(self.folder, Upload(
                client_id=client_id, arrays=dict(arrays), num_examples=n,
                label_counts=np.asarray([int(v) for v in metrics["label-counts"]],
                                        dtype=np.int64),
                metrics=dict(metrics), token_stats=stats))
        except Exception as err:  # noqa: BLE001
            problems = [f"upload could not be persisted: {short_reason(repr(err))}"]
            self.reject(client_id, problems, node)
            return problems
        self.accepted.append({"client-id": client_id, **_node(node), "num-examples": n,
                              "token-stats": stats_note, **_privacy_spent(metrics)})
        self.write_report()
        return []

    def _checked_stats(self, token_stats: Mapping[str, Any] | None,
                       metrics: Mapping[str, Any], num_examples: int
                       ) -> tuple[dict[str, np.ndarray] | None, str]:
        """The statistics to keep (or None) and a note for the account."""
        if token_stats is None:
            return None, "not shared"
        try:
            problems = validate_token_stats(token_stats, metrics, self.stats_shape,
                                            num_examples)
        except Exception as err:  # noqa: BLE001
            problems = [f"could not be validated: {short_reason(repr(err))}"]
        if problems:
            return None, short_reason("refused: " + "; ".join(problems))
        return {k: np.asarray(token_stats[k]) for k in STATS_NAMES}, "accepted"

    def reject(self, client_id: str, problems: list[str], node: int | None = None) -> None:
        """Record an upload refused before or by validation."""
        self.rejected.append({"client-id": client_id, **_node(node),
                              "reasons": [short_reason(p) for p in problems]})
        self.write_report()

    def fail(self, node: int, reason: str) -> None:
        """Record a client that failed or stayed silent (its reason cleaned, cut short)."""
        self.failed.append({"node-id": node, "reason": short_reason(reason)})
        self.write_report()

    def write_report(self, **extra: Any) -> dict[str, Any]:
        """Write ``upload_report.json`` (accepted, rejected, failed, ``extra``); return it.

        ``extra`` is kept for the later writes.
        """
        self.extra.update(extra)
        report = {"accepted": self.accepted, "rejected": self.rejected, "failed": self.failed,
                  **self.extra}
        text = json.dumps(report, indent=1)
        atomic_write(self.run_dir / UPLOAD_REPORT, lambda p: p.write_text(text, encoding="utf-8"))
        return report


def _node(node: int | None) -> dict[str, int]:
    return {} if node is None else {"node-id": int(node)}


def read_upload_report(run_dir: Path) -> dict[str, Any]:
    """``<run_dir>/upload_report.json``, or ``{}`` when there is none."""
    path = run_dir / UPLOAD_REPORT
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
