"""Token-gather forward and last-block CLS attention for timm ViTs.

After patch + position embedding only the kept patch tokens (plus CLS) go
through the blocks, so the cost is proportional to the kept tokens. The last
block's attention is computed explicitly (timm's fused attention never forms
the attention matrix) so that CLS -> patch attention comes out of the same
forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from timm.models.vision_transformer import Block, VisionTransformer

# Per layer: the kept patch tokens ``(B, n, D)`` -> a tuple of tensors.
LayerReduce = Callable[[torch.Tensor], tuple[torch.Tensor, ...]]


def embed_patches(vit: VisionTransformer, images: torch.Tensor) -> torch.Tensor:
    """Patch + position embedding: tokens ``(B, prefix + N, D)``."""
    x = vit.patch_embed(images)
    x = vit._pos_embed(x)
    return vit.norm_pre(vit.patch_drop(x))


def gather_tokens(tokens: torch.Tensor, keep_idx: torch.Tensor | None, num_prefix: int
                  ) -> torch.Tensor:
    """Prefix tokens plus the patch tokens at ``keep_idx`` ``(B, n_keep)``."""
    if keep_idx is None:
        return tokens
    patches = tokens[:, num_prefix:]
    idx = keep_idx.unsqueeze(-1).expand(-1, -1, patches.shape[-1])
    return torch.cat([tokens[:, :num_prefix], torch.gather(patches, 1, idx)], dim=1)


def forward_features_gathered(vit: VisionTransformer, images: torch.Tensor,
                              keep_idx: torch.Tensor | None = None) -> torch.Tensor:
    """Final-norm tokens ``(B, prefix + n_keep, D)`` from the kept patches only."""
    x = gather_tokens(embed_patches(vit, images), keep_idx, vit.num_prefix_tokens)
    return vit.norm(vit.blocks(x))


def block_with_attention(block: Block, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One timm ``Block`` forward that also returns its attention ``(B, H, T, T)``."""
    attn = block.attn
    h = block.norm1(x)
    b, t, _ = h.shape
    qkv = attn.qkv(h).reshape(b, t, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    q, k = attn.q_norm(q), attn.k_norm(k)
    weights = ((q * attn.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
    out = (weights @ v).transpose(1, 2).reshape(b, t, attn.attn_dim)
    out = attn.proj(attn.norm(out))
    x = x + block.drop_path1(block.ls1(out))
    x = x + block.drop_path2(block.ls2(block.mlp(block.norm2(x))))
    return x, weights


def forward_gathered(vit: VisionTransformer, images: torch.Tensor,
                     keep_idx: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits from the kept tokens only, and the last block's CLS attention.

    Parameters
    ----------
    vit
        A timm ``VisionTransformer`` with a class token.
    images
        ``(B, C, H, W)`` normalised images.
    keep_idx
        ``(B, n_keep)`` patch indices to keep, or ``None`` for all patches.

    Returns
    -------
    logits
        ``(B, num_classes)``.
    cls_attention
        ``(B, prefix + n_keep)``: the last block's CLS row, mean over heads; it
        sums to 1. Its patch part is ``cls_attention[:, prefix:]``, in the order
        of ``keep_idx``.
    """
    logits, attention, _ = forward_gathered_layers(vit, images, keep_idx, None)
    return logits, attention


def forward_gathered_layers(vit: VisionTransformer, images: torch.Tensor,
                            keep_idx: torch.Tensor | None, reduce: LayerReduce | None
                            ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """:func:`forward_gathered`, plus ``reduce`` of the patch tokens at every layer.

    ``reduce`` maps the kept patch tokens ``(B, n_keep, D)`` (prefix tokens left
    out, in float32) after the embedding (layer 0) and after each block (layer
    ``i + 1``) to a tuple of tensors; each comes back stacked over the layers,
    ``(depth + 1, ...)``. With ``reduce=None`` nothing is reduced and the tuple
    is empty.
    """
    prefix = vit.num_prefix_tokens
    per_layer: list[tuple[torch.Tensor, ...]] = []

    def read(tokens: torch.Tensor) -> None:
        if reduce is not None:
            per_layer.append(reduce(tokens[:, prefix:].float()))

    x = gather_tokens(embed_patches(vit, images), keep_idx, prefix)
    read(x)
    for block in vit.blocks[:-1]:
        x = block(x)
        read(x)
    x, weights = block_with_attention(vit.blocks[-1], x)
    read(x)
    logits = vit.forward_head(vit.norm(x))
    stacked = tuple(torch.stack(parts) for parts in zip(*per_layer, strict=True))
    return logits, weights[:, :, 0, :].mean(dim=1), stacked


def token_moments(patches: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and population variance ``(D,)`` over every token of ``(B, n, D)``."""
    flat = patches.flatten(0, 1)
    mean = flat.mean(dim=0)
    return mean, (flat - mean).pow(2).mean(dim=0)


def forward_gathered_stats(vit: VisionTransformer, images: torch.Tensor,
                           keep_idx: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`forward_gathered`, plus the batch's patch-token moments at every layer.

    Returns
    -------
    logits, cls_attention
        As :func:`forward_gathered`.
    token_mean, token_var
        ``(depth + 1, D)`` float32: :func:`token_moments` of the kept patch tokens
        after the embedding (layer 0) and after each block (layer ``i + 1``).
    """
    logits, attention, (mean, var) = forward_gathered_layers(vit, images, keep_idx,
                                                             token_moments)
    return logits, attention, mean, var


def all_patch_indices(batch: int, num_patches: int, device: torch.device | str
                      ) -> torch.Tensor:
    """``(batch, num_patches)`` indices 0..N-1 (every patch kept)."""
    return torch.arange(num_patches, device=device).expand(batch, -1).clone()
