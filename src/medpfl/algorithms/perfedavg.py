"""Per-FedAvg (Fallah, Mokhtari & Ozdaglar, "Personalized Federated Learning with Theoretical
Guarantees: A Model-Agnostic Meta-Learning Approach", NeurIPS 2020), first-order variant
(Per-FedAvg (FO), Sec. 5 and Algorithm 1 with the gradient estimate of eq. 10 without the
Hessian term), as the pFedKD-WCL paper compares it (spec ``methods-pfedkdwcl-epfl.md`` A.2, A.4).

The global model w is a meta-initialisation: a client adapts it with one SGD step on its own
data. Each local step on a pair of mini-batches (D, D'):

    w_tmp = w - alpha * grad f(w; D)                    (inner step, lr alpha)
    w     = w - beta  * grad f(w_tmp; D')               (outer step, lr beta; first order: the
                                                         Hessian-vector term is dropped)

The server averages the clients' w with weights ∝ n_k (FedAvg). What a client deploys, and what
its local test split scores at every evaluation (``personalized_on_local``), is the global model
after one adaptation on its train split: a step at lr alpha on one batch, then a step at lr beta
on another (the official pFedMe/pFedKD code's ``train_one_step``), by the engine's
``adaptation_phases`` for every client.

A "local step" takes two batches of ``train.batch_size`` each: here one batch of twice that
size drawn from the phase's seeded order, split into D (the first ``batch_size``) and D' (the
rest). The last batch of an epoch may be short; then D' is what is left after D (when nothing
is left the outer gradient is zero).
"""

from __future__ import annotations

import torch
from pydantic import Field

from medpfl.algorithms.base import MODEL_UPLOAD, Algorithm, MethodConfig
from medpfl.algorithms.inner import grad_of_trainable
from medpfl.fl.functional import weighted_ce
from medpfl.fl.optim import RunOptimizer, sgd
from medpfl.fl.program import Phase, RoundInfo


class PerFedAvgConfig(MethodConfig):
    """beta 0.002 and 20 local steps: the pFedKD-WCL paper (Sec. 5: "beta = 0.002", "20 local
    epochs", which its code runs as 20 single steps for Per-FedAvg); alpha None: the study's
    learning rate (0.01 in the paper and the code)."""

    beta: float = Field(0.002, gt=0.0, description="outer (meta) step size (pFedKD-WCL paper Sec. 5; code --beta)")
    alpha: float | None = Field(None, gt=0.0, description="inner step size; None = the round's lr "
                                                          "(pFedKD-WCL code: --learning_rate 0.01)")
    local_steps: int | None = Field(20, ge=1, description="local steps (each on two mini-batches) per round; "
                                                          "None = train.local_epochs epochs "
                                                          "(pFedKD-WCL paper: 20; its code: 20 steps)")
    adapt_at_eval: bool = Field(True, description="score every client's one-step adaptation of the global model "
                                                  "(the paper's personalized model; official code train_one_step)")


def first_order_maml_loss(algo: Algorithm, alpha: float, b: int):
    """The phase objective of Per-FedAvg (FO) on one batch of up to 2b samples split into D (the
    first b) and D' (the rest): ``f(w_tmp; D')`` with ``w_tmp = w - alpha * stopgrad(grad f(w; D))``,
    whose gradient w.r.t. w is exactly ``grad f(w_tmp; D')`` (Fallah et al. 2020, eq. 10 without
    the Hessian term). ``batch["w"]`` (float [<= 2b]; 0 on padding, which comes last) is
    renormalised within each half, so the stacked executor's padded batches split as the
    sequential executor's exact ones."""

    def loss(trees, ctx, batch):
        params = trees["model"]
        names = algo.forward.trainable
        x, y, w = batch["x"], batch["y"], batch["w"]
        half = min(b, x.shape[0])
        valid = (w > 0).to(w.dtype)
        w1 = valid[:half] / valid[:half].sum().clamp_min(1.0)
        w2 = valid[half:] / valid[half:].sum().clamp_min(1.0)

        def inner(p):
            logits = algo.forward(p, x[:half], train=True, mask=valid[:half] > 0)
            return weighted_ce(logits, y[:half], w1)

        g = grad_of_trainable(inner, {k: params[k].detach() for k in names},
                              {k: v for k, v in params.items() if k not in names})
        tmp = {**params, **{k: params[k] - alpha * g[k].detach() for k in names}}
        logits = algo.forward(tmp, x[half:], train=True, mask=valid[half:] > 0)
        return weighted_ce(logits, y[half:], w2)

    return loss


class PerFedAvg(Algorithm):
    name = "perfedavg"
    Config = PerFedAvgConfig
    paper = ("Fallah, Mokhtari & Ozdaglar, Personalized Federated Learning with Theoretical Guarantees: "
             "A Model-Agnostic Meta-Learning Approach, NeurIPS 2020 (first-order variant)")
    model_upload = MODEL_UPLOAD  # FedAvg's server: the n_k-weighted mean
    # no setting of its knobs gives FedAvg: every step is evaluated at an inner-adapted point

    personalized = True

    def _alpha(self, rnd: RoundInfo) -> float:
        return self.cfg.alpha if self.cfg.alpha is not None else rnd.lr

    def phases(self, rnd: RoundInfo) -> list[Phase]:
        if rnd.batch_size is None:
            raise ValueError("perfedavg needs the round's batch size (RoundInfo.batch_size) for its two-batch steps")
        return [Phase(name="meta", loss=first_order_maml_loss(self, self._alpha(rnd), rnd.batch_size),
                      optimizer=RunOptimizer(lr=self.cfg.beta), steps=self.cfg.local_steps,
                      batch_size=2 * rnd.batch_size)]

    def adaptation_phases(self, rnd: RoundInfo) -> list[Phase]:
        if not self.cfg.adapt_at_eval:
            return []
        return [Phase(name="adapt_alpha", steps=1, optimizer=sgd(self._alpha(rnd))),
                Phase(name="adapt_beta", steps=1, optimizer=sgd(self.cfg.beta))]

    def personalized_model(self, state, server):
        return server["model"]
