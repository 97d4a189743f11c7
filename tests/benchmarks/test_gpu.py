"""The GPU benchmark: runs without flwr, ray or datasets, and counts the work it times."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu import peak_bf16_tflops

ROOT = Path(__file__).resolve().parents[2]
# What the accelerator's image lacks (and what only other parts of the project need).
ABSENT = ("flwr", "ray", "datasets", "flwr_datasets", "opacus", "matplotlib")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("gpu")
    code = (f"import sys\nfor name in {ABSENT!r}:\n    sys.modules[name] = None\n"
            "from benchmarks.gpu import main\n"
            f"main(['--quick', '--device', 'cpu', '--out', {str(out)!r}])\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (json_file,) = out.glob("*.json")
    return json.loads(json_file.read_text()), out


def test_it_runs_with_flwr_ray_and_datasets_unimportable(quick_run):
    result, out = quick_run
    assert result["device"].startswith("CPU")
    assert result["cpu-cuda-check"] == "no CUDA device on this machine"
    assert "Skipped: no CUDA device" in next(out.glob("*.md")).read_text()


def test_sparse_inversion_counts_fewer_flops_than_dense_and_flops_grow_with_the_batch(
        quick_run):
    rows = [r for case in quick_run[0]["cases"] for r in case["inversion"]]
    dense = {(r["case"], r["batch"]): r for r in rows if r["inversion"] == "dense"}
    for row in (r for r in rows if r["inversion"] == "sparse"):
        twin = dense[(row["case"], row["batch"])]
        assert row["tokens-at-end"] < twin["tokens-at-end"]
        assert 0 < row["tflop"] < twin["tflop"]
        assert row["sparse-over-dense"] == pytest.approx(
            row["images-per-s"] / twin["images-per-s"])
    # Twice the images, twice the work (the labelling forwards included).
    assert dense[("vit-micro-32", 16)]["tflop"] == pytest.approx(
        2 * dense[("vit-micro-32", 8)]["tflop"], rel=0.02)


def test_the_students_learn_from_every_sparse_pool(quick_run):
    for case in quick_run[0]["cases"]:
        made = sum(r["batch"] for r in case["inversion"] if r["inversion"] == "sparse")
        (row,) = case["distillation"]
        assert row["pool"] == made and row["tflop"] > 0 and row["images-per-s"] > 0


@pytest.mark.parametrize(("name", "peak"), [("NVIDIA H100 PCIe", 756.0),
                                            ("NVIDIA H100 80GB HBM3", 989.0),
                                            ("NVIDIA H200", 989.0),
                                            ("NVIDIA A100-SXM4-80GB", 312.0),
                                            ("Tesla V100-SXM2-16GB", None)])
def test_the_bf16_peak_is_looked_up_by_the_most_specific_name(name, peak):
    assert peak_bf16_tflops(name) == peak


def test_the_cpu_cuda_check_finds_fp32_equal_and_bf16_within_its_tolerance():
    import torch

    from benchmarks.gpu import TOLERANCES, cpu_cuda_check

    rows = {r["quantity"]: r for r in cpu_cuda_check(torch.device("cpu"))}  # CPU against itself
    assert rows["logits fp32"]["relative difference"] == 0.0
    assert rows["gradient fp32"]["relative difference"] == 0.0
    bf16 = rows["logits bf16"]
    assert 0.0 < bf16["relative difference"] <= TOLERANCES["logits bf16"] and bf16["within"]
