"""The generator network of the generator-based baselines."""

import pytest
import torch

from fedmitr_core.synthesis.generator import ImageGenerator, reset_weights


@pytest.mark.parametrize("size", [16, 28, 32, 224])
def test_generator_makes_standardised_images_of_the_model_size(size):
    g = ImageGenerator(nz=32, image_shape=(3, size, size), width=8).train()
    x = g(torch.randn(6, 32))
    assert x.shape == (6, 3, size, size)
    # The last affine-free batch norm standardises every channel over the batch.
    assert torch.allclose(x.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-4)
    assert torch.allclose(x.std(dim=(0, 2, 3)), torch.ones(3), atol=1e-2)


def test_a_pixel_generator_makes_pixels_in_0_1_and_normalises_them_as_the_data():
    mean, std = (0.3,), (0.2,)
    g = ImageGenerator(nz=16, image_shape=(1, 16, 16), width=8, pixels=(mean, std))
    raw = g(torch.randn(5, 16)).detach()
    assert float(raw.min()) >= 0.0 and float(raw.max()) <= 1.0
    assert torch.allclose(g.to_inputs(raw), (raw - 0.3) / 0.2)
    assert "mean" not in g.state_dict()  # a checkpoint holds the trained weights only
    standardised = ImageGenerator(nz=16, image_shape=(1, 16, 16), width=8)
    x = standardised(torch.randn(5, 16)).detach()
    assert torch.equal(standardised.to_inputs(x), x)


def test_conditional_generator_depends_on_the_label_and_needs_it():
    g = ImageGenerator(nz=16, image_shape=(1, 16, 16), width=8, num_classes=10).eval()
    z = torch.randn(4, 16)
    a, b = g(z, torch.zeros(4, dtype=torch.long)), g(z, torch.ones(4, dtype=torch.long))
    assert not torch.allclose(a, b)
    with pytest.raises(ValueError, match="labels"):
        g(z)


def test_reset_weights_draws_the_same_network_from_the_same_rng():
    g = ImageGenerator(nz=8, image_shape=(1, 16, 16), width=4, rng=torch.Generator().manual_seed(3))
    first = {k: v.clone() for k, v in g.state_dict().items()}
    reset_weights(g, torch.Generator().manual_seed(4))
    assert any(not torch.equal(first[k], v) for k, v in g.state_dict().items())
    reset_weights(g, torch.Generator().manual_seed(3))
    assert all(torch.equal(first[k], v) for k, v in g.state_dict().items())
