"""EPFL (Wang, Chen, Zhang, Zhang, Lu & Chen, "FHBench: Towards Efficient and Personalized
Federated Learning for Multimodal Healthcare", arXiv 2504.10817, Sec. 4, Eq. 5-9, Alg. 1;
official code wph6/FHBench ``vit_lora_fed.py``, ``cal_sim_mat``), as spec
``methods-pfedkdwcl-epfl.md`` B.2-B.3 and C.10-13 read it.

"Adaptive" means client-adaptive, similarity-weighted aggregation of the LoRA **A** matrices; there
is no rank adaptation (r is the model's). The model declares its LoRA modules as two parts
(``extra_parts()``): ``lora_A`` and ``lora_B``, each a tuple of state names in the model's LoRA
module order l = 1..L (the l-th A pairs with the l-th B), plus the usual ``head``. The frozen
backbone is not in the model state. A model without these parts stops at the start of the run
with an error naming ``train.model`` and the part (``requires_parts``).

What is shared and what stays local (spec B.2.2):

- **A** (every LoRA module): uploaded, mixed per client by the server, each client downloads
  its own mixture (``Download.per_client``; ``bytes_down`` = |A| per trained client);
- **B** (every LoRA module): uploaded (the server needs it for the distances) and kept by the
  client (phi_B^{t+1} = phi_B^t: the server never sends a B back); ``bytes_up`` = |A| + |B|;
- **head** and any other state entry of the model: kept by the client, never uploaded.

**Server** (Eq. 5-9 with the spec's fixes), over the m clients that uploaded this round, with
B_i^(l) the l-th uploaded B of client i, psi^(l) in {0, 1} the selected layers (``psi``):

    d_ij^(l) = psi^(l) ||B_i^(l) - B_j^(l)||_F                      (Eq. 5; the code's Frobenius norm)
    dbar_ij  = sum_l d_ij^(l) / sum_l psi^(l)                        (Eq. 6)
    dbar_ij <- max(dbar_ij, 1e-12)                                   (zero guard; the paper defines Eq. 7
                                                                      only for d != 0, the code's guard is broken)
    s_hat_ij = (1/dbar_ij) / sum_{k != i} (1/dbar_ik),   j != i      (Eq. 7; the paper writes d_ij, the code
                                                                      uses dbar_ij)
    s_ii = lambda,   s_ij = (1 - lambda) s_hat_ij                    (Eq. 8; every row sums to 1)
    A_i^(l) <- sum_j s_ij A_j^(l)   for every l, pre-aggregation A_j (Eq. 9; Alg. 1 line 12's A_i is a typo)

computed in float64 (the mixed A is cast back to the model's dtype). ``mixing: uniform`` is the
ablation of Fig. 4a ("simple averaging" of A): A_i <- (1/m) sum_j A_j for every uploader (lambda
and psi unused). The server keeps every client's latest mixed A (``A``: stacked [K, ...], all
equal to the initial A at round 0) and, for inspection, the last mixing weights of every client
(``weights``: float64 [K, K], row i over all K clients, zero outside the uploaders of client i's
last round; the identity at round 0).

**Partial participation** (the paper uses full participation, spec B.3): the mixture runs over
the clients that uploaded this round (j in S_t); a client that did not upload keeps its row of
``A`` (its last mixture) and contributes nothing this round. The server stores no B between
rounds (nothing but A is server state), so no stale B or A enters a mixture. With a single
uploader there is no j != i: s_ii = 1, the client keeps its own trained A (Eq. 7's denominator
is empty).

**Client**: it trains ``{A_i from the download, its own B_i, head_i}`` (the engine's local
program: CE, the run's optimizer and epochs) and keeps B_i, head_i (and every non-A entry) in
its state; it never keeps A (the server holds its mixture). All clients start from the same A,
B (0 in LoRA) and head: the engine's initial model, which ``init_server`` and
``init_client_state`` copy (spec C.12).

**Evaluation**: ``local_after_training`` scores the trained (A_i, B_i, head_i) before
aggregation (the code's evaluation point, spec C.13); the personalized model of client i is its
latest mixed A_i from the server with its own B_i and head_i (a never-trained client: the
initial model). There is no single global model (``has_global_model`` False). No setting gives
FedAvg (B and head are never averaged).
"""

from __future__ import annotations

from typing import Any, Literal, Sequence

import torch
from pydantic import Field

from medpfl.algorithms.base import Algorithm, MethodConfig
from medpfl.fl.functional import Params
from medpfl.fl.payload import TreeSpec
from medpfl.fl.program import Download, Federation, RoundInfo

#: the zero-distance guard of Eq. 7 (spec B.2.3: dbar <- max(dbar, 1e-12))
DIST_EPS = 1e-12


