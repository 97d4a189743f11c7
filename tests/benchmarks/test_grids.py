"""Pools side by side: the right images per class, read from run folders."""

from pathlib import Path

import pytest
import torch
import yaml

from benchmarks.grids import main
from fedmitr_core.config import ConfigError
from fedmitr_core.server.reports import class_examples
from fedmitr_core.server.state import save_pool
from fedmitr_core.synthesis.pool import SyntheticPool


def _pool(labels: list[int], size: int = 8, patch: int = 4) -> SyntheticPool:
    n, tokens = len(labels), (size // patch) ** 2
    kept = torch.ones(n, tokens, dtype=torch.bool)
    kept[:, 0] = False
    return SyntheticPool(images=torch.rand(n, 1, size, size), labels=torch.tensor(labels),
                         high_mask=kept & (torch.arange(tokens) % 2 == 1), kept_mask=kept,
                         soft_labels=torch.rand(n, 3), low_labels=torch.rand(n, 3))


def _saved(run: Path, pool: SyntheticPool, patch: int = 4) -> Path:
    (run / "state" / "pools").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"patch-size": patch}))
    path = run / "state" / "pools" / "sparse-inversion.safetensors"
    save_pool(path, pool, torch.Generator())
    return path


def test_class_examples_pick_the_first_images_of_each_class_and_fewer_when_short():
    pool = _pool([2, 0, 2, 1, 2, 0, 2])
    assert class_examples(pool, 4, 2) == [[1, 5], [3], [0, 2], []]


def test_pools_of_two_runs_are_drawn_side_by_side(tmp_path):
    a = _saved(tmp_path / "no-prior", _pool([0, 1, 2, 0]))
    b = _saved(tmp_path / "prior", _pool([2, 1, 0]))
    out = tmp_path / "pictures" / "grids.png"
    main([str(out), f"no prior={a}", f"prior={b}", "--per-class", "2"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pools_need_their_run_folder_and_one_patch_size(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        main([str(tmp_path / "x.png"), f"a={tmp_path / 'missing.safetensors'}"])
    a = _saved(tmp_path / "a", _pool([0, 1]))
    b = _saved(tmp_path / "b", _pool([0, 1], size=8, patch=2), patch=2)
    with pytest.raises(ConfigError, match="different patch sizes"):
        main([str(tmp_path / "x.png"), f"a={a}", f"b={b}"])
    (tmp_path / "a" / "config.yaml").unlink()
    with pytest.raises(ConfigError, match="no config.yaml"):
        main([str(tmp_path / "x.png"), f"a={a}"])
