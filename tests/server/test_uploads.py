"""The upload intake: validation, atomic safetensors persistence, the account of all."""

import json

import numpy as np
import pytest
import torch

from fedmitr_core.models.token_stats import token_statistics
from fedmitr_core.models.vit import build_vit
from fedmitr_core.server.uploads import (
    UPLOAD_REPORT,
    Upload,
    UploadIntake,
    expected_spec,
    load_teacher_set,
    magnitude_bounds,
    partition_client_id,
    partition_of,
    persist_upload,
    read_upload_report,
    short_reason,
    validate_upload,
)


@pytest.fixture
def model(micro_vit):
    return micro_vit(seed=0).train()


def _good(model):
    arrays = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    counts = [3] * 10
    return arrays, {"num-examples": 30, "label-counts": counts}


def test_a_good_upload_passes(model):
    arrays, metrics = _good(model)
    assert validate_upload(arrays, metrics, expected_spec(model.state_dict()), 10) == []


def _break(kind, arrays, metrics):
    name = "head.weight"
    if kind == "nan":
        arrays[name][0, 0] = np.nan
    elif kind == "inf":
        arrays[name][0, 0] = np.inf
    elif kind == "shape":
        arrays[name] = np.zeros((3, 3), dtype=np.float32)
    elif kind == "dtype":
        arrays[name] = arrays[name].astype(np.float64)
    elif kind == "missing":
        del arrays[name]
    elif kind == "extra":
        arrays["backdoor"] = np.zeros(2, dtype=np.float32)
    elif kind == "huge":
        arrays["pos_embed"] = np.zeros((1, 10_000_000), dtype=np.float32)
    elif kind == "no-count":
        del metrics["label-counts"]
    elif kind == "negative":
        metrics["label-counts"] = [-1] + [3] * 9
    elif kind == "inconsistent":
        metrics["num-examples"] = 31
    elif kind == "zero-examples":
        metrics["num-examples"] = 0
    elif kind == "wrong-classes":
        metrics["label-counts"] = [3] * 9
    elif kind == "overflow":  # passes a sum check, overflows int64
        metrics["label-counts"] = [2**63] + [0] * 9
        metrics["num-examples"] = 2**63
    elif kind == "string-counts":
        metrics["label-counts"] = ["3"] * 10
    elif kind == "bool-examples":
        metrics["num-examples"] = True
    elif kind == "fractional":
        metrics["label-counts"] = [2.5, 3.5] + [3] * 8


KINDS = ["nan", "inf", "shape", "dtype", "missing", "extra", "huge", "no-count",
         "negative", "inconsistent", "zero-examples", "wrong-classes", "overflow",
         "string-counts", "bool-examples", "fractional"]


@pytest.mark.parametrize("kind", KINDS)
def test_each_bad_upload_is_rejected_with_a_reason(model, kind):
    arrays, metrics = _good(model)
    _break(kind, arrays, metrics)
    problems = validate_upload(arrays, metrics, expected_spec(model.state_dict()), 10)
    assert problems, kind
    assert all(isinstance(p, str) and p for p in problems)


