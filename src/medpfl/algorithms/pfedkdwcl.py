"""pFedKD-WCL (Hu, Kothari & Banerjee, "A Novel Algorithm for Personalized Federated Learning:
Knowledge Distillation with Weighted Combination Loss", Algorithms 2025, 18(5), 274,
doi:10.3390/a18050274; official code HengruiH/pFedKD ``algorithms/pfedkd.py``, commit a90cc3a).

A bi-level method. The global model w is the teacher; every client keeps a personal model
theta_i (the student, same architecture) that never leaves it.

- **Client (inner level, Eq. 3).** A sampled client takes ``local_steps`` mini-batch SGD steps on
  ``(1 - gamma) CE(theta_i) + gamma KL(p_w || p_theta_i)`` with the received w_t frozen as teacher
  (temperature 1, teacher first, batch mean). Then, with theta_hat_i frozen, it computes
  ``g_i = grad_w (1/n_i) sum_x KL(p_w(x) || p_theta_hat_i(x))`` over its *whole* local train split
  (official code: full batch, batch mean) and uploads g_i and n_i, not theta_i.
- **Server (outer level, Eq. 4).** One SGD step per round: ``w <- w - eta_s sum_i a_i g_i`` with
  a_i = 1/|S_t| (paper, Alg. 1) or n_i / sum_j n_j (``server_weighting: num_samples``, what the
  official code means to do). eta_s = ``server_lr``, by default the round's client lr (the paper
  uses one eta; the code 0.01 for both).

Choices where the paper is silent (spec ``methods-pfedkdwcl-epfl.md`` A.1.5, A.1.6, C.1-6):

- theta_i is persistent and starts from its *own* random initialisation (PyTorch's default, as
  building a fresh model; official code: one ``model_class()`` per user), drawn from a generator
  seeded by (run seed, client id) (``seeded_client_init``: the engine's ``seeded_cpu_rng``), so both executors and a
  resumed run agree, and independent of w_0. ``theta_init: global`` is the ablation
  theta_{i,0}^t = w_t (each round restarts from the received model; the state then only keeps
  the last trained theta_i for evaluation; its round-0 value is w_0).
- "20 local epochs" are R = 20 mini-batch steps (Alg. 1's R; the code's ``local_epochs`` for
  pFedKD). The batches follow the engine's plan: consecutive batches of a seeded permutation of
  the local train set (the code draws ``randperm(n)[:B]`` afresh each step, i.e. with replacement
  across steps; the same in distribution within a step). ``local_steps: null`` trains
  ``train.local_epochs`` full epochs instead. The optimizer is the run's (the paper: SGD,
  lr 0.01, no momentum, no weight decay).
- Teacher and KL-gradient forwards use evaluation mode (the code puts w in training mode for
  the gradient; identical for its MLR/MLP, and for BatchNorm models it keeps the sum over the
  train split independent of the batch size). No data ever passes w in training mode, so its
  buffers (BatchNorm running statistics) stay at their initial values; only its parameters
  receive the server step.
- ``legacy_last_client_grad`` reproduces the official code's aggregation bug: each client's
  ``compute_kl_gradients`` starts with ``global_model.zero_grad()``, wiping what earlier clients
  added, so the step uses ``(1 + n_last / sum_j n_j) g_last`` only. "Last" is the last client in
  the round's sampled order (the schedule's draw order, which is the order the code's
  ``random.sample`` list is trained in). This ignores ``server_weighting``.

Evaluation: theta_i is what each local test split scores (after training and as the
personalized model; a never-sampled client is scored with its initial theta_i, as the code
scores every user each round); w is scored as the global model.

FedAvg reduction: none (``fedavg_when = None``). The server never averages models; w moves only
by the KL-gradient step, and the clients train their own theta_i, never a copy of w. Even
``gamma = 0`` (clients train alone) with ``theta_init: global`` (start from w_t) differs from
FedAvg, because the trained models are not averaged into w.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch.func import grad

from medpfl.algorithms.base import Algorithm, MethodConfig
from medpfl.fl.functional import Params, clone_params, model_state, weighted_ce, weighted_kl
from medpfl.fl.payload import ArraySpec, TreeSpec
from medpfl.fl.program import Federation, Pass, Phase, RoundInfo


class PFedKDWCLConfig(MethodConfig):
    """gamma 0.1: the paper's main setting (Sec. 4; the code's ``--kd_weight``). local_steps 20:
    the paper's "20 local epochs", which Algorithm 1 and the official code run as R = 20
    single mini-batch steps. theta_init persistent, an independent random init per client:
    official code. server_weighting uniform: Algorithm 1 / Eq. 4 (1/S); num_samples is what the
    code intends. server_lr None: the round's client lr (paper: one eta; code: 0.01 for both).
    legacy_last_client_grad False: the correct aggregation; True reproduces the code's bug."""

    gamma: float = Field(0.1, ge=0.0, le=1.0,
                         description="KD weight gamma of Eq. (3) (paper Sec. 4 main setting; code --kd_weight 0.1)")
    local_steps: int | None = Field(20, ge=1, description="R mini-batch SGD steps per round (paper Alg. 1, '20 "
                                                          "local epochs'; official code); None = train.local_epochs")
    theta_init: Literal["persistent", "global"] = Field(
        "persistent", description="persistent: own random init, kept across rounds (official code); "
                                  "global: restart from w_t every round (ablation)")
    server_weighting: Literal["uniform", "num_samples"] = Field(
        "uniform", description="a_i of the server step: 1/|S_t| (paper Alg. 1, Eq. 4) or n_i/sum n (code's intent)")
    server_lr: float | None = Field(None, gt=0.0, description="server step size eta_s; None = the round's client lr "
                                                              "(paper: one eta; code: 0.01); decayed as the client lr")
    legacy_last_client_grad: bool = Field(False, description="reproduce the official code's zero_grad bug: only "
                                                             "(1 + n_last/sum n) g_last of the last sampled client")


