"""Client uploads cached on disk, keyed by everything that decides them.

The benchmark trains the clients of one (split, seed) once and reuses their
uploads for every server method and every later run. The key covers the
data, partition, model and client-training settings, the seed and the number
of clients; server settings are left out on purpose, so changing a server
method never retrains a client. Uploads are stored as the app stores them
(safetensors + JSON, ``fedmitr_core.uploads``), never pickled.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from fedmitr_core.client_job import simulate_clients
from fedmitr_core.config import FedMITRConfig
from fedmitr_core.data import DatasetSplits
from fedmitr_core.ensemble import TeacherSet
from fedmitr_core.models import vit_factory
from fedmitr_core.uploads import Upload, load_teacher_set, persist_upload

CLIENT_SECTIONS = ("data", "partition", "model", "client")


def client_key(cfg: FedMITRConfig, num_clients: int) -> str:
    """Hex digest of the settings that decide the clients' uploads."""
    flat = cfg.to_flat()
    section_keys = {k.replace("_", "-") for s in CLIENT_SECTIONS
                    for k in getattr(cfg, s).__dataclass_fields__}
    relevant = {k: flat[k] for k in sorted(section_keys)}
    relevant.update(seed=cfg.seed, num_clients=num_clients)
    blob = json.dumps(relevant, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def cached_teachers(cfg: FedMITRConfig, num_clients: int, splits: DatasetSplits,
                    cache_dir: Path, log: Callable[[str], None] = print
                    ) -> tuple[TeacherSet, bool]:
    """The teacher set for ``cfg``, trained now or loaded from ``cache_dir``.

    Returns the teachers and whether they came from the cache.
    """
    folder = cache_dir / client_key(cfg, num_clients)
    done = folder / "complete.json"
    new_model = vit_factory(cfg, splits)

    if done.is_file():
        return load_teacher_set(folder / "uploads", new_model), True
    log(f"training {num_clients} clients (cache {folder.name})")
    _, updates = simulate_clients(cfg, num_clients, splits)
    for pid, update in enumerate(updates):
        if update.num_examples == 0:
            log(f"client {pid} holds no examples: left out of the teacher set")
            continue
        persist_upload(folder / "uploads", Upload(
            client_id=f"partition-{pid:04d}",
            arrays={k: v.numpy() for k, v in update.state.items()},
            num_examples=update.num_examples,
            label_counts=np.asarray(update.label_counts, dtype=np.int64),
            metrics=update.metrics))
    done.write_text(json.dumps({"num-clients": num_clients, "config": cfg.to_flat()},
                               indent=1, default=str), encoding="utf-8")
    return load_teacher_set(folder / "uploads", new_model), False
