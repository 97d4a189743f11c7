"""Scale benchmark: what the server's work costs as the number of teachers K grows.

Usage::

    python -m benchmarks.scale [--ks 10,50,100,300,500] [--steps 2] [--e2e 100,300]
        [--out benchmarks/results/scale]

Measured side by side in one run, each case in a fresh subprocess (so its peak
memory is its own):

- seconds per inversion step (the default ``syn-batch-size`` images, forward and
  backward through every teacher) and peak memory, for the loop ensemble and the
  batched (``vmap``) form, at each K, and for the fastest form with
  ``teachers-per-class=2``;
- sparse against dense inversion at equal iterations (K = 10);
- end to end, ``flwr run .`` with K simulated SuperNodes (``--e2e``): wall time,
  how every upload was accounted for, the server's peak memory.

Step timings use untrained teachers of the default architecture (the cost of a
step does not depend on the weights) with Dirichlet(0.5) label counts. Writes
``scale.md`` and ``scale.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.tables import markdown_table

ROOT = Path(__file__).resolve().parents[1]
PER_CLASS = 2


def _step_case(k: int, form: str, per_class: int, sparse: bool, iterations: int
               ) -> dict[str, Any]:
    """One measurement (run inside its own process): one batch of ``iterations`` steps."""
    import numpy as np
    import torch

    from fedmitr_core.config import parse_config
    from fedmitr_core.data.datasets import DataSpec
    from fedmitr_core.models.vit import build_vit
    from fedmitr_core.runtime import resolve_device
    from fedmitr_core.server.ensemble import TeacherEnsemble, TeacherSet, select_teachers
    from fedmitr_core.server.pipeline import peak_rss_mb
    from fedmitr_core.synthesis.inversion import ModelInverter

    torch.manual_seed(0)
    cfg = parse_config({"inv-iterations": iterations})
    device = resolve_device("auto")
    rng = np.random.default_rng(0)
    counts = np.stack([rng.multinomial(int(rng.integers(5, 60)), rng.dirichlet([0.5] * 10))
                       for _ in range(k)])
    models = [build_vit(cfg.model.model, 10, cfg.data.image_size, 1, cfg.model.patch_size)
              for _ in range(k)]
    teachers = select_teachers(TeacherSet(models, counts), per_class)
    ensemble = TeacherEnsemble(teachers, "class", form, device)
    spec = DataSpec(10, cfg.data.image_size, 1, (0.0,), (1.0,), tuple(map(str, range(10))))
    labels = torch.arange(cfg.inversion.syn_batch_size) % 10
    rng = torch.Generator().manual_seed(0)

    def inverter(c: Any, sparse: bool) -> ModelInverter:
        return ModelInverter(ensemble, c.inversion, spec, c.model.patch_size, sparse=sparse,
                             label_temperature=c.distill.temperature)

    inverter(parse_config({"inv-iterations": 1}), sparse=False).synthesize(labels, rng)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    inverter(cfg, sparse).synthesize(labels, rng)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    out = {"k": k, "form": form, "teachers-per-class": per_class, "teachers": len(ensemble),
           "sparse": sparse, "steps": iterations, "seconds-per-step": seconds / iterations,
           "seconds": seconds, "peak-rss-mb": peak_rss_mb(), "device": str(device),
           "batch": int(labels.numel())}
    if device.type == "cuda":
        out["peak-cuda-mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def _in_subprocess(**case: Any) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.scale", "--case", json.dumps(case)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return {**case, "error": proc.stderr.strip().splitlines()[-1] if proc.stderr else
                f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def end_to_end(num_clients: int, out: Path) -> dict[str, Any]:
    """``flwr run .`` with ``num_clients`` simulated SuperNodes; wall time and accounting."""
    home = Path(tempfile.mkdtemp(prefix="fedmitr-scale-"))
    control = _free_port()
    env = {**os.environ, "FLWR_HOME": str(home),
           "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(_free_port()),
           "FLWR_LOCAL_CONTROL_API_PORT": str(control),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    run_dir = home / "outputs" / f"k{num_clients}"
    cmd = [str(Path(sys.executable).parent / "flwr"), "run", ".", "--stream",
           "--federation-config", f"num-supernodes={num_clients} client-resources-num-cpus=1",
           "--run-config", f'teachers-per-class={PER_CLASS} output-dir="{home / "outputs"}" '
                           f'run-name="k{num_clients}"']
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    subprocess.run(["pkill", "-f", f"control-api-address 127.0.0.1:{control}"], check=False)
    record: dict[str, Any] = {"clients": num_clients, "wall-seconds": wall,
                              "exit-code": proc.returncode}
    metrics_file = run_dir / "metrics.json"
    if metrics_file.is_file():
        metrics = json.loads(metrics_file.read_text())
        up = metrics["uploads"]
        record.update({
            "accepted": len(up["accepted"]), "rejected": len(up["rejected"]),
            "failed": len(up["failed"]),
            "rejected-reasons": sorted({r for x in up["rejected"] for r in x["reasons"]}),
            "ensemble-teachers": len(metrics.get("ensemble-teachers", [])),
            "server-peak-rss-mb": metrics.get("server-peak-rss-mb"),
            "accuracy": {k: v["accuracy"] for k, v in metrics["results"].items()},
            "server-seconds": {k: v["seconds"] for k, v in metrics["results"].items()},
        })
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(metrics_file, out / f"e2e-k{num_clients}-metrics.json")
    else:
        record["log-tail"] = (proc.stdout + proc.stderr)[-2000:]
    shutil.rmtree(home, ignore_errors=True)
    return record


def step_cases(ks: list[int], steps_per_case: int) -> list[dict[str, Any]]:
    """Per K: the loop and vmap forms, then the faster one with ``teachers-per-class``."""
    steps: list[dict[str, Any]] = []
    for k in ks:
        for form in ("loop", "vmap"):
            steps.append(_in_subprocess(k=k, form=form, per_class=0, sparse=False,
                                        iterations=steps_per_case))
            print(json.dumps(steps[-1]), flush=True)
        timed = [s for s in steps[-2:] if "error" not in s]
        fastest = min(timed, key=lambda s: s["seconds-per-step"])["form"] if timed else "loop"
        steps.append(_in_subprocess(k=k, form=fastest, per_class=PER_CLASS, sparse=False,
                                    iterations=steps_per_case))
        print(json.dumps(steps[-1]), flush=True)
    for row in steps:
        same_k = [s for s in steps if s["k"] == row["k"] and s.get("form") == "loop"
                  and s["teachers-per-class"] == 0 and "error" not in s]
        if same_k and "error" not in row:
            row["vs-loop"] = same_k[0]["seconds-per-step"] / row["seconds-per-step"]
    return steps


def write_report(out: Path, steps: list[dict[str, Any]], sparse_dense: list[dict[str, Any]],
                 e2e: list[dict[str, Any]]) -> str:
    """``scale.json`` and ``scale.md`` under ``out``; the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    result = {"steps": steps, "sparse-vs-dense": sparse_dense, "e2e": e2e,
              "argv": sys.argv[1:], "cpus": os.cpu_count()}
    (out / "scale.json").write_text(json.dumps(result, indent=1))
    md = ["# Scale benchmark", "",
          f"`python -m benchmarks.scale {' '.join(sys.argv[1:])}` on {os.cpu_count()} CPUs "
          f"(device {steps[0].get('device', '?') if steps else '?'}).", "",
          "## One inversion step (forward + backward through the ensemble)", "",
          markdown_table(steps, [("K uploads", "k"), ("form", "form"),
                                 ("teachers-per-class", "teachers-per-class"),
                                 ("teachers run", "teachers"), ("images", "batch"),
                                 ("s / step", "seconds-per-step"), ("× vs loop", "vs-loop"),
                                 ("peak RSS MB", "peak-rss-mb"), ("error", "error")]),
          "## Sparse vs dense inversion, equal iterations (K = 10)", "",
          markdown_table(sparse_dense, [("sparse", "sparse"), ("iterations", "steps"),
                                        ("seconds", "seconds"), ("speed-up", "speed-up")]),
          "## End to end: `flwr run .` with K simulated SuperNodes, "
          f"teachers-per-class={PER_CLASS}", "",
          markdown_table(e2e, [("SuperNodes", "clients"), ("wall s", "wall-seconds"),
                               ("accepted", "accepted"), ("rejected", "rejected"),
                               ("failed", "failed"), ("ensemble teachers", "ensemble-teachers"),
                               ("server peak RSS MB", "server-peak-rss-mb"),
                               ("exit", "exit-code")])]
    (out / "scale.md").write_text("\n".join(md))
    return "\n".join(md)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ks", default="10,50,100,300,500")
    parser.add_argument("--steps", type=int, default=2, help="timed inversion steps per case")
    parser.add_argument("--e2e", default="100,300", help="clients for flwr run ('' for none)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/scale")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:  # a worker: one measurement, JSON on the last line
        print(json.dumps(_step_case(**json.loads(args.case))))
        return
    steps = step_cases([int(k) for k in args.ks.split(",") if k], args.steps)
    sparse_dense = [_in_subprocess(k=10, form="loop", per_class=0, sparse=sparse,
                                   iterations=40) for sparse in (False, True)]
    if all("error" not in s for s in sparse_dense):
        sparse_dense[1]["speed-up"] = sparse_dense[0]["seconds"] / sparse_dense[1]["seconds"]
    print(json.dumps(sparse_dense), flush=True)
    e2e = [end_to_end(int(k), args.out) for k in args.e2e.split(",") if k]
    for r in e2e:
        print(json.dumps(r), flush=True)
    print(write_report(args.out, steps, sparse_dense, e2e))


if __name__ == "__main__":
    main()
