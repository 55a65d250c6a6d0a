"""FedProx (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020).

Local objective (eq. 2 of the paper): ``h_k(w) = F_k(w) + (mu/2) * ||w - w_g||^2`` where
``w_g`` is the global model received this round. Aggregation as FedAvg.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field

from medpfl.algorithms.base import MODEL_UPLOAD, Algorithm, LocalStepsConfig
from medpfl.fl.functional import Params, weighted_ce
from medpfl.fl.program import Phase, RoundInfo


class FedProxConfig(LocalStepsConfig):
    """mu: proximal weight. Default 1.0: the paper's best value for its image tasks (MNIST,
    FEMNIST; Section 5.3 and Fig. 2), and the FedKPer authors' baseline config. mu = 0 is FedAvg.
    ``local_steps`` (default None: epochs): a fixed number of mini-batch steps per round instead
    (:class:`~medpfl.algorithms.base.LocalStepsConfig`)."""

    mu: float = Field(1.0, ge=0.0, description="proximal weight (paper Sec. 5.3 / Fig. 2, its image tasks; "
                                                "FedKPer authors' baseline config); 0 = FedAvg")


class FedProx(Algorithm):
    name = "fedprox"
    Config = FedProxConfig
    paper = "Li et al., Federated Optimization in Heterogeneous Networks, MLSys 2020"
    model_upload = MODEL_UPLOAD  # FedAvg's server: the n_k-weighted mean
    fedavg_when = {"mu": 0.0}

    def shared_context(self, shared: dict[str, Any], rnd: RoundInfo) -> dict[str, Any]:
        return {"global": shared["model"]}

    def phases(self, rnd: RoundInfo) -> list[Phase]:
        """One phase: ``train.local_epochs`` epochs, or exactly ``local_steps`` mini-batches."""
        return [Phase(steps=self.cfg.local_steps)]

    def local_loss(self, trees: dict[str, Params], ctx: dict[str, Any], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        params = trees["model"]
        ce = weighted_ce(self.train_forward(params, batch), batch["y"], batch["w"])
        return ce + 0.5 * self.cfg.mu * proximal_term(params, ctx["global"], self.forward.trainable)


def proximal_term(params: Params, center: Params, names) -> torch.Tensor:
    """``sum_k ||params[k] - center[k]||^2`` over ``names`` (no gradient into the center);
    FedProx eq. 2 without its mu/2 factor. Scalar float tensor.

    As one fused ``mse_loss(reduction="sum")`` per tensor: the same value and gradient as the
    written-out ``sum((p - c) ** 2)`` (bit-identical training records on the pFedKD-WCL MNIST
    FedProx-MLP job), with fewer kernels and temporaries per step."""
    return sum(F.mse_loss(params[k], center[k].detach(), reduction="sum") for k in names)
