"""Batch augmentations: DENSE's per-image crop and flip."""

import torch

from fedmitr_core.data.batches import random_crop_and_flip


def test_each_image_is_a_window_of_its_zero_padded_self_and_gradients_flow():
    x = torch.rand(16, 1, 6, 6, requires_grad=True)
    out = random_crop_and_flip(x, padding=2, flip=False, rng=torch.Generator().manual_seed(0))
    padded = torch.nn.functional.pad(x.detach(), (2, 2, 2, 2))
    offsets = []
    for i in range(16):
        found = [(dy, dx) for dy in range(5) for dx in range(5)
                 if torch.equal(out[i].detach(), padded[i, :, dy:dy + 6, dx:dx + 6])]
        assert found, f"image {i} is not a crop of its padded self"
        offsets.append(found[0])
    assert len(set(offsets)) > 1  # drawn per image, not once per batch
    out.sum().backward()
    assert float(x.grad.sum()) > 0


def test_the_flip_mirrors_about_half_of_the_images_and_can_be_off():
    x = torch.rand(200, 1, 4, 4)
    rng = torch.Generator().manual_seed(1)
    out = random_crop_and_flip(x, padding=0, flip=True, rng=rng)
    mirrored = [torch.equal(o, xi.flip(-1)) for o, xi in zip(out, x, strict=True)]
    kept = [torch.equal(o, xi) for o, xi in zip(out, x, strict=True)]
    assert all(m or k for m, k in zip(mirrored, kept, strict=True))
    assert 70 < sum(mirrored) < 130
    assert torch.equal(random_crop_and_flip(x, 0, False, rng), x)
