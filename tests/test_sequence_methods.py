"""Every registered method on the sequence modalities of issue 33 (tokens with ``roberta-lora``,
waveforms with ``wav2vec2-lora``, time series with ``moment-lora``; tiny random backbones,
``dropout: false``, ``lora_dropout: 0``): one round on the stacked executor equals the sequential
one (issue 33: "stacked equals sequential for every method on each new modality (dropout off)"),
with the tolerances of ``tests/test_contract.py``; and token rows padded to L give the logits,
the batch loss and the round of the same rows at their true length ("padded equals truncated").

Coverage: the whole registry × 3 modalities × 2 executors cost about 7 minutes on the loaded
2-core development machine, so **every registered method runs on tokens** (the modality with
padding), and a subset on waveforms and time series (:data:`SUBSET`: a global model (FedAvg),
a server control state (SCAFFOLD), a persistent personal model (Ditto), head-body splits
(FedPer, FedRep, FedBABU), LoRA parts (EPFL), prototypes (FedProto), every-client training with
a sampled aggregation (pFedMe), and the two refusals: FedBN (no ``bn`` part) and FedALA (not
stackable)). A method that cannot run on a model fails with its declared reason: a missing
part (``requires_parts``) stops both executors before round 0 naming the part, a method that
declares ``not_stackable_because`` is refused by the stacked executor (and runs sequentially).

Costs are cut where a method's defaults run many more steps than one epoch (:data:`COST`:
pFedMe's 20 local iterations × 5 inner steps, Per-FedAvg's and pFedKD-WCL's 20 local steps, to
2 / 2): the same code paths with fewer iterations. Runs are cached per (kind, method, executor)
and the data and model templates are built once per kind (module-scoped fixture).

Sizes: 4 clients of 6 train + 2 test samples (2 sampled per round, batch 4: one full and one
padded batch per epoch), 3 classes; tokens L 16 (ids >= 3 between ``<s>`` = 0 and ``</s>`` =
2, true lengths 4..16, pad id 1); waveforms T 800 (the tiny stem, kernels 10, 3 and strides 5,
2, needs T >= 20 for one frame; 800 gives 159 then 79 frames); time series C 3 × T 64 (8
patches of 8).
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from medpfl.algorithms import REGISTRY, resolve_method
from medpfl.algorithms.base import weighted_ce
from medpfl.config import EvalConfig, TrainConfig
from medpfl.fl.data import FederatedData
from medpfl.fl.engine import Engine
from medpfl.fl.functional import make_forward, model_state, template_on
from medpfl.models.zoo import ZOO, build_model_for_data
from tests.conftest import assert_trees_close
from tests.test_contract import assert_runs_agree, metrics

pytestmark = pytest.mark.slow

CLASSES = 3
PAD = 1
CLIENTS, TRAIN, TEST, SERVER = 4, 6, 2, 4
MODEL = {"tokens": "roberta-lora", "waveform": "wav2vec2-lora", "timeseries": "moment-lora"}
SHAPE = {"tokens": (16,), "waveform": (800,), "timeseries": (3, 64)}
#: the methods run on waveforms and time series (every registered method runs on tokens)
SUBSET = ("fedavg", "scaffold", "ditto", "fedper", "fedrep", "fedbabu", "epfl", "fedproto", "pfedme", "fedbn",
          "fedala")
#: config overrides that cut a method's many local iterations (the same code paths, fewer steps)
COST = {"pfedme": {"local_steps": 2, "inner_steps": 2}, "perfedavg": {"local_steps": 2},
        "pfedkdwcl": {"local_steps": 2}}
CASES = [("tokens", m) for m in sorted(REGISTRY)] + [(k, m) for k in ("waveform", "timeseries") for m in SUBSET]
_RUNS: dict = {}


def token_rows(n: int, length: int, lengths: torch.Tensor, seed: int) -> torch.Tensor:
    """int64 [n, length]: ``<s>`` (0), random ids in [3, 64), ``</s>`` (2) at position
    ``lengths[i] - 1``, then the pad id (1) up to ``length``."""
    x = torch.randint(3, 64, (n, length), generator=torch.Generator().manual_seed(seed))
    x[:, 0] = 0
    for i, k in enumerate(lengths.tolist()):
        x[i, k - 1], x[i, k:] = 2, PAD
    return x


def federated(kind: str, x: torch.Tensor | None = None, seed: int = 0) -> FederatedData:
    """A random :class:`FederatedData` of ``kind``: :data:`CLIENTS` clients of :data:`TRAIN` train
    and :data:`TEST` test samples, :data:`SERVER` unlabeled server samples (FedBE reads them),
    no global test set, :data:`CLASSES` random labels; ``x`` (the samples) drawn when None."""
    n = CLIENTS * (TRAIN + TEST) + SERVER
    g = torch.Generator().manual_seed(seed)
    if x is None:
        if kind == "tokens":
            x = token_rows(n, SHAPE[kind][0], torch.randint(4, SHAPE[kind][0] + 1, (n,), generator=g), seed + 1)
        else:
            x = torch.randn(n, *SHAPE[kind], generator=g) * 2 + 0.5
    y = torch.randint(0, CLASSES, (n,), generator=g)
    ids = torch.arange(CLIENTS * (TRAIN + TEST)).view(CLIENTS, TRAIN + TEST)
    train = [r[:TRAIN].clone() for r in ids]
    return FederatedData(images=x, labels=y, num_classes=CLASSES, global_test=torch.empty(0, dtype=torch.int64),
                         client_train=train, client_test=[r[TRAIN:].clone() for r in ids],
                         train_hist=torch.stack([torch.bincount(y[t], minlength=CLASSES).float() for t in train]),
                         device=torch.device("cpu"), kind=kind, pad_token_id=PAD if kind == "tokens" else None,
                         server_idx=torch.arange(n - SERVER, n))


def template(kind: str, data: FederatedData) -> torch.nn.Module:
    """The kind's tiny model (``tiny_args``: dropout off, LoRA dropout 0) for ``data``, placed as
    ``medpfl.train`` places it; its trainable weights from ``torch.manual_seed(0)``."""
    torch.manual_seed(0)
    return template_on(build_model_for_data(MODEL[kind], data, ZOO[MODEL[kind]].tiny_args), "cpu")


@pytest.fixture(scope="module")
def setups():
    """kind -> (data, model template), built on first use and shared by the module's tests."""
    built: dict = {}

    def get(kind: str):
        if kind not in built:
            data = federated(kind)
            built[kind] = (data, template(kind, data))
        return built[kind]

    return get


