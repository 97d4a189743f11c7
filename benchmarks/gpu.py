"""Server-side work on a GPU, measured: inversion and token-relabelling distillation.

Usage::

    python -m benchmarks.gpu [--out benchmarks/results/gpu] [--device auto] [--quick]

Needs torch, timm, numpy, pyyaml and scikit-learn only (no flwr, ray or datasets),
so it runs on a bare accelerator image. Ten teachers per case:

- ``vit-tiny-32``: ViT-Tiny at 32 px, patch 4 (64 tokens), each trained briefly on
  its Dirichlet (α 0.5) share of digits upsampled to 32 px, with its token
  statistics over its images (the prior's targets);
- ``vit-small-224``: ViT-Small at 224 px, patch 16 (196 tokens), random weights and
  statistics over random images (a step costs the same whatever the weights).

Under ``precision=auto`` (bf16 autocast on CUDA) it times sparse inversion (FedMITR's
default schedule) and dense inversion (DeepInversion), both with the token-statistics
prior, at two batch sizes, and the token-relabelling distillation (live relabelling
included) on the sparse pool: synthetic images per second, the sparse / dense ratio,
and the achieved TFLOP/s (the FLOPs of the same work counted by
``torch.utils.flop_counter``, over the measured seconds) beside the GPU's dense bf16
peak. On CUDA it also checks the teachers' forward and the inversion gradient against
the CPU's on a tiny case (same weights and inputs; tolerances in ``TOLERANCES``).
Writes ``<device>.json`` and ``<device>.md`` under ``--out``. ``--quick``: micro ViTs
and a few steps, seconds on a CPU (what the tests run).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.sparse import sync_device
from benchmarks.tables import markdown_table
from fedmitr_core.config import FedMITRConfig, parse_config
from fedmitr_core.data.datasets import DataSpec, load_dataset
from fedmitr_core.distill.losses import TokenRelabelLoss
from fedmitr_core.distill.trainer import LiveRelabel, TrainingSetup, train_on_pool
from fedmitr_core.models.student import StudentViT
from fedmitr_core.models.token_stats import token_statistics
from fedmitr_core.models.vit import build_vit
from fedmitr_core.runtime import autocast, resolve_device
from fedmitr_core.server.ensemble import TeacherEnsemble, TeacherSet
from fedmitr_core.synthesis.inversion import ModelInverter
from fedmitr_core.synthesis.pool import SyntheticPool
from fedmitr_core.synthesis.prior import synthesis_prior

ROOT = Path(__file__).resolve().parents[1]
TEACHERS = 10
# Dense (no sparsity) bf16 tensor-core peaks from the vendors' datasheets, TFLOP/s;
# the first name contained in the device's name wins.
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("GH200", 989.0),
                    ("H200", 989.0), ("H100", 989.0), ("A100", 312.0), ("L40S", 362.0),
                    ("L4", 121.0))
# CUDA against CPU on the tiny case: relative L2 difference allowed. fp32 with TF32 off
# differs by summation order only; bf16 autocast keeps 8 bits of mantissa.
TOLERANCES = {"logits fp32": 1e-5, "gradient fp32": 1e-4, "logits bf16": 3e-2}


@dataclass(frozen=True)
class Case:
    """Ten teachers of one architecture and what is timed on them."""

    name: str
    model: str
    image_size: int
    patch_size: int
    trained: bool  # trained on digits (else random weights)
    batches: tuple[int, ...]  # inversion batch sizes
    steps: int = 40  # inversion steps per batch (the app's default)
    distill_epochs: int = 5
    train_steps: int = 100  # each teacher's brief training


CASES = (Case("vit-tiny-32", "vit-tiny", 32, 4, True, (150, 300)),
         Case("vit-small-224", "vit-small", 224, 16, False, (16, 32)))
QUICK_CASES = (Case("vit-micro-32", "vit-micro", 32, 4, True, (8, 16), steps=4,
                    distill_epochs=1, train_steps=3),
               Case("vit-micro-64", "vit-micro", 64, 8, False, (8,), steps=4,
                    distill_epochs=1))


def peak_bf16_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of the named GPU, if ``PEAK_BF16_TFLOPS`` knows it."""
    return next((peak for name, peak in PEAK_BF16_TFLOPS if name in device_name), None)


def counted_flops(work: Callable[[], Any]) -> int:
    """FLOPs of ``work`` as ``torch.utils.flop_counter`` counts them.

    Attention runs the math kernel while counting: the counter has no formula for
    every fused kernel; the matmuls it counts are the same.
    """
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        work()
    return counter.get_total_flops()


