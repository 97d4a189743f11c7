"""Deployed clients' own data: exported partitions, the data-path loaders, their errors."""

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from client_app.app import app as client_app
from fedmitr_core.client.training import client_partition, initial_model
from fedmitr_core.config import parse_config
from fedmitr_core.data.datasets import DataSpecError, load_dataset
from fedmitr_core.data.local import LocalDataError, load_local_data
from fedmitr_core.export_partitions import export_partitions, main


@pytest.fixture(scope="module")
def digits():
    cfg = parse_config({"alpha": 0.3, "seed": 3})
    return cfg, load_dataset(cfg.data, cfg.seed)


def test_exported_npz_loads_back_as_the_simulated_partition(digits, tmp_path):
    cfg, splits = digits
    paths = export_partitions(cfg, 3, tmp_path, "npz")
    assert [p.name for p in paths] == ["site-0.npz", "site-1.npz", "site-2.npz"]
    spec = splits.spec
    total = 0
    for pid, path in enumerate(paths):
        expected = client_partition(cfg, splits, pid, 3)
        got = load_local_data(path, spec)
        assert torch.equal(got.labels, expected.labels)
        torch.testing.assert_close(got.images, expected.images, atol=1e-5, rtol=0)
        total += len(got)
    assert total == len(splits.train)  # every training image went to one site


def test_exported_image_tree_loads_back_with_the_server_class_order(digits, tmp_path):
    cfg, splits = digits
    (path,) = export_partitions(cfg, 1, tmp_path, "imagefolder")
    assert sorted(p.name for p in path.iterdir()) == sorted(splits.spec.class_names)
    got = load_local_data(path, splits.spec)
    expected = splits.train
    # The tree is read class by class, so compare per class; PNG keeps 8 bits.
    for c in range(splits.spec.num_classes):
        a, b = got.images[got.labels == c], expected.images[expected.labels == c]
        assert len(a) == len(b)
        torch.testing.assert_close(a.mean(0), b.mean(0), atol=0.02, rtol=0)


def test_uint8_channels_last_npz_is_resized_and_normalised(digits, tmp_path):
    _, splits = digits
    spec = splits.spec
    pixels = np.full((4, 8, 8, 1), 255, dtype=np.uint8)
    np.savez(tmp_path / "d.npz", images=pixels, labels=np.array([0, 1, 2, 9]))
    got = load_local_data(tmp_path / "d.npz", spec)
    assert got.images.shape == (4, spec.in_chans, spec.image_size, spec.image_size)
    want = (1.0 - spec.mean[0]) / spec.std[0]
    torch.testing.assert_close(got.images, torch.full_like(got.images, want))


@pytest.mark.parametrize("arrays, words", [
    ({"images": np.zeros((2, 8, 8), np.uint8)}, ["'labels'", "found ['images']"]),
    ({"images": np.zeros((2, 8, 8), np.uint8), "labels": np.array([0, 10])}, ["0..9", "[10]"]),
    ({"images": np.full((2, 8, 8), 3.0, np.float32), "labels": np.array([0, 1])},
     ["[0, 1]"]),
    ({"images": np.zeros((3, 8, 8), np.uint8), "labels": np.array([0, 1])},
     ["3 images but 2 labels"]),
    ({"images": np.zeros((2, 5, 8, 8), np.uint8), "labels": np.array([0, 1])},
     ["1 or 3 channels"]),
])
def test_bad_npz_is_refused_naming_the_file(digits, tmp_path, arrays, words):
    _, splits = digits
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(LocalDataError) as err:
        load_local_data(tmp_path / "bad.npz", splits.spec)
    assert "bad.npz" in str(err.value)
    for word in words:
        assert word in str(err.value)


def test_unknown_class_folder_and_missing_path_are_named(digits, tmp_path):
    _, splits = digits
    (tmp_path / "tree" / "cat").mkdir(parents=True)
    with pytest.raises(LocalDataError, match=r"\['cat'\] are not among"):
        load_local_data(tmp_path / "tree", splits.spec)
    with pytest.raises(LocalDataError, match="node config 'data-path'"):
        load_local_data(tmp_path / "nowhere.npz", splits.spec)


def test_client_app_trains_on_its_data_path(digits, tmp_path, tiny_run_config):
    cfg, splits = digits
    run_config = {**tiny_run_config, "alpha": 0.3, "seed": 3}
    (path,) = export_partitions(cfg, 1, tmp_path / "sites", "npz")[:1]
    arrays = ArrayRecord(initial_model(cfg, splits.spec).state_dict())
    spec = ConfigRecord(splits.spec.to_record())
    ctx = Context(run_id=1, node_id=12, node_config={"data-path": str(path)},
                  state=RecordDict(), run_config=run_config)

    msg = Message(content=RecordDict({"arrays": arrays, "config": spec}), dst_node_id=12,
                  message_type="train")
    reply = client_app(msg, ctx)
    assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
    metrics = reply.content.metric_records["metrics"]
    assert metrics["num-examples"] == len(splits.train)
    assert metrics["label-counts"] == np.bincount(splits.train.labels.numpy(),
                                                  minlength=10).tolist()
    assert "partition-id" not in metrics  # a deployed client has no simulated partition

    # Without the server's data spec the client cannot prepare its files: it says so.
    bare = Message(content=RecordDict({"arrays": arrays}), dst_node_id=12, message_type="train")
    with pytest.raises(DataSpecError, match="must send the data spec"):
        client_app(bare, ctx)


def test_export_command_writes_imagefolder_sites(tmp_path, capsys):
    main([str(tmp_path), "--num-partitions", "2", "--format", "imagefolder",
          "--run-config", "partitioner=pathological", "classes-per-client=2"])
    out = capsys.readouterr().out
    assert out.count("data-path=") == 2
    for pid in range(2):
        classes = [p.name for p in (tmp_path / f"site-{pid}").iterdir()
                   if any(p.iterdir())]
        assert len(classes) == 2  # pathological split: two classes per client
