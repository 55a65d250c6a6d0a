"""SCAFFOLD (Karimireddy, Kale, Mohri, Reddi, Stich & Suresh, "SCAFFOLD: Stochastic Controlled
Averaging for Federated Learning", ICML 2020, Algorithm 1), with option II for the client control
variate, as FHBench runs it (spec ``methods-pfedkdwcl-epfl.md`` B.3: "server lr 1.0;
control variates with option-II update"; code wph6/FHBench ``core/traineval.py``
``train_SCAFFOLD``, ``core/comm.py`` ``global_aggregate``).

Notation: P = the model's trainable parameters (``forward.trainable``), each a float tensor of
its own shape; B = its buffers (BatchNorm running statistics and counters, ``forward.buffers``).

**State.** Server: the model x (every entry of P and B) and the server control variate c (one
float tensor per entry of P, same shape; zeros at round 0). Client i: its control variate c_i
(same names and shapes; zeros at round 0). Both are checkpointed with the run.

**Download** (shared, to each sampled client): x and c, i.e. ``bytes_down`` = (model + c) per
recipient: twice the parameters, plus the buffers.

**Local program** (one phase named ``train``; y starts at x; K = its number of mini-batch steps,
``train.local_epochs`` epochs):

    y <- y - lr (g_i(y) + c - c_i)                                   (Alg. 1, line 10)

The correction enters through the objective: ``CE(y) + sum_{p in P} <c_p - c_i,p, y_p>``,
whose gradient w.r.t. y_p is exactly ``grad CE + (c_p - c_i,p)`` (c - c_i is a constant of the
round, computed in ``begin`` from the shared c and the client's own c_i: per client by
construction, in both executors). The step is plain SGD by default (``momentum: 0``,
``weight_decay: 0``: Algorithm 1, and FHBench's and PFLlib's ``SCAFFOLDOptimizer``
``p -= lr (grad + c - c_i)``). With ``momentum``/``weight_decay`` set (or ``None`` = the run's
``train.optimizer``), the engine's SGD applies them to the *corrected* gradient:
``d = g + (c - c_i) + wd y; b = mu b + d; y -= lr b``. Weight decay is then part of the local
objective's gradient and the control variates estimate that gradient (harmless). Momentum is
not: the option-II estimate below measures the displacement per unit lr, which with momentum mu
is about ``(g + c - c_i) / (1 - mu)`` per step (K >> 1/(1 - mu)), so the correction is amplified
by 1/(1 - mu) on every round; with full participation and a locally constant gradient g_i the
correction a_i = c - c_i then evolves as ``a_i <- (g_bar - g_i)/(1 - mu) - mu/(1 - mu) a_i``,
which diverges for mu > 0.5 (mu = 0: ``a_i <- g_bar - g_i``, the intended correction). On an
Adam run (``train.optimizer.name: adam``) the phase is Adam on the corrected gradient (momentum
0 is then no extra term) and option II measures Adam's displacement per unit lr, not the mean
gradient: runnable, but not the paper's algorithm.

**Control update, option II** (Alg. 1, line 12; float, per entry of P):

    c_i+ = c_i - c + (x - y_i) / (K lr)

with K = the number of local steps actually taken (``info["steps"]["train"]``, int64 scalar,
a short last batch included) and lr the round's learning rate (``rnd.lr``). Without momentum this
is the mean over the K steps of the local gradients g_i(y) (the corrections cancel). Option I
(``c_i+ = g_i(x)``, an extra pass) is not offered.

**Upload** (``upload_spec``): ``delta`` = Δy_i = y_i - x and ``dc`` = Δc_i = c_i+ - c_i (a
``TreeSpec`` of P each), ``buffers`` = y_i's buffers (a ``TreeSpec`` of B; only for a model with
buffers) and ``num_samples`` n_i: ``bytes_up`` = twice the parameters, plus the buffers and n_i.

**Server** (Alg. 1, lines 16-17; S the m sampled clients, N = K clients in all):

    x <- x + eta_g sum_{i in S} a_i Δy_i        a_i = 1/m (the paper's mean; ``weighting:
                                                 uniform``) or n_i / sum_S n (``num_samples``)
    c <- c + (m / N) (1/m) sum_{i in S} Δc_i     always the paper's plain mean, so that
                                                 c = (1/N) sum_{all i} c_i holds every round

eta_g = ``server_lr`` (1.0: spec B.3, FHBench ``--server_learning_rate``, PFLlib ``-slr``).
**Buffers** are not controlled and take no step: the server's buffers are the a_i-weighted mean
of the clients' (as FedAvg; integer counters rounded), eta_g does not apply to them.

FedAvg reduction (``fedavg_when``): with ``control_variates: false`` (c and c_i are never
created, sent or applied: c = c_i = 0 throughout, where Algorithm 1's local step is FedAvg's),
size weights, eta_g = 1 and the run's optimizer, the server computes
``x + sum_i a_i (y_i - x) = sum_i a_i y_i``: FedAvg (up to float rounding; tested). Not a setting
of the paper's experiments: an ablation switch.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from medpfl.algorithms.aggregation import client_weights
from medpfl.algorithms.base import Algorithm, MethodConfig
from medpfl.fl.functional import Params, weighted_average, weighted_ce
from medpfl.fl.payload import ArraySpec, TreeSpec
from medpfl.fl.optim import RunOptimizer
from medpfl.fl.program import Download, Federation, Phase, RoundInfo


class ScaffoldConfig(MethodConfig):
    """server_lr 1.0: the FHBench code (spec B.3, ``--server_learning_rate 1.0``; PFLlib ``-slr``
    1.0). weighting uniform: the paper's
    plain mean over the sampled clients (Alg. 1; FHBench 1/N with every client, PFLlib 1/m);
    ``num_samples``: FedAvg's n_i weights for Δy (c's update stays the paper's). momentum 0,
    weight decay 0: Alg. 1's plain SGD and both codes' ``SCAFFOLDOptimizer``; ``None`` = the
    run's ``train.optimizer`` (see the module docstring for why momentum breaks option II).
    control_variates True: SCAFFOLD; False is the ablation without them (FedAvg with a server lr)."""

    server_lr: float = Field(1.0, gt=0.0, description="global step size eta_g of x <- x + eta_g mean(Δy) (spec B.3 / "
                                                      "FHBench --server_learning_rate 1.0; PFLlib -slr 1.0)")
    weighting: Literal["uniform", "num_samples"] = Field(
        "uniform", description="weights a_i of the Δy mean: 1/m (paper Alg. 1 line 16; PFLlib, FHBench) or "
                               "n_i / sum n (FedAvg's); c's update is always the paper's (|S|/N) mean")
    momentum: float | None = Field(0.0, ge=0.0, lt=1.0, description="local SGD momentum (paper Alg. 1 and FHBench/"
                                                                    "PFLlib SCAFFOLDOptimizer: none); None = the run's")
    weight_decay: float | None = Field(0.0, ge=0.0, description="local weight decay (paper, FHBench, PFLlib: none); "
                                                                "None = the run's train.optimizer.weight_decay")
    control_variates: bool = Field(True, description="SCAFFOLD's c, c_i (paper); False: none are kept, sent or "
                                                     "applied (ablation: with c = c_i = 0 Alg. 1 is FedAvg)")


def correction_term(params: Params, corr: Params, names) -> torch.Tensor:
    """``sum_{p in names} <corr_p, params_p>`` (scalar; ``corr`` detached): its gradient w.r.t.
    ``params_p`` is ``corr_p``, SCAFFOLD's ``c - c_i`` added to the local gradient."""
    return sum(torch.sum(corr[k].detach() * params[k]) for k in names)


