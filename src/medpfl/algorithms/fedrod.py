"""FedRoD (Chen & Chao, "On Bridging Generic and Personalized Federated Learning for Image
Classification", ICLR 2022; the linear personal head of PFLlib's ``clientrod.py``, the authors'
repository hongyouc/Fed-RoD holds no code).

Two predictors on one body. The model (body f_theta + **generic head** g_psi, the model's own
head) is shared: it is downloaded, trained and uploaded as FedAvg's and averaged ∝ n_k, and it
is the global model scored on the global test set. Each client also keeps a **personal head**
p_i (a tree with the head's shapes, in the client state, never uploaded), initialised as a copy
of the initial model's head (PFLlib: ``copy.deepcopy(model.head)``).

Per mini-batch (x float [B, ...], y int64 [B]), one forward z = f_theta(x) (float [B, d]),
g = g_psi(z) (float [B, C]):

- the generic model minimises the balanced softmax loss (Ren et al. 2020; paper Sec. 4.2)
  ``BSM = CE(g + log pi_i, y)`` with ``pi_i = n_{i,c} / n_i`` the client's local train label
  distribution (``info["label_hist"]``); a class absent from the client gets ``log 0 = -inf``,
  i.e. probability 0 in its balanced softmax, unguarded, as PFLlib's ``balanced_softmax_loss``
  (``spc.log()`` on raw counts; counts and proportions give the same loss);
- the personal head minimises ``CE(sg(g) + p_i(sg(z)), y)`` (sg = stop-gradient): it learns on
  top of the generic prediction and sends no gradient into the body or the generic head
  (PFLlib ``out_p = self.pred(rep.detach()); loss = CE(out_g.detach() + out_p, y)``).

Both losses are summed into one phase objective; because of the stop-gradients each tree gets
exactly the gradient of its own loss, at the same point (PFLlib steps the model and then the
personal head on tensors computed before either step), with the round's lr for both.

The personalized prediction is ``g_psi(f_theta(x)) + p_i(f_theta(x))`` (:meth:`predict`); a
client's personalized model is the current global model with its own personal head (PFLlib
evaluates every client after it received the global model; a client never sampled has its
initial personal head), and the model scored right after local training is its trained model
with its trained personal head.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from medpfl.algorithms.base import MODEL_UPLOAD, Algorithm, MethodConfig
from medpfl.fl.functional import Params, clone_params, weighted_ce
from medpfl.fl.program import Federation, Phase, RoundInfo


class FedRoDConfig(MethodConfig):
    """The paper's main loss for the generic model is the balanced softmax (Sec. 4.2, BSM; PFLlib
    ``clientrod.py`` implements only this, with a linear personal head and no other knob).
    ``generic_loss: ce`` trains the generic model with plain cross-entropy (then the generic
    model is FedAvg's, tested): an ablation, not in the paper's tables."""

    generic_loss: Literal["bsm", "ce"] = Field(
        "bsm", description="generic-head objective: balanced softmax (paper Sec. 4.2; PFLlib) or plain CE (ablation)")


def label_log_prior(label_hist: torch.Tensor) -> torch.Tensor:
    """``log(n_c / n)`` per class, float [C] (``-inf`` for a class with no local train sample),
    from the client's local train label counts float [C]."""
    return torch.log(label_hist / label_hist.sum(-1, keepdim=True))


def balanced_softmax_ce(logits: torch.Tensor, y: torch.Tensor, w: torch.Tensor, log_prior: torch.Tensor) -> torch.Tensor:
    """Balanced softmax loss ``sum_j w_j CE(logits_j + log_prior, y_j)``: logits float [B, C],
    y int64 [B] (classes with a finite prior), w float [B], log_prior float [C]."""
    return weighted_ce(logits + log_prior, y, w)


class FedRoD(Algorithm):
    name = "fedrod"
    Config = FedRoDConfig
    paper = "Chen & Chao, On Bridging Generic and Personalized Federated Learning for Image Classification, ICLR 2022"
    model_upload = MODEL_UPLOAD  # the generic model's n_k-weighted mean
    requires_parts = ("body", "head")  # a shared body's features feed the generic and the personal head

    personalized = True

    def init_client_state(self, params: Params, client: int, fed: Federation) -> dict[str, Any]:
        return {"personal": clone_params(self.forward.part(params, "head"))}

    def begin(self, received, state, info, rnd: RoundInfo):
        ctx = {"log_prior": label_log_prior(info["label_hist"])} if self.cfg.generic_loss == "bsm" else {}
        return {"model": received["model"], "personal": state["personal"]}, ctx

    def phases(self, rnd: RoundInfo) -> list[Phase]:
        """One phase on both trees (the engine's batches, epochs and optimizer)."""
        return [Phase(trainable={"model": None, "personal": None})]

    def local_loss(self, trees: dict[str, Params], ctx: dict[str, Any], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``BSM(g) + CE(sg(g) + p(sg(z)))`` on one batch (the generic term trains ``model``, the
        personal term ``personal`` only)."""
        y, w = batch["y"], batch["w"]
        z, g = self.train_features(trees["model"], batch)
        if self.cfg.generic_loss == "bsm":
            generic = balanced_softmax_ce(g, y, w, ctx["log_prior"])
        else:
            generic = weighted_ce(g, y, w)
        personal = weighted_ce(g.detach() + self.forward.head(trees["personal"], z.detach()), y, w)
        return generic + personal

    def finish(self, trees, ctx, state, info, rnd):
        up = {"model": trees["model"], "num_samples": info["num_samples"]}
        return up, {"personal": trees["personal"]}, {"model": trees["model"], "personal": trees["personal"]}

    def personalized_model(self, state, server):
        return {"model": server["model"], "personal": state["personal"]}

    def predict(self, model: Any, x: torch.Tensor) -> torch.Tensor:
        """Generic + personal logits (float [B, C]) for ``{"model", "personal"}``; the generic
        logits alone for a plain model state (the global model)."""
        if "personal" not in model:
            return self.forward(model, x)
        z, g = self.forward.features_logits(model["model"], x)
        return g + self.forward.head(model["personal"], z)
