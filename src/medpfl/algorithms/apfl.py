"""APFL (Deng, Kamani & Mahdavi, "Adaptive Personalized Federated Learning", arXiv 2003.13461,
2020, Algorithm 1 and its adaptive mixing parameter), with the FHBench settings of the EPFL
study as defaults (spec ``methods-pfedkdwcl-epfl.md`` B.3: "mixing alpha starts at 1.0 and is
updated once per round by a gradient step with lr = ``--lr`` plus 0.02 alpha regularization,
clipped to [0, 1]"; code wph6/FHBench ``core/traineval.py`` ``train_APFL``). Authors' code:
MLOPTPSU/FedTorch ``comms/trainings/federated/apfl.py``, ``alpha_update`` in
``comms/utils/flow_utils.py``.

Notation: P = the model's trainable parameters, B = its buffers (BatchNorm running statistics).
Every client i keeps a personal model v_i (a full model state, float tensors by name; starts as
the initial global model) and a mixing weight alpha_i (float scalar in [0, 1], starts at
``alpha_init``). Its personalized model is the parameter mixture

    v_bar_i = alpha_i v_i + (1 - alpha_i) w          (on P; B: v_i's own buffers)

**Local program** (w starts at the received global model; the same mini-batches xi for both):

    w   <- w   - lr grad f_i(w; xi)                               (Alg. 1: a FedAvg step)
    v   <- v   - lr grad_v f_i(v_bar; xi)                          = alpha grad f_i(v_bar; xi)
    alpha <- alpha - lr_a (grad_alpha f_i(v_bar; xi) + rho alpha),  clipped to [0, 1]
    grad_alpha f_i(v_bar) = < v - w, grad f_i(v_bar) >  (sum over P)

as one phase on the trees ``model`` (w), ``personal`` (v) and ``alpha`` (``{"alpha": scalar}``)
whose objective is ``CE(w) + CE(alpha v + (1 - alpha) sg(w))``: w's gradient is its own CE's
only (w enters the mixture detached), v's is alpha grad f(v_bar), alpha's the inner product
above. rho = ``alpha_reg`` (0.02: the ``+ 0.02 alpha`` of FedTorch's ``alpha_update``, kept by
FHBench and PFLlib) is the loss term ``rho/2 alpha^2``; lr_a = lr x ``alpha_lr_scale``.

When alpha moves (``alpha_update``):

- ``round`` (default; spec B.3, FHBench, FedTorch ``fed_adaptive_alpha``): alpha is a constant of
  the training phase; after it a phase ``alpha`` takes **one** SGD step on alpha alone (one
  mini-batch of its own seeded draw, no momentum, no weight decay) at the trained v_i, w_i, then
  clips (FHBench and FedTorch use the gradients stored from the last training batch; FHBench
  moreover never stores the new alpha, so every round restarts from 1.0, and steps its w with an
  optimizer bound to another model, so its w never trains: neither is reproduced).
- ``step`` (the paper's Sec. on adaptive alpha, PFLlib every batch): alpha is a third tree of the
  training phase, stepped and clipped after every mini-batch. It then shares the phase's SGD
  (the run's momentum and weight decay; the paper: plain SGD).
- ``fixed``: alpha stays ``alpha_init`` (the paper's fixed-alpha runs; FedTorch's default).

Which gradient alpha steps on (``alpha_grad``), with g_v = grad f_i(v; xi) and g_w = grad
f_i(w; xi) each model's own cross-entropy gradient on the batch (sums over P):

- ``exact`` (default; the paper's expression for the adaptive alpha):
  ``<v - w, grad f_i(v_bar)> + rho alpha``, the derivative of ``CE(alpha sg(v) + (1 - alpha)
  sg(w)) + rho/2 alpha^2``;
- ``endpoint`` (FedTorch ``alpha_update`` in ``comms/utils/flow_utils.py``, PFLlib
  ``clientapfl.py``): grad f_i(v_bar) approximated by the end points' gradients,
  ``<v - w, alpha g_v + (1 - alpha) g_w> + rho alpha``;
- ``fhbench`` (FHBench ``core/traineval.py`` ``train_APFL``, which passes the personal model
  where ``alpha_update`` expects the local one): v and w swapped in the same expression,
  ``<w - v, alpha g_w + (1 - alpha) g_v> + rho alpha``. At alpha = 1/2 it is the negative of
  ``endpoint``'s: alpha moves the other way.

``endpoint`` and ``fhbench`` step alpha on ``alpha * sg(d) + rho/2 alpha^2`` with d the inner
product above (computed with ``torch.func.grad``), whose alpha-gradient is exactly the
expression; they evaluate g_v, g_w at the current (pre-step) v and w of the batch.

``personal_objective: own`` trains v on ``CE(v)`` instead (PFLlib and FHBench); alpha's
gradient is still the ``alpha_grad`` expression (with v and w detached). ``personal_state:
mixture`` stores ``alpha v_i + (1 - alpha) w_i`` as the next v_i at the end of the round, as
PFLlib and FHBench do (the paper keeps v_i).

**Upload**: w_i and n_i (FedAvg's; ``bytes_up`` one model + n_i); v_i and alpha_i never leave the
client. **Server**: ``w <- sum_i a_i w_i``, a_i ∝ n_i (FedAvg; ``weighting: uniform``: 1/m,
Alg. 1's and both codes' mean). The global model is FedAvg's by construction (tested).

**Evaluation.** Every scored model is one mixture ``alpha_i v_i + (1 - alpha_i) w`` (never a
mixture of a mixture); which w each reading names:

- right after training (``local_after_training``), both readings: w = the client's trained local
  w_i (Alg. 1's v_bar at the end of the local steps);
- the personalized model (``personalized_on_local``) with ``personal_state: v`` (the paper):
  ``alpha_i v_i + (1 - alpha_i) w`` with the current global w, which is what the client holds after
  the synchronisation (Alg. 1 sets w_i to the average);
- with ``personal_state: mixture`` (PFLlib, FHBench): the stored mixture itself, ``alpha_i v_i +
  (1 - alpha_i) w_i`` with the w_i of the client's last visit (PFLlib's ``test_metrics`` scores
  ``model_per``, which ``train`` overwrote with that mixture).

A never-sampled client keeps its initial v_i (the initial global model) and alpha_init: with
``personal_state: v`` it scores ``alpha_init v_0 + (1 - alpha_init) w`` (with alpha_init 1: the
initial model), with ``mixture`` the initial model (as PFLlib). ``predict`` is the plain forward
of the mixed state. BatchNorm buffers are not mixed:
the mixed model uses v_i's, which the mixture's training-mode forward updates (with
``personal_objective: own``: v's own forward), so they are the running statistics of the model
that is deployed; w's forward updates w's buffers, averaged with the uploads as FedAvg's.

No setting gives FedAvg's records (the personalized view is always added; ``fedavg_when`` None);
with ``alpha_update: fixed, alpha_init: 0`` and ``personal_state: v`` the personalized model is
the global model.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from medpfl.algorithms.aggregation import client_weights
from medpfl.algorithms.base import MODEL_UPLOAD, Algorithm, MethodConfig
from medpfl.algorithms.inner import grad_of_trainable
from medpfl.fl.functional import Params, clone_params, weighted_average, weighted_ce
from medpfl.fl.optim import RunOptimizer, sgd
from medpfl.fl.program import Federation, Phase, RoundInfo


class APFLConfig(MethodConfig):
    """alpha_init 1.0, alpha_update round, alpha_lr_scale 1 (the client lr), alpha_reg 0.02: the
    FHBench code as spec B.3 reads it (PFLlib: alpha 1.0, updated every step with the same lr
    and 0.02; the authors' FedTorch: 0.5, fixed unless ``--fed_adaptive_alpha``, then once per
    round with the client lr and 0.02). personal_objective mixed and personal_state v: the
    paper's Algorithm 1 (PFLlib and FHBench: ``own``, ``mixture``). weighting num_samples:
    FedAvg's (the paper's Alg. 1, FedTorch and FHBench average uniformly: ``uniform``)."""

    alpha_init: float = Field(1.0, ge=0.0, le=1.0,
                              description="alpha_i at round 0 (spec B.3 / FHBench --alpha_APFL 1.0; PFLlib -al 1.0; "
                                          "authors' FedTorch --fed_personal_alpha 0.5)")
    alpha_update: Literal["round", "step", "fixed"] = Field(
        "round", description="one alpha step per round after local training (spec B.3, FHBench; FedTorch "
                             "--fed_adaptive_alpha), a step with every mini-batch (paper's adaptive alpha; PFLlib), "
                             "or none (the paper's fixed-alpha runs; FedTorch's default)")
    alpha_lr_scale: float = Field(1.0, ge=0.0, description="alpha's step size as a multiple of the round's lr "
                                                           "(FHBench, FedTorch, PFLlib, paper: the client lr)")
    alpha_reg: float = Field(0.02, ge=0.0, description="rho of the extra rho*alpha in alpha's gradient (FedTorch "
                                                       "alpha_update 0.02, kept by FHBench and PFLlib; paper: 0)")
    personal_objective: Literal["mixed", "own"] = Field(
        "mixed", description="v's loss: CE of the mixture alpha v + (1 - alpha) sg(w) (paper Alg. 1) or CE(v) "
                             "(PFLlib, FHBench)")
    personal_state: Literal["v", "mixture"] = Field(
        "v", description="kept as the next v_i: v_i (paper Alg. 1) or alpha v_i + (1 - alpha) w_i (PFLlib, FHBench "
                         "overwrite their personal model with the mixture each round)")
    alpha_grad: Literal["exact", "endpoint", "fhbench"] = Field(
        "exact", description="alpha's gradient: <v - w, grad f(v_bar)> (the paper's adaptive alpha), "
                             "<v - w, alpha grad f(v) + (1 - alpha) grad f(w)> (FedTorch alpha_update, PFLlib), or "
                             "the same with v and w swapped (FHBench train_APFL)")
    weighting: Literal["num_samples", "uniform"] = Field(
        "num_samples", description="weights of the w average: n_i / sum n (FedAvg) or 1/m (paper Alg. 1, FedTorch, "
                                   "FHBench)")


class APFL(Algorithm):
    name = "apfl"
    Config = APFLConfig
    paper = "Deng, Kamani & Mahdavi, Adaptive Personalized Federated Learning, arXiv 2003.13461 (2020)"
    model_upload = MODEL_UPLOAD  # the weighted mean of the global copies w
    # FedAvg's global model by construction, but its records always add the personalized mixture

    personalized = True

    # ----- the mixture -------------------------------------------------------------------------
    def mix(self, v: Params, w: Params, alpha: torch.Tensor, clone_buffers: bool = False) -> Params:
        """``alpha v + (1 - alpha) w`` on the trainable parameters (float tensors, shapes of the
        model; alpha a float scalar); every other entry (buffers) is v's own tensor, by reference
        (a training-mode forward then updates v's running statistics) or cloned."""
        train = set(self.forward.trainable)
        return {k: (alpha * v[k] + (1.0 - alpha) * w[k]) if k in train else (v[k].clone() if clone_buffers else v[k])
                for k in v}

    def _ce(self, params: Params, batch) -> torch.Tensor:
        return weighted_ce(self.train_forward(params, batch), batch["y"], batch["w"])

    def endpoint_product(self, v: Params, w: Params, alpha: torch.Tensor, batch) -> torch.Tensor:
        """The detached scalar d of ``alpha_grad`` ``endpoint``: ``<v - w, alpha g_v + (1 - alpha)
        g_w>``, or ``fhbench``: ``<w - v, alpha g_w + (1 - alpha) g_v>``; g_v, g_w (float, shapes
        of the trainable parameters P) the gradients of each model's own batch cross-entropy
        (FedTorch ``alpha_update``; PFLlib ``clientapfl.alpha_update``; FHBench ``train_APFL``).
        Buffers are cloned, so the training-mode forwards leave v's and w's as they were."""
        train = self.forward.trainable
        sv = {k: t.detach() for k, t in v.items()}
        sw = {k: t.detach() for k, t in w.items()}

        def grad_at(p: Params) -> Params:
            rest = {k: t.clone() for k, t in p.items() if k not in train}
            return grad_of_trainable(lambda q: self._ce(q, batch), {k: p[k] for k in train}, rest)

        gv, gw = grad_at(sv), grad_at(sw)
        a = alpha.detach()
        if self.cfg.alpha_grad == "fhbench":
            sv, sw, gv, gw = sw, sv, gw, gv
        return sum(torch.sum((sv[k] - sw[k]) * (a * gv[k] + (1.0 - a) * gw[k])) for k in train).detach()

    def alpha_loss(self, v: Params, w: Params, alpha: torch.Tensor, batch) -> torch.Tensor:
        """alpha's objective, whose alpha-gradient is the ``alpha_grad`` expression plus rho alpha:
        ``exact``: ``CE(alpha sg(v) + (1 - alpha) sg(w)) + (rho/2) alpha^2`` (gradient
        ``<v - w, grad f(v_bar)> + rho alpha``; the training-mode forward leaves v's buffers as
        they were); ``endpoint``/``fhbench``: ``alpha sg(d) + (rho/2) alpha^2`` with d from
        :meth:`endpoint_product`."""
        reg = 0.5 * self.cfg.alpha_reg * alpha**2
        if self.cfg.alpha_grad != "exact":
            return alpha * self.endpoint_product(v, w, alpha, batch) + reg
        sv = {k: t.detach() for k, t in v.items()}
        sw = {k: t.detach() for k, t in w.items()}
        return self._ce(self.mix(sv, sw, alpha, clone_buffers=True), batch) + reg

    def train_loss(self, trees, ctx, batch) -> torch.Tensor:
        """The training phase's objective: ``CE(w) + CE(alpha v + (1 - alpha) sg(w))`` (alpha
        constant unless ``alpha_update: step``), or ``CE(w) + CE(v)`` with ``personal_objective:
        own``; in ``step`` mode plus alpha's term (:meth:`alpha_loss`, v and w detached; with the
        mixed objective and ``alpha_grad: exact`` the mixture's own CE already gives alpha its
        exact gradient, so only rho/2 alpha^2 is added)."""
        w, v, alpha = trees["model"], trees["personal"], trees["alpha"]["alpha"]
        step = self.cfg.alpha_update == "step"
        loss = self._ce(w, batch)
        sw = {k: t.detach() for k, t in w.items()}
        if self.cfg.personal_objective == "mixed":
            through_mixture = step and self.cfg.alpha_grad == "exact"
            loss = loss + self._ce(self.mix(v, sw, alpha if through_mixture else alpha.detach()), batch)
            if through_mixture:
                loss = loss + 0.5 * self.cfg.alpha_reg * alpha**2
            elif step:
                loss = loss + self.alpha_loss(v, w, alpha, batch)
        else:
            loss = loss + self._ce(v, batch)
            if step:
                loss = loss + self.alpha_loss(v, w, alpha, batch)
        return loss

    @staticmethod
    def clip_alpha(trees) -> dict:
        """Project alpha onto [0, 1] (the ``project`` of the phases that train it)."""
        return {"alpha": {"alpha": torch.clamp(trees["alpha"]["alpha"], 0.0, 1.0)}}

    # ----- client ------------------------------------------------------------------------------
    def init_client_state(self, params: Params, client: int, fed: Federation) -> dict[str, Any]:
        ref = params[self.forward.trainable[0]]
        return {"personal": clone_params(params),
                "alpha": torch.tensor(self.cfg.alpha_init, dtype=ref.dtype, device=ref.device)}

    def begin(self, received, state, info, rnd):
        return {"model": received["model"], "personal": state["personal"], "alpha": {"alpha": state["alpha"]}}, {}

    def phases(self, rnd: RoundInfo) -> list[Phase]:
        cfg = self.cfg
        if cfg.alpha_update == "step":
            return [Phase(trainable={"model": None, "personal": None, "alpha": None}, loss=self.train_loss,
                          optimizer={"alpha": RunOptimizer(lr_scale=cfg.alpha_lr_scale)}, project=self.clip_alpha)]
        train = Phase(trainable={"model": None, "personal": None}, loss=self.train_loss)
        if cfg.alpha_update == "fixed":
            return [train]

        def loss(trees, ctx, batch):
            return self.alpha_loss(trees["personal"], trees["model"], trees["alpha"]["alpha"], batch)

        return [train, Phase(name="alpha", trainable={"alpha": None}, loss=loss, steps=1,
                             optimizer=sgd(rnd.lr * cfg.alpha_lr_scale), project=self.clip_alpha)]

    def finish(self, trees, ctx, state, info, rnd):
        w, v, alpha = trees["model"], trees["personal"], trees["alpha"]["alpha"]
        mixed = self.mix(v, w, alpha)
        keep = mixed if self.cfg.personal_state == "mixture" else v
        up = {"model": w, "num_samples": info["num_samples"]}
        return up, {"personal": keep, "alpha": alpha}, mixed

    def personalized_model(self, state, server):
        """``personal_state: v``: ``alpha_i v_i + (1 - alpha_i) w`` with the global w;
        ``mixture``: the stored ``alpha_i v_i + (1 - alpha_i) w_i`` itself (mixing it again with
        w would score ``alpha^2 v + alpha (1 - alpha) w_i + (1 - alpha) w``, no reading's model)."""
        if self.cfg.personal_state == "mixture":
            return state["personal"]
        return self.mix(state["personal"], server["model"], state["alpha"])

    # ----- server ------------------------------------------------------------------------------
    def aggregate(self, server, uploads, clients, rnd):
        a = client_weights(uploads["num_samples"], self.cfg.weighting)
        return {**server, "model": weighted_average(uploads["model"], a)}