def random_model_state(template: torch.nn.Module, like: Params) -> Params:
    """A freshly initialised state of ``template``'s architecture (PyTorch's default
    initialisation: every submodule's ``reset_parameters``, as building the model runs them),
    drawn from the CPU generator, with the names, devices and dtypes of ``like``.

    Raises ValueError if a state entry belongs to no module with ``reset_parameters`` (it would
    stay uninitialised)."""
    module = copy.deepcopy(template).to_empty(device="cpu")
    covered: set[str] = set()
    with torch.no_grad():
        for prefix, mod in module.named_modules():
            reset = getattr(mod, "reset_parameters", None)
            if callable(reset):
                reset()
                pre = f"{prefix}." if prefix else ""
                covered |= {pre + n for n, _ in mod.named_parameters(recurse=False)}
                covered |= {pre + n for n, _ in mod.named_buffers(recurse=False)}
    state = model_state(module)
    missing = sorted(set(like) - covered)
    if missing:
        raise ValueError(f"pfedkdwcl: cannot draw a random initialisation of {missing[:4]} (no reset_parameters "
                         "in their module); use theta_init: global")
    return {k: state[k].to(device=like[k].device, dtype=like[k].dtype) for k in like}


def kl_sum(teacher_logits: torch.Tensor, student_logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``sum_i valid_i KL(softmax(teacher_i) || softmax(student_i))`` (teacher first, T = 1),
    differentiable in both. [B, C] each, valid float [B]; scalar."""
    log_p = F.log_softmax(teacher_logits, dim=-1)
    log_q = F.log_softmax(student_logits, dim=-1)
    return torch.sum(valid * torch.sum(log_p.exp() * (log_p - log_q), dim=-1))


class PFedKDWCL(Algorithm):
    name = "pfedkdwcl"
    Config = PFedKDWCLConfig
    paper = ("Hu, Kothari & Banerjee, A Novel Algorithm for Personalized Federated Learning: Knowledge "
             "Distillation with Weighted Combination Loss, Algorithms 2025, 18(5), 274")
    fedavg_when = None  # the server takes a KL-gradient step on w; it never averages models
    seeded_client_init = True  # theta_i's random draw: a function of (run seed, client id)

    personalized = True

    def _grad_shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: self.forward.shapes[k] for k in self.forward.trainable}

    # ----- server -----------------------------------------------------------------------------
    def upload_spec(self):
        return {"grad": TreeSpec(self._grad_shapes()), "num_samples": ArraySpec()}

    def aggregate(self, server, uploads, clients, rnd: RoundInfo):
        """``w <- w - eta_s sum_i a_i g_i`` on w's parameters (buffers unchanged)."""
        g, n = uploads["grad"], uploads["num_samples"].to(torch.float64)
        m = n.shape[0]
        if self.cfg.legacy_last_client_grad:
            coef = torch.zeros_like(n)
            coef[-1] = 1.0 + n[-1] / n.sum()
        elif self.cfg.server_weighting == "num_samples":
            coef = n / n.sum()
        else:
            coef = torch.full_like(n, 1.0 / m)
        lr = rnd.lr if self.cfg.server_lr is None else self.cfg.server_lr * rnd.decay
        model = dict(server["model"])
        for k, gk in g.items():
            step = torch.sum(coef.to(gk.dtype).view(-1, *([1] * (gk.dim() - 1))) * gk, dim=0)
            model[k] = model[k] - lr * step
        return {**server, "model": model}

    # ----- client -----------------------------------------------------------------------------
    def init_client_state(self, params: Params, client: int, fed: Federation) -> dict[str, Any]:
        if self.cfg.theta_init == "global":
            return {"theta": clone_params(params)}
        return {"theta": random_model_state(self.forward.module, params)}

    def shared_context(self, shared, rnd: RoundInfo):
        return {"teacher": shared["model"]}

    def begin(self, received, state, info, rnd):
        theta = received["model"] if self.cfg.theta_init == "global" else state["theta"]
        return {"theta": theta}, {}

    def sample_context(self, ctx, x):
        return {"teacher_logits": self.forward(ctx["teacher"], x)}

    def wcl_loss(self, trees, ctx, batch):
        """Eq. (3) on a batch: ``(1 - gamma) CE(theta) + gamma KL(p_w || p_theta)``, both batch
        means over the real samples (``w = 1/b``)."""
        logits = self.train_forward(trees["theta"], batch)
        ce = weighted_ce(logits, batch["y"], batch["w"])
        kl = weighted_kl(batch["teacher_logits"], logits, batch["w"])
        return (1.0 - self.cfg.gamma) * ce + self.cfg.gamma * kl

    def phases(self, rnd: RoundInfo) -> list[Phase]:
        return [Phase(trainable={"theta": None}, loss=self.wcl_loss, steps=self.cfg.local_steps)]

    def kl_grad_sum(self, trees, ctx, batch) -> dict[str, Any]:
        """The pass summand: ``grad_w sum_{x in batch, real} KL(p_w(x) || p_theta(x))`` with theta
        frozen (evaluation mode for both), on w's parameters."""
        w = ctx["teacher"]
        x = batch["x"]
        valid = (batch["w"] > 0).to(x.dtype)
        student = self.forward(trees["theta"], x).detach()

        def objective(sub: Params) -> torch.Tensor:
            return kl_sum(self.forward({**w, **sub}, x), student, valid)

        return {"g": grad(objective)({k: w[k] for k in self.forward.trainable})}

    def passes(self, rnd: RoundInfo) -> list[Pass]:
        return [Pass("kl_grad", self.kl_grad_sum, when="after")]

    def finish(self, trees, ctx, state, info, rnd):
        n = info["num_samples"]
        g = {k: v / n.to(v.dtype) for k, v in info["kl_grad"]["g"].items()}
        theta = trees["theta"]
        return {"grad": g, "num_samples": n}, {"theta": theta}, theta

    def personalized_model(self, state, server):
        return state["theta"]