class EPFLConfig(MethodConfig):
    """lambda 0.5 and psi all: the FHBench code (``--model_momentum 0.5``, ``--layers_part``
    default all; the paper gives no value for lambda, spec B.3); similarity mixing: the paper's
    Eq. 5-9 (``uniform``: its Fig. 4a ablation, simple averaging of A)."""

    lambda_self: float = Field(0.5, ge=0.0, le=1.0,
                               description="self-weight s_ii = lambda of Eq. 8 (FHBench code --model_momentum 0.5; "
                                           "not given in the paper)")
    psi: Literal["all", "first_half", "second_half"] = Field(
        "all", description="LoRA layers whose B enters the distances (psi of Eq. 5-6; FHBench --layers_part): all, "
                           "the first floor(L/2) B matrices in the model's LoRA order, or the remaining ones "
                           "(paper Sec. 5.3 sensitivity study)")
    mixing: Literal["similarity", "uniform"] = Field(
        "similarity", description="A_i <- sum_j s_ij A_j with the B-distance weights (paper Eq. 9) or the plain mean "
                                  "over the round's uploaders (paper Fig. 4a ablation, simple averaging)")


def selected_layers(num_layers: int, psi: str) -> list[int]:
    """The 0-based indices l with psi^(l) = 1 among L = ``num_layers`` LoRA modules: all, the
    first floor(L/2) or the remaining L - floor(L/2). Raises ValueError when the choice is empty."""
    half = num_layers // 2
    idx = {"all": list(range(num_layers)), "first_half": list(range(half)),
           "second_half": list(range(half, num_layers))}[psi]
    if not idx:
        raise ValueError(f"epfl: psi={psi!r} selects no LoRA layer of a model with L={num_layers}")
    return idx


def mean_distances(bs: Sequence[torch.Tensor]) -> torch.Tensor:
    """dbar (Eq. 5-6, before the guard): float64 [m, m], the mean over the given layers of the
    Frobenius distances ||B_i - B_j||_F. ``bs``: one stacked B per selected layer, [m, ...]."""
    total = None
    for b in bs:
        f = b.reshape(b.shape[0], -1).to(torch.float64)
        d = torch.stack([torch.linalg.vector_norm(f - f[i], dim=1) for i in range(f.shape[0])])
        total = d if total is None else total + d
    return total / len(bs)


def similarity_weights(dbar: torch.Tensor, lam: float) -> torch.Tensor:
    """s (Eq. 7-8): float64 [m, m] from the mean distances dbar [m, m]; row i sums to 1, s_ii =
    lambda, s_ij = (1 - lambda) (1/dbar_ij) / sum_{k != i} 1/dbar_ik with dbar guarded below by
    1e-12. One client (m = 1): [[1]] (no j != i; it keeps its own A)."""
    m = dbar.shape[0]
    eye = torch.eye(m, dtype=torch.float64, device=dbar.device)
    if m == 1:
        return eye
    inv = (1.0 / dbar.to(torch.float64).clamp_min(DIST_EPS)) * (1.0 - eye)
    s_hat = inv / inv.sum(dim=1, keepdim=True)
    return lam * eye + (1.0 - lam) * s_hat


