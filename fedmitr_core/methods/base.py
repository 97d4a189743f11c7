"""What every server method receives and returns."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedmitr_core.config import FedMITRConfig
from fedmitr_core.data import Split
from fedmitr_core.ensemble import TeacherEnsemble, TeacherSet
from fedmitr_core.inversion import SyntheticPool
from fedmitr_core.models import StudentViT, build_vit
from fedmitr_core.progress import Emit


@dataclass
class ServerContext:
    """The validated uploads and everything a server method may use."""

    teachers: TeacherSet
    ensemble: TeacherEnsemble
    cfg: FedMITRConfig
    num_classes: int
    in_chans: int
    image_size: int
    hflip_ok: bool
    device: torch.device
    emit: Emit | None = None
    real_train: Split | None = None  # only for the ``kd-real`` oracle reference
    state_dir: Path | None = None  # crash-safe state: pools, checkpoints (None: keep none)

    def method_state(self, name: str) -> Path | None:
        """Where method ``name`` keeps its pool and checkpoints, if anywhere."""
        return None if self.state_dir is None else self.state_dir / name

    def pool_file(self, name: str) -> Path | None:
        """Where the synthetic pool ``name`` is kept, if anywhere.

        Methods that make the same pool (same synthesis, same salt) ask for the
        same name and share it: the pool is made once per run.
        """
        return None if self.state_dir is None else self.state_dir / "pools" / f"{name}.safetensors"

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)`` of the model's input."""
        return (self.in_chans, self.image_size, self.image_size)

    def new_vit(self) -> nn.Module:
        """A fresh ViT of the clients' architecture."""
        return build_vit(self.cfg.model.model, self.num_classes, self.image_size,
                         self.in_chans, self.cfg.model.patch_size)

    def generator(self, salt: int) -> torch.Generator:
        """A CPU generator seeded by the run seed and ``salt`` (one per method)."""
        return torch.Generator().manual_seed(self.cfg.seed * 7919 + salt)


@dataclass
class MethodResult:
    """A server method's global model and what it produced on the way."""

    model: nn.Module
    pool: SyntheticPool | None = None
    details: dict[str, Any] = field(default_factory=dict)
    pool_file: Path | None = None  # where ``pool`` is kept, if it is
    reused_seconds: float = 0.0  # seconds of shared work made earlier (counted in its time)


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