def timed(work: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """``work()``'s result and its seconds, the device's queue drained on both sides."""
    sync_device(device)
    start = time.perf_counter()
    out = work()
    sync_device(device)
    return out, time.perf_counter() - start


def dirichlet_shares(labels: np.ndarray, k: int, alpha: float, rng: np.random.Generator
                     ) -> list[np.ndarray]:
    """Indices of ``labels`` split over ``k`` clients, each class by Dirichlet(``alpha``)."""
    shares: list[list[int]] = [[] for _ in range(k)]
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        cuts = (np.cumsum(rng.dirichlet([alpha] * k))[:-1] * len(idx)).astype(int)
        for client, part in enumerate(np.split(idx, cuts)):
            shares[client] += part.tolist()
    return [np.array(s if len(s) >= 8 else rng.choice(len(labels), 8).tolist()) for s in shares]


def train_briefly(vit: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor,
                  steps: int, device: torch.device, seed: int) -> None:
    """``steps`` AdamW steps of cross-entropy on random batches of 64 (a little knowledge)."""
    rng = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(vit.parameters(), lr=1e-3, weight_decay=0.05)
    vit.to(device).train()
    for _ in range(steps):
        idx = torch.randint(len(images), (64,), generator=rng)
        loss = F.cross_entropy(vit(images[idx].to(device)), labels[idx].to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    vit.eval()


def case_data(case: Case, cfg: FedMITRConfig) -> tuple[DataSpec, list[tuple[torch.Tensor,
                                                                          torch.Tensor]]]:
    """The images spec and each teacher's (images, labels): digits shares or random images."""
    rng = np.random.default_rng(0)
    if case.trained:
        splits = load_dataset(cfg.data, seed=0)
        train = splits.train
        shares = dirichlet_shares(train.labels.numpy(), TEACHERS, 0.5, rng)
        return splits.spec, [(train.images[s], train.labels[s]) for s in shares]
    spec = DataSpec(10, case.image_size, 3, (0.0,) * 3, (1.0,) * 3, tuple(map(str, range(10))))
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(32, 3, case.image_size, case.image_size, generator=gen),
             torch.as_tensor(rng.choice(10, 32, p=rng.dirichlet([0.5] * 10))))
            for _ in range(TEACHERS)]
    return spec, data


def make_teachers(case: Case, cfg: FedMITRConfig, device: torch.device
                  ) -> tuple[TeacherSet, DataSpec]:
    """The case's ten teachers, with their label counts and token statistics."""
    spec, data = case_data(case, cfg)
    models, stats = [], []
    for k, (images, labels) in enumerate(data):
        torch.manual_seed(k)
        vit = build_vit(case.model, spec.num_classes, case.image_size, spec.in_chans,
                        case.patch_size)
        if case.trained:
            train_briefly(vit, images, labels, case.train_steps, device, seed=k)
        models.append(vit.to(device).eval())
        stats.append(token_statistics(vit, images, device=device))
    counts = np.stack([np.bincount(y.numpy(), minlength=spec.num_classes) for _, y in data])
    return TeacherSet(models, counts, [f"client-{k}" for k in range(TEACHERS)], stats), spec


def _looped(ensemble: TeacherEnsemble) -> TeacherEnsemble:
    """The same teachers called one by one (what the FLOP counter sees through)."""
    loop = copy.copy(ensemble)
    loop.form = "loop"
    return loop


def make_inverter(ensemble: TeacherEnsemble, cfg: FedMITRConfig, spec: DataSpec, case: Case,
                  sparse: bool) -> ModelInverter:
    """The app's inverter over ``ensemble`` for ``case.steps`` steps, with the prior."""
    return ModelInverter(ensemble, replace(cfg.inversion, inv_iterations=case.steps), spec,
                         case.patch_size, sparse=sparse,
                         label_temperature=cfg.distill.temperature, precision="auto",
                         prior=synthesis_prior(ensemble, cfg.prior,
                                               cfg.prior.feature_stats_weight))


