"""The server's work without a Flower round: resume a stopped run, or distil published models.

Usage::

    python -m fedmitr_core.offline --resume-from <run folder>
    python -m fedmitr_core.offline --teachers <folder> --out <run folder> [--run-config k=v ...]

``--resume-from`` continues a run whose server was stopped (crash, SIGKILL,
reboot) from what it persisted: the validated uploads, the synthetic pools,
the last distillation checkpoints and the methods that had finished; no
client is contacted. ``--teachers`` is the "model market" case: a folder of
``<name>.safetensors`` state dicts, each with a ``<name>.json`` holding its
``label-counts``; they are validated like uploads (never unpickled) before
the server methods run on them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from safetensors.numpy import load_file

from fedmitr_core.config import ConfigError, FedMITRConfig, parse_config, parse_overrides
from fedmitr_core.data.datasets import DatasetSplits, load_dataset
from fedmitr_core.models.vit import vit_factory
from fedmitr_core.progress import Emit
from fedmitr_core.server.pipeline import ServerOutcome, run_pipeline
from fedmitr_core.server.uploads import UploadIntake, expected_spec


def resume_run(run_dir: Path, emit: Emit = print) -> ServerOutcome:
    """Finish the run in ``run_dir`` from its persisted uploads and server state."""
    config_file = run_dir / "config.yaml"
    if not config_file.is_file():
        raise ConfigError(f"resume-from '{run_dir}': no config.yaml (not a run folder)")
    flat = yaml.safe_load(config_file.read_text(encoding="utf-8"))
    flat["resume-from"] = str(run_dir)
    cfg = parse_config(flat)
    data = load_dataset(cfg.data, cfg.seed)
    count = len(list((run_dir / "uploads").glob("*.json")))
    emit(f"resuming {run_dir}: {count} persisted uploads, no client contacted")
    return run_pipeline(cfg, data, run_dir, emit=emit, resume=True)


def _read_published(weights: Path) -> tuple[dict[str, np.ndarray], dict[str, Any], list[str]]:
    """Arrays, metrics and problems of one published checkpoint and its ``.json``."""
    meta_file = weights.with_suffix(".json")
    try:
        arrays = dict(load_file(str(weights)))
    except Exception as err:  # noqa: BLE001 - any unreadable file is rejected, not fatal
        return {}, {}, [f"not a readable safetensors file: {err}"]
    if not meta_file.is_file():
        return arrays, {}, [f"no {meta_file.name} with 'label-counts'"]
    counts = json.loads(meta_file.read_text(encoding="utf-8")).get("label-counts")
    metrics = {"label-counts": counts,
               "num-examples": int(np.sum(counts)) if isinstance(counts, list) else None}
    return arrays, metrics, []


def import_teachers(folder: Path, cfg: FedMITRConfig, data: DatasetSplits, run_dir: Path
                    ) -> dict[str, Any]:
    """Validate published checkpoints and persist the good ones as the run's uploads."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"--teachers '{folder}': no *.safetensors files")
    intake = UploadIntake(run_dir, expected_spec(vit_factory(cfg.model, data.spec)()),
                          data.spec.num_classes)
    for weights in files:
        arrays, metrics, problems = _read_published(weights)
        if problems:
            intake.reject(weights.stem, problems)
        else:
            intake.take(weights.stem, arrays, metrics)
    report = intake.write_report(source=str(folder))
    if not intake.accepted:
        raise ConfigError(f"--teachers '{folder}': no valid checkpoint ({intake.rejected})")
    return report


def distil_published(folder: Path, run_dir: Path, run_config: dict[str, Any],
                     emit: Emit = print) -> ServerOutcome:
    """Run the server methods on checkpoints that clients published in ``folder``."""
    cfg = parse_config(run_config)
    data = load_dataset(cfg.data, cfg.seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    import_teachers(folder, cfg, data, run_dir)
    return run_pipeline(cfg, data, run_dir, emit=emit)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--resume-from", type=Path, help="a run folder to finish")
    group.add_argument("--teachers", type=Path, help="a folder of published checkpoints")
    parser.add_argument("--out", type=Path, help="run folder for --teachers")
    parser.add_argument("--run-config", nargs="*", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    if args.resume_from is not None:
        resume_run(args.resume_from.expanduser().resolve())
        return
    if args.out is None:
        parser.error("--teachers needs --out <run folder>")
    try:
        overrides = parse_overrides(args.run_config, "--run-config")
    except ConfigError as err:
        parser.error(str(err))
    distil_published(args.teachers.expanduser().resolve(), args.out.expanduser().resolve(),
                     overrides)


if __name__ == "__main__":
    main()
