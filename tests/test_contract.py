"""The registry-wide contract: every registered method (present and future, found through the
registry, never listed here) runs on both executors with equal results where it is stackable,
sends only what it declares, resumes to the same numbers after a kill (on each executor it runs
on), records what its capabilities say, documents its defaults (each with its source), and
differs from FedAvg unless the knob its paper names says it should not (``fedavg_when``), in
which case it equals FedAvg.

Runs are tiny (5 synthetic clients, 3 sampled per round, 1 local epoch, 2 rounds) and cached per
(method, executor, model, overrides) so that each check reuses them. A method runs on ``cnn4``,
or, where it declares model parts that ``cnn4`` lacks (``requires_parts``: FedBN's ``bn``), on the
first model of the zoo that has them (:func:`model_for`); it is compared with FedAvg on that model.
"""

from __future__ import annotations

import re

import pandas as pd
import pytest
import torch
import torch.utils._pytree as pytree

from medpfl.algorithms import REGISTRY
from medpfl.config import EvalConfig, TrainConfig
from medpfl.fl.engine import Engine
from medpfl.fl.functional import make_forward, template_on
from medpfl.fl.payload import LowRank, check_upload, payload_nbytes, svd_decode, svd_encode
from medpfl.fl.tree import tree_leaves
from medpfl.models import MODEL_NAMES, ZOO, build_model
from tests.conftest import assert_trees_close, make_algo

METHODS = sorted(REGISTRY)
ROUNDS = 2
_CACHE: dict = {}


def _train(**kw) -> TrainConfig:
    return TrainConfig(**{"rounds": ROUNDS, "participation": 0.6, "local_epochs": 1, "batch_size": 16,
                          "checkpoint_every": 1, **kw})


def model_for(method: str) -> str:
    """The zoo model a method's contract runs use: ``cnn4``, or the first model of the zoo (on
    ``fed_data``'s 3x28x28 images) whose parts include every part the method declares it needs,
    non-empty (``requires_parts``; FedBN: ``bn``, i.e. ``cnn4bn``)."""
    need = REGISTRY[method].requires_parts
    for name in ("cnn4", *[n for n in MODEL_NAMES if n != "cnn4" and ZOO[n].input in ("image", "any")]):
        parts = make_forward(template_on(build_model(name, 3, 4, 28, ZOO[name].tiny_args), "cpu")).parts
        if all(parts.get(p) for p in need):
            return name
    raise AssertionError(f"{method}: no model of the zoo has the parts {need}")


#: fewer local iterations for the methods whose defaults run 20 (x 5) mini-batch steps per client
#: and round: the contract's checks (declarations, uploads, executors, resume) take the same code
#: paths; each method's own defaults are exercised by its own test module (pFedMe's 20 x 5 took
#: 120 s in one contract test of a CI run)
COST = {"pfedme": {"local_steps": 2, "inner_steps": 2}, "perfedavg": {"local_steps": 2},
        "pfedkdwcl": {"local_steps": 2}}


def run(fed_data, method, executor="sequential", checkpoint=None, callbacks=(), capture=None, model=None,
        **overrides):
    """One engine run on ``model`` (default: :func:`model_for`); ``capture`` (a list) receives every
    round's stacked uploads at the server."""
    model = model or model_for(method)
    overrides = {**COST.get(method, {}), **overrides}
    algo = make_algo(method, model=model, model_args=ZOO[model].tiny_args, device=fed_data.device, **overrides)
    if capture is not None:
        real = algo.aggregate

        def spy(server, uploads, clients, rnd):
            capture.append(uploads)
            return real(server, uploads, clients, rnd)

        algo.aggregate = spy
    eng = Engine(algo, fed_data, _train(model=model, model_args=ZOO[model].tiny_args), EvalConfig(), seed=1, executor_kind=executor,
                 checkpoint=checkpoint, callbacks=list(callbacks), fingerprint="contract")
    return algo, eng.run()


