"""ServerApp: parse the config once, build the one-shot strategy, run one round."""

from __future__ import annotations

from logging import INFO
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from fedmitr_core.client_job import initial_model
from fedmitr_core.config import parse_config
from fedmitr_core.data import load_dataset
from fedmitr_core.local_data import DataSpec
from fedmitr_core.offline import resume_run
from fedmitr_core.server_job import resolve_run_dir
from server_app.fedavg_rounds import add_fedavg_rounds
from server_app.strategy import OneShotStrategy, emit_log

APP_DIR = Path(__file__).resolve().parents[1]

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """One-shot FedMITR: clients train once, the server distils the global ViT."""
    cfg = parse_config(context.run_config)
    if cfg.server.resume_from:
        # Everything the clients sent was persisted before the server stopped:
        # finish from there without a round.
        resume_run(Path(cfg.server.resume_from).expanduser().resolve(), emit=emit_log)
        return
    run_dir = resolve_run_dir(cfg, APP_DIR)
    log(INFO, "FedMITR: methods %s, outputs in %s", ",".join(cfg.server.methods), run_dir)
    splits = load_dataset(cfg.data, cfg.seed)
    strategy = OneShotStrategy(cfg, splits, run_dir)
    # Deployed clients read their own files and prepare them as this spec says.
    strategy.start(grid=grid, initial_arrays=ArrayRecord(initial_model(cfg, splits).state_dict()),
                   num_rounds=1, timeout=cfg.server.round_timeout,
                   train_config=ConfigRecord(DataSpec.of(splits).to_record()))
    if "fedavg-rounds" in cfg.server.methods:
        add_fedavg_rounds(grid, cfg, splits, run_dir, emit_log)
