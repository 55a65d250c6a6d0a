"""APPLE (Luo & Wu, "Adapt to Adaptation: Learning Personalization for Cross-Silo Federated
Learning", IJCAI 2022, arXiv 2110.08394; authors' code ljaiverson/pFL-APPLE ``train_APPLE.py``,
``utils/models.py``, ``utils/losses.py``), with the FHBench settings of the EPFL study as
defaults (spec ``methods-pfedkdwcl-epfl.md`` B.3: "APPLE: DR-vector lr 1e-3; mu = 1e-3 pulls
toward 1/N; lambda_t = (cos(pi t/T)+1)/2"; code wph6/FHBench ``core/traineval.py``
``train_APPLE``, ``vit_lora_fed.py``). PFLlib: ``flcore/clients/clientapple.py``,
``flcore/servers/serverapple.py``.

Notation: K = N clients; P = the model's trainable parameters (``forward.trainable``); B = its
buffers (BatchNorm running statistics and counters, ``forward.buffers``).

**Server state**: ``cores``: the K *core models* C_1..C_K (every entry of P, stacked [K, ...]),
all equal to the initial model at round 0 (FHBench and PFLlib copy one model; the authors' code
draws K independent inits: not offered). There is no global model (``has_global_model`` False:
the global-test columns do not apply; the last evaluation round scores every personalized model
on the global test set, ``local_on_global_test``).

**Client state**: the *directed relationship* (DR) vector p_i (float [K], every entry 1/K at
round 0: FHBench ``pss = 1/n_clients``, PFLlib ``ps = 1/N``; the authors' code starts at the
clients' train-size fractions n_j / sum n, which ``init_client_state`` cannot see, see below) and,
on a model with buffers, the client's own B.

**Download** (shared, the same to every recipient): all K core models. ``bytes_down`` = K x |P|
per recipient, its own core included (the authors' code downloads all K every round unless its
bandwidth limit ``limit_downloaded_models`` (default 10000, i.e. none) picks M by p; PFLlib hands
every client the list of the last round's uploads, which is all N only under full participation,
uncounted; nothing here sends only the cores that changed since a client's last visit).

**Personalized model** of client i (eq. of the paper; the authors' ``ClientNet.compress``):

    w_i = sum_j p_ij C_j        on P;   B: the client's own buffers

The authors' ``ClientNet`` mixes layer *outputs* (``sum_j p_j layer_j(x)``), which for the
linear and conv layers of their CNN equals the parameter mixture; on a BatchNorm model the
mixture's BN layer uses the client's own running statistics (its affine weights are mixed as
any parameter), which its training-mode forward updates (PFLlib likewise keeps the client's
model's buffers and mixes ``parameters()`` only). B never leaves the client.

**Local program** (one phase ``train``; the same mini-batches for both trees; own core c = C_i
from the download, p = p_i from the state):

    L(c, p) = CE(sum_{j != i} p_j C_j + p_i c) + (mu / 2) lambda_t ||p - 1/K||^2

trained on the trees ``core`` (c; its gradient is p_i grad CE(w_i), "scaled by p_ii": the
authors' autograd, PFLlib ``lr * grad * ps[id]``, FHBench likewise) and ``dr`` (p; d/dp_j =
<C_j, grad CE(w_i)> summed over P, with c in place of C_i, plus mu lambda_t (p_j - 1/K)). The
other clients' cores are constants. The core takes the round's lr (times K with
``core_lr_times_k``: PFLlib multiplies its learning rate by N); p takes ``dr_lr`` (absolute,
constant over rounds; with ``dr_lr_decay`` it follows the run's lr decay, as the authors'
``lr_coef * decay**r``). Momentum and weight decay: the run's ``train.optimizer`` for both trees
(the authors: SGD momentum 0.9 for both; FHBench and PFLlib: plain SGD). The engine has no
per-tree weight decay, so the run's weight decay also shrinks p (1e-5 by default: negligible
beside mu).

The proximal weight (the paper's lambda(r), the authors' ``get_reg_coef``), over 0-based rounds
t of T = ``train.rounds``, L = ``int(reg_rounds_fraction * T)``:

    cosine (default; FHBench, PFLlib):  lambda_t = (cos(pi t / L) + 1) / 2   for t < L, else 0
    exponential (authors' default):     lambda_t = 1e-3 ** (t / L)          for t < L, else 0

FHBench: L = T (its ``lamda`` of round t); PFLlib: L = ``-L`` x T (default 1.0), but it applies the
value computed after round t-1 in round t (lambda = 1 in rounds 0 and 1): not reproduced; the
authors: L = 0.1 T, exponential.

The proximal term's scale: FHBench and PFLlib step p by ``mu lambda (p - p0)``, i.e. the loss
``(mu/2) lambda ||p - p0||^2`` used here; the authors' code adds ``mu lambda ||p - p0||^2``
(gradient ``2 mu lambda (p - p0)``; their default mu 0.1): their setting is ours with mu doubled.
The centre p0: 1/K (FHBench, spec B.3); PFLlib and the authors use the train-size fractions
n_j / sum n (not available to a client state here: ``init_client_state(params, client)`` sees
neither K's train sizes nor K itself; K is taken from ``init_server``, which the engine calls
first).

``dr_gradient: layer_mean`` gives p PFLlib's and FHBench's gradient instead of the exact one:
``(1/|P|) sum_{t in P} mean(grad_t CE(w_i) * C_j,t)`` (a mean over each tensor's elements,
averaged over the tensors), built as a surrogate whose value is the mixture's exactly and whose
core gradient is unchanged. (Both codes also take one DR step per mini-batch; FHBench's
``train_APPLE`` moreover trains a separate client model with its own optimizer and then steps
the core and p once from that model's last-batch gradient: not reproduced.)

**Upload**: c (the own core's P, a ``TreeSpec``) and n_i; p_i and B never leave the client.
**Server**: C_i <- the upload of each sampled client i (no averaging); the other cores are kept.

**Evaluation.** Right after training (``local_after_training``) the client scores
``sum_{j != i} p_j C_j + p_i c`` with its trained c and p (the mixture it deploys);
``personalized_on_local`` scores ``sum_j p_ij C_j`` with the server's current cores (for client i,
C_i is its last upload; the other cores are as recent as the server holds them), with its own B.
A never-sampled client mixes the current cores with its initial p.

No setting gives FedAvg (``fedavg_when`` None): the cores are never averaged.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from pydantic import Field

from medpfl.algorithms.base import Algorithm, MethodConfig
from medpfl.fl.functional import Params, weighted_ce
from medpfl.fl.payload import ArraySpec, TreeSpec
from medpfl.fl.optim import RunOptimizer
from medpfl.fl.program import Download, Federation, Phase, RoundInfo


class APPLEConfig(MethodConfig):
    """dr_lr 1e-3, mu 1e-3, cosine lambda over all T rounds, p and its centre 1/K: the FHBench code
    as spec B.3 reads it (``-drlr 1e-3``, ``--mu 1e-3``, ``lamda = (cos(round pi / n_rounds) + 1) / 2``,
    ``pss = 1/n_clients``, ``p0 = 1/n_clients``). The authors' code (pFL-APPLE ``utils/utils.py``):
    ``--lr_coef 1e-3``, ``--mu 0.1`` (on ``mu ||p - p0||^2``: ours x 2), ``--scheduler exponential``,
    ``--reg_last_round_over_total_round 0.1``, p0 = n_j / sum n. PFLlib: ``-dlr`` 0.0 (must be set),
    ``-mu`` 0.0, ``-L`` 1.0, cosine, core lr x N. dr_gradient exact: the authors' autograd (PFLlib,
    FHBench: ``layer_mean``)."""

    dr_lr: float = Field(1e-3, ge=0.0, description="learning rate of the DR vector p (spec B.3 / FHBench "
                                                   "--dr_learning_rate 1e-3; authors' --lr_coef 1e-3; PFLlib -dlr, "
                                                   "default 0.0)")
    dr_lr_decay: bool = Field(False, description="p's lr follows the run's lr decay (authors' lr_coef * decay**r); "
                                                 "False: constant (FHBench, PFLlib)")
    mu: float = Field(1e-3, ge=0.0, description="weight of the proximal term (mu/2) lambda_t ||p - 1/K||^2 (spec B.3 "
                                                "/ FHBench --mu 1e-3; PFLlib -mu; authors' --mu 0.1 on mu ||.||^2)")
    schedule: Literal["cosine", "exponential"] = Field(
        "cosine", description="shape of lambda_t: (cos(pi t/L) + 1)/2 (FHBench, PFLlib, the paper's cosine) or "
                              "1e-3**(t/L) (authors' --scheduler default exponential)")
    reg_rounds_fraction: float = Field(1.0, ge=0.0, le=1.0,
                                       description="L / T: lambda_t is 0 from round int(L) on (FHBench: 1, all rounds; "
                                                   "PFLlib -L 1.0; authors' --reg_last_round_over_total_round 0.1)")
    dr_gradient: Literal["exact", "layer_mean"] = Field(
        "exact", description="p's gradient: the exact d/dp_j = <C_j, grad CE> (paper, authors' autograd) or PFLlib's "
                             "and FHBench's mean over each tensor's elements, averaged over the tensors")
    core_lr_times_k: bool = Field(False, description="the own core's lr is the round's lr x K (PFLlib multiplies its "
                                                     "learning rate by N); False: the round's lr (authors, FHBench)")


def dr_lambda(t: int, rounds: int, fraction: float, schedule: str) -> float:
    """The proximal weight lambda_t of round ``t`` (0-based) of ``rounds``: 0 from round
    ``L = int(fraction * rounds)`` on; before, ``(cos(pi t / L) + 1) / 2`` (cosine) or
    ``1e-3 ** (t / L)`` (exponential; the authors' ``get_reg_coef`` without mu)."""
    horizon = int(fraction * rounds)
    if t >= horizon:
        return 0.0
    if schedule == "cosine":
        return (math.cos(math.pi * t / horizon) + 1.0) / 2.0
    return 1e-3 ** (t / horizon)


class APPLE(Algorithm):
    name = "apple"
    Config = APPLEConfig
    paper = ("Luo & Wu, Adapt to Adaptation: Learning Personalization for Cross-Silo Federated Learning, "
             "IJCAI 2022")
    # the cores are never averaged: no setting gives FedAvg

    has_global_model = False
    personalized = True

    # ----- the mixture -------------------------------------------------------------------------
    def mixture(self, p: torch.Tensor, cores: Params, own: torch.Tensor, core: Params) -> Params:
        """Client i's model ``sum_{j != i} p_j C_j + p_i c`` on P (``cores`` [K, ...], ``own`` the
        one-hot e_i float [K], ``core`` = c, its own core, with its buffers, which the mixture uses
        by reference so that a training-mode forward updates them). With ``dr_gradient:
        layer_mean`` p's gradient per tensor t is scaled by 1 / (|P| numel_t) (same value)."""
        q = p * (1.0 - own)
        p_own = torch.sum(p * own)
        names = self.forward.trainable
        out = {}
        for k in names:
            w = torch.tensordot(q, cores[k], dims=1) + p_own * core[k]
            if self.cfg.dr_gradient == "layer_mean":
                s = 1.0 / (len(names) * cores[k][0].numel())
                wp = torch.tensordot(q, cores[k].detach(), dims=1) + p_own * core[k].detach()
                w = (torch.tensordot(q.detach(), cores[k], dims=1) + p_own.detach() * core[k]
                     + s * wp - s * wp.detach())
            out[k] = w
        for k in self.forward.buffers:
            out[k] = core[k]
        return out

    def dr_loss(self, lam: float):
        """The phase objective of a round with proximal weight ``lam`` (lambda_t)."""
        mu = self.cfg.mu

        def loss(trees, ctx, batch) -> torch.Tensor:
            p = trees["dr"]["p"]
            w = self.mixture(p, ctx["cores"], ctx["own"], trees["core"])
            ce = weighted_ce(self.train_forward(w, batch), batch["y"], batch["w"])
            return ce + 0.5 * mu * lam * torch.sum((p - 1.0 / p.shape[-1]) ** 2)

        return loss

    # ----- server ------------------------------------------------------------------------------
    def init_server(self, params: Params, fed: Federation) -> dict[str, Any]:
        return {"cores": {k: params[k].unsqueeze(0).repeat(fed.num_clients, *([1] * params[k].dim()))
                          for k in self.forward.trainable}}

    def download(self, server, clients, rnd: RoundInfo) -> Download:
        return Download(shared={"cores": server["cores"]})

    def upload_spec(self):
        shapes = self.forward.shapes
        return {"core": TreeSpec({k: shapes[k] for k in self.forward.trainable}), "num_samples": ArraySpec()}

    def aggregate(self, server, uploads, clients, rnd):
        """C_i <- the upload of each sampled client i; every other core is kept (no averaging)."""
        cores = {k: c.index_copy(0, clients, uploads["core"][k].to(c.dtype)) for k, c in server["cores"].items()}
        return {**server, "cores": cores}

    def global_model(self, server):
        return None

    # ----- client ------------------------------------------------------------------------------
    def init_client_state(self, params: Params, client: int, fed: Federation) -> dict[str, Any]:
        k = fed.num_clients
        ref = params[self.forward.trainable[0]]
        state: dict[str, Any] = {"p": torch.full((k,), 1.0 / k, dtype=ref.dtype, device=ref.device)}
        if self.forward.buffers:
            state["buffers"] = {b: params[b].clone() for b in self.forward.buffers}
        return state

    def shared_context(self, shared, rnd: RoundInfo):
        return {"cores": shared["cores"]}

    def _own(self, p: torch.Tensor, client: torch.Tensor) -> torch.Tensor:
        """e_i: float [K], 1 at the client's index."""
        return (torch.arange(p.shape[-1], device=p.device) == client).to(p.dtype)

    def begin(self, received, state, info, rnd):
        p = state["p"]
        own = self._own(p, info["client"])
        cores = received["cores"]
        core = {k: torch.tensordot(own, cores[k], dims=1) for k in self.forward.trainable}  # exactly C_i
        core.update(state.get("buffers", {}))
        return {"core": core, "dr": {"p": p}}, {"own": own}

    def phases(self, rnd: RoundInfo) -> list[Phase]:
        cfg = self.cfg
        lam = dr_lambda(rnd.round, rnd.rounds, cfg.reg_rounds_fraction, cfg.schedule)
        dr_lr = cfg.dr_lr * (rnd.decay if cfg.dr_lr_decay else 1.0)
        core_scale = float(rnd.num_clients) if cfg.core_lr_times_k else 1.0
        dr_scale = dr_lr / rnd.lr if rnd.lr > 0 else 0.0
        return [Phase(trainable={"core": None, "dr": None}, loss=self.dr_loss(lam),
                      optimizer={"core": RunOptimizer(lr_scale=core_scale), "dr": RunOptimizer(lr_scale=dr_scale)})]

    def finish(self, trees, ctx, state, info, rnd):
        core, p = trees["core"], trees["dr"]["p"]
        names = self.forward.trainable
        up = {"core": {k: core[k] for k in names}, "num_samples": info["num_samples"]}
        new_state: dict[str, Any] = {"p": p}
        if self.forward.buffers:
            new_state["buffers"] = {b: core[b] for b in self.forward.buffers}
        model = {k: v.detach() for k, v in self.mixture(p, ctx["cores"], ctx["own"], core).items()}
        return up, new_state, model

    def personalized_model(self, state, server):
        """``sum_j p_ij C_j`` with the server's cores (C_i is client i's last upload) and its own B."""
        p = state["p"]
        out = {k: torch.tensordot(p, c, dims=1) for k, c in server["cores"].items()}
        out.update(state.get("buffers", {}))
        return out