def cached(fed_data, method, executor="sequential", model=None, **overrides):
    model = model or model_for(method)
    key = (method, executor, model, tuple(sorted(overrides.items())))
    if key not in _CACHE:
        _CACHE[key] = run(fed_data, method, executor, model=model, **overrides)
    return _CACHE[key]


def metrics(res) -> pd.DataFrame:
    return res.records.drop(columns=["loss"]).reset_index(drop=True)


def assert_trains_as_fedavg(fed_data, method, **overrides):
    """``method`` with ``overrides`` and FedAvg (on the method's model, :func:`model_for`) give the
    same records (every view, round and client; the losses to float32 rounding) and the same global
    model up to float32 rounding: a reduction is algebraic, not bitwise (SCAFFOLD computes
    x + mean(y_i - x), FedAvg mean(y_i): 3.7e-6 apart after 2 rounds on an AMD EPYC, below 1e-6 on
    the Intel CI machines). Both runs are :func:`cached`."""
    _, avg = cached(fed_data, "fedavg", model=model_for(method))
    _, red = cached(fed_data, method, **overrides)
    pd.testing.assert_frame_equal(metrics(avg), metrics(red))
    torch.testing.assert_close(torch.tensor(avg.records["loss"].to_numpy()), torch.tensor(red.records["loss"].to_numpy()),
                               atol=1e-5, rtol=1e-5)
    assert_trees_close(avg.server["model"], red.server["model"], atol=1e-5)


def decoded(tree):
    """``tree`` with every :class:`~medpfl.fl.payload.LowRank` leaf replaced by the matrix it
    encodes (``svd_decode``: U diag(S) Vh, float [..., P, Q]). A truncated SVD's factors are
    unique only up to the signs of the singular vector pairs (and rotations within equal singular
    values), so two executors' low-rank payloads (FedKD's and FedMIC's broadcast update in the
    server state) are compared by what they encode, not by their raw factors."""
    def leaf(v):
        if isinstance(v, LowRank):
            return svd_decode(v, (v.u.shape[-2], v.vh.shape[-1]))
        return v

    return pytree.tree_map(leaf, tree, is_leaf=lambda v: isinstance(v, LowRank))


def test_decoded_compares_low_rank_payloads_by_what_they_encode():
    """Two factorisations of one matrix that differ in the signs of a singular vector pair differ
    raw and agree decoded; the decoding is the matrix itself (up to the truncation)."""
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(6, 2, generator=gen) @ torch.randn(2, 5, generator=gen)
    a = svd_encode(m, 0.999)
    flip = torch.ones(a.s.shape[-1])
    flip[0] = -1.0
    b = LowRank(a.u * flip, a.s, a.vh * flip.unsqueeze(-1), a.rank)
    with pytest.raises(AssertionError):
        assert_trees_close({"update": {"w": a}}, {"update": {"w": b}}, atol=1e-5)
    assert_trees_close(decoded({"update": {"w": a}}), decoded({"update": {"w": b}}), atol=1e-5)
    torch.testing.assert_close(decoded({"w": a})["w"], m, atol=1e-5, rtol=1e-5)


def test_registry_holds_the_table1_methods():
    table1 = {"fedavg", "fedcurv", "moon", "fedprox", "fedntd", "fedas", "fedala", "ditto", "fedper", "fedkd",
              "fedbabu", "fedkper"}
    assert table1 <= set(REGISTRY), sorted(table1 - set(REGISTRY))


# What a config field's description must contain to count as naming the source of its default: the
# method's paper or a section, equation, algorithm, table, figure or appendix item of it ("paper",
# "Sec. 4", "§5", "Eq. 6", "Alg. 1", "Table 5", "Fig. 2", "A.7"), a reference code ("official",
# "authors'", "code", "scripts", "notebook", a code file such as "clientas.py" or "fedcurv.json",
# PFLlib, FHBench, FedTorch), the spec ("spec B.3"), or "ours" where no source is known.
SOURCE_MARKER = re.compile(
    r"paper|official|authors|\bcode\b|\bscripts?\b|notebook|\bspec\b|PFLlib|FHBench|FedTorch|\bours\b"
    r"|\bSec\.|§|\b[Ee]q\.|\bAlg\.|\bTable\b|\bFig\.|\b[A-Z]\.\d|\b\w+\.(?:py|json|yaml|sh|ipynb)\b")


