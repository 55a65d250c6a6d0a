"""The algorithm contract: what a federated method declares, and nothing more.

A method does not own the loop, the data, the device, the optimizer or the logging. It declares:

**Server** (plain functions, run once per round):
  - ``init_server(params, fed)``: the server state (``fed``: a
    :class:`~medpfl.fl.program.Federation`, K and the clients' sample counts) (a dict of trees; ``"model"`` by default), checkpointed
    with the run: SCAFFOLD's control variate, FedCurv's Fisher sums, FedGKD's buffer live here.
  - ``download(server, clients, rnd)``: a :class:`~medpfl.fl.program.Download`: what is sent to
    every sampled client (``shared``) and to each one (``per_client``, leading dim m).
  - ``aggregate(server, uploads, clients, rnd)``: the next server state from the stacked uploads.
  - ``global_model(server)``: the single global model scored on the global test set, if any.
  - ``training_clients(sampled, K, rnd)``: who trains this round (default: the sampled clients;
    pFedMe: every client trains, only the sampled ones are aggregated).

**Client** (per client; the stacked executor runs them under ``torch.func.vmap``, the sequential
one calls them plainly, so write them for one client with tensor ops only):
  - ``init_client_state(params, client, fed)``: one client's persistent state (the engine stacks K).
  - ``shared_context(shared, rnd)``: frozen tensors derived from what every recipient gets
    alike (the shared and synced download; e.g. the global model as teacher). Called once per round, never per client: these stay
    shared (one batched forward for all clients in the stacked executor).
  - ``begin(received, state, info, rnd) -> (trees, ctx)``: the trainable trees (``{"model": ...}``
    by default) and the per-client context (anything computed from the client's state, e.g.
    SCAFFOLD's ``c - c_i``: per client by construction, nothing is inferred).
  - ``passes(rnd)``: :class:`~medpfl.fl.program.Pass` sums over the local train set, before or
    after the phases (class prototypes, train accuracy, Fisher information).
  - ``sample_context(ctx, x)``: per-sample tensors over the local train set (a teacher's logits).
  - ``phases(rnd)``: the local program, a list of :class:`~medpfl.fl.program.Phase`.
  - ``local_loss(trees, ctx, batch)``: the default phase objective (cross-entropy of ``model``).
  - ``finish(trees, ctx, state, info, rnd) -> (upload, new state, eval model)``: what crosses to
    the server (checked against ``upload_spec()``), what the client keeps, and the model its local
    test split scores right after training (``local_after_training``).
  - ``personalized_model(state, server)``: each client's deployable model (personalized methods).
  - ``adaptation_phases(rnd)``: the evaluation-time program: phases the executor runs at an
    evaluation round on every client's local train split from its personalized model before it
    is scored (Per-FedAvg's one-step adaptation; FedBABU's fine-tuning of the final global model,
    at the last round only); the client's state is not changed.
  - ``predict(model, x)``: logits of an evaluated model (FedRoD's two heads, APFL's mixture).

**Server data**: a method with ``uses_server_data = True`` reads the partition's unlabeled server
images in its server hooks from ``self.server_data`` (``len``, ``x(pos)``; set by the engine;
FedBE's distillation set); every other method sees None.

**Declarations** (class attributes, never code; the engine reads and enforces them):
``aggregates`` (the server combines uploads), ``has_global_model`` (there is one global model to
score on the global test set), ``personalized`` (clients keep models of their own),
``requires_parts`` (model parts it cannot run without; checked against the model before round
0), ``uses_server_data``, ``not_stackable_because`` (why the client hooks cannot run under vmap;
then it runs on the sequential executor), ``fedavg_when``, ``seeded_client_init``,
``model_upload`` (the upload that upload transforms and DP-FedAvg act on). A plain
loss-only method is a config class and one ``local_loss``.

Shapes: a "tree" is a flat ``dict[str, Tensor]`` (a model state: parameters and buffers by name;
or any other named tensors). In ``aggregate`` every upload leaf has a leading dim m (the sampled
clients in schedule order). ``info`` holds per client: ``client`` (int64 scalar), ``num_samples``
(float scalar, local train size), ``label_hist`` (float [C], local train labels), and in
``finish`` also ``steps`` (``{phase: int64 scalar}``) and each after-pass's sums by its name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_serializer

from medpfl.fl.functional import FunctionalModel, Params, weighted_average, weighted_ce
from medpfl.fl.payload import ArraySpec, Spec, TreeSpec
from medpfl.fl.program import Download, Federation, Pass, Phase, RoundInfo

if TYPE_CHECKING:
    from medpfl.fl.data import ServerData


class ModelUpload(NamedTuple):
    """A method's declaration that one upload is a model, read against a model the client received,
    and that the server uses it only through a weighted mean (a convex combination over the round's
    clients, whose weights come from the upload entries ``weights`` alone), whatever it then does
    with that mean.

    upload: the upload key holding the model (or model part) a client sends (a tree with the
    declared ``TreeSpec``); reference: the key of the shared download it started from (same names
    and shapes), so that Δ_k = upload_k − reference is the client's update; weights: the other
    upload keys, each read only to weight the mean (``num_samples``; FedKPer's ``score``, FedAS's
    ``fisher_trace``). The engine's upload transforms (``train.upload``: clipping, noise,
    low-rank) act on Δ_k, and DP-FedAvg (``train.dp``) replaces the mean by its private estimate
    (McMahan et al., ICLR 2018; :mod:`medpfl.fl.privacy`); a secure aggregation of weighted sums
    would need the same declaration."""

    upload: str
    reference: str
    weights: tuple[str, ...] = ("num_samples",)


#: FedAvg's declaration: the uploaded ``model`` against the downloaded ``model``, weights n_k.
MODEL_UPLOAD = ModelUpload("model", "model", ("num_samples",))


class MethodConfig(BaseModel):
    """Base for per-method hyper-parameters: unknown keys are errors, values are typed. Every
    field of a subclass has an explicit default with its source in its description."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class LocalStepsConfig(MethodConfig):
    """A method config with ``local_steps``: each round's local training is exactly that many
    mini-batch steps (the epochs' shuffled batches truncated, or cycled when a client has fewer)
    instead of ``train.local_epochs`` epochs. Default None: epochs, as the method's paper.

    Why: the pFedKD-WCL code's FedAvg/FedProx (``algorithms/fedprox_slow.py``) loops over the E
    epochs but slices a 20-element index list in each, so each "epoch" is one SGD step on one
    mini-batch: its effective local work is E steps, not E epochs (issue 30; ``docs/studies.md``).
    ``local_steps`` is not dumped at its default, so jobs written before it existed keep their
    description (and Snakemake params trigger)."""

    local_steps: int | None = Field(None, ge=1, description="null (default): train.local_epochs epochs per round (the "
                                                            "method's paper); n: exactly n mini-batch steps per round "
                                                            "(the pFedKD-WCL code's fedprox_slow.py reading: E=20 "
                                                            "'epochs' of one step each)")

    @model_serializer(mode="wrap")
    def _drop_default_steps(self, handler):
        out = handler(self)
        if isinstance(out, dict) and out.get("local_steps", False) is None:
            out.pop("local_steps")
        return out


