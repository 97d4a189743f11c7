"""Client uploads cached on disk, keyed by everything that decides them.

The benchmark trains the clients of one (split, seed) once and reuses their
uploads for every server method and every later run. The key covers the
data, partition, model and client-training settings, the seed, the number
of clients and torch's thread count (training is bit-identical at a fixed
thread count only: reductions split differently across threads); server
settings are left out on purpose, so changing a server method never retrains
a client. Uploads go through the app's own intake
(validated, persisted as safetensors + JSON, never pickled), so a cache folder
is laid out as a run folder: ``uploads/`` and ``upload_report.json``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

import torch

from fedmitr_core.client.training import initial_model_load, simulate_clients
from fedmitr_core.config import FedMITRConfig
from fedmitr_core.data.datasets import DatasetSplits
from fedmitr_core.server.uploads import UploadIntake, partition_client_id

CLIENT_SECTIONS = ("data", "partition", "model", "client")


def client_key(cfg: FedMITRConfig, num_clients: int, threads: int | None = None) -> str:
    """Hex digest of the settings that decide the clients' uploads.

    ``threads`` defaults to torch's current intra-op thread count.
    """
    flat = cfg.to_flat()
    section_keys = {f.name.replace("_", "-") for s in CLIENT_SECTIONS
                    for f in fields(getattr(cfg, s))}
    if cfg.privacy.private:  # only then: the keys of non-private caches stay as they were
        section_keys |= {f.name.replace("_", "-") for f in fields(cfg.privacy)}
    relevant = {k: flat[k] for k in sorted(section_keys)}
    relevant.update(seed=cfg.seed, num_clients=num_clients,
                    torch_threads=threads or torch.get_num_threads())
    blob = json.dumps(relevant, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def uploads_digest(folder: Path) -> str:
    """Hex digest of the uploads in a run or cache folder (every file of ``uploads/``).

    Two folders with the same digest hold the same teachers, statistics and label
    counts byte for byte, whichever machine trained them.
    """
    digest = hashlib.sha256()
    for path in sorted(p for p in (folder / "uploads").rglob("*") if p.is_file()):
        digest.update(path.relative_to(folder).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def cached_uploads(cfg: FedMITRConfig, num_clients: int, data: DatasetSplits,
                   cache_dir: Path, log: Callable[[str], None] = print) -> tuple[Path, bool]:
    """The folder of ``cfg``'s uploads, trained now or found in ``cache_dir``.

    Returns the folder (``uploads/``, ``upload_report.json``) and whether it was cached.
    """
    folder = cache_dir / client_key(cfg, num_clients)
    done = folder / "complete.json"
    if done.is_file():
        return folder, True
    log(f"training {num_clients} clients (cache {folder.name})")
    _, updates = simulate_clients(cfg, num_clients, data)
    model, pretrained = initial_model_load(cfg, data.spec)
    log(pretrained.summary())
    intake = UploadIntake(folder, model.state_dict(), data.spec.num_classes,
                          cfg.server.max_weight_ratio)
    for pid, update in enumerate(updates):
        metrics = {"num-examples": update.num_examples,
                   "label-counts": [int(v) for v in update.label_counts], **update.metrics}
        stats = None
        if update.token_stats is not None:
            metrics["token-stats-images"] = update.token_stats.num_images
            stats = update.token_stats.arrays()
        problems = intake.take(partition_client_id(pid),
                               {k: v.numpy() for k, v in update.state.items()}, metrics,
                               token_stats=stats)
        if problems:
            log(f"client {pid} left out of the teacher set: {'; '.join(problems)}")
    intake.write_report(**{"num-partitions": num_clients, "pretrained": pretrained.record()})
    done.write_text(json.dumps({"num-clients": num_clients,
                                "torch-threads": torch.get_num_threads(),
                                "config": cfg.to_flat()},
                               indent=1, default=str), encoding="utf-8")
    return folder, False
