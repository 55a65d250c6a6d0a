"""Ditto (Li, Hu, Beirami & Smith, "Ditto: Fair and Robust Federated Learning Through
Personalization", ICML 2021, Algorithm 1; code litian96/ditto ``trainers_MTL/ditto.py``).

Each client keeps a personal model v_k. A sampled client trains (a) its copy of the global
model w on cross-entropy, uploaded and averaged as FedAvg, and (b) its personal model on
``CE(v_k) + (lam/2) ||v_k - w^t||^2`` with w^t the global model received this round (eq. 2:
the step ``v <- v - lr (grad F_k(v) + lam (v - w^t))``). The personal model is what the client
deploys and what its local test split scores.

By default both models take the same number of steps on the same mini-batches, as the official
code (one personal step, then one global step, per batch): one phase trains both trees, each on
its own term. ``personal_epochs`` set gives PFLlib's variant: global epochs, then that many
personal epochs.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from medpfl.algorithms.base import MODEL_UPLOAD, Algorithm, MethodConfig
from medpfl.algorithms.fedprox import proximal_term
from medpfl.fl.functional import Params, clone_params, weighted_ce
from medpfl.fl.program import Federation, Phase, RoundInfo


class DittoConfig(MethodConfig):
    """lam 1.0: the paper's fixed value for devices without a validation choice and the value of
    the authors' released scripts (``run_*_lam1.sh``); the paper selects lam per device from
    {0.1, 1, 2} on validation data. personal_epochs None: the personal model takes the same steps
    as the global one (official code); an integer: PFLlib's ``plocal_epochs``."""

    lam: float = Field(1.0, ge=0.0, description="proximal weight of the personal objective (paper, scripts)")
    personal_epochs: int | None = Field(
        None, ge=1, description="None = same steps and batches as the global model (official code); an integer: "
                                "that many personal epochs after the global ones (PFLlib plocal_epochs)")


class Ditto(Algorithm):
    name = "ditto"
    Config = DittoConfig
    paper = "Li, Hu, Beirami & Smith, Ditto: Fair and Robust Federated Learning Through Personalization, ICML 2021"
    model_upload = MODEL_UPLOAD  # the global copy's n_k-weighted mean; the personal model never leaves

    personalized = True

    def init_client_state(self, params: Params, client: int, fed: Federation) -> dict[str, Any]:
        return {"personal": clone_params(params)}

    def shared_context(self, shared, rnd: RoundInfo):
        return {"global": shared["model"]}

    def begin(self, received, state, info, rnd):
        return {"model": received["model"], "personal": state["personal"]}, {}

    def personal_loss(self, trees, ctx, batch):
        v = trees["personal"]
        ce = weighted_ce(self.train_forward(v, batch), batch["y"], batch["w"])
        return ce + 0.5 * self.cfg.lam * proximal_term(v, ctx["global"], self.forward.trainable)

    def _joint_loss(self, trees, ctx, batch):
        return self.local_loss(trees, ctx, batch) + self.personal_loss(trees, ctx, batch)

    def phases(self, rnd: RoundInfo) -> list[Phase]:
        if self.cfg.personal_epochs is None:
            return [Phase(trainable={"model": None, "personal": None}, loss=self._joint_loss)]
        return [Phase(), Phase(name="personal", trainable={"personal": None}, loss=self.personal_loss,
                               epochs=self.cfg.personal_epochs)]

    def finish(self, trees, ctx, state, info, rnd):
        up = {"model": trees["model"], "num_samples": info["num_samples"]}
        return up, {"personal": trees["personal"]}, trees["personal"]

    def personalized_model(self, state, server):
        return state["personal"]
