"""The upload intake: validation, atomic safetensors persistence, the account of all."""

import json

import numpy as np
import pytest
import torch

from fedmitr_core.models.vit import build_vit
from fedmitr_core.server.uploads import (
    UPLOAD_REPORT,
    Upload,
    UploadIntake,
    expected_spec,
    load_teacher_set,
    persist_upload,
    read_upload_report,
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
    assert validate_upload(arrays, metrics, expected_spec(model), 10) == []


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


KINDS = ["nan", "inf", "shape", "dtype", "missing", "extra", "huge", "no-count",
         "negative", "inconsistent", "zero-examples", "wrong-classes"]


@pytest.mark.parametrize("kind", KINDS)
def test_each_bad_upload_is_rejected_with_a_reason(model, kind):
    arrays, metrics = _good(model)
    _break(kind, arrays, metrics)
    problems = validate_upload(arrays, metrics, expected_spec(model), 10)
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
    intake = UploadIntake(tmp_path, expected_spec(model), 10)
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
    assert report["accepted"] == [{"client-id": "good", "node-id": 7, "num-examples": 30}]
    assert [r["client-id"] for r in report["rejected"]] == ["bad", "garbled"]
    assert "node-id" not in report["rejected"][0] and report["rejected"][1]["node-id"] == 9
    assert report["failed"] == [{"node-id": 11, "reason": "no reply before 'round-timeout'"}]
    assert report["num-partitions"] == 4
    assert read_upload_report(tmp_path / "elsewhere") == {}
