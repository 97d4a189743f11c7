"""Sparse-inversion benchmark: what pruning patches saves where there are patches to prune.

Usage::

    python -m benchmarks.sparse [--iterations 100] [--batch 4] [--teachers 2]
        [--memory-batches 4,8,16] [--out benchmarks/results/sparse]

Measured side by side in one run, each case in a fresh subprocess (so its peak
memory is its own), on whatever device the server would use:

- per architecture, ViT-Tiny at 32 px / patch 4 (64 tokens) and ViT-Small at
  224 px / patch 16 (196 tokens): one batch of ``--batch`` images inverted for
  ``--iterations`` steps through ``--teachers`` teachers, dense (DeepInversion),
  sparse with the default prune schedule and sparse with SMI's (iterations
  50/100/200/300 of 2000, 30 % each). Seconds per step and per synthetic image
  (everything ``synthesize`` does: the steps, the final labelling forwards),
  the speed-up over dense, the tokens kept at the end, and the speed-up that the
  token count alone would give (cost proportional to tokens), so what limits the
  measured one can be read off;
- the student's training step on the kept tokens against all tokens, at each
  schedule's final token count;
- peak memory of one inversion step through 10 ViT-Small teachers at 224 px at
  each of ``--memory-batches``, and the largest batch that fits 24 GiB, from a
  straight-line fit of peak memory against batch size (an extrapolation: said so
  in the table).

Teachers are untrained (the cost of a step does not depend on the weights) and
send no token statistics (the prior's per-layer moments are a small reduction
beside the blocks). Writes ``sparse.md`` and ``sparse.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.tables import markdown_table

ROOT = Path(__file__).resolve().parents[1]
ARCHS = {"vit-tiny-32": ("vit-tiny", 32, 4), "vit-small-224": ("vit-small", 224, 16)}
SCHEDULES = {"dense": None, "default": None,
             "smi": (50 / 2000, 100 / 2000, 200 / 2000, 300 / 2000)}
BUDGET_GIB = 24.0
# The paper presets and the images their clients train on (before the validation
# hold-out): CIFAR's training sets; OfficeHome Real_World (4,357) and mini-ImageNet
# (60,000) less the preset's test-fraction 0.2.
PRESET_TRAIN_IMAGES = {"cifar10": 50_000, "cifar100": 50_000, "officehome": 3_486,
                       "mini-imagenet": 48_000}
# Sustained bf16 throughput assumed for the wall-time estimate on one H100 (dense bf16
# peak 989 TFLOP/s): 10 % and 30 % of peak. An assumption, not a measurement.
ASSUMED_TFLOPS = (100.0, 300.0)


def _setup(arch: str, teachers: int, schedule: str) -> Any:
    """A case's config, a builder of inverters over its teachers, and the device.

    Imports are here: each case runs in its own subprocess.
    """
    from dataclasses import replace

    import numpy as np
    import torch

    from fedmitr_core.config import parse_config
    from fedmitr_core.data.datasets import DataSpec
    from fedmitr_core.models.vit import build_vit
    from fedmitr_core.runtime import resolve_device
    from fedmitr_core.server.ensemble import TeacherEnsemble, TeacherSet
    from fedmitr_core.synthesis.inversion import ModelInverter

    model, size, patch = ARCHS[arch]
    keys: dict[str, Any] = {"model": model, "image-size": size,
                            "patch-size": patch}
    if SCHEDULES[schedule] is not None:
        keys["prune-at"] = ",".join(f"{f:g}" for f in SCHEDULES[schedule])
    cfg = parse_config(keys)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    counts = np.stack([rng.multinomial(50, rng.dirichlet([0.5] * 10)) for _ in range(teachers)])
    models = [build_vit(model, 10, size, 3, patch) for _ in range(teachers)]
    device = resolve_device("auto")
    ensemble = TeacherEnsemble(TeacherSet(models, counts), "class", "loop", device)
    spec = DataSpec(10, size, 3, (0.0,) * 3, (1.0,) * 3, tuple(map(str, range(10))))

    def inverter(steps: int, sparse: bool) -> ModelInverter:
        settings = replace(cfg.inversion, inv_iterations=steps)
        return ModelInverter(ensemble, settings, spec, patch, sparse=sparse,
                             label_temperature=cfg.distill.temperature)

    return cfg, inverter, device


def sync_device(device: Any) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously), so a timer reads it."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def inversion_case(arch: str, schedule: str, teachers: int, batch: int, iterations: int
                   ) -> dict[str, Any]:
    """One batch inverted under ``schedule``: seconds, tokens, the token-count ideal."""
    import torch

    cfg, make_inverter, device = _setup(arch, teachers, schedule)
    inverter = make_inverter(iterations, sparse=schedule != "dense")
    labels = torch.arange(batch) % 10
    rng = torch.Generator().manual_seed(0)
    make_inverter(1, sparse=False).synthesize(labels, rng)  # warm-up
    sync_device(device)
    start = time.perf_counter()
    pool = inverter.synthesize(labels, rng)
    sync_device(device)
    seconds = time.perf_counter() - start
    share = token_work(iterations, inverter.prune_steps, cfg.inversion.prune_ratio,
                       inverter.num_patches)
    return {"arch": arch, "schedule": schedule, "teachers": teachers, "batch": batch,
            "iterations": iterations, "patches": inverter.num_patches,
            "prune-steps": inverter.prune_steps,
            "tokens-at-end": int(pool.kept_mask[0].sum()), "seconds": seconds,
            "seconds-per-step": seconds / iterations, "seconds-per-image": seconds / batch,
            "token-ideal-speed-up": 1 / share, "device": str(device)}


def student_case(arch: str, kept_tokens: int, batch: int, steps: int) -> dict[str, Any]:
    """Seconds per student training step (forward, backward, AdamW) on ``kept_tokens``."""
    import torch

    from fedmitr_core.models.student import StudentViT
    from fedmitr_core.models.vit import build_vit
    from fedmitr_core.runtime import resolve_device

    model, size, patch = ARCHS[arch]
    device = resolve_device("auto")
    torch.manual_seed(0)
    student = StudentViT(build_vit(model, 10, size, 3, patch)).to(device)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
    n = (size // patch) ** 2
    images = torch.randn(batch, 3, size, size, device=device)
    keep = torch.stack([torch.randperm(n)[:kept_tokens].sort().values for _ in range(batch)])
    keep = None if kept_tokens == n else keep.to(device)

    def step() -> None:
        cls_logits, token_logits = student.forward_tokens(images, keep)
        loss = cls_logits.logsumexp(1).mean() + token_logits.logsumexp(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    step()
    sync_device(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync_device(device)
    return {"arch": arch, "tokens": kept_tokens, "patches": n, "batch": batch,
            "seconds-per-step": (time.perf_counter() - start) / steps}


def memory_case(batch: int, teachers: int = 10) -> dict[str, Any]:
    """Peak memory of one dense inversion step through ``teachers`` ViT-Small at 224 px."""
    import torch

    from fedmitr_core.server.pipeline import peak_rss_mb

    _, make_inverter, device = _setup("vit-small-224", teachers, "dense")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    labels, rng = torch.arange(batch) % 10, torch.Generator().manual_seed(0)
    make_inverter(1, sparse=False).synthesize(labels, rng)
    sync_device(device)
    out = {"teachers": teachers, "batch": batch, "seconds": time.perf_counter() - start,
           "peak-rss-mb": peak_rss_mb(), "device": str(device)}
    if device.type == "cuda":
        out["peak-cuda-mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def flops_case(model: str, size: int, patch: int) -> dict[str, Any]:
    """Forward FLOPs of one image through ``model`` at every token, counted by torch."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from fedmitr_core.models.vit import build_vit

    vit = build_vit(model, 10, size, 3, patch).eval()
    # The math attention: the counter has no formula for CPU's fused attention kernel.
    with (torch.no_grad(), sdpa_kernel(SDPBackend.MATH),
          FlopCounterMode(display=False) as counter):
        vit(torch.zeros(1, 3, size, size))
    return {"model": model, "image-size": size, "patch-size": patch,
            "gflops-per-image": counter.get_total_flops() / 1e9}


