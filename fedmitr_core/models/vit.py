"""timm ViT presets and loading pretrained weights."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from timm.models._manipulate import adapt_input_conv
from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn

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


@dataclass(frozen=True)
class PretrainedLoad:
    """What :func:`load_pretrained` did with each of the model's tensors.

    ``resampled`` maps a tensor to ``"<checkpoint shape> -> <model shape>"`` (timm's
    position-embedding and patch-embedding resampling, input-channel adaptation);
    ``skipped`` maps each tensor that kept its initialisation to the reason.
    """

    source: str = ""
    loaded: tuple[str, ...] = ()
    resampled: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        """What ``metrics.json`` and ``upload_report.json`` keep under ``pretrained``."""
        return {"source": self.source, "loaded": len(self.loaded),
                "resampled": self.resampled, "skipped": self.skipped}

    def summary(self) -> str:
        """One line for the log."""
        if not self.source:
            return "pretrained: none (every tensor initialised)"
        skipped = ", ".join(f"{k} ({v})" for k, v in self.skipped.items()) or "none"
        resampled = ", ".join(f"{k} {v}" for k, v in self.resampled.items()) or "none"
        return (f"pretrained {self.source}: {len(self.loaded)} tensors loaded; "
                f"resampled: {resampled}; kept initialised: {skipped}")


def load_pretrained(model: VisionTransformer, pretrained: str) -> PretrainedLoad:
    """Load weights from a local checkpoint file or a timm model name into ``model``.

    The checkpoint goes through timm's own ViT checkpoint filter, as when timm
    loads a checkpoint into another ``img_size``/``patch_size``: position
    embeddings are resampled to the model's grid and the patch embedding to its
    patch size; input channels are adapted as timm does (summed for one channel).
    Tensors that still do not fit (a classifier head for other classes) keep their
    initialisation and are listed in the returned report. An empty ``pretrained``
    leaves the model as initialised. Names that are not files go to timm, which
    downloads them (or reads the Hugging Face cache).
    """
    if not pretrained:
        return PretrainedLoad()
    raw = _checkpoint_state(pretrained)
    own = model.state_dict()
    state = checkpoint_filter_fn(dict(raw), model)
    key = "patch_embed.proj.weight"
    if key in state and key in own and state[key].shape[1] != own[key].shape[1]:
        state[key] = adapt_input_conv(own[key].shape[1], state[key])
    usable = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    model.load_state_dict(usable, strict=False)
    resampled = {k: f"{_shape(raw[k])} -> {_shape(v)}" for k, v in usable.items()
                 if k in raw and raw[k].shape != v.shape}
    skipped = {k: (f"checkpoint has {_shape(state[k])}, model {_shape(own[k])}"
                   if k in state else "not in the checkpoint")
               for k in sorted(set(own) - set(usable))}
    return PretrainedLoad(pretrained, tuple(sorted(usable)), resampled, skipped)


def _checkpoint_state(pretrained: str) -> dict[str, torch.Tensor]:
    path = Path(pretrained).expanduser()
    if path.suffix in (".safetensors", ".pt", ".pth", ".bin") or path.exists():
        if not path.is_file():
            raise FileNotFoundError(f"run config key 'pretrained': no file '{path}'")
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        state = torch.load(str(path), map_location="cpu", weights_only=True)
        for wrapper in ("model", "state_dict"):
            state = state.get(wrapper, state) if isinstance(state, dict) else state
        if not isinstance(state, dict):
            raise ValueError(f"run config key 'pretrained': '{path}' holds no state dict")
        return state
    import timm

    return timm.create_model(pretrained, pretrained=True).state_dict()


def _shape(t: torch.Tensor) -> str:
    return "x".join(str(s) for s in t.shape)
