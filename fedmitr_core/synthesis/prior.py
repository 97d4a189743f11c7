"""Priors that make synthetic images look like the clients' data, read from the teachers' tokens.

A prior reduces each teacher's kept patch tokens at every layer
(:meth:`SynthesisPrior.reduce`, applied inside the ensemble's forward, so it
works for every ensemble form and under the token-gather forward) and turns
the reductions into a loss term (:meth:`SynthesisPrior.forward`).

- :class:`FeatureStatsPrior` matches the token statistics the clients reported
  (DESIGN.md §9): the ViT analogue of DeepInversion's BatchNorm-statistics loss;
  :class:`ClassMomentsStatsPrior` matches each client's on the images of its classes.
- :class:`PatchSimilarityPrior` needs no statistics: PSAQ-ViT's patch-similarity
  entropy, for teachers that came without them.

:func:`synthesis_prior` builds what a run's settings ask for, or None.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fedmitr_core.config import PriorConfig
from fedmitr_core.models.token_stats import prior_layers
from fedmitr_core.models.tokens import token_moments
from fedmitr_core.server.ensemble import TeacherEnsemble

Reduced = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class FrozenTokens:
    """The patch tokens sparse inversion pruned so far, at the features they had when pruned.

    ``first`` and ``second``: per-teacher sums of their features and squared
    features, ``(K, depth + 1, D)``; ``count`` of them in the batch; ``kept``:
    the tokens the forward still carries (batch × kept patches).
    """

    first: torch.Tensor
    second: torch.Tensor
    count: int
    kept: int

    def merge(self, mean: torch.Tensor, var: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Moments of the kept tokens ``(K, depth + 1, D)`` -> moments of kept and pruned."""
        total = self.kept + self.count
        merged_mean = (mean * self.kept + self.first) / total
        second = ((var + mean * mean) * self.kept + self.second) / total
        return merged_mean, (second - merged_mean * merged_mean).clamp_min(0.0)


def masked_sums(mask: torch.Tensor) -> Callable[[torch.Tensor], Reduced]:
    """A layer reduction: per-channel sums of the features and their squares, masked.

    Only the tokens where ``mask`` ``(B, n)`` is True count; sums run over the batch.
    """
    weights = mask.float().unsqueeze(-1)

    def reduce(patches: torch.Tensor) -> Reduced:
        chosen = patches * weights
        return chosen.sum(dim=(0, 1)), (chosen * patches).sum(dim=(0, 1))

    return reduce


