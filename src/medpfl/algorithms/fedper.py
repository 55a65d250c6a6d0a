"""FedPer (Arivazhagan et al., "Federated Learning with Personalization Layers", arXiv
1912.00818, 2019).

The model is split into a shared body (base layers) and a personal head (the last layer for the
4-layer CNN, as PFLlib; the paper's deeper nets keep their last two fully connected layers
personal). A sampled client trains the received body with its own head on cross-entropy and
uploads only the body; the server averages the bodies weighted by n_k. Clients download only
the body. There is no single global model: the global-test columns are not applicable.

A client's personalized model is its last trained model (body and head); a client never sampled
has the current global body with its initial head (PFPS-LWC spec B.4).
"""

from __future__ import annotations

from typing import Any

import torch

from medpfl.algorithms.base import Algorithm, MethodConfig, ModelUpload
from medpfl.fl.functional import Params, clone_params, size_weights, weighted_average
from medpfl.fl.payload import ArraySpec, TreeSpec
from medpfl.fl.program import Download, Federation, RoundInfo


class FedPerConfig(MethodConfig):
    """FedPer has no knobs here: the personal layers are the model's head (``parts["head"]``)."""


class FedPer(Algorithm):
    name = "fedper"
    Config = FedPerConfig
    paper = "Arivazhagan et al., Federated Learning with Personalization Layers, arXiv 1912.00818 (2019)"
    model_upload = ModelUpload("body", "body", ("num_samples",))  # the n_k-weighted mean of the bodies
    requires_parts = ("body", "head")  # shares the body, keeps the head

    has_global_model = False
    personalized = True

    def upload_spec(self):
        return {"body": TreeSpec(self.forward.part_shapes("body")), "num_samples": ArraySpec()}

    def init_server(self, params: Params, fed: Federation) -> dict[str, Any]:
        return {"body": self.forward.part(params, "body")}

    def download(self, server, clients, rnd: RoundInfo) -> Download:
        return Download(shared={"body": server["body"]})

    def init_client_state(self, params: Params, client: int, fed: Federation) -> dict[str, Any]:
        return {"model": clone_params(params), "trained": torch.zeros((), device=next(iter(params.values())).device)}

    def begin(self, received, state, info, rnd):
        return {"model": {**state["model"], **received["body"]}}, {}

    def finish(self, trees, ctx, state, info, rnd):
        up = {"body": self.forward.part(trees["model"], "body"), "num_samples": info["num_samples"]}
        return up, {"model": trees["model"], "trained": torch.ones_like(state["trained"])}, trees["model"]

    def aggregate(self, server, uploads, clients, rnd):
        return {**server, "body": weighted_average(uploads["body"], size_weights(uploads["num_samples"]))}

    def personalized_model(self, state, server):
        t = state["trained"] > 0
        body = {k: torch.where(t, state["model"][k], v) for k, v in server["body"].items()}
        return {**state["model"], **body}
