"""One-shot FedAvg: the example-weighted average of the uploaded weights."""

from __future__ import annotations

from fedmitr_core.methods.base import MethodResult, ServerContext, fedavg_state


def run_fedavg(ctx: ServerContext) -> MethodResult:
    """Average the teachers' parameters (weights ∝ n_k)."""
    model = ctx.new_vit()
    model.load_state_dict(fedavg_state(ctx.teachers))
    return MethodResult(model=model.eval())
