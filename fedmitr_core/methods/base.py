"""What every server method receives and returns, and which pool each one distils from."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedmitr_core.config import FedMITRConfig
from fedmitr_core.data.datasets import DataSpec, Split
from fedmitr_core.distill.trainer import TrainingSetup
from fedmitr_core.models.student import StudentViT
from fedmitr_core.models.vit import vit_factory
from fedmitr_core.progress import Emit
from fedmitr_core.runtime import Seconds
from fedmitr_core.server.ensemble import TeacherEnsemble, TeacherSet
from fedmitr_core.server.state import CHECKPOINT_FILE
from fedmitr_core.synthesis.pool import SyntheticPool

# The synthetic data each method learns from. Methods that name the same pool make the
# same images from the same random stream, so a run makes that pool once and shares it
# (``<run>/state/pools/<pool>.safetensors``; its seconds count for every method using it).
POOLS: dict[str, str] = {
    "fedmitr": "sparse-inversion",
    "fedmitr-sparse": "sparse-inversion",
    "deepinversion": "dense-inversion",
    "fedmitr-relabel": "dense-inversion",
    "kd-real": "real-images",
    "dense": "dense-generator",
    "coboosting": "coboosting-generator",
    "fedftg": "fedftg-generator",
}
# Each pool's random stream: its torch.Generator (rng) is seeded ``seed * 7919 + stream``.
RNG_STREAMS: dict[str, int] = {
    "sparse-inversion": 1, "dense-inversion": 2, "real-images": 3, "dense-generator": 4,
    "coboosting-generator": 5, "fedftg-generator": 6,
}


@dataclass
class ServerContext:
    """The validated uploads and everything a server method may use.

    ``real_train`` is only for the ``kd-real`` oracle reference; ``state_dir``
    holds crash-safe state (pools, checkpoints; ``None``: keep none).
    """

    teachers: TeacherSet
    ensemble: TeacherEnsemble
    cfg: FedMITRConfig
    spec: DataSpec
    device: torch.device
    emit: Emit | None = None
    real_train: Split | None = None
    state_dir: Path | None = None

    def method_state(self, name: str) -> Path | None:
        """Where method ``name`` keeps its checkpoints and result, if anywhere."""
        return None if self.state_dir is None else self.state_dir / name

    def pool_file(self, method: str) -> Path | None:
        """Where the pool ``method`` distils from is kept, if anywhere (see ``POOLS``)."""
        if self.state_dir is None:
            return None
        return self.state_dir / "pools" / f"{POOLS[method]}.safetensors"

    def rng(self, method: str) -> torch.Generator:
        """A CPU random generator for ``method``, seeded by the run seed and its pool's stream."""
        return torch.Generator().manual_seed(self.cfg.seed * 7919 + RNG_STREAMS[POOLS[method]])

    def new_vit(self) -> nn.Module:
        """A fresh ViT of the clients' architecture."""
        return vit_factory(self.cfg.model, self.spec)()


@dataclass
class MethodResult:
    """A server method's global model and what it produced on the way.

    ``pool_file`` is where ``pool`` is kept, if it is; ``reused_seconds`` the
    seconds of shared work made earlier (counted in the method's time).
    """

    model: nn.Module
    pool: SyntheticPool | None = None
    details: dict[str, Any] = field(default_factory=dict)
    pool_file: Path | None = None
    reused_seconds: Seconds = Seconds()


ServerMethod = Callable[[ServerContext], MethodResult]


def fedavg_state(teachers: TeacherSet) -> dict[str, torch.Tensor]:
    """Parameter average of the teachers weighted by their example counts."""
    weights = torch.as_tensor(teachers.num_examples, dtype=torch.float64)
    weights = weights / weights.sum()
    states = [m.state_dict() for m in teachers.models]
    return {name: sum(float(w) * s[name].double().cpu()
                      for w, s in zip(weights, states, strict=True)).to(states[0][name].dtype)
            for name in states[0]}


def make_student(ctx: ServerContext, init: str | None = None) -> StudentViT:
    """The student ViT, initialised from one-shot FedAvg or from scratch.

    ``init`` (``fedavg`` or ``scratch``) overrides ``student-init`` for a method
    whose start is part of its definition.
    """
    vit = ctx.new_vit()
    if (init or ctx.cfg.distill.student_init) == "fedavg":
        vit.load_state_dict(fedavg_state(ctx.teachers))
    return StudentViT(vit, token_head_from_cls=ctx.cfg.distill.token_head_init == "cls-head")


def training_setup(ctx: ServerContext, name: str) -> TrainingSetup:
    """Where method ``name``'s student trains and checkpoints."""
    folder = ctx.method_state(name)
    return TrainingSetup(device=ctx.device, precision=ctx.cfg.runtime.precision,
                         checkpoint=None if folder is None else folder / CHECKPOINT_FILE,
                         checkpoint_every=ctx.cfg.server.checkpoint_every, emit=ctx.emit)
