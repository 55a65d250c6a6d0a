"""FedCurv (Shoham et al., "Overcoming Forgetting in Federated Learning on Non-IID Data",
NeurIPS 2019 workshop, arXiv 1910.07796, Section 3).

Client s minimises ``L_s(w) + lam * sum_{j != s} (w - w_j)^T diag(u_j) (w - w_j)`` where ``w_j``
is client j's latest locally trained model and ``u_j`` the diagonal (empirical) Fisher
information at it. Expanded (dropping the constant): ``lam * (<P_s, w^2> - 2 <Q_s, w>)`` with
``P_s = sum_{j != s} u_j`` and ``Q_s = sum_{j != s} u_j * w_j`` (element-wise), over the
parameters (not the buffers).

- After local training the client computes ``u`` on its trained model in evaluation mode, as
  the FedNTD code the FedKPer authors built on (``algorithms/fedcurv/ClientTrainer.py``): the
  squared gradient of each mini-batch's mean cross-entropy, averaged over mini-batches of the
  train batch size, stopping once more than ``fisher_samples`` samples were seen.
- It uploads its model and ``u``; the server keeps every client's latest ``(u_j, u_j * w_j)``
  (clients never sampled contribute nothing) and sends each sampled client its own ``P_s`` and
  ``Q_s``: the sums over the *other* clients. (The FedNTD code subtracts a client's own term in
  place from the shared sums, so later clients of a round also lose earlier clients' terms;
  that aliasing bug is not reproduced.) Aggregation as FedAvg.

Bytes: up = model + u (trainable shapes) + n; down = model + P_s + Q_s per client.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field
from torch.func import grad

from medpfl.algorithms.base import Algorithm, MethodConfig
from medpfl.fl.functional import Params, size_weights, weighted_average, weighted_ce
from medpfl.fl.payload import ArraySpec, TreeSpec
from medpfl.fl.program import Download, Federation, Pass, RoundInfo


class FedCurvConfig(MethodConfig):
    """lam: penalty weight; 1.0 is the FedNTD code's ``config/fedcurv.json`` (the FedKPer authors'
    baseline config; the paper does not state its value). fisher_samples: 500, same file.
    fisher_batch_size: None = the train batch size (that code uses its train loader)."""

    lam: float = Field(1.0, ge=0.0, description="penalty weight lambda (FedNTD config/fedcurv.json)")
    fisher_samples: int = Field(500, ge=1, description="Fisher from mini-batches until more than this many samples "
                                                       "(FedNTD config/fedcurv.json)")
    fisher_batch_size: int | None = Field(
        None, ge=1, description="None = train.batch_size (FedNTD code ClientTrainer.py: its train loader)")


def curvature_penalty(params: Params, p: Params, q: Params) -> torch.Tensor:
    """``sum_k <P_k, w_k^2> - 2 <Q_k, w_k>`` over the names of ``p`` (FedCurv Sec. 3, expanded).
    Scalar; equals ``sum_j (w - w_j)^T diag(u_j) (w - w_j)`` up to a constant in w."""
    return sum(torch.sum(p[k] * params[k] ** 2) - 2.0 * torch.sum(q[k] * params[k]) for k in p)


class FedCurv(Algorithm):
    name = "fedcurv"
    Config = FedCurvConfig
    paper = "Shoham et al., Overcoming Forgetting in Federated Learning on Non-IID Data, arXiv 1910.07796 (2019)"
    fedavg_when = {"lam": 0.0}

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: self.forward.shapes[k] for k in self.forward.trainable}

    def upload_spec(self):
        return {"model": TreeSpec(self.forward.shapes), "fisher": TreeSpec(self._shapes()), "num_samples": ArraySpec()}

    def init_server(self, params: Params, fed: Federation) -> dict[str, Any]:
        k = fed.num_clients
        zeros = {n: torch.zeros((k, *params[n].shape), dtype=params[n].dtype, device=params[n].device)
                 for n in self.forward.trainable}
        return {"model": params, "u": zeros, "v": {n: t.clone() for n, t in zeros.items()}}

    def download(self, server: dict[str, Any], clients: torch.Tensor, rnd: RoundInfo) -> Download:
        p = {n: server["u"][n].sum(0) - server["u"][n][clients] for n in server["u"]}
        q = {n: server["v"][n].sum(0) - server["v"][n][clients] for n in server["v"]}
        return Download(shared={"model": server["model"]}, per_client={"P": p, "Q": q})

    def begin(self, received, state, info, rnd):
        return {"model": received["model"]}, {"P": received["P"], "Q": received["Q"]}

    def local_loss(self, trees, ctx, batch):
        params = trees["model"]
        ce = weighted_ce(self.train_forward(params, batch), batch["y"], batch["w"])
        return ce + self.cfg.lam * curvature_penalty(params, ctx["P"], ctx["Q"])

    def passes(self, rnd: RoundInfo) -> list[Pass]:
        names = self.forward.trainable

        def fisher(trees, ctx, batch):
            params = trees["model"]

            def loss(sub):
                return weighted_ce(self.forward({**params, **sub}, batch["x"]), batch["y"], batch["w"])

            g = grad(loss)({k: params[k] for k in names})
            return {"sq": {k: v**2 for k, v in g.items()}, "batches": torch.ones((), device=batch["x"].device)}

        return [Pass("fisher", fisher, when="after", batch_size=self.cfg.fisher_batch_size or "train",
                     max_samples=self.cfg.fisher_samples, shuffle=True)]

    def finish(self, trees, ctx, state, info, rnd):
        f = info["fisher"]
        u = {k: v / f["batches"] for k, v in f["sq"].items()}
        return {"model": trees["model"], "fisher": u, "num_samples": info["num_samples"]}, state, trees["model"]

    def aggregate(self, server, uploads, clients, rnd):
        model = weighted_average(uploads["model"], size_weights(uploads["num_samples"]))
        u, v = dict(server["u"]), dict(server["v"])
        for n, fk in uploads["fisher"].items():
            u[n] = u[n].index_copy(0, clients, fk)
            v[n] = v[n].index_copy(0, clients, fk * uploads["model"][n])
        return {"model": model, "u": u, "v": v}
