"""Privacy audit: what a synthetic pool and a global model give away about training images.

Run by the experimenter, who holds the clients' data (the server never does):

- **Nearest neighbours.** For every synthetic image, the distance to the nearest
  training image (a member) and to the nearest held-out image of the same classes
  (a non-member, as many of each per class), in pixel space and in a fixed feature
  space. A pool that reproduces training images sits closer to members than to
  non-members; one that only learnt the classes does not.
- **Membership inference on the pool.** Score every candidate by minus its distance
  to the nearest synthetic image; the attack's AUC of members against non-members is
  1 for a pool that copies training images and 0.5 for one that carries nothing of
  them.
- **Membership inference on the global model.** The loss-threshold attack (Yeom et
  al., 2018): members score minus their loss; the AUC of members against
  non-members.
- **The clients' own uploads**, the reference risk: the loss attack on each
  client's uploaded model with its own images as members, and a tracing attack on
  its released token statistics (Dwork et al., 2015, "Robust traceability from
  trace amounts"): the statistics are the mean over the client's images of each
  image's per-layer token mean and second moment, so a candidate whose own
  moments point the way the release departs from a reference population is more
  likely to be in it.

Every attack reports its AUC and its true-positive rate at 1 % false positives.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.covariance import LedoitWolf
from sklearn.metrics import roc_auc_score, roc_curve
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from fedmitr_core.config import PartitionConfig
from fedmitr_core.data.datasets import DatasetSplits, Split
from fedmitr_core.data.partition import partition_indices
from fedmitr_core.models.token_stats import TokenStats
from fedmitr_core.models.tokens import forward_gathered_layers
from fedmitr_core.server.ensemble import TeacherSet
from fedmitr_core.server.reports import plot_closest_pairs
from fedmitr_core.server.state import load_method_result, load_pool
from fedmitr_core.server.uploads import partition_of

Embed = Callable[[torch.Tensor], torch.Tensor]


def balanced_members(members: Split, non_members: Split, rng: np.random.Generator
                     ) -> tuple[Split, Split]:
    """As many members as non-members of every class, drawn from both without replacement."""
    keep_m, keep_n = [], []
    m_labels, n_labels = members.labels.numpy(), non_members.labels.numpy()
    for c in np.union1d(m_labels, n_labels):
        m_idx, n_idx = np.flatnonzero(m_labels == c), np.flatnonzero(n_labels == c)
        k = min(len(m_idx), len(n_idx))
        keep_m.append(rng.choice(m_idx, k, replace=False))
        keep_n.append(rng.choice(n_idx, k, replace=False))
    return members.subset(np.concatenate(keep_m)), non_members.subset(np.concatenate(keep_n))


def nearest(queries: torch.Tensor, references: torch.Tensor, chunk: int = 512
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """L2 distance from each query row to its nearest reference row, and that row's index."""
    refs = references.flatten(1).double()
    found = [torch.cdist(q.flatten(1).double(), refs).min(dim=1) for q in queries.split(chunk)]
    return (torch.cat([f.values for f in found]).float(),
            torch.cat([f.indices for f in found]))


def nearest_distances(queries: torch.Tensor, references: torch.Tensor, chunk: int = 512
                      ) -> torch.Tensor:
    """L2 distance from each query row to its nearest reference row."""
    return nearest(queries, references, chunk)[0]