def test_persisted_uploads_load_back_as_the_same_models(tmp_path, model):
    arrays, _ = _good(model)
    up = Upload("partition-0001-node-7", arrays, 30, np.array([3] * 10), {"x": 1.0})
    path = persist_upload(tmp_path, up)
    assert path.suffix == ".safetensors"
    assert not list(tmp_path.glob(".*.tmp"))
    teachers = load_teacher_set(tmp_path, lambda: build_vit("vit-micro", 10, 16, 1, 4))
    assert teachers.client_ids == ["partition-0001-node-7"]
    assert teachers.num_examples.tolist() == [30]
    x = torch.randn(2, 1, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(teachers.models[0](x), model.eval()(x))


def test_loading_from_an_empty_folder_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_teacher_set(tmp_path, lambda: build_vit("vit-micro", 10, 16, 1, 4))


def test_intake_persists_the_good_upload_at_once_and_accounts_for_every_one(tmp_path, model):
    intake = UploadIntake(tmp_path, model.state_dict(), 10)
    arrays, metrics = _good(model)
    assert intake.take("good", arrays, metrics, node=7) == []
    assert (tmp_path / "uploads" / "good.safetensors").is_file()  # before any report
    bad_arrays, bad_metrics = _good(model)
    _break("nan", bad_arrays, bad_metrics)
    problems = intake.take("bad", bad_arrays, bad_metrics)
    assert problems and "NaN" in problems[0]
    assert not (tmp_path / "uploads" / "bad.safetensors").exists()
    intake.reject("garbled", ["reply must hold exactly one ArrayRecord"], node=9)
    intake.fail(11, "no reply before 'round-timeout'")
    report = intake.write_report(**{"num-partitions": 4})
    assert json.loads((tmp_path / UPLOAD_REPORT).read_text()) == report == \
        read_upload_report(tmp_path)
    assert report["accepted"] == [{"client-id": "good", "node-id": 7, "num-examples": 30,
                                   "token-stats": "not shared"}]
    assert [r["client-id"] for r in report["rejected"]] == ["bad", "garbled"]
    assert "node-id" not in report["rejected"][0] and report["rejected"][1]["node-id"] == 9
    assert report["failed"] == [{"node-id": 11, "reason": "no reply before 'round-timeout'"}]
    assert report["num-partitions"] == 4
    assert read_upload_report(tmp_path / "elsewhere") == {}


def test_whole_float_counts_pass_and_counts_beyond_2_to_the_40_do_not(model):
    arrays, metrics = _good(model)
    floats = {"num-examples": 30.0, "label-counts": [3.0] * 10}
    assert validate_upload(arrays, floats, expected_spec(model.state_dict()), 10) == []
    huge = {"num-examples": 2**40 + 1, "label-counts": [2**40 + 1] + [0] * 9}
    problems = validate_upload(arrays, huge, expected_spec(model.state_dict()), 10)
    assert any("num-examples" in p for p in problems)
    assert any("label-counts" in p for p in problems)


def test_weights_far_beyond_the_initial_models_are_implausible(model, micro_vit):
    initial = micro_vit(seed=1).state_dict()
    bounds = magnitude_bounds(initial, 20.0)
    arrays, metrics = _good(model)  # another seed's weights: a plausible upload
    spec = expected_spec(initial)
    assert validate_upload(arrays, metrics, spec, 10, bounds=bounds) == []
    arrays["blocks.0.mlp.fc1.weight"] = np.full_like(arrays["blocks.0.mlp.fc1.weight"], 1e30)
    problems = validate_upload(arrays, metrics, spec, 10, bounds=bounds)
    assert len(problems) == 1
    assert "blocks.0.mlp.fc1.weight" in problems[0] and "max-weight-ratio" in problems[0]
    # Biases start at 0: the floor of 1 keeps their bound at the ratio itself.
    assert bounds["head.bias"] == 20.0
    assert validate_upload(arrays, metrics, spec, 10) == []  # bounds off: finite is enough


def test_nothing_a_client_sends_raises_out_of_the_intake(tmp_path, model):
    intake = UploadIntake(tmp_path, model.state_dict(), 10, max_weight_ratio=20.0)
    arrays, metrics = _good(model)
    odd_inputs = [
        ({"head.weight": object()}, metrics),
        (arrays, {"num-examples": 30, "label-counts": {"a": 1}}),
        (arrays, {"num-examples": float("nan"), "label-counts": [float("inf")] * 10}),
        (arrays, {"num-examples": "30", "label-counts": "3" * 10}),
        ({k: v.astype(object) for k, v in arrays.items()}, metrics),
        (arrays, {"num-examples": 2**63, "label-counts": [2**63] + [0] * 9}),
    ]
    for i, (a, m) in enumerate(odd_inputs):
        problems = intake.take(f"odd-{i}", a, m)
        assert problems, i
    report = read_upload_report(tmp_path)  # rewritten after every upload
    assert [r["client-id"] for r in report["rejected"]] == [f"odd-{i}" for i in range(6)]
    assert not (tmp_path / "uploads").exists()


def test_a_failed_clients_traceback_is_kept_as_its_last_line_without_colour(tmp_path, model):
    trace = ("\x1b[91mTraceback (most recent call last):\n  File \"app.py\", line 3\n"
             "    raise\nRuntimeError: CUDA out of memory\x1b[0m\n")
    assert short_reason(trace) == "RuntimeError: CUDA out of memory"
    assert short_reason("x" * 1000).endswith("...") and len(short_reason("x" * 1000)) == 300
    intake = UploadIntake(tmp_path, model.state_dict(), 10)
    intake.fail(3, trace)
    assert read_upload_report(tmp_path)["failed"] == [
        {"node-id": 3, "reason": "RuntimeError: CUDA out of memory"}]


def _stats(model, n=30):
    return token_statistics(model.eval(), torch.randn(n, 1, 16, 16)).arrays()


def test_token_statistics_are_persisted_beside_the_weights_and_load_with_the_teacher(
        tmp_path, model):
    intake = UploadIntake(tmp_path, model.state_dict(), 10)
    arrays, metrics = _good(model)
    stats = _stats(model)
    assert intake.take("with", arrays, {**metrics, "token-stats-images": 30},
                       token_stats=stats) == []
    assert intake.take("without", *_good(model)) == []
    assert (tmp_path / "uploads" / "with.stats.safetensors").is_file()
    assert not (tmp_path / "uploads" / "without.stats.safetensors").exists()
    assert [a["token-stats"] for a in read_upload_report(tmp_path)["accepted"]] == \
        ["accepted", "not shared"]
    teachers = load_teacher_set(tmp_path / "uploads", lambda: build_vit("vit-micro", 10, 16, 1, 4))
    assert teachers.client_ids == ["with", "without"]
    loaded, missing = teachers.token_stats
    assert missing is None and loaded.num_images == 30
    np.testing.assert_array_equal(loaded.mean.numpy(), stats["mean"])
    np.testing.assert_array_equal(loaded.var.numpy(), stats["var"])


def _break_stats(kind, stats, metrics):
    if kind == "negative-var":
        stats["var"][0, 0] = -1.0
    elif kind == "nan":
        stats["mean"][1, 2] = np.nan
    elif kind == "shape":
        stats["mean"] = stats["mean"][:2]
    elif kind == "dtype":
        stats["var"] = stats["var"].astype(np.float64)
    elif kind == "extra":
        stats["images"] = np.zeros((4, 48), dtype=np.float32)
    elif kind == "missing":
        del stats["var"]
    elif kind == "no-count":
        del metrics["token-stats-images"]
    elif kind == "more-images-than-examples":
        metrics["token-stats-images"] = 31
    elif kind == "not-arrays":
        stats["mean"] = "0.5"
    elif kind == "huge":  # finite, but its squares overflow float32
        stats["mean"][0] = 1e30


STATS_KINDS = ["negative-var", "nan", "shape", "dtype", "extra", "missing", "no-count",
               "more-images-than-examples", "not-arrays", "huge"]


@pytest.mark.parametrize("kind", STATS_KINDS)
def test_bad_statistics_are_refused_with_a_reason_and_the_weights_kept(tmp_path, model, kind):
    intake = UploadIntake(tmp_path, model.state_dict(), 10)
    arrays, metrics = _good(model)
    metrics["token-stats-images"] = 30
    stats = _stats(model)
    _break_stats(kind, stats, metrics)
    assert intake.take("client", arrays, metrics, token_stats=stats) == []
    note = read_upload_report(tmp_path)["accepted"][0]["token-stats"]
    assert note.startswith("refused: ") and len(note) > len("refused: "), kind
    assert (tmp_path / "uploads" / "client.safetensors").is_file()
    assert not (tmp_path / "uploads" / "client.stats.safetensors").exists()
    teachers = load_teacher_set(tmp_path / "uploads", lambda: build_vit("vit-micro", 10, 16, 1, 4))
    assert teachers.token_stats == [None]


def test_intake_records_the_epsilon_a_private_client_spent_and_refuses_nothing(tmp_path, model):
    intake = UploadIntake(tmp_path, model.state_dict(), 10)
    arrays, metrics = _good(model)
    assert intake.take("private", arrays, {**metrics, "dp-epsilon": 4.0, "dp-delta": 1e-5}) == []
    assert intake.take("odd", *_good(model)[:1], {**metrics, "dp-epsilon": float("nan")}) == []
    accepted = intake.write_report()["accepted"]
    assert accepted[0]["dp-epsilon"] == 4.0 and accepted[0]["dp-delta"] == 1e-5
    assert "dp-epsilon" not in accepted[1]  # a non-finite claim is not recorded as one


def test_a_simulated_client_id_names_its_partition_and_only_it():
    assert partition_client_id(7) == "partition-0007"
    assert partition_of(partition_client_id(7, node=123)) == 7
    assert partition_of(partition_client_id(12345)) == 12345
    for other in ("node-7", "client-partition-7", "partition-", "partition-x"):
        assert partition_of(other) is None