def token_work(iterations: int, prune_steps: list[int], prune_ratio: float, patches: int
               ) -> float:
    """Mean fraction of the tokens a step runs with under a prune schedule."""
    tokens, work = patches, 0.0
    for step in range(1, iterations + 1):
        work += tokens / patches
        if step in prune_steps:
            tokens -= int(prune_ratio * tokens)
    return work / iterations


def preset_estimate(name: str, gflops: float) -> dict[str, Any]:
    """FLOPs of a paper preset's run (clients, FedMITR, DeepInversion) and hours on one GPU.

    Clients: ``local-epochs`` passes over the training images, forward and backward
    (3 forwards). Inversion: every step runs every teacher forward and backward to the
    input (2 forwards), FedMITR's on the scheduled share of the tokens. Distillation:
    the student forward and backward and every teacher forward (live relabelling) per
    image and epoch. The other methods each cost about as much as DeepInversion.
    """
    from benchmarks.accuracy import load_sweep
    from fedmitr_core.config import parse_config
    from fedmitr_core.synthesis.inversion import prune_steps

    run_config, sweep = load_sweep(ROOT / "sim_configs" / f"{name}.yaml")
    cfg = parse_config(run_config)
    inv, k = cfg.inversion, int(sweep.get("num-clients", 10))
    patches = (cfg.data.image_size // cfg.model.patch_size) ** 2
    share = token_work(inv.inv_iterations, prune_steps(inv.prune_at, inv.inv_iterations),
                       inv.prune_ratio, patches)
    f = gflops * 1e9
    train = PRESET_TRAIN_IMAGES[name] * (1 - cfg.data.val_fraction)
    pflops = {"clients": cfg.client.local_epochs * train * 3 * f / 1e15,
              "deepinversion-inversion": inv.syn_images * inv.inv_iterations * k * 2 * f / 1e15,
              "distillation": cfg.distill.distill_epochs * inv.syn_images * (3 + k) * f / 1e15}
    pflops["fedmitr-inversion"] = pflops["deepinversion-inversion"] * share
    total = sum(pflops.values()) + pflops["distillation"]  # DeepInversion distils too
    return {"preset": name, "model": cfg.model.model, "image-size": cfg.data.image_size,
            "patch-size": cfg.model.patch_size, "teachers": k, "token-share": share,
            **{f"{key}-pflop": v for key, v in pflops.items()}, "total-pflop": total,
            **{f"hours-at-{t:g}-tflops": total * 1e15 / (t * 1e12) / 3600
               for t in ASSUMED_TFLOPS}}


CASES = {"inversion": inversion_case, "student": student_case, "memory": memory_case,
         "flops": flops_case}


def _in_subprocess(kind: str, **case: Any) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.sparse", "--case", json.dumps([kind, case])]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()
        return {**case, "error": tail[-1] if tail else f"exit {proc.returncode}"}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(result), flush=True)
    return result


