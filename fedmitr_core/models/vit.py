"""timm ViT presets and loading pretrained weights."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from timm.models.vision_transformer import VisionTransformer

from fedmitr_core.config import ModelConfig
from fedmitr_core.data.datasets import DataSpec


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


def vit_factory(model: ModelConfig, spec: DataSpec) -> Callable[[], VisionTransformer]:
    """A builder of fresh ViTs of the run's architecture for inputs like ``spec``."""
    return partial(build_vit, model.model, spec.num_classes, spec.image_size, spec.in_chans,
                   model.patch_size)


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
