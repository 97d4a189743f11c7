"""The sparse-inversion benchmark's cases and its memory extrapolation."""

import pytest

from benchmarks.sparse import (
    flops_case,
    inversion_case,
    largest_batch,
    preset_estimate,
    student_case,
    token_work,
)


def test_smis_schedule_prunes_four_times_and_the_ideal_follows_the_token_count():
    row = inversion_case("vit-tiny-32", "smi", teachers=1, batch=1, iterations=40)
    # 50/100/200/300 of 2000 -> steps 1, 2, 4, 6 of 40; 64 -> 45 -> 32 -> 23 -> 17 tokens.
    assert row["prune-steps"] == [1, 2, 4, 6] and row["tokens-at-end"] == 17
    work = (1 + 45 / 64 + 2 * 32 / 64 + 2 * 23 / 64 + 34 * 17 / 64) / 40
    assert row["token-ideal-speed-up"] == pytest.approx(1 / work)
    dense = inversion_case("vit-tiny-32", "dense", teachers=1, batch=1, iterations=2)
    assert dense["tokens-at-end"] == 64 and dense["token-ideal-speed-up"] == 1.0


def test_the_student_case_runs_on_the_tokens_it_is_given():
    row = student_case("vit-tiny-32", kept_tokens=17, batch=2, steps=1)
    assert row["tokens"] == 17 and row["patches"] == 64 and row["seconds-per-step"] > 0


def test_largest_batch_follows_the_line_through_the_measurements():
    rows = [{"batch": 4, "peak-rss-mb": 2048.0}, {"batch": 8, "peak-rss-mb": 3072.0},
            {"batch": 16, "error": "killed"}]
    fit = largest_batch(rows, budget_gib=24)
    assert fit["mb-per-image"] == 256 and fit["fixed-mb"] == 1024
    assert fit["largest-batch"] == (24 * 1024 - 1024) // 256
    assert "error" in largest_batch(rows[:1])


def test_flops_per_image_match_the_published_vit_small_figure():
    # timm lists vit_small_patch16_224 at 4.6 GMACs: 9.2 GFLOPs, attention included.
    row = flops_case("vit-small", 224, 16)
    assert row["gflops-per-image"] == pytest.approx(9.2, rel=0.01)
    assert flops_case("vit-small", 32, 4)["gflops-per-image"] < row["gflops-per-image"] / 3


def test_a_preset_estimate_adds_up_from_its_config():
    est = preset_estimate("officehome", gflops=10.0)
    # OfficeHome: ViT-Small 224/16, 5 clients, 2600 images x 400 steps, 60 epochs.
    assert est["teachers"] == 5
    assert est["deepinversion-inversion-pflop"] == pytest.approx(2600 * 400 * 5 * 2 * 1e10 / 1e15)
    assert est["distillation-pflop"] == pytest.approx(60 * 2600 * (3 + 5) * 1e10 / 1e15)
    # SMI's schedule: 30 % of the tokens at steps 10, 20, 40 and 60 of 400.
    share = token_work(400, [10, 20, 40, 60], 0.3, 196)
    assert est["token-share"] == pytest.approx(share) and 0.2 < share < 0.4
    assert est["fedmitr-inversion-pflop"] == pytest.approx(
        est["deepinversion-inversion-pflop"] * share)
    hours = est["total-pflop"] * 1e15 / 100e12 / 3600
    assert est["hours-at-100-tflops"] == pytest.approx(hours)