class Algorithm:
    """Base class. Subclasses set ``name``, ``Config``, ``paper`` and override what they change.

    forward: the functional model (:class:`~medpfl.fl.functional.FunctionalModel`):
    ``forward(state, x) -> logits`` (float [B, C]), ``forward.features_logits``, ``forward.head``,
    ``forward.parts`` (``body``/``head`` state names), ``forward.shapes``. num_classes: C.
    """

    name: ClassVar[str] = ""
    Config: ClassVar[type[MethodConfig]] = MethodConfig
    paper: ClassVar[str] = ""
    # ----- declarations (class level; the engine reads and enforces them) ---------------------
    #: the server combines the clients' uploads every round (Local: False)
    aggregates: ClassVar[bool] = True
    #: there is one global model to score on the global test set (``global_model``)
    has_global_model: ClassVar[bool] = True
    #: clients keep models of their own (``personalized_model``), scored on their local test
    #: splits at every evaluation round
    personalized: ClassVar[bool] = False
    #: model parts (``forward.parts``, per model: ``docs/models.md``) the method cannot run
    #: without, each non-empty: the methods that split the model into a shared body and a head
    #: (FedPer ``("body", "head")``), that read the body's features (MOON ``("body",)``), or that
    #: need BatchNorm or LoRA layers (FedBN ``("bn",)``, EPFL). The engine checks them against the
    #: model before round 0 and stops with one line naming the method, the part and
    #: ``train.model`` (:func:`check_required_parts`).
    requires_parts: ClassVar[tuple[str, ...]] = ()
    #: True: the server hooks use the partition's unlabeled server data
    #: (``partitions.<name>.server_data``, a held-out part of the official val split). The
    #: engine then sets :attr:`server_data` before the run (and stops, naming the key, when the
    #: partition has none); False (default): :attr:`server_data` stays None. The client hooks
    #: never see server data, whatever the flag.
    uses_server_data: ClassVar[bool] = False
    #: why the method cannot run under vmap, if it cannot (it then runs sequentially); None:
    #: stackable
    not_stackable_because: ClassVar[str | None] = None
    #: config overrides under which the method is FedAvg (a reduction its paper states, e.g.
    #: FedProx with mu = 0); None where no setting of its knobs gives FedAvg. Tested for every method.
    fedavg_when: ClassVar[dict[str, Any] | None] = None
    #: True: the engine builds each client's initial state (``init_client_state``) with the CPU
    #: generator seeded from (run seed, client id) and restores it after, so a random draw there
    #: (on the CPU) is the same in both executors, whatever K, and independent of the global
    #: model's init (pFedKD-WCL's personal models). False: the global generator as it stands.
    seeded_client_init: ClassVar[bool] = False
    #: the upload that is a model sent against a downloaded model and averaged
    #: (:class:`ModelUpload`), or None: what ``train.upload`` transforms and ``train.dp``
    #: (DP-FedAvg) privatize. Declared per method (never inherited from this class's default
    #: FedAvg hooks: a method that changes ``aggregate`` or ``upload_spec`` says it again);
    #: the config refuses both keys for a method that declares None
    #: (:func:`medpfl.fl.privacy.check_applicable`).
    model_upload: ClassVar[ModelUpload | None] = None

    def __init__(self, cfg: MethodConfig, forward: FunctionalModel, num_classes: int):
        self.cfg = cfg
        self.forward = forward
        self.num_classes = num_classes
        #: the server's unlabeled images (:class:`~medpfl.fl.data.ServerData`: ``len``, ``x(pos)``;
        #: no labels), set by the engine for a method with ``uses_server_data``; else None
        self.server_data: ServerData | None = None

    @property
    def stackable(self) -> bool:
        """The client hooks run under vmap (``not_stackable_because`` is None)."""
        return self.not_stackable_because is None

    # ----- server side -----------------------------------------------------------------------
    def init_server(self, params: Params, fed: Federation) -> dict[str, Any]:
        """The server state at round 0 from the initial model, for the federation ``fed`` (K =
        ``fed.num_clients``, the clients' sample counts). Default: ``{"model": params}``."""
        return {"model": params}

    def download(self, server: dict[str, Any], clients: torch.Tensor, rnd: RoundInfo) -> Download:
        """What the sampled ``clients`` (int64 [m]) receive. Default: the global model, shared."""
        return Download(shared={"model": server["model"]})

    def aggregate(self, server: dict[str, Any], uploads: dict[str, Any], clients: torch.Tensor,
                  rnd: RoundInfo) -> dict[str, Any]:
        """The next server state from stacked uploads (leading dim m). Default: FedAvg, weights
        ∝ n_k (McMahan et al. 2017; FedKPer eq. 2)."""
        n = uploads["num_samples"].to(torch.float64)
        return {**server, "model": weighted_average(uploads["model"], n / n.sum())}

    def training_clients(self, sampled: np.ndarray, num_clients: int, rnd: RoundInfo) -> np.ndarray:
        """The clients that run their local program this round (int64 [m'], sorted, containing
        every sampled client). Default: the sampled clients. Only the sampled clients' uploads
        are aggregated (and counted in ``bytes_up``); every trained client receives the download
        (counted in ``bytes_down``) and keeps its new state. pFedMe (Dinh et al. 2020, Alg. 1):
        all clients train, a subset is aggregated."""
        return sampled

    def global_model(self, server: dict[str, Any]) -> Params | None:
        """The model scored on the global test set (None where ``has_global_model`` is false)."""
        return server["model"] if self.has_global_model else None

    def upload_spec(self) -> dict[str, Spec]:
        """What may cross from a client to the server, with its shape (the upload check enforces it).
        Default: the whole model state and the sample count."""
        return {"model": TreeSpec(self.forward.shapes), "num_samples": ArraySpec()}

    # ----- client side -----------------------------------------------------------------------
    def init_client_state(self, params: Params, client: int, fed: Federation) -> dict[str, Any]:
        """One client's persistent state at round 0 (the engine stacks K of them; ``fed``: K and
        the clients' sample counts, e.g. APPLE's DR vector of length K). With
        ``seeded_client_init`` the engine calls it with the CPU generator seeded from (run seed,
        ``client``) and restores the generator after. Default: none."""
        return {}

    def shared_context(self, shared: dict[str, Any], rnd: RoundInfo) -> dict[str, Any]:
        """Frozen tensors built from the shared download only, the same for every client."""
        return {}

    def begin(self, received: dict[str, Any], state: dict[str, Any], info: dict[str, torch.Tensor],
              rnd: RoundInfo) -> tuple[dict[str, Params], dict[str, Any]]:
        """``(trainable trees, per-client context)`` at the start of local training. Default:
        train the received global model; no context."""
        return {"model": received["model"]}, {}

    def passes(self, rnd: RoundInfo) -> list[Pass]:
        """Sums over the local train set before/after the phases. Default: none."""
        return []

    def sample_context(self, ctx: dict[str, Any], x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-sample tensors (float [n, ...]) computed once per round on the local train set
        (x float [n, C, H, W]) and gathered per batch into ``batch``. Default: none."""
        return {}

    def phases(self, rnd: RoundInfo) -> list[Phase]:
        """The local program. Default: one phase training ``model`` on ``local_loss``."""
        return [Phase()]

    def local_loss(self, trees: dict[str, Params], ctx: dict[str, Any], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The default objective on one batch: ``batch["x"]`` float [B, C, H, W], ``batch["y"]``
        int64 [B], ``batch["w"]`` float [B] (1/b on the b valid samples, 0 on padding).
        Default: cross-entropy of ``trees["model"]`` (FedAvg)."""
        return weighted_ce(self.train_forward(trees["model"], batch), batch["y"], batch["w"])

    def ce_loss(self, tree: str):
        """A phase objective: cross-entropy of ``trees[tree]`` on the batch (training mode)."""

        def loss(trees: dict[str, Params], ctx: dict[str, Any], batch: dict[str, torch.Tensor]) -> torch.Tensor:
            return weighted_ce(self.train_forward(trees[tree], batch), batch["y"], batch["w"])

        return loss

    def train_forward(self, params: Params, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Logits of a model being trained on ``batch`` (training mode: BatchNorm uses and
        updates batch statistics over the real samples, ``w > 0``)."""
        return self.forward(params, batch["x"], train=True, mask=batch["w"] > 0)

    def train_features(self, params: Params, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(features, logits)`` of a model being trained on ``batch`` (training mode)."""
        return self.forward.features_logits(params, batch["x"], train=True, mask=batch["w"] > 0)

    def finish(self, trees: dict[str, Params], ctx: dict[str, Any], state: dict[str, Any],
               info: dict[str, Any], rnd: RoundInfo) -> tuple[dict[str, Any], dict[str, Any], Any]:
        """``(upload, new state, model scored on the local test split)`` after local training.
        Only ``upload`` crosses to the server. Default: the model and the sample count (FedAvg)."""
        return {"model": trees["model"], "num_samples": info["num_samples"]}, state, trees["model"]

    def personalized_model(self, state: dict[str, Any], server: dict[str, Any]) -> Any:
        """A client's personalized model (only called when ``personalized``)."""
        raise NotImplementedError(f"method {self.name!r} declares personalized but has no personalized_model")

    def adaptation_phases(self, rnd: RoundInfo) -> list[Phase]:
        """Phases run at every evaluation round on each client's local train split, starting from
        its ``personalized_model`` (trained tree ``"model"``), before the adapted copy is scored
        on the local test split (``personalized_on_local``); the client's state is not changed.
        Default: none. Per-FedAvg (Fallah et al. 2020, Sec. 5): one step of the meta-learned
        initialisation on local data before it is evaluated."""
        return []

    def predict(self, model: Any, x: torch.Tensor) -> torch.Tensor:
        """Logits (float [B, C]) of an evaluated model (evaluation mode). Default: the model state's forward."""
        return self.forward(model, x)


def check_required_parts(algo: Algorithm) -> None:
    """Stops a run before round 0 when the model lacks a part the method declares it needs
    (``requires_parts``): raises ValueError, one line naming the method, the part, ``train.model``
    and the parts the model has. Nothing when every declared part is present and non-empty."""
    fw = algo.forward
    for part in type(algo).requires_parts:
        if fw.parts.get(part):
            continue
        has = sorted(p for p, names in fw.parts.items() if names)
        why = f"its {part!r} part is empty" if part in fw.parts else f"it has no {part!r} part"
        raise ValueError(f"method {algo.name!r} needs the model part {part!r} and train.model="
                         f"{getattr(fw, 'model_name', '?')} lacks it ({why}; its parts: {', '.join(has) or 'none'}); "
                         f"choose a train.model with a {part!r} part (docs/models.md)")


def accuracy_pass(algo: Algorithm, tree: str = "model", name: str = "train_acc") -> Pass:
    """A pass counting correct predictions of ``trees[tree]`` over the local train set
    (evaluation mode): sums ``correct`` and ``count`` (float64 scalars)."""

    def fn(trees: dict[str, Params], ctx: dict[str, Any], batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        valid = (batch["w"] > 0).to(torch.float64)
        hit = (algo.predict(trees[tree], batch["x"]).argmax(-1) == batch["y"]).to(torch.float64)
        return {"correct": torch.sum(hit * valid), "count": torch.sum(valid)}

    return Pass(name=name, fn=fn, when="after")