@pytest.mark.parametrize("description, sourced", [
    ("proximal weight (paper Sec. 5.3)", True), ("alignment lr (official clientas.py)", True),
    ("penalty weight (FedNTD config/fedcurv.json)", True), ("spec B.2 READING", True), ("(PFLlib -mlr)", True),
    ("bound on the first epochs (ours)", True), ("None = train.batch_size", False),
    ("upper bound of the adaptive KD weight lambda", False), ("", False),
])
def test_source_marker_tells_a_sourced_description(description, sourced):
    assert bool(SOURCE_MARKER.search(description)) is sourced


@pytest.mark.parametrize("method", METHODS)
def test_defaults_are_explicit_and_sourced(method):
    cls = REGISTRY[method]
    assert cls.paper, f"{method}: no paper"
    assert cls.Config.__doc__, f"{method}: the config class documents where its defaults come from"
    for name, field in cls.Config.model_fields.items():
        assert field.is_required() is False, f"{method}.{name}: no default"
        assert field.description and SOURCE_MARKER.search(field.description), \
            f"{method}.{name}: the description names no source of the default: {field.description!r}"


@pytest.mark.parametrize("method", METHODS)
def test_capabilities_match_what_is_recorded_and_sent(fed_data, method):
    algo, res = cached(fed_data, method)
    views = set(res.records["view"])
    assert ("global_test" in views) == algo.has_global_model
    assert ("personalized_on_local" in views) == algo.personalized
    assert (res.global_params is None) == (not algo.has_global_model)
    assert (res.personalized is None) == (not algo.personalized)
    assert "local_after_training" in views
    if algo.aggregates:
        assert (res.rounds["bytes_up"] > 0).all()
    else:
        assert (res.rounds["bytes_up"] == 0).all()
    assert res.records["accuracy"].between(0, 1).all()


@pytest.mark.parametrize("method", METHODS)
def test_only_declared_uploads_cross_to_the_server(fed_data, method):
    crossed: list = []
    algo, res = run(fed_data, method, capture=crossed)
    if not algo.aggregates:
        assert crossed == [] and (res.rounds["bytes_up"] == 0).all()
        return
    assert len(crossed) == ROUNDS
    spec = algo.upload_spec()
    images = fed_data.images
    sizes = {len(t) for t in fed_data.client_train} | {len(t) for t in fed_data.client_test}
    for r, up in enumerate(crossed):
        check_upload(algo.name, spec, up, 3)
        assert payload_nbytes(up) == res.rounds["bytes_up"].iloc[r]
        for t in tree_leaves(up):
            assert t.dtype.is_floating_point or t.dtype == torch.int64
            assert tuple(t.shape[-3:]) != tuple(images.shape[-3:]), "an image-shaped tensor crossed"
            assert not any(s in sizes for s in t.shape[1:] if s > 64), "a per-sample-sized tensor crossed"


@pytest.mark.parametrize("method", METHODS)
def test_stacked_equals_sequential(fed_data, method):
    algo = make_algo(method, model=model_for(method), model_args=ZOO[model_for(method)].tiny_args)
    if not algo.stackable:
        assert algo.not_stackable_because, f"{method}: not stackable without a reason"
        with pytest.raises(ValueError, match="cannot be stacked"):
            run(fed_data, method, executor="stacked")
        return
    _, seq = cached(fed_data, method, "sequential")
    _, stk = cached(fed_data, method, "stacked")
    assert_runs_agree(seq, stk)