class SynthesisPrior(nn.Module):
    """A loss term computed from per-layer reductions of each teacher's patch tokens."""

    num_outputs = 0  # how many tensors ``reduce`` returns
    reads_pruned = False  # whether ``forward`` counts the tokens sparse inversion pruned

    def reduce(self, patches: torch.Tensor) -> Reduced:
        """Patch tokens ``(B, n, D)`` of one layer -> this prior's tensors."""
        raise NotImplementedError

    def forward(self, reduced: Reduced, target_weights: torch.Tensor,
                frozen: FrozenTokens | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """The weighted term and its parts, from ``reduced`` ``(K, depth + 1, ...)`` each.

        ``frozen``: the tokens pruned so far, for a prior that ``reads_pruned``.
        """
        raise NotImplementedError


def _shares(mask: torch.Tensor) -> torch.Tensor:
    mask = mask.float()
    return mask / mask.sum().clamp_min(1.0)


class FeatureStatsPrior(SynthesisPrior):
    """``weight · Σ_k a_k Σ_l (‖μ_l(x) − μ_{k,l}‖₂ + ‖σ²_l(x) − σ²_{k,l}‖₂)``.

    ``μ_l(x), σ²_l(x)``: the batch's patch-token moments at layer ``l`` in teacher
    ``k``'s forward; ``μ_{k,l}, σ²_{k,l}``: what client ``k`` reported of its
    data; ``a_k`` sums to 1 over the teachers that reported any: uniform, or
    each teacher's share of the batch's target classes (``class``). Unsquared
    norms bound each teacher's pull on the images by its ``a_k``, however far
    off its statistics are.

    Parameters
    ----------
    weight
        The prior's coefficient.
    target_mean, target_var
        ``(K, depth + 1, D)``: the clients' reported moments (any values where
        ``available`` is False).
    available
        ``(K,)`` bool: which teachers reported statistics.
    layers
        Layer indices to match (0: the embedding, ``i + 1``: block ``i``).
    teachers
        ``uniform`` or ``class``.
    pruned
        Under sparse inversion, the batch's moments are those of the kept tokens
        (``kept``), or of the kept tokens and the pruned ones at the features they
        had when pruned (``frozen``): the clients' statistics cover every token of
        their images, background included, and kept tokens alone are pulled to
        look like all of them.
    """

    num_outputs = 2

    def __init__(self, weight: float, target_mean: torch.Tensor, target_var: torch.Tensor,
                 available: torch.Tensor, layers: list[int], teachers: str = "uniform",
                 pruned: str = "kept") -> None:
        super().__init__()
        self.reads_pruned = pruned == "frozen"
        if not bool(available.any()):
            raise ValueError("the feature-statistics prior needs at least one teacher "
                             "with token statistics")
        self.weight, self.teachers = weight, teachers
        self.layers = list(layers)
        self.register_buffer("target_mean", target_mean[:, self.layers].float())
        self.register_buffer("target_var", target_var[:, self.layers].float())
        self.register_buffer("available", available.float())

    def reduce(self, patches: torch.Tensor) -> Reduced:
        """The per-channel moments of the layer's tokens (:func:`token_moments`)."""
        return token_moments(patches)

    def teacher_shares(self, target_weights: torch.Tensor) -> torch.Tensor:
        """``a_k`` ``(K,)`` from the teachers' class shares ``(K, B)`` of the batch."""
        share = target_weights.float().mean(dim=1) if self.teachers == "class" \
            else torch.ones_like(self.available)
        share = share * self.available
        total = share.sum()
        # A batch of classes no reporting teacher holds: fall back to uniform (decided
        # on the device, no host sync in the inversion loop).
        return torch.where(total > 0, share / total.clamp_min(1e-12), _shares(self.available))

    def forward(self, reduced: Reduced, target_weights: torch.Tensor,
                frozen: FrozenTokens | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        batch_mean, batch_var = reduced
        if frozen is not None and self.reads_pruned:
            batch_mean, batch_var = frozen.merge(batch_mean.float(), batch_var.float())
        return self._term(batch_mean[:, self.layers].float(), batch_var[:, self.layers].float(),
                          target_weights)

    def _term(self, batch_mean: torch.Tensor, batch_var: torch.Tensor,
              target_weights: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """The weighted distance of the matched layers' moments ``(K, layers, D)``."""
        dist = ((batch_mean - self.target_mean).norm(dim=-1)
                + (batch_var - self.target_var).norm(dim=-1))
        value = (self.teacher_shares(target_weights) * dist.sum(dim=1)).sum()
        return self.weight * value, {"stats": float(value.detach())}


class ClassMomentsStatsPrior(FeatureStatsPrior):
    """:class:`FeatureStatsPrior` with each teacher's moments taken over its classes' images.

    Teacher ``k``'s batch moments weigh image ``b`` by ``k``'s share of its target
    class, ``w_{k,y_b}`` (normalised over the batch), and its term by its share of
    the batch (``class``). A client that holds one class is matched on that class's
    images only: under ``uniform`` every image is pulled towards every client's
    statistics, so a batch of ten classes is pulled towards each client's one or two.
    Under sparse inversion the moments are those of the kept tokens.
    """

    def __init__(self, weight: float, target_mean: torch.Tensor, target_var: torch.Tensor,
                 available: torch.Tensor, layers: list[int]) -> None:
        super().__init__(weight, target_mean, target_var, available, layers, "class")

    def reduce(self, patches: torch.Tensor) -> Reduced:
        """Per image ``(B, D)``: the mean of its tokens' features and of their squares."""
        return patches.mean(dim=1), patches.pow(2).mean(dim=1)

    def forward(self, reduced: Reduced, target_weights: torch.Tensor,
                frozen: FrozenTokens | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        first, second = (r[:, self.layers].float() for r in reduced)  # (K, layers, B, D)
        weights = target_weights.float() * self.available[:, None]
        total = weights.sum(dim=1, keepdim=True)
        # A teacher none of whose classes is in the batch weighs the images uniformly
        # (its term then has no weight, unless no reporting teacher has any).
        image_weights = torch.where(total > 0, weights / total.clamp_min(1e-12),
                                    torch.full_like(weights, 1.0 / weights.shape[1]))
        mean = torch.einsum("kb,klbd->kld", image_weights, first)
        var = (torch.einsum("kb,klbd->kld", image_weights, second) - mean * mean).clamp_min(0.0)
        return self._term(mean, var, target_weights)


def similarity_entropy(patches: torch.Tensor, bandwidth: float = 0.01, points: int = 10
                       ) -> torch.Tensor:
    """Per image ``(B,)``: the differential entropy of its patches' cosine similarities.

    PSAQ-ViT's estimate: a Gaussian kernel density (``bandwidth``) of the ``n²``
    similarities, read at ``points`` values spanning the batch's range and
    integrated by the trapezoidal rule (density + 1e-4 inside the log).
    """
    unit = F.normalize(patches.float(), dim=-1)
    sims = (unit @ unit.transpose(1, 2)).flatten(1)  # (B, n²)
    lo, hi = sims.min().detach(), sims.max().detach()
    grid = lo + (hi - lo) * torch.linspace(0.0, 1.0, points, device=sims.device)
    diffs = grid[None, :, None] - sims[:, None, :]
    density = torch.exp(-diffs.pow(2) / (2 * bandwidth**2)).mean(dim=-1)
    density = density / math.sqrt(2 * math.pi * bandwidth**2) + 1e-4
    f = -density * density.log()
    step = (hi - lo) / (points - 1)
    return ((f[:, 1:] + f[:, :-1]) / 2).sum(dim=-1) * step


class PatchSimilarityPrior(SynthesisPrior):
    """``−weight · Σ_k c_k Σ_l mean_b H_l(x_b)``: diverse patch similarities, no statistics.

    PSAQ-ViT's patch-similarity entropy (Li et al., ECCV 2022): real images
    make a ViT's patches similar to each other in varied degrees, noise does
    not. ``H_l`` is :func:`similarity_entropy` of block ``l``'s output tokens
    (PSAQ-ViT reads each block's attention output before the projection; the
    block output is what the token-gather forward carries), over every block;
    ``c_k`` is uniform over the teachers it ``applies`` to.
    """

    num_outputs = 1

    def __init__(self, weight: float, applies: torch.Tensor, depth: int) -> None:
        super().__init__()
        if not bool(applies.any()):
            raise ValueError("the patch-similarity prior applies to no teacher")
        self.weight = weight
        self.layers = list(range(1, depth + 1))
        self.register_buffer("shares", _shares(applies))

    def reduce(self, patches: torch.Tensor) -> Reduced:
        """The layer's :func:`similarity_entropy` per image."""
        return (similarity_entropy(patches),)

    def forward(self, reduced: Reduced, target_weights: torch.Tensor,
                frozen: FrozenTokens | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        entropy = reduced[0][:, self.layers].float().mean(dim=-1).sum(dim=1)  # (K,)
        value = (self.shares * entropy).sum()
        return -self.weight * value, {"similarity": float(value.detach())}


class CombinedPrior(SynthesisPrior):
    """Several priors read from one forward: their reductions side by side, their terms summed."""

    def __init__(self, priors: list[SynthesisPrior]) -> None:
        super().__init__()
        self.priors = nn.ModuleList(priors)
        self.num_outputs = sum(p.num_outputs for p in priors)
        self.reads_pruned = any(p.reads_pruned for p in priors)

    def reduce(self, patches: torch.Tensor) -> Reduced:
        return tuple(t for p in self.priors for t in p.reduce(patches))

    def forward(self, reduced: Reduced, target_weights: torch.Tensor,
                frozen: FrozenTokens | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        total, parts, start = torch.zeros((), device=reduced[0].device), {}, 0
        for prior in self.priors:
            term, prior_parts = prior(reduced[start:start + prior.num_outputs], target_weights,
                                      frozen)
            total, start = total + term, start + prior.num_outputs
            parts.update(prior_parts)
        return total, parts


def synthesis_prior(ensemble: TeacherEnsemble, settings: PriorConfig, stats_weight: float
                    ) -> SynthesisPrior | None:
    """The priors a run's settings ask for on ``ensemble``; None when there are none.

    The token-statistics prior at ``stats_weight`` covers the teachers that sent
    statistics (off when ``feature-stats`` is false or the weight is 0); the
    ``fallback-prior`` covers the others (all of them when ``feature-stats`` is false).
    """
    has_stats = ensemble.has_token_stats
    if not settings.feature_stats:
        has_stats = torch.zeros_like(has_stats)
    priors: list[SynthesisPrior] = []
    if stats_weight > 0 and bool(has_stats.any()):
        mean, var = ensemble.stats_targets()
        layers = prior_layers(settings.feature_stats_layers, mean.shape[1] - 1)
        if settings.feature_stats_teachers == "class-moments":
            priors.append(ClassMomentsStatsPrior(stats_weight, mean, var, has_stats, layers))
        else:
            priors.append(FeatureStatsPrior(stats_weight, mean, var, has_stats, layers,
                                            settings.feature_stats_teachers,
                                            settings.feature_stats_pruned))
    without = ~has_stats
    if settings.fallback_prior == "patch-similarity" and settings.fallback_prior_weight > 0 \
            and bool(without.any()):
        depth = len(ensemble.models[0].blocks)
        priors.append(PatchSimilarityPrior(settings.fallback_prior_weight, without, depth))
    if not priors:
        return None
    prior = priors[0] if len(priors) == 1 else CombinedPrior(priors)
    return prior.to(ensemble.device)