class Scaffold(Algorithm):
    name = "scaffold"
    Config = ScaffoldConfig
    paper = ("Karimireddy, Kale, Mohri, Reddi, Stich & Suresh, SCAFFOLD: Stochastic Controlled Averaging for "
             "Federated Learning, ICML 2020")
    fedavg_when = {"control_variates": False, "weighting": "num_samples", "server_lr": 1.0, "momentum": None,
                   "weight_decay": None}

    @property
    def _control(self) -> bool:
        return self.cfg.control_variates

    def _zeros(self, params: Params) -> Params:
        return {k: torch.zeros_like(params[k]) for k in self.forward.trainable}

    # ----- server ------------------------------------------------------------------------------
    def init_server(self, params: Params, fed: Federation) -> dict[str, Any]:
        return {"model": params, "c": self._zeros(params)} if self._control else {"model": params}

    def download(self, server, clients, rnd: RoundInfo) -> Download:
        if self._control:
            return Download(shared={"model": server["model"], "c": server["c"]})
        return Download(shared={"model": server["model"]})

    def upload_spec(self):
        shapes = self.forward.shapes
        spec = {"delta": TreeSpec({k: shapes[k] for k in self.forward.trainable}), "num_samples": ArraySpec()}
        if self.forward.buffers:
            spec["buffers"] = TreeSpec({k: shapes[k] for k in self.forward.buffers})
        if self._control:
            spec["dc"] = TreeSpec({k: shapes[k] for k in self.forward.trainable})
        return spec

    def aggregate(self, server, uploads, clients, rnd):
        """x <- x + eta_g sum a_i Δy_i (buffers: sum a_i b_i); c <- c + (1/N) sum_S Δc_i."""
        a = client_weights(uploads["num_samples"], self.cfg.weighting)
        step = weighted_average(uploads["delta"], a)
        bufs = weighted_average(uploads["buffers"], a) if "buffers" in uploads else {}
        x = server["model"]
        eta = self.cfg.server_lr
        new = {k: (x[k] + eta * step[k]) if k in step else bufs[k] for k in x}
        out = {**server, "model": new}
        if self._control:
            n_all = rnd.num_clients
            out["c"] = {k: server["c"][k] + torch.sum(uploads["dc"][k], dim=0) / n_all for k in server["c"]}
        return out

    # ----- client ------------------------------------------------------------------------------
    def init_client_state(self, params: Params, client: int, fed: Federation) -> dict[str, Any]:
        return {"c": self._zeros(params)} if self._control else {}

    def shared_context(self, shared, rnd: RoundInfo):
        return {"x": shared["model"], **({"c": shared["c"]} if self._control else {})}

    def begin(self, received, state, info, rnd):
        if not self._control:
            return {"model": received["model"]}, {}
        corr = {k: received["c"][k] - state["c"][k] for k in self.forward.trainable}
        return {"model": received["model"]}, {"corr": corr}

    def local_loss(self, trees, ctx, batch):
        y = trees["model"]
        ce = weighted_ce(self.train_forward(y, batch), batch["y"], batch["w"])
        if not self._control:
            return ce
        return ce + correction_term(y, ctx["corr"], self.forward.trainable)

    def phases(self, rnd: RoundInfo) -> list[Phase]:
        return [Phase(optimizer=RunOptimizer(momentum=self.cfg.momentum, weight_decay=self.cfg.weight_decay))]

    def control_update(self, c_i: Params, c: Params, x: Params, y: Params, steps: torch.Tensor, lr: float) -> Params:
        """Option II: ``c_i+ = c_i - c + (x - y) / (K lr)`` per trainable entry (K = ``steps``,
        int64 scalar, at least 1; lr the round's)."""
        out = {}
        for k in self.forward.trainable:
            k_lr = torch.clamp(steps, min=1).to(y[k].dtype) * lr
            out[k] = c_i[k] - c[k] + (x[k] - y[k]) / k_lr
        return out

    def finish(self, trees, ctx, state, info, rnd):
        y, x = trees["model"], ctx["x"]
        names = self.forward.trainable
        up: dict[str, Any] = {"delta": {k: y[k] - x[k] for k in names}, "num_samples": info["num_samples"]}
        if self.forward.buffers:
            up["buffers"] = {k: y[k] for k in self.forward.buffers}
        if not self._control:
            return up, state, y
        c_new = self.control_update(state["c"], ctx["c"], x, y, info["steps"]["train"], rnd.lr)
        up["dc"] = {k: c_new[k] - state["c"][k] for k in names}
        return up, {"c": c_new}, y