def make(method: str, module: torch.nn.Module):
    cls, cfg = resolve_method(method, {method: COST.get(method, {})})
    return cls(cfg, make_forward(module), CLASSES)


class ActingEngine(Engine):
    """The engine from an initial model whose LoRA B (zero at init: the adapters start as the
    identity) and head (std 0.02 at init: logits near 0, every loss near ln C) are moved by
    0.3 N(0, 1) noise (a fixed draw over the sorted names), so that the adapters act and a
    difference in the backbone's output shows in the losses and the updates."""

    def initial_params(self):
        gen = torch.Generator().manual_seed(7)
        params = super().initial_params()
        return {k: params[k] + 0.3 * torch.randn(params[k].shape, generator=gen) for k in sorted(params)}


def engine_run(method: str, data: FederatedData, module: torch.nn.Module, executor: str):
    """One round of ``method`` (1 local epoch, batch 4, half of the clients sampled) from the
    moved initial model (:class:`ActingEngine`)."""
    name = module.zoo_name
    train = TrainConfig(rounds=1, participation=0.5, local_epochs=1, batch_size=4, checkpoint_every=0, model=name,
                        model_args=ZOO[name].tiny_args)
    return ActingEngine(make(method, module), data, train, EvalConfig(), seed=1, executor_kind=executor,
                        fingerprint="sequence-methods").run()


def cached(setups, kind: str, method: str, executor: str):
    key = (kind, method, executor)
    if key not in _RUNS:
        data, module = setups(kind)
        _RUNS[key] = engine_run(method, data, module, executor)
    return _RUNS[key]


def test_the_cases_cover_the_registry_on_tokens_and_the_subset_on_the_other_kinds():
    assert set(SUBSET) <= set(REGISTRY), sorted(set(SUBSET) - set(REGISTRY))
    assert set(COST) <= set(REGISTRY)
    assert {m for k, m in CASES if k == "tokens"} == set(REGISTRY)


@pytest.mark.parametrize("kind, method", CASES)
def test_stacked_equals_sequential_on_sequence_data(setups, kind, method):
    data, module = setups(kind)
    algo = make(method, module)
    missing = [p for p in type(algo).requires_parts if not algo.forward.parts.get(p)]
    if missing:  # e.g. FedBN: the LoRA models have no BatchNorm
        for executor in ("sequential", "stacked"):
            with pytest.raises(ValueError, match=rf"method '{method}' needs the model part '{missing[0]}' and "
                                                 rf"train\.model={MODEL[kind]} lacks it"):
                engine_run(method, data, module, executor)
        return
    seq = cached(setups, kind, method, "sequential")
    assert len(seq.records) and seq.records["loss"].notna().all() and seq.records["accuracy"].between(0, 1).all()
    if not algo.stackable:
        assert algo.not_stackable_because, f"{method}: not stackable without a reason"
        with pytest.raises(ValueError, match=rf"method '{method}' cannot be stacked"):
            engine_run(method, data, module, "stacked")
        return
    stk = cached(setups, kind, method, "stacked")
    assert_runs_agree(seq, stk)