def largest_batch(rows: list[dict[str, Any]], budget_gib: float = BUDGET_GIB
                  ) -> dict[str, Any]:
    """The batch at which a straight line through (batch, peak memory) reaches ``budget_gib``."""
    key = "peak-cuda-mb" if all("peak-cuda-mb" in r for r in rows) else "peak-rss-mb"
    points = [(r["batch"], r[key]) for r in rows if "error" not in r]
    if len(points) < 2:
        return {"memory": key, "error": "needs two measured batch sizes"}
    (b0, m0), (b1, m1) = points[0], points[-1]
    per_image = (m1 - m0) / (b1 - b0)
    base = m0 - per_image * b0
    fits = int((budget_gib * 1024 - base) / per_image) if per_image > 0 else None
    return {"memory": key, "mb-per-image": per_image, "fixed-mb": base,
            "largest-batch": fits, "budget-gib": budget_gib}


def run(iterations: int, batch: int, teachers: int, memory_batches: list[int],
        student_steps: int = 3) -> dict[str, Any]:
    """Every case of the benchmark; the speed-ups filled in against dense."""
    from benchmarks.accuracy import load_sweep

    inversion = [_in_subprocess("inversion", arch=a, schedule=s, teachers=teachers,
                                batch=batch, iterations=iterations)
                 for a in ARCHS for s in SCHEDULES]
    for row in inversion:
        dense = next(r for r in inversion if r["arch"] == row["arch"]
                     and r["schedule"] == "dense")
        if "error" not in row and "error" not in dense:
            row["speed-up"] = dense["seconds-per-image"] / row["seconds-per-image"]
    student = []
    for arch in ARCHS:
        counts = sorted({r["tokens-at-end"] for r in inversion
                         if r["arch"] == arch and "error" not in r}, reverse=True)
        rows = [_in_subprocess("student", arch=arch, kept_tokens=c, batch=batch * 4,
                               steps=student_steps) for c in counts]
        for row in rows:
            if "error" not in row and "error" not in rows[0]:
                row["speed-up"] = rows[0]["seconds-per-step"] / row["seconds-per-step"]
        student += rows
    memory = [_in_subprocess("memory", batch=b) for b in memory_batches]
    presets = []
    for name in PRESET_TRAIN_IMAGES:
        keys = load_sweep(ROOT / "sim_configs" / f"{name}.yaml")[0]
        flops = _in_subprocess("flops", model=keys["model"], size=keys["image-size"],
                               patch=keys["patch-size"])
        presets.append({**preset_estimate(name, flops["gflops-per-image"]),
                        "gflops-per-image": flops["gflops-per-image"]})
    return {"inversion": inversion, "student": student, "memory": memory,
            "fit": largest_batch(memory), "presets": presets}


