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


class LocalConfig(MethodConfig):
    """Local has no method-specific knobs."""


class Local(Algorithm):
    name = "local"
    Config = LocalConfig
    upload_keys = ()
    paper = "no-communication baseline (each client trains alone)"
    has_global_model = False
    personalized = True

    def init_client_state(self, global_params: Params) -> dict[str, Any]:
        return {"params": clone_params(global_params)}

    def download(self, global_params: Params) -> dict[str, Any]:
        return {}

    def start_params(self, received: dict[str, Any], state: dict[str, Any]) -> Params:
        return state["params"]

    def client_update(self, params: Params, state: dict[str, Any], info: dict[str, torch.Tensor]):
        return {}, {"params": params}

    def personalized_params(self, state: dict[str, Any]) -> Params:
        return state["params"]

    def aggregate(self, global_params: Params, uploads: dict[str, Any]) -> Params:
        return global_params
