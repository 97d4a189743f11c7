import numpy as np
import pytest
import torch

from fedmitr_core.models import build_vit
from fedmitr_core.uploads import (
    Upload,
    expected_spec,
    load_teacher_set,
    persist_upload,
    validate_upload,
)


@pytest.fixture
def model():
    torch.manual_seed(0)
    return build_vit("vit-micro", 10, 16, 1, 4)


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
