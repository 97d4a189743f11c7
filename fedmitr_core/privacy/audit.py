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
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch import nn

from fedmitr_core.data.datasets import DatasetSplits, Split
from fedmitr_core.server.state import load_method_result, load_pool

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


def nearest_distances(queries: torch.Tensor, references: torch.Tensor, chunk: int = 512
                      ) -> torch.Tensor:
    """L2 distance from each query row to its nearest reference row."""
    refs = references.flatten(1).double()
    out = [torch.cdist(q.flatten(1).double(), refs).min(dim=1).values
           for q in queries.split(chunk)]
    return torch.cat(out).float()


def _auc(member_scores: torch.Tensor, non_member_scores: torch.Tensor) -> float:
    truth = np.r_[np.ones(len(member_scores)), np.zeros(len(non_member_scores))]
    return float(roc_auc_score(truth, np.r_[member_scores.numpy(), non_member_scores.numpy()]))


def audit_space(pool: torch.Tensor, members: torch.Tensor, non_members: torch.Tensor
                ) -> dict[str, float]:
    """Nearest-neighbour figures and the pool attack's AUC in one space (rows = images)."""
    to_members = nearest_distances(pool, members)
    to_non_members = nearest_distances(pool, non_members)
    attack = _auc(-nearest_distances(members, pool), -nearest_distances(non_members, pool))
    return {"pool-to-train-median": float(to_members.median()),
            "pool-to-heldout-median": float(to_non_members.median()),
            "pool-to-train-min": float(to_members.min()),
            "closer-to-train": float((to_members < to_non_members).float().mean()),
            "pool-attack-auc": attack}


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
def loss_attack_auc(model: nn.Module, members: Split, non_members: Split,
                    batch_size: int = 256) -> float:
    """AUC of the loss-threshold membership attack on ``model`` (0.5: nothing learnt)."""
    model.eval()

    def scores(split: Split) -> torch.Tensor:
        losses = [F.cross_entropy(model(x), y, reduction="none")
                  for x, y in zip(split.images.split(batch_size),
                                  split.labels.split(batch_size), strict=True)]
        return -torch.cat(losses)

    return _auc(scores(members), scores(non_members))


def audit_state(state_dir: Path, data: DatasetSplits, new_vit: Callable[[], nn.Module],
                seed: int = 0) -> dict[str, Any]:
    """Every saved pool and finished method model in a run's ``state/``, audited.

    Members are ``data.train`` (the clients' images), non-members ``data.test``,
    balanced by class. The feature space is a ViT from ``new_vit`` initialised with
    ``seed`` and never trained: it knows neither set, so it cannot favour members.
    """
    members, non_members = balanced_members(data.train, data.test, np.random.default_rng(seed))
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        embed = embed_with(new_vit())
    out: dict[str, Any] = {"members": len(members), "pools": {}, "loss-attack-auc": {},
                           "method-pools": {}}
    for pool_file in sorted((state_dir / "pools").glob("*.safetensors")):
        pool, _ = load_pool(pool_file, torch.Generator())
        out["pools"][pool_file.stem] = audit_pool(pool.images, members, non_members, embed)
    for folder in sorted(p for p in state_dir.iterdir() if (p / "result.json").is_file()):
        model, saved = load_method_result(folder, new_vit)
        out["loss-attack-auc"][folder.name] = loss_attack_auc(model, members, non_members)
        if saved.get("pool"):
            out["method-pools"][folder.name] = Path(saved["pool"]).stem
    return out