def measure_inversion(ensemble: TeacherEnsemble, cfg: FedMITRConfig, spec: DataSpec,
                      case: Case, sparse: bool, batch: int
                      ) -> tuple[dict[str, Any], SyntheticPool | None]:
    """One batch inverted, sparse or dense, with the prior: seconds, images/s, TFLOP/s."""
    labels = torch.arange(batch) % spec.num_classes
    row: dict[str, Any] = {"case": case.name, "inversion": "sparse" if sparse else "dense",
                           "batch": batch, "steps": case.steps}
    timed_inverter = make_inverter(ensemble, cfg, spec, case, sparse)
    counted_inverter = make_inverter(_looped(ensemble), cfg, spec, case, sparse)
    try:
        pool, seconds = timed(lambda: timed_inverter.synthesize(
            labels, torch.Generator().manual_seed(0)), ensemble.device)
        flops = counted_flops(lambda: counted_inverter.synthesize(
            labels, torch.Generator().manual_seed(0)))
    except torch.cuda.OutOfMemoryError as err:
        torch.cuda.empty_cache()
        return {**row, "error": f"out of memory: {str(err).splitlines()[0]}"}, None
    row.update({"tokens-at-end": int(pool.kept_mask[0].sum()), "seconds": seconds,
                "images-per-s": batch / seconds, "tflop": flops / 1e12,
                "tflops-per-s": flops / seconds / 1e12})
    return row, pool


def measure_distillation(ensemble: TeacherEnsemble, cfg: FedMITRConfig, spec: DataSpec,
                         case: Case, pool: SyntheticPool) -> dict[str, Any]:
    """The token-relabelling student on ``pool`` (live relabelling on): images/s, TFLOP/s."""
    d = replace(cfg.distill, distill_epochs=case.distill_epochs)
    loss = TokenRelabelLoss(d.kd_weight, d.hi_weight, d.lo_weight, d.temperature)
    setup = TrainingSetup(device=ensemble.device, precision="auto")

    def trainer(ens: TeacherEnsemble) -> Callable[[], None]:
        torch.manual_seed(0)
        student = StudentViT(build_vit(case.model, spec.num_classes, case.image_size,
                                       spec.in_chans, case.patch_size)).to(ens.device)
        live = LiveRelabel(ens, d.live_mix, d.live_shift, d.temperature, d.kd_weight)
        return lambda: train_on_pool(student, pool, loss, d, setup,
                                     torch.Generator().manual_seed(0), "distillation", live)

    _, seconds = timed(trainer(ensemble), ensemble.device)
    flops = counted_flops(trainer(_looped(ensemble)))
    seen = len(pool) * case.distill_epochs
    return {"case": case.name, "pool": len(pool), "epochs": case.distill_epochs,
            "seconds": seconds, "images-per-s": seen / seconds, "tflop": flops / 1e12,
            "tflops-per-s": flops / seconds / 1e12}


def run_case(case: Case, device: torch.device) -> dict[str, Any]:
    """Every measurement of one case; the students learn from every sparse pool made."""
    cfg = parse_config({"model": case.model, "image-size": case.image_size,
                        "patch-size": case.patch_size})
    teachers, spec = make_teachers(case, cfg, device)
    ensemble = TeacherEnsemble(teachers, "class", "auto", device)
    warm_up = make_inverter(ensemble, cfg, spec, replace(case, steps=1), sparse=False)
    warm_up.synthesize(torch.arange(min(case.batches)) % spec.num_classes,
                       torch.Generator().manual_seed(0))
    inversion, pools = [], {}
    for batch in case.batches:
        for sparse in (True, False):
            row, pool = measure_inversion(ensemble, cfg, spec, case, sparse, batch)
            inversion.append(row)
            if sparse and pool is not None:
                pools[batch] = pool
    for row in inversion:
        dense = next(r for r in inversion if r["batch"] == row["batch"]
                     and r["inversion"] == "dense")
        if row["inversion"] == "sparse" and "error" not in row and "error" not in dense:
            row["sparse-over-dense"] = row["images-per-s"] / dense["images-per-s"]
    distill = [measure_distillation(ensemble, cfg, spec, case,
                                    SyntheticPool.concat(list(pools.values())))] if pools else []
    return {"case": case.name, "form": ensemble.form, "inversion": inversion,
            "distillation": distill}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm())


