"""ServerApp: parse the config once, build the one-shot strategy, run one round."""

from __future__ import annotations

from collections.abc import Callable
from logging import ERROR, INFO
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from fedmitr_core.config import FedMITRConfig, parse_config
from fedmitr_core.data.datasets import load_dataset
from fedmitr_core.offline import resume_run
from fedmitr_core.server.pipeline import make_run_dir
from fedmitr_core.server.reports import mark_failed
from fedmitr_core.server.uploads import short_reason
from server_app.fedavg_rounds import add_fedavg_rounds
from server_app.strategy import OneShotStrategy, emit_log

APP_DIR = Path(__file__).resolve().parents[1]

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """One-shot FedMITR: clients train once, the server distils the global ViT.

    A failure after the run folder exists is recorded there (``status: failed``
    in ``metrics.json``) before the ServerApp fails: ``flwr run`` itself exits 0.
    """
    cfg = parse_config(context.run_config)
    if cfg.server.resume_from:
        # Everything the clients sent was persisted before the server stopped:
        # finish from there without a round.
        run_dir = Path(cfg.server.resume_from).expanduser().resolve()
        _recording_failure(run_dir, lambda: resume_run(run_dir, emit=emit_log))
        return
    run_dir = make_run_dir(cfg, APP_DIR)
    log(INFO, "FedMITR: methods %s, outputs in %s", ",".join(cfg.server.methods), run_dir)
    _recording_failure(run_dir, lambda: _one_shot(grid, cfg, run_dir))


def _one_shot(grid: Grid, cfg: FedMITRConfig, run_dir: Path) -> None:
    data = load_dataset(cfg.data, cfg.seed)
    strategy = OneShotStrategy(cfg, data, run_dir)
    # Deployed clients read their own files and prepare them as this spec says.
    spec = ConfigRecord(data.spec.to_record())
    strategy.start(grid=grid, initial_arrays=ArrayRecord(strategy.initial_state), num_rounds=1,
                   timeout=cfg.server.round_timeout, train_config=spec)
    if "fedavg-rounds" in cfg.server.methods:
        add_fedavg_rounds(grid, cfg, data, run_dir, emit_log)


def _recording_failure(run_dir: Path, work: Callable[[], object]) -> None:
    try:
        work()
    except BaseException as err:
        reason = short_reason(f"{type(err).__name__}: {err}")
        mark_failed(run_dir, reason)
        log(ERROR, "FedMITR run FAILED: %s (status recorded in %s)", reason,
            run_dir / "metrics.json")
        raise
