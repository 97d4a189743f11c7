"""The ViT presets and loading pretrained weights through timm's checkpoint filter."""

import pytest
import torch
from safetensors.torch import save_file
from timm.layers import resample_abs_pos_embed, resample_patch_embed

from fedmitr_core.models.vit import MODEL_PRESETS, build_vit, load_pretrained


def test_pretrained_local_checkpoint_loads_and_skips_the_other_head(tmp_path):
    torch.manual_seed(1)
    source = build_vit("vit-micro", 100, 16, 1, 4)
    path = tmp_path / "backbone.safetensors"
    save_file(source.state_dict(), str(path))
    target = build_vit("vit-micro", 10, 16, 1, 4)
    load = load_pretrained(target, str(path))
    assert sorted(load.skipped) == ["head.bias", "head.weight"]
    assert "checkpoint has 100x48, model 10x48" in load.skipped["head.weight"]
    assert load.resampled == {}
    torch.testing.assert_close(target.pos_embed, source.pos_embed)
    with pytest.raises(FileNotFoundError, match="pretrained"):
        load_pretrained(target, str(tmp_path / "missing.pt"))


def test_another_grid_patch_size_and_channel_count_are_resampled(tmp_path):
    """A 32 px / patch 8 RGB checkpoint into a 32 px / patch 4 grey model (4x4 -> 8x8 grid)."""
    torch.manual_seed(2)
    source = build_vit("vit-micro", 10, 32, 3, 8)
    path = tmp_path / "other-grid.pt"
    torch.save({"state_dict": source.state_dict()}, path)
    target = build_vit("vit-micro", 10, 32, 1, 4)
    load = load_pretrained(target, str(path))

    assert load.resampled == {"patch_embed.proj.weight": "48x3x8x8 -> 48x1x4x4",
                              "pos_embed": "1x17x48 -> 1x65x48"}
    assert load.skipped == {}
    expected_pos = resample_abs_pos_embed(source.pos_embed.detach(), [8, 8], num_prefix_tokens=1)
    torch.testing.assert_close(target.pos_embed.detach(), expected_pos)
    # Resampling is linear per channel, so summing the RGB kernels first gives the same.
    expected_patch = resample_patch_embed(source.patch_embed.proj.weight.detach().sum(1, True),
                                          [4, 4])
    torch.testing.assert_close(target.patch_embed.proj.weight.detach(), expected_patch,
                               rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(target.blocks[1].mlp.fc1.weight, source.blocks[1].mlp.fc1.weight)
    record = load.record()
    assert record["loaded"] == len(target.state_dict()) and record["source"] == str(path)


def test_a_timm_name_loads_from_the_hugging_face_cache(timm_checkpoint_in_hf_cache):
    """The timm-name path, on a checkpoint written where timm's hub download finds it."""
    torch.manual_seed(3)
    name = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"
    source = timm_checkpoint_in_hf_cache(name)
    target = build_vit("vit-tiny", 10, 32, 1, 4)  # the cifar10 preset's grid: 8x8 tokens
    load = load_pretrained(target, name)
    assert load.source == name
    assert load.resampled["pos_embed"] == "1x197x192 -> 1x65x192"
    assert load.resampled["patch_embed.proj.weight"] == "192x3x16x16 -> 192x1x4x4"
    assert sorted(load.skipped) == ["head.bias", "head.weight"]
    qkv = "blocks.11.attn.qkv.weight"
    torch.testing.assert_close(target.state_dict()[qkv], source[qkv])


@pytest.mark.parametrize("preset", sorted(MODEL_PRESETS))
def test_presets_build_and_forward(preset):
    vit = build_vit(preset, 10, 32, 1, 8).eval()
    out = vit(torch.randn(2, 1, 32, 32))
    assert out.shape == (2, 10) and torch.isfinite(out).all()