def assert_runs_agree(a, b, loss_atol=1e-4, server_atol=2e-5, state_atol=1.5e-4, rtol=1e-4):
    """Two runs of one job (e.g. the two executors) agree: every record's counts equal, losses,
    bytes, the server state and the client states within the tolerances.

    Client states may hold models after many more gradient evaluations than one round of FedAvg
    (pFedMe: 20 iterations x 5 inner steps, every client; pFedKD-WCL: 2 x 20 steps of a randomly
    initialised personal CNN, up to 9e-5 here, as FedAvg reaches 5.5e-5 at 4 epochs): fp32
    reduction-order noise grows with them (max-pool/ReLU switches at ulp-level differences). In
    float64 the executors agree to rounding (tests/test_pfedkdwcl.py checks it at its defaults)."""
    pd.testing.assert_frame_equal(metrics(a), metrics(b))  # every view, round, client and correct count
    torch.testing.assert_close(torch.tensor(a.records["loss"].to_numpy()), torch.tensor(b.records["loss"].to_numpy()),
                               atol=loss_atol, rtol=rtol)
    assert a.rounds["bytes_up"].tolist() == b.rounds["bytes_up"].tolist()
    assert a.rounds["bytes_down"].tolist() == b.rounds["bytes_down"].tolist()
    assert_trees_close(decoded(a.server), decoded(b.server), atol=server_atol, rtol=rtol)
    assert_trees_close(decoded(a.client_states), decoded(b.client_states), atol=state_atol, rtol=rtol)


class _Kill(Exception):
    pass


#: stacked resume on one method per kind of state (none; server and client control variates; a
#: persistent personal model; a server buffer; K server cores and a per-client vector; a compressed
#: update broadcast to all): every stackable method resumes through the same code, and the whole
#: registry on the stacked executor costs about 25 minutes of a 2-core CI run
STACKED_RESUME = ("fedavg", "scaffold", "ditto", "fedgkd", "apple", "fedmic")


@pytest.mark.parametrize("method, executor", [
    *[(m, "sequential") for m in METHODS],
    *[(m, "stacked") for m in STACKED_RESUME],
])
def test_killed_and_resumed_run_equals_uninterrupted(fed_data, method, executor, tmp_path):
    """On the executor that wrote the checkpoint, the resumed run equals the uninterrupted one to
    the bit (records with losses, server and client states)."""
    _, full = cached(fed_data, method, executor)
    ckpt = tmp_path / "checkpoint.pt"

    def die(r, row, recs):  # round 0 is checkpointed; the kill lands during round 1
        if r == 1:
            raise _Kill()

    with pytest.raises(_Kill):
        run(fed_data, method, executor, checkpoint=ckpt, callbacks=[die])
    assert ckpt.exists()
    _, resumed = run(fed_data, method, executor, checkpoint=ckpt)
    assert resumed.resumed_from == 1
    pd.testing.assert_frame_equal(full.records, resumed.records)
    assert_trees_close(full.server, resumed.server, atol=0)
    assert_trees_close(full.client_states, resumed.client_states, atol=0)


@pytest.mark.parametrize("method", [m for m in METHODS if m != "fedavg"])
def test_differs_from_fedavg_unless_its_knob_says_so(fed_data, method):
    _, avg = cached(fed_data, "fedavg", model=model_for(method))  # FedAvg on the method's model
    algo, res = cached(fed_data, method)
    def la(r):  # the sampled clients' losses after local training (a method may train more clients)
        rec = r.records[r.records["view"] == "local_after_training"]
        sampled = avg.records[avg.records["view"] == "local_after_training"][["round", "client_id"]]
        return rec.merge(sampled, on=["round", "client_id"])["loss"].to_numpy()

    assert not torch.allclose(torch.tensor(la(avg)), torch.tensor(la(res)), atol=1e-6), \
        f"{method} with its defaults trains like FedAvg"
    if algo.fedavg_when is None:
        return
    assert_trains_as_fedavg(fed_data, method, **algo.fedavg_when)
