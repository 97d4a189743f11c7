"""timm ViT presets, the FedMITR student, and loading pretrained weights."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from fedmitr_core.tokens import forward_features_gathered

if TYPE_CHECKING:
    from fedmitr_core.config import FedMITRConfig
    from fedmitr_core.data import DatasetSplits


@dataclass(frozen=True)
class ViTPreset:
    """Width, depth and heads of one ViT size."""

    embed_dim: int
    depth: int
    num_heads: int
    mlp_ratio: float = 4.0
    timm_name: str = ""


MODEL_PRESETS: dict[str, ViTPreset] = {
    "vit-micro": ViTPreset(embed_dim=48, depth=3, num_heads=3, mlp_ratio=2.0),
    "vit-tiny": ViTPreset(embed_dim=192, depth=12, num_heads=3,
                          timm_name="vit_tiny_patch16_224"),
    "vit-small": ViTPreset(embed_dim=384, depth=12, num_heads=6,
                           timm_name="vit_small_patch16_224"),
}


def build_vit(preset: str, num_classes: int, image_size: int, in_chans: int,
              patch_size: int) -> VisionTransformer:
    """A timm ``VisionTransformer`` of the named preset (CLS-token pooling)."""
    p = MODEL_PRESETS[preset]
    return VisionTransformer(
        img_size=image_size, patch_size=patch_size, in_chans=in_chans,
        num_classes=num_classes, embed_dim=p.embed_dim, depth=p.depth,
        num_heads=p.num_heads, mlp_ratio=p.mlp_ratio, class_token=True,
        global_pool="token",
    )


def vit_factory(cfg: FedMITRConfig, splits: DatasetSplits) -> Callable[[], VisionTransformer]:
    """A builder of fresh ViTs of the run's architecture for ``splits`` (no arguments)."""
    return partial(build_vit, cfg.model.model, splits.num_classes, splits.image_size,
                   splits.in_chans, cfg.model.patch_size)


def load_pretrained(model: VisionTransformer, pretrained: str) -> list[str]:
    """Load backbone weights from a local checkpoint file or a timm model name.

    Tensors whose shape does not match (the classifier head, a different patch
    grid) are skipped; their names are returned. An empty ``pretrained`` leaves
    the model as initialised. Names that are not files go to timm, which
    downloads them (users' machines only).
    """
    if not pretrained:
        return []
    path = Path(pretrained).expanduser()
    if path.suffix in (".safetensors", ".pt", ".pth", ".bin") or path.exists():
        if not path.is_file():
            raise FileNotFoundError(f"run config key 'pretrained': no file '{path}'")
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(str(path), map_location="cpu", weights_only=True)
            state = state.get("state_dict", state) if isinstance(state, dict) else state
    else:
        import timm

        state = timm.create_model(pretrained, pretrained=True).state_dict()
    own = model.state_dict()
    usable = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    model.load_state_dict(usable, strict=False)
    return sorted(set(own) - set(usable))


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
