"""The FedMITR student: a timm ViT with a token head for token relabelling."""

from __future__ import annotations

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from fedmitr_core.models.tokens import forward_features_gathered


class StudentViT(nn.Module):
    """A ViT with its CLS head plus a token head applied to every patch token.

    Inference uses the CLS head only (``forward``); ``forward_tokens`` also
    returns the token head's logits for token relabelling. With
    ``token_head_from_cls`` the token head starts as a copy of the CLS head, so
    its first gradients agree with what the backbone already encodes instead
    of pulling the features towards a random projection.
    """

    def __init__(self, vit: VisionTransformer, token_head_from_cls: bool = False) -> None:
        super().__init__()
        self.vit = vit
        self.token_head = nn.Linear(vit.embed_dim, vit.num_classes)
        if token_head_from_cls:
            self.token_head.load_state_dict(vit.head.state_dict())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.vit(x)

    def forward_tokens(self, x: torch.Tensor, keep_idx: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """CLS logits ``(B, C)`` and token logits ``(B, n_keep, C)`` of the kept patches."""
        feats = forward_features_gathered(self.vit, x, keep_idx)
        cls_logits = self.vit.forward_head(feats)
        patch_tokens = feats[:, self.vit.num_prefix_tokens:]
        return cls_logits, self.token_head(patch_tokens)
