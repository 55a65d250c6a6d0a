"""pFedMe (T. Dinh, Tran & Nguyen, "Personalized Federated Learning with Moreau Envelopes",
NeurIPS 2020, Algorithm 1), as the pFedKD-WCL paper runs it (spec ``methods-pfedkdwcl-epfl.md``
A.2, A.4; code HengruiH/pFedKD, which follows the pFedMe authors' code).

Each client keeps a personalized model theta_i and a local copy w_loc of the global model.
Every local iteration (R per round) draws one mini-batch D and

    theta <- theta - plr * (grad f(theta; D) + lam * (theta - w_loc))     K times on D  (eq. 7, its
                                                                          approximate solution)
    w_loc <- w_loc - eta * lam * (w_loc - theta)                          (Alg. 1, line 8)

with eta the round's learning rate. **Every** client trains each round, but only the sampled
subset S_t sends w_loc and is aggregated (Alg. 1: "server uniformly samples a subset S_t ... and
sends the global model to all clients"), with uniform weights and the server's beta step
``w <- (1 - beta) w + beta * mean_{i in S_t} w_loc_i`` (Alg. 1, line 11). The personalized theta_i
is what every client's local test split scores.

On the engine: one phase trains two trees on one objective per step (the same batch D):
``theta`` and ``local`` (w_loc). The K inner steps are computed inside the objective (functional
gradients, vmap-able) to theta_hat; the objective is

    1/(2 eta) ||theta - sg(theta_hat)||^2  +  (lam/2) ||w_loc - sg(theta_hat)||^2

whose SGD step at lr eta (no momentum, no weight decay) moves theta exactly to theta_hat and
w_loc by ``- eta lam (w_loc - theta_hat)``: Alg. 1's two updates. theta persists across rounds
(``theta_init="persistent"``, the pFedKD code's pFedMe per the spec); ``"global"`` restarts it
from the received global model each round (the pFedMe authors' ``set_parameters``).

**As the pFedKD-WCL code runs it** (HengruiH/pFedKD ``algorithms/pfedme.py``, ``UserpFedMe.train``),
two things differ from Alg. 1, each an option:

- ``local_update: round``: w_loc stays the received w^t through the R iterations (so every
  iteration's K theta steps are pulled towards w^t) and is updated **once**, after them:
  ``w_loc = w^t - lam eta (w^t - theta) = (1 - lam eta) w^t + lam eta theta``. Alg. 1 (line 8,
  ``iteration``, the default) updates w_loc after every iteration. Here the phase then trains
  theta alone (objective ``1/(2 eta) ||theta - sg(theta_hat)||^2``) and ``finish`` applies the
  round's single update.
- ``theta_init: random``: each client's theta is a persistent model with its own independent
  random initialisation (the code builds every user's ``model`` with ``model_class()``), drawn
  from the CPU generator seeded by (run seed, client id) (``seeded_client_init``), as
  pFedKD-WCL's own theta; ``persistent`` starts it from w_0.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field

from medpfl.algorithms.base import MODEL_UPLOAD, Algorithm, MethodConfig
from medpfl.algorithms.inner import grad_of_trainable
from medpfl.algorithms.pfedkdwcl import random_model_state
from medpfl.fl.functional import Params, clone_params, weighted_average, weighted_ce
from medpfl.fl.optim import sgd
from medpfl.fl.program import Federation, Phase, RoundInfo


class PFedMeConfig(MethodConfig):
    """lam 15: the pFedKD-WCL paper's value for the MLP on MNIST (its Sec. 5: 5 for MLR on
    MNIST, 15 for the MLP, 30 on Synthetic; the studies set each); K 5, personal_lr 0.01,
    beta 1: the pFedKD-WCL code's defaults where its paper is silent (also the pFedMe paper's
    K = 5 and its beta = 1 setting); 20 local iterations: pFedKD-WCL's "20 local epochs",
    run by its code as 20 mini-batch iterations."""

    lam: float = Field(15.0, gt=0.0, description="Moreau-envelope weight lambda (pFedKD-WCL paper Sec. 5: 5 MLR/MNIST, "
                                                 "15 MLP/MNIST, 30 Synthetic)")
    inner_steps: int = Field(5, ge=1, description="K steps solving for theta on each batch (pFedKD-WCL code; pFedMe Sec. 5)")
    personal_lr: float = Field(0.01, gt=0.0, description="step size of the K theta steps (pFedKD-WCL code --personal_learning_rate)")
    beta: float = Field(1.0, gt=0.0, le=2.0, description="server mixing w <- (1-beta) w + beta avg (pFedMe Alg. 1; "
                                                        "pFedKD-WCL code b = 1)")
    local_steps: int | None = Field(20, ge=1, description="local iterations R per round; None = train.local_epochs "
                                                          "epochs (pFedKD-WCL paper/code: 20)")
    all_clients_train: bool = Field(True, description="every client trains every round, only the sampled are "
                                                      "aggregated (pFedMe Alg. 1 and both codes); False: only the sampled train")
    theta_init: Literal["persistent", "global", "random"] = Field(
        "persistent", description="theta kept across rounds from w_0 (spec A.4), restarted from the received global "
                                  "model each round (pFedMe authors' code), or kept across rounds from its own random "
                                  "init (pFedKD-WCL code: model_class() per user)")
    local_update: Literal["iteration", "round"] = Field(
        "iteration", description="w_loc <- w_loc - eta lam (w_loc - theta) after every local iteration (pFedMe Alg. 1 "
                                 "line 8) or once after the R iterations from the received w^t (pFedKD-WCL code "
                                 "UserpFedMe.train)")


def inner_solution(algo: Algorithm, theta: Params, w_loc: Params, batch: dict[str, torch.Tensor], lam: float,
                   lr: float, steps: int) -> Params:
    """``steps`` gradient steps on ``h(theta) = f(theta; D) + (lam/2)||theta - w_loc||^2`` from
    ``theta`` (pFedMe eq. 7's approximate solution, its optimizer's update
    ``theta - lr (grad f + lam (theta - w_loc))``). Trainable leaves only; detached. Returns the
    parameters (same names and shapes as ``theta``'s trainable leaves)."""
    names = algo.forward.trainable
    cur = {k: theta[k].detach() for k in names}
    center = {k: w_loc[k].detach() for k in names}
    rest = {k: v.detach() for k, v in theta.items() if k not in cur}

    def f(params):
        return weighted_ce(algo.forward(params, batch["x"], train=True, mask=batch["w"] > 0), batch["y"], batch["w"])

    for _ in range(steps):
        g = grad_of_trainable(f, cur, rest)
        cur = {k: cur[k] - lr * (g[k] + lam * (cur[k] - center[k])) for k in names}
    return cur


class PFedMe(Algorithm):
    name = "pfedme"
    Config = PFedMeConfig
    paper = "T. Dinh, Tran & Nguyen, Personalized Federated Learning with Moreau Envelopes, NeurIPS 2020"
    model_upload = MODEL_UPLOAD  # the uniform mean, then w <- (1 - beta) w + beta mean
    # the global model is driven by the Moreau envelope's gradient, never FedAvg's update
    seeded_client_init = True  # theta_init random: a function of (run seed, client id); the others draw nothing

    personalized = True

    def training_clients(self, sampled: np.ndarray, num_clients: int, rnd: RoundInfo) -> np.ndarray:
        if not self.cfg.all_clients_train:
            return sampled
        return np.arange(num_clients, dtype=np.int64)

    def init_client_state(self, params: Params, client: int, fed: Federation) -> dict[str, Any]:
        if self.cfg.theta_init == "random":
            return {"theta": random_model_state(self.forward.module, params)}
        return {"theta": clone_params(params)}

    def begin(self, received, state, info, rnd):
        theta = state["theta"] if self.cfg.theta_init == "persistent" else received["model"]
        return {"theta": theta, "local": received["model"]}, {}

    def _loss(self, eta: float):
        lam, cfg = self.cfg.lam, self.cfg
        names = self.forward.trainable
        per_iteration = cfg.local_update == "iteration"

        def loss(trees, ctx, batch):
            th, wl = trees["theta"], trees["local"]
            hat = inner_solution(self, th, wl, batch, lam, cfg.personal_lr, cfg.inner_steps)
            move = sum(torch.sum((th[k] - hat[k]) ** 2) for k in names) / (2.0 * eta)
            if not per_iteration:  # w_loc stays w^t until finish
                return move
            pull = 0.5 * lam * sum(torch.sum((wl[k] - hat[k]) ** 2) for k in names)
            return move + pull

        return loss

    def phases(self, rnd: RoundInfo) -> list[Phase]:
        trained = {"theta": None, "local": None} if self.cfg.local_update == "iteration" else {"theta": None}
        return [Phase(name="train", trainable=trained, loss=self._loss(rnd.lr), steps=self.cfg.local_steps,
                      optimizer=sgd(rnd.lr))]

    def finish(self, trees, ctx, state, info, rnd):
        local = trees["local"]
        if self.cfg.local_update == "round":  # the pFedKD-WCL code: w_loc = w^t - lam eta (w^t - theta), once
            c = self.cfg.lam * rnd.lr
            train = set(self.forward.trainable)
            local = {k: (v - c * (v - trees["theta"][k])) if k in train else v for k, v in local.items()}
        up = {"model": local, "num_samples": info["num_samples"]}
        return up, {"theta": trees["theta"]}, trees["theta"]

    def aggregate(self, server, uploads, clients, rnd):
        """``w <- (1 - beta) w + beta * mean(w_loc)`` over the sampled clients, uniform weights
        (pFedMe Alg. 1 line 11; both codes average uniformly)."""
        m = uploads["num_samples"].shape[0]
        w_dev = next(iter(uploads["model"].values())).device
        avg = weighted_average(uploads["model"], torch.full((m,), 1.0 / m, dtype=torch.float64, device=w_dev))
        b = self.cfg.beta
        w = server["model"]
        new = {k: ((1 - b) * w[k] + b * avg[k]) if w[k].is_floating_point() else avg[k] for k in w}
        return {**server, "model": new}

    def personalized_model(self, state, server):
        return state["theta"]
