"""ServerApp: parse the config once, build the one-shot strategy, run one round."""

from __future__ import annotations

from logging import INFO
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from fedmitr_core.client.training import initial_model
from fedmitr_core.config import parse_config
from fedmitr_core.data.datasets import load_dataset
from fedmitr_core.offline import resume_run
from fedmitr_core.server.pipeline import resolve_run_dir
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
    data = load_dataset(cfg.data, cfg.seed)
    strategy = OneShotStrategy(cfg, data, run_dir)
    # Deployed clients read their own files and prepare them as this spec says.
    initial = ArrayRecord(initial_model(cfg, data.spec).state_dict())
    spec = ConfigRecord(data.spec.to_record())
    strategy.start(grid=grid, initial_arrays=initial, num_rounds=1,
                   timeout=cfg.server.round_timeout, train_config=spec)
    if "fedavg-rounds" in cfg.server.methods:
        add_fedavg_rounds(grid, cfg, data, run_dir, emit_log)