def write_report(out: Path, result: dict[str, Any]) -> str:
    """``sparse.json`` and ``sparse.md`` under ``out``; the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    result = {**result, "argv": sys.argv[1:], "cpus": os.cpu_count()}
    (out / "sparse.json").write_text(json.dumps(result, indent=1))
    fit = result["fit"]
    device = next((r["device"] for r in result["inversion"] if "device" in r), "?")
    md = ["# Sparse against dense inversion", "",
          f"`python -m benchmarks.sparse {' '.join(sys.argv[1:])}` on {os.cpu_count()} CPUs, "
          f"device {device}. Schedules: `default` prunes 30 % at 30 % and 60 % of the "
          "iterations, `smi` 30 % at 50/100/200/300 of 2000 (SMI's).", "",
          "## Inverting one batch (every step plus the final labelling forwards)", "",
          markdown_table(result["inversion"], [
              ("model", "arch"), ("patches", "patches"), ("schedule", "schedule"),
              ("teachers", "teachers"), ("images", "batch"), ("steps", "iterations"),
              ("tokens at end", "tokens-at-end"), ("s / step", "seconds-per-step"),
              ("s / image", "seconds-per-image"), ("speed-up", "speed-up"),
              ("token-count ideal", "token-ideal-speed-up"), ("error", "error")]),
          "## The student's training step on the kept tokens", "",
          markdown_table(result["student"], [
              ("model", "arch"), ("tokens", "tokens"), ("of", "patches"), ("images", "batch"),
              ("s / step", "seconds-per-step"), ("speed-up", "speed-up"), ("error", "error")]),
          "## Memory: one inversion step through 10 ViT-Small teachers at 224 px", "",
          markdown_table(result["memory"], [
              ("images", "batch"), ("s / step", "seconds"), ("peak RSS MB", "peak-rss-mb"),
              ("peak CUDA MB", "peak-cuda-mb"), ("error", "error")]),
          f"Largest batch within {fit.get('budget-gib', BUDGET_GIB):g} GiB "
          f"({fit.get('memory', '?')}, extrapolated along the line through the smallest and "
          f"largest measured batch): **{fit.get('largest-batch', fit.get('error'))}** "
          f"({fit.get('mb-per-image', float('nan')):.0f} MB per image over "
          f"{fit.get('fixed-mb', float('nan')):.0f} MB fixed).", "",
          "## Paper presets: FLOPs of a run and an estimate of its hours on one GPU", "",
          "Forward FLOPs per image counted by `torch.utils.flop_counter` on the preset's "
          "architecture; the run's FLOPs from them (`preset_estimate`: clients, FedMITR "
          "and DeepInversion, one split and seed); hours **estimated** at an assumed "
          f"sustained {' and '.join(f'{t:g}' for t in ASSUMED_TFLOPS)} TFLOP/s "
          "(10 % and 30 % of an H100's dense bf16 peak), not measured.", "",
          markdown_table(result.get("presets", []), [
              ("preset", "preset"), ("model", "model"), ("px", "image-size"),
              ("patch", "patch-size"), ("teachers", "teachers"),
              ("GFLOP / image", "gflops-per-image"), ("token share", "token-share"),
              ("clients PFLOP", "clients-pflop"),
              ("DI inversion PFLOP", "deepinversion-inversion-pflop"),
              ("FedMITR inversion PFLOP", "fedmitr-inversion-pflop"),
              ("distillation PFLOP", "distillation-pflop"), ("total PFLOP", "total-pflop"),
              *((f"h at {t:g} TFLOP/s", f"hours-at-{t:g}-tflops") for t in ASSUMED_TFLOPS)]),
          ""]
    (out / "sparse.md").write_text("\n".join(md))
    return "\n".join(md)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=100,
                        help="inversion steps per case (SMI's prune steps scale with it)")
    parser.add_argument("--batch", type=int, default=4, help="images inverted per case")
    parser.add_argument("--teachers", type=int, default=2, help="teachers in the timed cases")
    parser.add_argument("--memory-batches", default="4,8,16",
                        help="batch sizes of the 10-teacher memory cases ('' for none)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/sparse")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:  # a worker: one measurement, JSON on the last line
        kind, case = json.loads(args.case)
        print(json.dumps(CASES[kind](**case)))
        return
    result = run(args.iterations, args.batch, args.teachers,
                 [int(b) for b in args.memory_batches.split(",") if b])
    print(write_report(args.out, result))


if __name__ == "__main__":
    main()