class EPFL(Algorithm):
    name = "epfl"
    Config = EPFLConfig
    paper = ("Wang, Chen, Zhang, Zhang, Lu & Chen, FHBench: Towards Efficient and Personalized Federated Learning "
             "for Multimodal Healthcare, arXiv 2504.10817 (2025)")
    requires_parts = ("lora_A", "lora_B", "head")
    # B and the head are never averaged: no setting gives FedAvg

    has_global_model = False
    personalized = True

    # ----- the split -----------------------------------------------------------------------------
    def lora_names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """``(A names, B names)`` in the model's LoRA order (the l-th A pairs with the l-th B).
        ValueError naming ``train.model`` and the part when the model lacks a LoRA part or a head,
        or when its parts do not pair up."""
        fw = self.forward
        for part in self.requires_parts:
            if not fw.parts.get(part):
                why = f"its {part!r} part is empty" if part in fw.parts else f"it declares no {part!r} part"
                raise ValueError(f"train.model={fw.model_name}: EPFL mixes the LoRA A matrices and keeps B and the "
                                 f"head local, and this model has no LoRA parts ('lora_A', 'lora_B') and a 'head' "
                                 f"({why}); choose a train.model with LoRA adapters")
        a, b, head = fw.parts["lora_A"], fw.parts["lora_B"], fw.parts["head"]
        if len(a) != len(b):
            raise ValueError(f"train.model={fw.model_name}: its 'lora_A' ({len(a)}) and 'lora_B' ({len(b)}) parts "
                             f"must pair up one to one")
        if set(a) & (set(b) | set(head)) or set(b) & set(head):
            raise ValueError(f"train.model={fw.model_name}: its 'lora_A', 'lora_B' and 'head' parts overlap")
        if set(a) & set(fw.buffers):
            raise ValueError(f"train.model={fw.model_name}: its 'lora_A' part holds buffers, not parameters")
        return a, b

    def local_names(self) -> tuple[str, ...]:
        """Every state entry but A (B, head and anything else), in the model's order: what a
        client keeps."""
        a = set(self.lora_names()[0])
        return tuple(k for k in self.forward.shapes if k not in a)

    def _part(self, params: Params, names: Sequence[str]) -> Params:
        return {k: params[k] for k in names}

    def _whole(self, a: Params, local: Params) -> Params:
        merged = {**a, **local}
        return {k: merged[k] for k in self.forward.shapes}

    def mixing_weights(self, b_uploads: Params) -> torch.Tensor:
        """s float64 [m, m] from the round's stacked B uploads (leading dim m): Eq. 5-8 on the
        selected layers, or 1/m everywhere with ``mixing: uniform``."""
        b_names = self.lora_names()[1]
        ref = b_uploads[b_names[0]]
        m = ref.shape[0]
        if self.cfg.mixing == "uniform":
            return torch.full((m, m), 1.0 / m, dtype=torch.float64, device=ref.device)
        layers = selected_layers(len(b_names), self.cfg.psi)
        dbar = mean_distances([b_uploads[b_names[l]] for l in layers])
        return similarity_weights(dbar, self.cfg.lambda_self)

    # ----- server --------------------------------------------------------------------------------
    def upload_spec(self):
        a, b = self.lora_names()
        shapes = self.forward.shapes
        return {"A": TreeSpec({k: shapes[k] for k in a}), "B": TreeSpec({k: shapes[k] for k in b})}

    def init_server(self, params: Params, fed: Federation) -> dict[str, Any]:
        a, b = self.lora_names()
        selected_layers(len(b), self.cfg.psi)  # an empty psi stops here, not at the first aggregation
        ref = params[a[0]]
        return {"A": {k: params[k].detach().unsqueeze(0).repeat(fed.num_clients, *([1] * params[k].dim())).clone()
                      for k in a},
                "weights": torch.eye(fed.num_clients, dtype=torch.float64, device=ref.device)}

    def download(self, server, clients, rnd: RoundInfo) -> Download:
        """Client i gets its own mixed A_i (per client, leading dim m); nothing is shared."""
        return Download(per_client={"A": {k: v[clients] for k, v in server["A"].items()}})

    def aggregate(self, server, uploads, clients, rnd):
        """A_i <- sum_j s_ij A_j over the m uploaders (pre-aggregation A_j); every other row of
        ``A`` is kept. B and the head are not server state: nothing overwrites them."""
        s = self.mixing_weights(uploads["B"])
        mixed = {k: torch.tensordot(s, v.to(torch.float64), dims=1).to(v.dtype) for k, v in uploads["A"].items()}
        a = {k: v.index_copy(0, clients, mixed[k]) for k, v in server["A"].items()}
        w = server["weights"].index_copy(0, clients, torch.zeros_like(server["weights"][clients]))
        w[clients.unsqueeze(1), clients.unsqueeze(0)] = s.to(w.dtype)
        return {**server, "A": a, "weights": w}

    def global_model(self, server):
        return None

    # ----- client --------------------------------------------------------------------------------
    def init_client_state(self, params: Params, client: int, fed: Federation) -> dict[str, Any]:
        """The client's id (to pick its row of the server's A in ``personalized_model``) and its
        local entries (B, head, ...) from the common initial model."""
        ref = params[self.lora_names()[0][0]]
        return {"client": torch.tensor(client, dtype=torch.int64, device=ref.device),
                "local": {k: params[k].detach().clone() for k in self.local_names()}}

    def begin(self, received, state, info, rnd):
        return {"model": self._whole(received["A"], state["local"])}, {}

    def finish(self, trees, ctx, state, info, rnd):
        model = trees["model"]
        a, b = self.lora_names()
        up = {"A": self._part(model, a), "B": self._part(model, b)}
        return up, {"client": state["client"], "local": self._part(model, self.local_names())}, model

    def personalized_model(self, state, server):
        """The server's latest A_i (one-hot row pick, exact) with the client's own B_i and head_i."""
        a = server["A"]
        k = next(iter(a.values())).shape[0]
        own = (torch.arange(k, device=state["client"].device) == state["client"])
        picked = {n: torch.tensordot(own.to(v.dtype), v, dims=1) for n, v in a.items()}
        return self._whole(picked, state["local"])