def tiny_outputs(teachers: TeacherSet, device: torch.device, images: torch.Tensor,
                 keep: torch.Tensor, labels: torch.Tensor, precision: str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The teachers' logits on the kept tokens and the gradient of the ensemble's CE."""
    ensemble = TeacherEnsemble(copy.deepcopy(teachers), "class", "loop", device)
    x = images.to(device).requires_grad_(True)
    with autocast(device, precision):
        logits, _ = ensemble.teacher_outputs(x, keep.to(device))
    loss = F.cross_entropy(ensemble.mixture(logits.float()), labels.to(device))
    (grad,) = torch.autograd.grad(loss, x)
    return logits.detach(), grad


def cpu_cuda_check(device: torch.device | None = None) -> list[dict[str, Any]]:
    """``device`` (CUDA by default) against CPU: two micro teachers at 16 px, half the tokens.

    TF32 is off for the fp32 comparison, so only the order of summation differs.
    """
    torch.manual_seed(0)
    models = [build_vit("vit-micro", 10, 16, 1, 4).eval() for _ in range(2)]
    teachers = TeacherSet(models, np.full((2, 10), 5))
    images, labels = torch.randn(8, 1, 16, 16), torch.arange(8)
    keep = torch.stack([torch.randperm(16)[:8].sort().values for _ in range(8)])
    cpu, cuda = torch.device("cpu"), device or torch.device("cuda")
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        ref_logits, ref_grad = tiny_outputs(teachers, cpu, images, keep, labels, "fp32")
        logits, grad = tiny_outputs(teachers, cuda, images, keep, labels, "fp32")
        bf16_logits, _ = tiny_outputs(teachers, cuda, images, keep, labels, "bf16")
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    measured = {"logits fp32": _relative(logits, ref_logits),
                "gradient fp32": _relative(grad, ref_grad),
                "logits bf16": _relative(bf16_logits, ref_logits)}
    return [{"quantity": k, "relative difference": v, "tolerance": TOLERANCES[k],
             "within": v <= TOLERANCES[k]} for k, v in measured.items()]


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's architecture."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.machine()}"


def write_report(result: dict[str, Any], out: Path) -> str:
    """``<device>.json`` and ``<device>.md`` under ``out``; the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^A-Za-z0-9]+", "-", result["device"]).strip("-").lower()
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    peak = result["peak-bf16-tflops"]
    rows = [r for case in result["cases"] for r in case["inversion"]]
    distill = [r for case in result["cases"] for r in case["distillation"]]
    for r in rows + distill:
        if peak and "tflops-per-s" in r:
            r["percent-of-peak"] = 100 * r["tflops-per-s"] / peak
    md = [f"# Server-side work on {result['device']}", "",
          f"`python -m benchmarks.gpu {' '.join(result['argv'])}`; torch {result['torch']}, "
          f"precision `auto` (bf16 autocast on CUDA), ensemble form "
          f"{', '.join(sorted({c['form'] for c in result['cases']}))}, 10 teachers per case. "
          f"Dense bf16 peak: {f'{peak:g} TFLOP/s' if peak else 'not known for this device'}.",
          "", "## Inversion of one batch, with the token-statistics prior", "",
          markdown_table(rows, [
              ("case", "case"), ("inversion", "inversion"), ("images", "batch"),
              ("steps", "steps"), ("tokens at end", "tokens-at-end"), ("s", "seconds"),
              ("images / s", "images-per-s"), ("sparse / dense", "sparse-over-dense"),
              ("TFLOP", "tflop"), ("TFLOP/s", "tflops-per-s"), ("% of peak", "percent-of-peak"),
              ("error", "error")]),
          "## Token-relabelling distillation on the sparse pool (live relabelling on)", "",
          markdown_table(distill, [
              ("case", "case"), ("pool", "pool"), ("epochs", "epochs"), ("s", "seconds"),
              ("images / s", "images-per-s"), ("TFLOP", "tflop"),
              ("TFLOP/s", "tflops-per-s"), ("% of peak", "percent-of-peak")]),
          "## CUDA against CPU (two micro teachers, 16 px, half the tokens kept)", ""]
    check = result["cpu-cuda-check"]
    md += [markdown_table(check, [("quantity", "quantity"),
                                  ("relative L2 difference", "relative difference"),
                                  ("tolerance", "tolerance"), ("within", "within")])
           if isinstance(check, list) else f"Skipped: {check}.\n"]
    text = "\n".join(md)
    (out / f"{stem}.md").write_text(text, encoding="utf-8")
    return text


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/gpu")
    parser.add_argument("--device", default="auto", help="auto (CUDA if there), cuda or cpu")
    parser.add_argument("--quick", action="store_true", help="micro ViTs, a few steps")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    cases = []
    for case in QUICK_CASES if args.quick else CASES:
        start = time.perf_counter()
        cases.append(run_case(case, device))
        print(f"{case.name}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    name = device_name(device)
    result = {"device": name, "torch": torch.__version__, "argv": sys.argv[1:],
              "peak-bf16-tflops": peak_bf16_tflops(name), "cases": cases,
              "cpu-cuda-check": cpu_cuda_check() if torch.cuda.is_available()
              else "no CUDA device on this machine"}
    print(write_report(result, args.out))


if __name__ == "__main__":
    main()
