"""MOON (Li, He & Song, "Model-Contrastive Federated Learning", CVPR 2021, Sec. 3.3, eq. 1-3).

Local objective: ``CE(logits, y) + mu * l_con`` with the model-contrastive term

    l_con = -log( exp(sim(z, z_glob)/tau) / (exp(sim(z, z_glob)/tau) + exp(sim(z, z_prev)/tau)) )

where z is the representation of the model being trained, z_glob that of the global model
received this round and z_prev that of the client's own model from its previous visit (both
frozen), and sim the cosine similarity. Aggregation as FedAvg.

Representation: the model's penultimate feature (the 512-d output of ``fc`` in ``cnn4``). The
paper adds a 2-layer projection head (to 256-d) under its classifier; that is part of its
network, not of the method, and the FedNTD/FedKPer code the Table 1 baseline comes from
contrasts the 512-d feature without one, as here. A client's previous model starts as the
initial global model (FedNTD code: ``_init_prev_locals``), so the term is active from the first
visit; MOON's own code has no negative in its first round.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field

from medpfl.algorithms.base import MODEL_UPLOAD, Algorithm, MethodConfig
from medpfl.fl.functional import Params, clone_params, weighted_ce
from medpfl.fl.program import Federation, RoundInfo


class MOONConfig(MethodConfig):
    """mu: weight of the contrastive term; 5 is the paper's value for CIFAR-10 (Sec. 4.1, best of
    {0.1, 1, 5, 10}; 1 for CIFAR-100 and Tiny-ImageNet). The FedKPer authors' baseline config
    uses 0.1 (``config/fedkper-table1.yaml``). tau: temperature 0.5 (paper Sec. 4.1)."""

    mu: float = Field(5.0, ge=0.0, description="contrastive weight (paper Sec. 4.1, CIFAR-10)")
    tau: float = Field(0.5, gt=0.0, description="temperature (paper Sec. 4.1)")


def contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, w: torch.Tensor,
                     tau: float) -> torch.Tensor:
    """``sum_i w_i l_con_i`` (MOON eq. 2): features float [B, d]; the positive pair is (z, z_glob),
    the negative (z, z_prev); no gradient into z_glob and z_prev."""
    pos = F.cosine_similarity(z, z_glob.detach(), dim=-1) / tau
    neg = F.cosine_similarity(z, z_prev.detach(), dim=-1) / tau
    logits = torch.stack([pos, neg], dim=-1)
    return torch.sum(w * -F.log_softmax(logits, dim=-1)[..., 0])


class MOON(Algorithm):
    name = "moon"
    Config = MOONConfig
    paper = "Li, He & Song, Model-Contrastive Federated Learning, CVPR 2021"
    model_upload = MODEL_UPLOAD  # FedAvg's server: the n_k-weighted mean
    requires_parts = ("body",)  # contrasts the body's features
    fedavg_when = {"mu": 0.0}

    def init_client_state(self, params: Params, client: int, fed: Federation) -> dict[str, Any]:
        return {"prev": clone_params(params)}

    def shared_context(self, shared, rnd: RoundInfo):
        return {"global": shared["model"]}

    def begin(self, received, state, info, rnd):
        return {"model": received["model"]}, {"prev": state["prev"]}

    def sample_context(self, ctx, x):
        z_glob, _ = self.forward.features_logits(ctx["global"], x)
        z_prev, _ = self.forward.features_logits(ctx["prev"], x)
        return {"z_glob": z_glob, "z_prev": z_prev}

    def local_loss(self, trees, ctx, batch):
        z, logits = self.train_features(trees["model"], batch)
        ce = weighted_ce(logits, batch["y"], batch["w"])
        return ce + self.cfg.mu * contrastive_loss(z, batch["z_glob"], batch["z_prev"], batch["w"], self.cfg.tau)

    def finish(self, trees, ctx, state, info, rnd):
        up, _, model = super().finish(trees, ctx, state, info, rnd)
        return up, {"prev": trees["model"]}, model
