"""FedAS (Yang, Huang & Ye, "FedAS: Bridging Inconsistency in Personalized Federated Learning",
CVPR 2024), as its official code (xiyuanyang45/FedAS, a PFLlib fork) and PFLlib implement it.

Each client keeps a personal model (shared body + personal head). In a round, a sampled client:

1. *parameter alignment*: computes class prototypes (per-class means of its own model's body
   features over its local train set) and fits the received global model's body to them for one
   epoch: per batch, ``sum_c MSE(body_g(x[y == c]), proto_c)`` over the classes present (plain
   SGD, lr 0.01, batch 16);
2. replaces its body by the aligned one, keeps its head, and trains the whole model on
   cross-entropy;
3. *client synchronisation*: computes the trace of the empirical Fisher information of its
   trained model, ``sum over mini-batches and parameters of (d mean-NLL / dw)^2`` (evaluation
   mode, train batch size), and uploads it with the model.

The server averages the uploaded models with weights ``trace_k / sum_j trace_j`` (no sample-size
factor). The global model (body and averaged heads) is scored on the global test set; the
personal models on the local test splits. The official code hands every client the server's
model by reference, so each alignment also moves the model the next client aligns; PFLlib
aligns a copy per client, as here. The official code computes the Fisher trace of unsampled
clients too, unused by the aggregation; only sampled clients compute it here (same result).
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field
from torch.func import grad

from medpfl.algorithms.base import Algorithm, MethodConfig, ModelUpload
from medpfl.fl.functional import Params, clone_params, size_weights, weighted_average, weighted_ce
from medpfl.fl.payload import ArraySpec, TreeSpec
from medpfl.fl.optim import sgd
from medpfl.fl.program import Federation, Pass, Phase, RoundInfo


class FedASConfig(MethodConfig):
    """Alignment settings are hard-coded in the official code (``clientas.py``: SGD lr 0.01,
    1 epoch, batch 16), as in PFLlib. ``use_alignment: false`` / ``use_fisher_weights: false`` are
    the official code's ``--wo_local`` / ``--wo_global`` ablations."""

    align_lr: float = Field(0.01, gt=0.0, description="alignment SGD lr (official clientas.py)")
    align_epochs: int = Field(1, ge=0, description="alignment epochs (official clientas.py)")
    align_batch_size: int = Field(16, ge=1, description="prototype/alignment batch size (official clientas.py)")
    use_alignment: bool = Field(True, description="false: plain copy of the global body (official --wo_local ablation)")
    use_fisher_weights: bool = Field(True, description="false: size-weighted FedAvg (official --wo_global ablation)")


def prototype_alignment_loss(z: torch.Tensor, y: torch.Tensor, valid: torch.Tensor, proto: torch.Tensor,
                             has_proto: torch.Tensor) -> torch.Tensor:
    """``sum_c MSE(z[y == c], proto_c)`` over the classes c present in the batch that have a
    prototype; MSE is the mean over that class's samples and the feature dims (PFLlib/official
    ``clientas.set_parameters``). z float [B, d], y int64 [B], valid bool [B], proto [C, d],
    has_proto bool [C]."""
    c = proto.shape[0]
    onehot = torch.nn.functional.one_hot(y, c).to(z.dtype) * valid.to(z.dtype).unsqueeze(-1)  # [B, C]
    err = ((z - proto[y]) ** 2).mean(-1)  # [B]
    n_c = onehot.sum(0)
    per_class = (onehot * err.unsqueeze(-1)).sum(0) / n_c.clamp(min=1)
    return torch.sum(torch.where((n_c > 0) & has_proto, per_class, torch.zeros_like(per_class)))


class FedAS(Algorithm):
    name = "fedas"
    Config = FedASConfig
    paper = "Yang, Huang & Ye, FedAS: Bridging Inconsistency in Personalized Federated Learning, CVPR 2024"
    # the Fisher-trace-weighted mean (n_k where undefined)
    model_upload = ModelUpload("model", "model", ("fisher_trace", "num_samples"))
    requires_parts = ("body", "head")  # aligns the global body to its own head's prototypes

    personalized = True

    def upload_spec(self):
        return {"model": TreeSpec(self.forward.shapes), "fisher_trace": ArraySpec(), "num_samples": ArraySpec()}

    def init_client_state(self, params: Params, client: int, fed: Federation) -> dict[str, Any]:
        return {"model": clone_params(params)}

    def begin(self, received, state, info, rnd):
        return {"model": state["model"], "aligned": received["model"]}, {}

    def passes(self, rnd: RoundInfo) -> list[Pass]:
        c = self.num_classes

        def prototypes(trees, ctx, batch):
            z, _ = self.forward.features_logits(trees["model"], batch["x"])
            onehot = torch.nn.functional.one_hot(batch["y"], c).to(z.dtype) * (batch["w"] > 0).to(z.dtype).unsqueeze(-1)
            return {"sum": onehot.T @ z, "count": onehot.sum(0)}

        def fisher_trace(trees, ctx, batch):
            params = trees["model"]
            names = self.forward.trainable

            def nll(sub):
                return weighted_ce(self.forward({**params, **sub}, batch["x"]), batch["y"], batch["w"])

            g = grad(nll)({k: params[k] for k in names})
            return {"trace": sum(torch.sum(v**2) for v in g.values())}

        out = [Pass("fisher", fisher_trace, when="after", batch_size="train", shuffle=True)]
        if self.cfg.use_alignment:
            out.insert(0, Pass("protos", prototypes, when="before", batch_size=self.cfg.align_batch_size, shuffle=True))
        return out

    def _align_loss(self, trees, ctx, batch):
        z, _ = self.train_features(trees["aligned"], batch)
        p = ctx["protos"]
        proto = p["sum"] / p["count"].clamp(min=1).unsqueeze(-1)
        return prototype_alignment_loss(z, batch["y"], batch["w"] > 0, proto, p["count"] > 0)

    def _personal_start(self, trees, ctx):
        body = self.forward.part(trees["aligned"], "body")
        return {"model": {**trees["model"], **body}}

    def phases(self, rnd: RoundInfo) -> list[Phase]:
        out = [Phase(init=self._personal_start)]
        if self.cfg.use_alignment and self.cfg.align_epochs > 0:
            out.insert(0, Phase(name="align", trainable={"aligned": "body"}, loss=self._align_loss,
                                epochs=self.cfg.align_epochs, batch_size=self.cfg.align_batch_size,
                                optimizer=sgd(self.cfg.align_lr)))
        return out

    def finish(self, trees, ctx, state, info, rnd):
        up = {"model": trees["model"], "fisher_trace": info["fisher"]["trace"].to(torch.float32),
              "num_samples": info["num_samples"]}
        return up, {"model": trees["model"]}, trees["model"]

    def aggregate(self, server, uploads, clients, rnd):
        if self.cfg.use_fisher_weights:
            f = uploads["fisher_trace"].to(torch.float64)
            total = f.sum()
            ok = torch.isfinite(total) & (total > 0)
            w = torch.where(ok, f / torch.where(ok, total, torch.ones_like(total)), size_weights(uploads["num_samples"]))
        else:
            w = size_weights(uploads["num_samples"])
        return {**server, "model": weighted_average(uploads["model"], w)}

    def personalized_model(self, state, server):
        return state["model"]