# ----------------------------------------------------------------------------- padded equals truncated

CUT = 11  # the longest true length of the rows below: columns CUT.. are padding in every row


def _padded_and_truncated():
    """The same token rows as two data sets: padded to L 16 and cut to their longest true
    length (11; rows of every length 4..11, several of 11, i.e. unpadded once cut)."""
    n = CLIENTS * (TRAIN + TEST) + SERVER
    lengths = torch.arange(n) % (CUT - 3) + 4
    x = token_rows(n, SHAPE["tokens"][0], lengths, seed=5)
    assert (x[:, CUT:] == PAD).all() and (lengths == CUT).sum() > 1
    return federated("tokens", x, seed=3), federated("tokens", x[:, :CUT].clone(), seed=3), lengths


def test_padded_token_rows_give_the_logits_and_batch_loss_of_the_rows_at_their_true_length():
    """Through :meth:`FederatedData.x` and the model: a client's batch padded to L gives each row
    the logits of that row alone at its true length (no padding at all), and the same weighted
    cross-entropy and gradient as the batch cut to its longest true length (within 1e-5)."""
    pad, cut, lengths = _padded_and_truncated()
    m_pad, m_cut = template("tokens", pad), template("tokens", cut)
    f = make_forward(m_pad)
    gen = torch.Generator().manual_seed(9)  # B != 0 and a moved head: the adapters act
    state = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in model_state(m_pad).items()}
    assert_trees_close(model_state(m_pad), model_state(m_cut), atol=0)  # the same model for either length
    f_cut = make_forward(m_cut)
    idx = torch.cat([pad.client_train[1], pad.client_train[2][:2]])
    xp, xc = pad.x(idx), cut.x(idx)
    assert xp.dtype == torch.int64 and xp.shape == (len(idx), 16) and xc.shape == (len(idx), CUT)
    for train in (False, True):
        logits = f(state, xp, train=train)
        alone = torch.cat([f(state, xp[i:i + 1, :int(lengths[j])], train=train) for i, j in enumerate(idx.tolist())])
        torch.testing.assert_close(logits, alone, atol=1e-5, rtol=0)
        torch.testing.assert_close(logits, f_cut(state, xc, train=train), atol=1e-5, rtol=0)
    # the comparison can fail: a real token in place of the padding changes the logits
    unmasked = xp.clone()
    unmasked[unmasked == PAD] = 5
    assert (f(state, unmasked) - f(state, xp)).abs().max() > 1e-4
    # one batch's loss and gradient, as a method's local step computes them (w = 1/b on the b real rows)
    algo_pad, algo_cut = make("fedavg", m_pad), make("fedavg", m_cut)
    y, w = pad.labels[idx], torch.full((len(idx),), 1.0 / len(idx))
    out = []
    for algo, x in ((algo_pad, xp), (algo_cut, xc)):
        leaves = {k: v.clone().requires_grad_() for k, v in state.items()}
        loss = algo.local_loss({"model": leaves}, {}, {"x": x, "y": y, "w": w})
        out.append((loss, torch.autograd.grad(loss, list(leaves.values()))))
    torch.testing.assert_close(out[0][0], out[1][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(out[0][0], weighted_ce(logits, y, w), atol=1e-5, rtol=0)
    for ga, gb in zip(out[0][1], out[1][1]):
        torch.testing.assert_close(ga, gb, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("executor", ["sequential", "stacked"])
def test_one_round_on_padded_rows_equals_the_round_on_truncated_rows(executor):
    """The engine's round (FedAvg: local training on padded batches, evaluation, aggregation) on
    rows padded to L 16 gives the records (losses within 1e-5, correct counts exactly) and the
    global model (within 1e-5) of the same round on the rows cut to their longest true length."""
    pad, cut, _ = _padded_and_truncated()
    a = engine_run("fedavg", pad, template("tokens", pad), executor)
    b = engine_run("fedavg", cut, template("tokens", cut), executor)
    pd.testing.assert_frame_equal(metrics(a), metrics(b))
    torch.testing.assert_close(torch.tensor(a.records["loss"].to_numpy()), torch.tensor(b.records["loss"].to_numpy()),
                               atol=1e-5, rtol=0)
    assert_trees_close(a.global_params, b.global_params, atol=1e-5)
    init = ActingEngine(make("fedavg", template("tokens", pad)), pad, TrainConfig(
        model="roberta-lora", model_args=ZOO["roberta-lora"].tiny_args), EvalConfig(), seed=1).initial_params()
    assert max((a.global_params[k] - init[k]).abs().max() for k in init) > 1e-3  # it trained
