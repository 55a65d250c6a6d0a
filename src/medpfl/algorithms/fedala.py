"""FedALA (Zhang et al., "FedALA: Adaptive Local Aggregation for Personalized Federated
Learning", AAAI 2023, Sec. 3.2-3.3, eq. 4-6; code TsingZ0/FedALA ``utils/ALA.py``).

Each client keeps its local model w_i. Before local training, *adaptive local aggregation*
(ALA) builds its starting model from the received global model w: the lower layers are taken
from w; the top ``layer_idx`` parameter tensors are ``w_i + (w - w_i) * W_i`` with element-wise
weights W_i in [0, 1] (kept across rounds, initialised to 1), learned by SGD on the local loss
of that mixture over a contiguous ``rand_percent`` % window of the local train set:
``W_i <- clip(W_i - eta * dL/dw_mix * (w - w_i), 0, 1)`` (eq. 6; exactly the gradient of the
loss w.r.t. W_i). On the client's first ALA, W_i is trained epoch after epoch until the std of
the last ``num_pre_loss`` epoch losses falls below ``threshold``; afterwards one epoch per round.
ALA is skipped while the local model equals the global one (the code's check on the first
tensor; in practice round 0). The mixed model is then trained on cross-entropy, uploaded, and
averaged as FedAvg; it is the client's personalized model.

The code runs ALA for every client every round; here only sampled clients run it (the paper's
Algorithm 1), so an unsampled client's personalized model is its last trained one.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field

from medpfl.algorithms.base import MODEL_UPLOAD, Algorithm, MethodConfig
from medpfl.fl.functional import Params, clone_params, weighted_ce
from medpfl.fl.optim import sgd
from medpfl.fl.program import Federation, Phase, RoundInfo, Until


class FedALAConfig(MethodConfig):
    """eta 1.0, rand_percent 80 (the paper's s = 80 %), layer_idx 2 (the last layer's weight and
    bias: the paper's p = 1 layer) and num_pre_loss 10 are the official code's defaults
    (``main.py``, ``run_me.sh``); threshold 0.01 is the paper's (the code's README; the code has
    used 0.1 since June 2023). max_init_epochs bounds the first, until-convergence ALA (ours: the
    code has no bound)."""

    eta: float = Field(1.0, gt=0.0, description="ALA weight learning rate (code default)")
    rand_percent: float = Field(80.0, gt=0.0, le=100.0, description="% of local data used by ALA (paper s)")
    layer_idx: int = Field(2, ge=1, description="number of top parameter tensors ALA mixes (paper p = 1 layer)")
    threshold: float = Field(0.01, gt=0.0, description="std of recent ALA losses that ends the first ALA (paper)")
    num_pre_loss: int = Field(10, ge=1, description="number of recent losses in that std (code)")
    max_init_epochs: int = Field(100, ge=1, description="bound on the first ALA's epochs (ours)")


def ala_mix(local: Params, global_: Params, weights: Params) -> Params:
    """FedALA eq. 5: ``global`` everywhere except the weighted leaves,
    ``local + (global - local) * W`` there. Trees of model-state tensors; returns a new tree."""
    out = dict(global_)
    for k, w in weights.items():
        out[k] = local[k] + (global_[k] - local[k]) * w
    return out


class FedALA(Algorithm):
    name = "fedala"
    Config = FedALAConfig
    paper = "Zhang et al., FedALA: Adaptive Local Aggregation for Personalized Federated Learning, AAAI 2023"
    model_upload = MODEL_UPLOAD  # FedAvg's server: the n_k-weighted mean
    not_stackable_because = ("its first adaptive local aggregation trains until its loss converges "
                             "(a data-dependent number of epochs)")

    personalized = True

    def _top(self) -> tuple[str, ...]:
        return self.forward.trainable[-self.cfg.layer_idx:]

    def init_client_state(self, params: Params, client: int, fed: Federation) -> dict[str, Any]:
        return {"model": clone_params(params), "weights": {k: torch.ones_like(params[k]) for k in self._top()},
                "first": torch.ones((), device=params[self._top()[0]].device)}

    def shared_context(self, shared, rnd: RoundInfo):
        return {"global": shared["model"]}

    def begin(self, received, state, info, rnd):
        return {"ala": state["weights"]}, {"local": state["model"], "first": state["first"]}

    def _ala_loss(self, trees, ctx, batch):
        mixed = ala_mix(ctx["local"], ctx["global"], trees["ala"])
        return weighted_ce(self.forward(mixed, batch["x"], train=True, mask=batch["w"] > 0), batch["y"], batch["w"])

    def _ala_epochs(self, ctx) -> torch.Tensor:
        first = self.forward.trainable[0]
        return (torch.sum(ctx["global"][first] - ctx["local"][first]) != 0).to(torch.int64)

    def phases(self, rnd: RoundInfo) -> list[Phase]:
        c = self.cfg
        ala = Phase(name="ala", trainable={"ala": None}, loss=self._ala_loss, epochs=self._ala_epochs,
                    optimizer=sgd(c.eta), subset=c.rand_percent / 100.0, shuffle=False,
                    project=lambda t: {"ala": {k: v.clamp(0.0, 1.0) for k, v in t["ala"].items()}},
                    until=Until(window=c.num_pre_loss, threshold=c.threshold, max_epochs=c.max_init_epochs),
                    until_applies=lambda ctx: ctx["first"] > 0.5)
        train = Phase(init=lambda t, ctx: {**t, "model": ala_mix(ctx["local"], ctx["global"], t["ala"])})
        return [ala, train]

    def finish(self, trees, ctx, state, info, rnd):
        ran = (info["steps"]["ala"] > 0).to(state["first"].dtype)
        new_state = {"model": trees["model"], "weights": trees["ala"], "first": state["first"] * (1 - ran)}
        return {"model": trees["model"], "num_samples": info["num_samples"]}, new_state, trees["model"]

    def personalized_model(self, state, server):
        return state["model"]
