"""Local: every client trains its own model on its own data and never communicates.

The no-federation baseline of personalized FL (PFLlib ``Local``, FLamby "Local i"). Each
client's model starts from the same initial weights and persists across rounds; a client
trains only in the rounds it is sampled, so the compute matches the federated methods. There
is no global model: the global-test columns are empty, and at the final round every client's
model is scored on the global test set (``final_local_models_on_global_test``).
"""

from __future__ import annotations

from typing import Any

import torch

from medpfl.algorithms.base import Algorithm, MethodConfig
from medpfl.fl.functional import Params, clone_params
from medpfl.fl.program import Download, Federation, RoundInfo


class LocalConfig(MethodConfig):
    """Local has no method-specific knobs."""


class Local(Algorithm):
    name = "local"
    Config = LocalConfig
    paper = "no-communication baseline (each client trains alone)"

    aggregates = False
    has_global_model = False
    personalized = True

    def upload_spec(self):
        return {}

    def init_client_state(self, params: Params, client: int, fed: Federation) -> dict[str, Any]:
        return {"model": clone_params(params)}

    def download(self, server: dict[str, Any], clients: torch.Tensor, rnd: RoundInfo) -> Download:
        return Download()

    def begin(self, received, state, info, rnd):
        return {"model": state["model"]}, {}

    def finish(self, trees, ctx, state, info, rnd):
        return {}, {"model": trees["model"]}, trees["model"]

    def personalized_model(self, state: dict[str, Any], server: dict[str, Any]) -> Params:
        return state["model"]
