"""The ViT presets and loading pretrained weights."""

import pytest
import torch
from safetensors.torch import save_file

from fedmitr_core.models.vit import MODEL_PRESETS, build_vit, load_pretrained


def test_pretrained_local_checkpoint_loads_and_skips_the_other_head(tmp_path):
    torch.manual_seed(1)
    source = build_vit("vit-micro", 100, 16, 1, 4)
    path = tmp_path / "backbone.safetensors"
    save_file(source.state_dict(), str(path))
    target = build_vit("vit-micro", 10, 16, 1, 4)
    skipped = load_pretrained(target, str(path))
    assert skipped == ["head.bias", "head.weight"]
    torch.testing.assert_close(target.pos_embed, source.pos_embed)
    with pytest.raises(FileNotFoundError, match="pretrained"):
        load_pretrained(target, str(tmp_path / "missing.pt"))


@pytest.mark.parametrize("preset", sorted(MODEL_PRESETS))
def test_presets_build_and_forward(preset):
    vit = build_vit(preset, 10, 32, 1, 8).eval()
    out = vit(torch.randn(2, 1, 32, 32))
    assert out.shape == (2, 10) and torch.isfinite(out).all()
