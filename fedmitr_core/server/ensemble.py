"""The client ensemble: teachers, their weights, and one batched forward."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn
from torch.func import functional_call, stack_module_state
from torch.utils.checkpoint import checkpoint

from fedmitr_core.models.token_stats import TokenStats
from fedmitr_core.models.tokens import LayerReduce, forward_gathered_layers

Form = Literal["loop", "vmap"]


@dataclass
class TeacherSet:
    """The accepted uploads: one model per client with its label counts."""

    models: list[VisionTransformer]
    label_counts: np.ndarray  # (K, C)
    client_ids: list[str] = field(default_factory=list)
    token_stats: list[TokenStats | None] = field(default_factory=list)  # [] or one per model

    @property
    def num_examples(self) -> np.ndarray:
        """Examples per client ``(K,)``."""
        return self.label_counts.sum(axis=1)

    def __len__(self) -> int:
        return len(self.models)


def select_teachers(teachers: TeacherSet, per_class: int) -> TeacherSet:
    """Only the top ``per_class`` clients of each class by label count.

    The ensemble is the union of every class's experts: at most
    ``per_class * C`` teachers however many clients uploaded, so the cost of
    one ensemble forward stops growing with the number of clients. The kept
    teachers keep their full label counts, so ``class`` weighting is computed
    over the kept set (``w_kc = n_kc / sum of n_jc over kept j``). (Keeping each
    teacher's counts for its own expert classes only was tried: with one or two
    experts per class every class's score then comes from clients that predict
    that class for everything, and the mixture collapsed to chance on digits.)

    Parameters
    ----------
    teachers
        Every accepted upload.
    per_class
        Experts per class; ``0`` keeps every teacher unchanged.
    """
    if per_class <= 0 or per_class >= len(teachers):
        return teachers
    counts = np.asarray(teachers.label_counts)
    chosen: set[int] = set()
    for c in range(counts.shape[1]):
        holders = np.flatnonzero(counts[:, c] > 0)
        # Stable sort: ties go to the lower client index, so the choice is reproducible.
        chosen.update(holders[np.argsort(-counts[holders, c], kind="stable")[:per_class]].tolist())
    keep = sorted(chosen)
    ids = [teachers.client_ids[k] for k in keep] if teachers.client_ids else []
    stats = [teachers.token_stats[k] for k in keep] if teachers.token_stats else []
    return TeacherSet(models=[teachers.models[k] for k in keep], label_counts=counts[keep],
                      client_ids=ids, token_stats=stats)


def auto_form(device: torch.device) -> Form:
    """The ensemble form for ``device``: the loop on CPU, ``vmap`` on an accelerator.

    Decided by the device alone, so a seed gives the same figures on every run.
    On CPU torch's ``vmap`` falls back to a slow path for attention: the loop was
    faster at every K measured (``benchmarks/scale.py``).
    """
    return "loop" if device.type == "cpu" else "vmap"


def class_weights(label_counts: np.ndarray) -> torch.Tensor:
    """``w[k, c] = n_kc / n_c``; classes no client holds get uniform weights."""
    counts = torch.as_tensor(label_counts, dtype=torch.float32)
    totals = counts.sum(dim=0, keepdim=True)
    uniform = torch.full_like(counts, 1.0 / counts.shape[0])
    return torch.where(totals > 0, counts / totals.clamp_min(1.0), uniform)


Outputs = tuple[torch.Tensor, ...]


def _gathered(vit: VisionTransformer, images: torch.Tensor, keep_idx: torch.Tensor | None,
              reduce: LayerReduce | None) -> Outputs:
    """Logits, CLS attention and (with ``reduce``) the per-layer reductions, flat."""
    logits, attention, per_layer = forward_gathered_layers(vit, images, keep_idx, reduce)
    return logits, attention, *per_layer


class _GatheredViT(nn.Module):
    """Module whose forward is the token-gather forward (for ``functional_call``)."""

    def __init__(self, vit: VisionTransformer) -> None:
        super().__init__()
        self.vit = vit

    def forward(self, images: torch.Tensor, keep_idx: torch.Tensor | None,
                reduce: LayerReduce | None = None) -> Outputs:
        return _gathered(self.vit, images, keep_idx, reduce)


class TeacherEnsemble:
    """Frozen same-architecture teachers evaluated together.

    Parameters
    ----------
    teachers
        The accepted uploads.
    weighting
        ``uniform``, ``samples`` (a_k ∝ n_k) or ``class`` (per class c,
        w_kc = n_kc / n_c, renormalised over classes).
    form
        ``loop`` (one call per teacher), ``vmap`` (stacked weights under
        ``torch.vmap``) or ``auto`` (:func:`auto_form`: decided by the device).
    device
        Where the teachers run.
    chunk_size
        Teachers per call. With more teachers than this and a backward pass to
        come (inversion), each chunk's forward is recomputed during backward
        (activation checkpointing): memory holds one chunk's activations plus
        every teacher's outputs, whatever the number of teachers, for about a
        third more compute.
    """

    def __init__(self, teachers: TeacherSet, weighting: str, form: str,
                 device: torch.device, chunk_size: int = 32) -> None:
        self.device = device
        self.weighting = weighting
        self.client_ids = list(teachers.client_ids)
        self.models = [m.to(device).eval().requires_grad_(False) for m in teachers.models]
        self.num_patches = int(self.models[0].patch_embed.num_patches)
        self.num_prefix = int(self.models[0].num_prefix_tokens)
        self.class_weights = class_weights(teachers.label_counts).to(device)  # (K, C)
        n = torch.as_tensor(teachers.num_examples, dtype=torch.float32)
        self.sample_weights = (n / n.sum()).to(device)  # (K,)
        wrapped = [_GatheredViT(m) for m in self.models]
        step = max(1, chunk_size)
        self._bounds = [(i, min(i + step, len(wrapped))) for i in range(0, len(wrapped), step)]
        self._stacks = [stack_module_state(wrapped[a:b]) for a, b in self._bounds]
        self._base = copy.deepcopy(wrapped[0]).to("meta")
        self.form: Form = form if form in ("loop", "vmap") else auto_form(device)
        self.token_stats: list[TokenStats | None] = \
            list(teachers.token_stats) or [None] * len(self.models)

    def __len__(self) -> int:
        return len(self.models)

    def _vmap_chunk(self, chunk: int, images: torch.Tensor, keep_idx: torch.Tensor | None,
                    reduce: LayerReduce | None) -> Outputs:
        def call(params: dict, buffers: dict) -> Outputs:
            return functional_call(self._base, (params, buffers), (images, keep_idx, reduce))

        params, buffers = self._stacks[chunk]
        return torch.vmap(call, in_dims=(0, 0))(params, buffers)

    def _loop_chunk(self, chunk: int, images: torch.Tensor, keep_idx: torch.Tensor | None,
                    reduce: LayerReduce | None) -> Outputs:
        a, b = self._bounds[chunk]
        outs = [_gathered(m, images, keep_idx, reduce) for m in self.models[a:b]]
        return tuple(torch.stack(parts) for parts in zip(*outs, strict=True))

    def _outputs(self, form: str, images: torch.Tensor, keep_idx: torch.Tensor | None,
                 reduce: LayerReduce | None = None) -> Outputs:
        run = self._vmap_chunk if form == "vmap" else self._loop_chunk
        if len(self._bounds) == 1:
            return run(0, images, keep_idx, reduce)
        recompute = torch.is_grad_enabled() and images.requires_grad
        outs = [checkpoint(run, i, images, keep_idx, reduce, use_reentrant=False)
                if recompute else run(i, images, keep_idx, reduce)
                for i in range(len(self._bounds))]
        return tuple(torch.cat(parts) for parts in zip(*outs, strict=True))

    def teacher_outputs(self, images: torch.Tensor, keep_idx: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-teacher logits ``(K, B, C)`` and CLS attention ``(K, B, prefix + n)``."""
        logits, attention = self._outputs(self.form, images, keep_idx)
        return logits, attention

    def teacher_outputs_layers(self, images: torch.Tensor, keep_idx: torch.Tensor | None,
                               reduce: LayerReduce
                               ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """:meth:`teacher_outputs`, plus ``reduce`` of each teacher's patch tokens per layer.

        Each reduced tensor is ``(K, depth + 1, ...)``, taken over the kept tokens
        only (``forward_gathered_layers``); the priors of synthesis read them.
        """
        logits, attention, *per_layer = self._outputs(self.form, images, keep_idx, reduce)
        return logits, attention, tuple(per_layer)

    @property
    def has_token_stats(self) -> torch.Tensor:
        """``(K,)`` bool: which teachers came with token statistics."""
        return torch.tensor([s is not None for s in self.token_stats], device=self.device)

    def stats_targets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The teachers' uploaded moments ``(K, depth + 1, D)`` (zeros where missing)."""
        present = next((s for s in self.token_stats if s is not None), None)
        if present is None:
            raise ValueError("no teacher came with token statistics")
        zeros = torch.zeros_like(present.mean)
        mean = torch.stack([s.mean if s is not None else zeros for s in self.token_stats])
        var = torch.stack([s.var if s is not None else zeros for s in self.token_stats])
        return mean.to(self.device), var.to(self.device)

    def mixture(self, logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """Ensemble probabilities ``(B, C)`` from per-teacher logits ``(K, B, C)``."""
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        if self.weighting == "uniform":
            return probs.mean(dim=0)
        if self.weighting == "samples":
            return torch.einsum("k,kbc->bc", self.sample_weights, probs)
        mixed = torch.einsum("kc,kbc->bc", self.class_weights, probs)
        return mixed / mixed.sum(dim=-1, keepdim=True).clamp_min(1e-12)

    def target_weights(self, labels: torch.Tensor) -> torch.Tensor:
        """Each teacher's share of each target class: ``(K, B)``."""
        return self.class_weights[:, labels]

    @torch.no_grad()
    def predict(self, images: torch.Tensor, temperature: float = 1.0,
                keep_idx: torch.Tensor | None = None) -> torch.Tensor:
        """Ensemble probabilities for ``images`` (optionally from kept tokens only)."""
        logits, _ = self.teacher_outputs(images.to(self.device), keep_idx)
        return self.mixture(logits, temperature)