def closest_pairs(pool: torch.Tensor, members: torch.Tensor, count: int = 8
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``count`` synthetic images nearest a member, in pixel space.

    Returns their pool indices, the indices of their nearest members and the
    distances, nearest first.
    """
    dist, idx = nearest(pool, members)
    order = dist.argsort()[:count]
    return order, idx[order], dist[order]


def attack_figures(member_scores: torch.Tensor, non_member_scores: torch.Tensor,
                   fpr: float = 0.01) -> tuple[float, float]:
    """AUC and true-positive rate at ``fpr`` false positives of a membership score.

    Higher scores mean "member"; an attack that knows nothing scores AUC 0.5 and
    TPR ≈ ``fpr``.
    """
    truth = np.r_[np.ones(len(member_scores)), np.zeros(len(non_member_scores))]
    scores = np.r_[member_scores.double().numpy(), non_member_scores.double().numpy()]
    false_pos, true_pos, _ = roc_curve(truth, scores)
    return (float(roc_auc_score(truth, scores)),
            float(true_pos[false_pos <= fpr].max(initial=0.0)))


def audit_space(pool: torch.Tensor, members: torch.Tensor, non_members: torch.Tensor
                ) -> dict[str, float]:
    """Nearest-neighbour figures and the pool attack's AUC in one space (rows = images)."""
    to_members = nearest_distances(pool, members)
    to_non_members = nearest_distances(pool, non_members)
    auc, tpr = attack_figures(-nearest_distances(members, pool),
                              -nearest_distances(non_members, pool))
    return {"pool-to-train-median": float(to_members.median()),
            "pool-to-heldout-median": float(to_non_members.median()),
            "pool-to-train-min": float(to_members.min()),
            "closer-to-train": float((to_members < to_non_members).float().mean()),
            "pool-attack-auc": auc, "pool-attack-tpr": tpr}


def embed_with(model: nn.Module, batch_size: int = 256) -> Embed:
    """The fixed feature space of ``model``: its pre-logits features (timm ``forward_head``)."""

    @torch.no_grad()
    def embed(images: torch.Tensor) -> torch.Tensor:
        model.eval()
        parts = [model.forward_head(model.forward_features(x), pre_logits=True)
                 for x in images.split(batch_size)]
        return torch.cat(parts)

    return embed


def audit_pool(pool: torch.Tensor, members: Split, non_members: Split, embed: Embed
               ) -> dict[str, dict[str, float]]:
    """:func:`audit_space` in pixel space and in ``embed``'s feature space.

    ``members`` and ``non_members`` should be balanced by class
    (:func:`balanced_members`).
    """
    return {"pixel": audit_space(pool, members.images, non_members.images),
            "feature": audit_space(embed(pool), embed(members.images),
                                   embed(non_members.images))}


@torch.no_grad()
def loss_attack(model: nn.Module, members: Split, non_members: Split,
                batch_size: int = 256) -> tuple[float, float]:
    """AUC and TPR at 1 % FPR of the loss-threshold attack on ``model`` (AUC 0.5: no signal)."""
    model.eval()

    def scores(split: Split) -> torch.Tensor:
        losses = [F.cross_entropy(model(x), y, reduction="none")
                  for x, y in zip(split.images.split(batch_size),
                                  split.labels.split(batch_size), strict=True)]
        return -torch.cat(losses)

    return attack_figures(scores(members), scores(non_members))


@torch.no_grad()
def image_moments(vit: VisionTransformer, images: torch.Tensor, batch_size: int = 256
                  ) -> torch.Tensor:
    """Each image's patch-token mean and second moment at every layer, ``(B, 2 (depth+1) D)``.

    The mean over a client's images of these rows is exactly what its token
    statistics release: ``mean`` and ``var + mean²``.
    """
    vit.eval()

    def reduce(patches: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return patches.mean(dim=1), patches.pow(2).mean(dim=1)

    rows = []
    for x in images.split(batch_size):
        _, _, (first, second) = forward_gathered_layers(vit, x, None, reduce)
        rows.append(torch.cat([first.transpose(0, 1).flatten(1),
                               second.transpose(0, 1).flatten(1)], dim=1))
    return torch.cat(rows).double()


def released_moments(stats: TokenStats) -> torch.Tensor:
    """The release as one row: ``mean`` and ``var + mean²``, in :func:`image_moments`' order."""
    mean, var = stats.mean.double(), stats.var.double()
    return torch.cat([mean.flatten(), (var + mean * mean).flatten()])


def tracing_attack(vit: VisionTransformer, stats: TokenStats, members: Split,
                   non_members: Split, reference: Split) -> tuple[float, float]:
    """AUC and TPR at 1 % FPR of the tracing attack on a client's released statistics.

    ``reference`` holds images the attacker has from the same population (neither
    the members nor the non-members scored). A candidate scores
    ``(φ(x) − μ)ᵀ Σ⁻¹ (release − μ)``, with ``φ`` its :func:`image_moments`, ``μ``
    and ``Σ`` (Ledoit-Wolf shrunk) the reference's: a member pulled the release its way.
    """
    ref = image_moments(vit, reference.images)
    centre = ref.mean(dim=0)
    precision = torch.from_numpy(LedoitWolf().fit(ref.numpy()).precision_)
    direction = precision @ (released_moments(stats) - centre)

    def scores(split: Split) -> torch.Tensor:
        return (image_moments(vit, split.images) - centre) @ direction

    return attack_figures(scores(members), scores(non_members))


def audit_clients(teachers: TeacherSet, data: DatasetSplits, partition: PartitionConfig,
                  num_partitions: int, seed: int) -> dict[str, dict[str, float]]:
    """The clients' own uploads under attack: the reference risk a pool or global model adds to.

    Each teacher whose client id names its partition (``partition-<n>…``, as in
    simulations) is attacked with its own training images as members, against
    held-out test images of the same classes: the loss attack on its uploaded
    model and, when it sent token statistics, the tracing attack on them (the
    validation split is the attacker's reference population).
    """
    partitions = partition_indices(data.train.labels.numpy(), partition, num_partitions, seed)
    rng = np.random.default_rng(seed)
    out: dict[str, dict[str, float]] = {}
    released = teachers.token_stats or [None] * len(teachers)
    for model, client_id, stats in zip(teachers.models, teachers.client_ids, released,
                                       strict=True):
        pid = partition_of(client_id)
        if pid is None or pid >= len(partitions):
            continue
        own = data.train.subset(partitions[pid])
        members, non_members = balanced_members(own, data.test, rng)
        auc, tpr = loss_attack(model, members, non_members)
        row = {"members": float(len(members)), "loss-attack-auc": auc, "loss-attack-tpr": tpr}
        if stats is not None:
            auc, tpr = tracing_attack(model, stats, members, non_members, data.val)
            row.update({"stats-attack-auc": auc, "stats-attack-tpr": tpr})
        out[client_id] = row
    return out


def audit_state(state_dir: Path, data: DatasetSplits, new_vit: Callable[[], nn.Module],
                seed: int = 0, pairs_picture: Path | None = None) -> dict[str, Any]:
    """Every saved pool and finished method model in a run's ``state/``, audited.

    Members are ``data.train`` (the clients' images), non-members ``data.test``,
    balanced by class. The feature space is a ViT from ``new_vit`` initialised with
    ``seed`` and never trained: it knows neither set, so it cannot favour members.
    With ``pairs_picture``, each pool's synthetic images nearest a training image
    are drawn there beside those images (:func:`closest_pairs`).
    """
    members, non_members = balanced_members(data.train, data.test, np.random.default_rng(seed))
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        embed = embed_with(new_vit())
    out: dict[str, Any] = {"members": len(members), "pools": {}, "loss-attack-auc": {},
                           "loss-attack-tpr": {}, "method-pools": {}}
    pairs = {}
    for pool_file in sorted((state_dir / "pools").glob("*.safetensors")):
        pool, _ = load_pool(pool_file, torch.Generator())
        out["pools"][pool_file.stem] = audit_pool(pool.images, members, non_members, embed)
        if pairs_picture is not None:
            chosen, matches, dist = closest_pairs(pool.images, data.train.images)
            pairs[pool_file.stem] = (pool.images[chosen], data.train.images[matches], dist)
    if pairs_picture is not None and pairs:
        plot_closest_pairs(pairs, pairs_picture)
    for folder in sorted(p for p in state_dir.iterdir() if (p / "result.json").is_file()):
        model, saved = load_method_result(folder, new_vit)
        (out["loss-attack-auc"][folder.name],
         out["loss-attack-tpr"][folder.name]) = loss_attack(model, members, non_members)
        if saved.get("pool"):
            out["method-pools"][folder.name] = Path(saved["pool"]).stem
    return out
