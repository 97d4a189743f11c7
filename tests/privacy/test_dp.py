"""Differentially private clients: Opacus's accounting, the Gaussian releases, the ClientApp."""

import math

import numpy as np
import pytest
import torch
from flwr.app import Context, Message, RecordDict
from opacus.accountants import RDPAccountant

from client_app.app import app as client_app
from fedmitr_core.config import ConfigError, parse_config
from fedmitr_core.data.datasets import load_dataset
from fedmitr_core.models.token_stats import token_statistics
from fedmitr_core.models.tokens import forward_gathered_layers
from fedmitr_core.models.vit import vit_factory
from fedmitr_core.privacy.dp import (
    calibrate_noise,
    private_label_counts,
    private_token_statistics,
    release_steps,
    train_local_private,
)


@pytest.fixture(scope="module")
def small_data(tiny):
    cfg = parse_config({**tiny, "local-epochs": 2})
    splits = load_dataset(cfg.data, 0)
    return cfg, splits, splits.train.subset(np.arange(96))


def test_a_private_clients_epsilon_is_opacus_accountant_for_its_steps(small_data):
    cfg, splits, data = small_data
    cfg = parse_config({**cfg.to_flat(), "dp-noise-multiplier": 1.1})
    releases = release_steps(cfg.privacy, with_stats=True)
    model = vit_factory(cfg.model, splits.spec)()
    before = [p.detach().clone() for p in model.parameters()]
    spent = train_local_private(model, data, cfg.client, cfg.privacy, torch.device("cpu"),
                                seed=0, releases=releases)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    # 96 images at batch 16: rate 1/6, 6 steps per epoch, 2 epochs.
    assert spent.sample_rate == pytest.approx(16 / 96) and spent.steps == 12
    accountant = RDPAccountant()
    for _ in range(spent.steps):
        accountant.step(noise_multiplier=1.1, sample_rate=16 / 96)
    for _ in range(2):  # the label counts and the statistics
        accountant.step(noise_multiplier=cfg.privacy.dp_release_noise, sample_rate=1.0)
    assert spent.epsilon == pytest.approx(accountant.get_epsilon(cfg.privacy.dp_delta))


def test_the_noise_is_calibrated_to_the_target_epsilon_releases_included(small_data):
    cfg = parse_config({"dp-epsilon": 4})
    releases = release_steps(cfg.privacy, with_stats=True)
    sigma = calibrate_noise(4.0, 1e-5, 0.1, 300, releases)
    accountant = RDPAccountant()
    accountant.history = [(sigma, 0.1, 300), *releases]
    spent = accountant.get_epsilon(1e-5)
    assert 4.0 * 0.97 < spent <= 4.0
    assert calibrate_noise(4.0, 1e-5, 0.1, 300, []) < sigma  # the releases cost budget
    with pytest.raises(ConfigError, match="dp-epsilon.*dp-release-noise"):
        calibrate_noise(0.05, 1e-5, 0.1, 300, release_steps(parse_config({}).privacy, True))


def test_dp_keys_are_checked_naming_the_key():
    with pytest.raises(ConfigError, match="dp-noise-multiplier"):
        parse_config({"dp-epsilon": 8, "dp-noise-multiplier": 1.0})
    with pytest.raises(ConfigError, match="dp-epsilon"):
        parse_config({"dp-epsilon": -1})
    assert not parse_config({}).privacy.private
    assert parse_config({"dp-epsilon": 8}).privacy.private


def _per_image_norms(vit, images):
    with torch.no_grad():
        _, _, (mean, second) = forward_gathered_layers(
            vit, images, None, lambda t: (t.mean(1), t.pow(2).mean(1)))
    return torch.cat([mean, second]).transpose(0, 1).flatten(1).norm(dim=1)


def test_noiseless_unclipped_statistics_are_the_exact_ones(small_data):
    cfg, splits, data = small_data
    vit = vit_factory(cfg.model, splits.spec)().eval()
    images = data.images[:40]
    clip = float(_per_image_norms(vit, images).max()) * 2
    private = private_token_statistics(vit, images, 40, clip=clip, noise=0.0,
                                       generator=torch.Generator().manual_seed(0))
    exact = token_statistics(vit, images)
    torch.testing.assert_close(private.mean, exact.mean, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(private.var, exact.var, atol=1e-5, rtol=1e-4)
    # Clipped below every image's norm, the statistics shrink: the bound binds.
    clipped = private_token_statistics(vit, images, 40, clip=clip / 20, noise=0.0,
                                       generator=torch.Generator().manual_seed(0))
    assert clipped.mean.norm() < exact.mean.norm() / 5


def test_the_noise_on_the_statistics_has_the_configured_scale(small_data):
    cfg, splits, data = small_data
    vit = vit_factory(cfg.model, splits.spec)().eval()
    images, n, clip, noise = data.images[:20], 20, 3.0, 0.5
    clean = private_token_statistics(vit, images, n, clip, 0.0, torch.Generator())
    draws = torch.stack([
        private_token_statistics(vit, images, n, clip, noise,
                                 torch.Generator().manual_seed(s)).mean - clean.mean
        for s in range(40)])
    # The sum gets N(0, (noise * clip)^2) per coordinate; the mean divides it by n.
    assert draws.std().item() == pytest.approx(noise * clip / n, rel=0.05)
    assert abs(draws.mean().item()) < 3 * noise * clip / n / math.sqrt(draws.numel())


def test_the_noise_on_the_label_counts_has_the_configured_scale():
    labels = np.repeat(np.arange(10), 50)
    draws = np.stack([private_label_counts(labels, 10, 7.0, torch.Generator().manual_seed(s))
                      for s in range(300)]).astype(float)
    assert (draws >= 0).all()
    # Rounding adds 1/12 to the variance.
    assert draws.std() == pytest.approx(math.sqrt(49 + 1 / 12), rel=0.05)
    assert draws.mean() == pytest.approx(50, abs=1.0)


def test_a_private_client_runs_through_the_real_client_app(initial_arrays, tiny_run_config):
    run_config = {**tiny_run_config, "local-epochs": 2}
    cfg = parse_config(run_config)
    _, arrays = initial_arrays(cfg)
    msg = Message(content=RecordDict({"arrays": arrays}), dst_node_id=3, message_type="train")
    # The site sets its own ε in its node config; the run is not private.
    ctx = Context(run_id=1, node_id=3,
                  node_config={"partition-id": 1, "num-partitions": 4, "dp-epsilon": 6.0},
                  state=RecordDict(), run_config=run_config)
    reply = client_app(msg, ctx)
    assert not reply.has_error()
    metrics = reply.content.metric_records["metrics"]
    assert 6.0 * 0.97 < metrics["dp-epsilon"] <= 6.0 and metrics["dp-delta"] == 1e-5
    assert metrics["dp-noise-multiplier"] > 0 and metrics["dp-steps"] > 0
    counts = np.asarray(metrics["label-counts"])
    assert (counts >= 0).all() and counts.sum() == metrics["num-examples"]
    stats = reply.content.array_records["token-stats"].to_numpy_ndarrays()
    assert [a.shape for a in stats] == [(4, 48), (4, 48)] and (stats[1] >= 0).all()
    # The same site with dp-stats=off sends none.
    ctx.node_config["dp-stats"] = "off"
    reply = client_app(msg, ctx)
    assert "token-stats" not in reply.content.array_records
