"""Deployment (medpfl.deploy): the engine's client side at sites gives the simulator's records.

In-process sites here (the requests and replies packed as Flower carries them); the same with
real Flower processes on loopback in tests/test_flower.py."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from medpfl.deploy.server import InProcessTransport, run_deployed
from medpfl.deploy.site import Site
from medpfl.deploy.wire import pack, unpack
from medpfl.errors import DeploymentError
from medpfl.fl.payload import LowRank
from medpfl.io import read_parquet
from medpfl.train import run_training
from tests.conftest import prepare_train_jobs

METHODS = ("fedavg", "ditto", "scaffold")
#: records of a deployed run vs the simulator (sequential executor): the same arithmetic, except
#: that a site evaluates its own clients' splits in batches of its own (BLAS blocking may differ)
ATOL = 1e-6


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    d = tmp_path_factory.mktemp("deploy")
    jobs, _ = prepare_train_jobs(d, methods=METHODS, num_clients=3, counts=(150, 15, 45), mlflow=False,
                                 train={"rounds": 3, "local_epochs": 1, "participation": 0.67, "batch_size": 16,
                                        "checkpoint_every": 1},
                                 image_size=16)
    return d, {j["method"]: j for j in jobs}


def _sites(d, tmp, split):
    """A transport with one site per entry of ``split`` (client ids), each with its own state folder."""
    def make(n, job, key):
        return Site(job, d / "arrays.npz", d / "samples.parquet", d / "partition.parquet", split[n], tmp / f"site{n}",
                    key)
    return InProcessTransport(list(range(len(split))), make)


def _records(folder):
    rec = read_parquet(folder / "records.parquet").sort_values(["round", "view", "client_id"]).reset_index(drop=True)
    return rec


@pytest.mark.parametrize("method", METHODS)
def test_deployed_records_equal_the_simulator(study, tmp_path, method):
    d, jobs = study
    job = jobs[method]
    run_training(job, d / "arrays.npz", d / "samples.parquet", d / "partition.parquet", tmp_path / "sim")
    transport = _sites(d, tmp_path, [[0, 2], [1]])
    run_deployed(job, d / "arrays.npz", d / "samples.parquet", d / "partition.parquet", tmp_path / "dep", transport)
    sim, dep = _records(tmp_path / "sim"), _records(tmp_path / "dep")
    pd.testing.assert_frame_equal(sim.drop(columns=["accuracy", "balanced_accuracy", "loss"]),
                                  dep.drop(columns=["accuracy", "balanced_accuracy", "loss"]))
    for col in ("accuracy", "balanced_accuracy", "loss"):
        np.testing.assert_allclose(dep[col], sim[col], atol=ATOL, rtol=0)
    rounds = read_parquet(tmp_path / "dep" / "rounds.parquet")
    assert (rounds["missing_clients"] == "").all()
    sim_rounds = read_parquet(tmp_path / "sim" / "rounds.parquet")
    assert list(rounds["bytes_up"]) == list(sim_rounds["bytes_up"])
    # the global model the server ends with is the simulator's
    a = torch.load(tmp_path / "sim" / "final_model.pt", weights_only=False)
    b = torch.load(tmp_path / "dep" / "final_model.pt", weights_only=False)
    if a["global"] is not None:
        for k in a["global"]:
            torch.testing.assert_close(b["global"][k], a["global"][k], atol=1e-6, rtol=0)
    assert b["personalized"] is None  # personal models stay at the sites
    if method == "ditto":  # ... where each site saved its own clients' models
        saved = list(tmp_path.glob("site*/run-*/final_model.pt"))
        assert len(saved) == 2
        for f in saved:
            blob = torch.load(f, weights_only=False)
            for j, c in enumerate(blob["clients"]):
                for k, v in blob["personalized"].items():
                    torch.testing.assert_close(v[j], a["personalized"][k][c], atol=1e-6, rtol=0)


def test_site_down_leaves_the_round_and_rejoins(study, tmp_path):
    d, jobs = study
    transport = _sites(d, tmp_path, [[0, 2], [1]])
    real = transport.request
    calls = {"n": 0}

    def flaky(requests, timeout):
        kinds = {k for k, _, _ in requests.values()}
        if "train" in kinds:
            calls["n"] += 1
            transport.down = {1} if calls["n"] == 2 else set()  # node 1 silent in round 2's training
        return real(requests, timeout)

    transport.request = flaky
    run_deployed(jobs["ditto"], d / "arrays.npz", d / "samples.parquet", d / "partition.parquet", tmp_path / "dep",
                 transport, timeout=5)
    rounds = read_parquet(tmp_path / "dep" / "rounds.parquet")
    # node 1 (client 1) is silent through round 2's training and evaluation
    assert rounds["missing_clients"].tolist() == ["", "1", ""]
    rec = read_parquet(tmp_path / "dep" / "records.parquet")
    r1 = rec[rec["round"] == 1]
    assert 1 not in r1["client_id"].tolist()
    assert set(r1[r1["view"] == "personalized_on_local"]["client_id"]) == {0, 2}
    # round 3: the site is back, with the state it kept
    assert set(rec[(rec["round"] == 2) & (rec["view"] == "personalized_on_local")]["client_id"]) == {0, 1, 2}


def test_sites_must_cover_every_client(study, tmp_path):
    d, jobs = study
    with pytest.raises(DeploymentError, match=r"client\(s\) \[1\]"):
        run_deployed(jobs["fedavg"], d / "arrays.npz", d / "samples.parquet", d / "partition.parquet",
                     tmp_path / "dep", _sites(d, tmp_path, [[0, 2]]))
    with pytest.raises(DeploymentError, match="held by two sites"):
        run_deployed(jobs["fedavg"], d / "arrays.npz", d / "samples.parquet", d / "partition.parquet",
                     tmp_path / "dep", _sites(d, tmp_path, [[0, 1], [1, 2]]))


def test_wire_round_trip_keeps_every_leaf_bit_for_bit():
    tree = {"a": {"w": torch.randn(3, 2), "n": torch.tensor(7)}, "empty": {},
            "lr": LowRank(torch.randn(2, 1), torch.randn(1), torch.randn(1, 3), torch.tensor(1)),
            "h": torch.randn(4).to(torch.bfloat16), "i": torch.arange(3, dtype=torch.int32)}
    arrays, meta = pack(tree)
    back = unpack(arrays, json.loads(json.dumps(meta)))
    assert back["empty"] == {} and isinstance(back["lr"], LowRank)
    for x, y in ((back["a"]["w"], tree["a"]["w"]), (back["a"]["n"], tree["a"]["n"]), (back["h"], tree["h"]),
                 (back["i"], tree["i"]), (back["lr"].vh, tree["lr"].vh)):
        assert x.dtype == y.dtype and torch.equal(x, y)
    del arrays["p0"]
    with pytest.raises(ValueError, match="arrays"):
        unpack(arrays, meta)


def test_server_resumes_from_its_checkpoint_with_the_sites_states(study, tmp_path, monkeypatch):
    """The server side fails after round 2 (an injected fault); the same deployed run again
    resumes from its checkpoint, the sites start from the states it refers to, and the records
    are the uninterrupted simulator's."""
    import medpfl.train as train_mod

    d, jobs = study
    job = jobs["scaffold"]
    run_training(job, d / "arrays.npz", d / "samples.parquet", d / "partition.parquet", tmp_path / "sim")
    real = train_mod.round_scalars

    def boom(records, row):
        if row["round"] == 2:
            raise RuntimeError("injected server fault in round 3")
        return real(records, row)

    transport = _sites(d, tmp_path, [[0], [1, 2]])
    monkeypatch.setattr(train_mod, "round_scalars", boom)
    with pytest.raises(RuntimeError, match="injected"):
        run_deployed(job, d / "arrays.npz", d / "samples.parquet", d / "partition.parquet", tmp_path / "dep", transport)
    assert torch.load(tmp_path / "dep" / "checkpoint.pt", weights_only=False)["next_round"] == 2
    monkeypatch.setattr(train_mod, "round_scalars", real)
    fresh = _sites(d, tmp_path, [[0], [1, 2]])  # new site processes, the same state folders
    run_deployed(job, d / "arrays.npz", d / "samples.parquet", d / "partition.parquet", tmp_path / "dep", fresh)
    sim, dep = _records(tmp_path / "sim"), _records(tmp_path / "dep")
    pd.testing.assert_frame_equal(sim[["round", "view", "client_id", "correct"]],
                                  dep[["round", "view", "client_id", "correct"]])
    np.testing.assert_allclose(dep["loss"], sim["loss"], atol=ATOL, rtol=0)


def test_a_site_serves_its_own_file_in_the_official_layout(tmp_path):
    """prepare-site: a MedMNIST-layout file -> arrays, samples, a one-client partition a Site
    reads; a file not in the layout stops with one line naming it."""
    from medpfl.data.synthetic import write_synthetic_npz
    from medpfl.deploy.site import prepare_site_files
    from medpfl.errors import DataError

    write_synthetic_npz(tmp_path / "own.npz", 4, 3, 16, (60, 10, 20), seed=5)
    paths = prepare_site_files(tmp_path / "own.npz", tmp_path / "site", client_id=2, num_classes=4, n_channels=3)
    table = read_parquet(paths["partition-table"])
    assert set(table["client_id"]) == {2} and table["local_split"].value_counts().to_dict() == {"train": 60, "test": 20}
    jobs, _ = prepare_train_jobs(tmp_path / "study", methods=("fedavg",), num_clients=3, counts=(150, 15, 45),
                                 mlflow=False, image_size=16)
    site = Site(jobs[0], paths["arrays"], paths["samples"], paths["partition-table"], None, tmp_path / "state", "run-x")
    hello = site.hello()
    assert hello["clients"] == [2] and hello["num_samples"] == [60] and hello["num_classes"] == 4
    np.savez(tmp_path / "bad.npz", images=np.zeros((3, 16, 16, 3), dtype=np.uint8))
    with pytest.raises(DataError, match="bad.npz"):
        prepare_site_files(tmp_path / "bad.npz", tmp_path / "bad", client_id=0, num_classes=4, n_channels=3)


# ----- secure aggregation (SecAgg+): the server side holds the sites' mean only -----------------
def test_secagg_gives_the_server_only_the_mean_and_the_simulators_records(study, tmp_path, monkeypatch):
    """Under secagg, nothing of one site's upload reaches FlowerClients: every train request goes
    through the transport's ``secure_train``, which hands back one mean and each site's
    metrics (JSON counts); the engine's uploads are m identical rows (weights of ones), none equal
    to a site's own upload, and their value is the n-weighted mean of the sites' uploads. The
    records equal the simulator's (the in-process mean is exact; over Flower SecAgg+ quantises)."""
    from medpfl.deploy.server import FlowerClients

    d, jobs = study
    job = jobs["fedavg"]
    run_training(job, d / "arrays.npz", d / "samples.parquet", d / "partition.parquet", tmp_path / "sim")
    transport = _sites(d, tmp_path, [[0], [1], [2]])
    site_uploads, secure_out, plain_kinds, engine_got = [], [], [], []
    orig_train, orig_secure, orig_request = Site.train, transport.secure_train, transport.request
    orig_round = FlowerClients.train_round

    def site_train(self, *a, **k):  # what each site computed (never sent as is)
        tree, cfg = orig_train(self, *a, **k)
        site_uploads.append(({c: n for c, n in zip(self.clients, self.hello()["num_samples"])},
                             {kk: v.clone() for kk, v in tree["uploads"]["model"].items()}))
        return tree, cfg

    def secure(*a, **k):
        mean, metrics = orig_secure(*a, **k)
        secure_out.append((mean, metrics))
        return mean, metrics

    def request(requests, timeout):
        plain_kinds.extend(kind for kind, _, _ in requests.values())
        return orig_request(requests, timeout)

    def train_round(self, *a, **k):
        out = orig_round(self, *a, **k)
        engine_got.append(out)
        return out

    monkeypatch.setattr(Site, "train", site_train)
    monkeypatch.setattr(transport, "secure_train", secure)
    monkeypatch.setattr(transport, "request", request)
    monkeypatch.setattr(FlowerClients, "train_round", train_round)
    run_deployed(job, d / "arrays.npz", d / "samples.parquet", d / "partition.parquet", tmp_path / "dep", transport,
                 secagg=True)
    rounds = job["train"]["rounds"]
    assert "train" not in plain_kinds and transport.secure_rounds == rounds == len(secure_out) == len(engine_got)
    for mean, metrics in secure_out:
        assert isinstance(mean, list) and all(isinstance(a, np.ndarray) for a in mean)
        for met in metrics.values():  # a site's metrics: its evaluation counts, nothing of its model
            assert set(met) == {"reply"} and set(json.loads(met["reply"])) == {"test", "val", "bad_state"}
    per_round = len(site_uploads) // rounds
    for r, out in enumerate(engine_got):
        rows = out.uploads["model"]
        m = rows[next(iter(rows))].shape[0]
        assert m == per_round >= 2 and torch.equal(out.uploads["num_samples"], torch.ones(m))
        sent = site_uploads[r * per_round:(r + 1) * per_round]
        n = torch.tensor([float(next(iter(ns.values()))) for ns, _ in sent], dtype=torch.float64)
        for key, v in rows.items():
            for j in range(1, m):
                assert torch.equal(v[j], v[0])  # identical rows: the mean
            mean = sum(w * up[key][0].double() for w, (_, up) in zip(n / n.sum(), sent))
            torch.testing.assert_close(v[0].double(), mean, atol=1e-6, rtol=0)
            if v[0].numel() > 1:  # no row is a site's own upload
                assert not any(torch.equal(v[0], up[key][0]) for _, up in sent)
    sim, dep = _records(tmp_path / "sim"), _records(tmp_path / "dep")
    keys = ["round", "view", "client_id", "n_samples", "correct"]
    pd.testing.assert_frame_equal(sim[keys], dep[keys])
    for col in ("accuracy", "balanced_accuracy", "loss"):
        np.testing.assert_allclose(dep[col], sim[col], atol=ATOL, rtol=0)


def test_secagg_refuses_a_method_it_cannot_aggregate(study, tmp_path):
    from medpfl.deploy.secagg import check_secagg
    from medpfl.errors import ParamsError
    from tests.conftest import make_algo

    d, jobs = study
    with pytest.raises(ParamsError, match=r"^secagg: .*'scaffold'.*control"):
        run_deployed(jobs["scaffold"], d / "arrays.npz", d / "samples.parquet", d / "partition.parquet",
                     tmp_path / "dep", _sites(d, tmp_path, [[0], [1], [2]]), secagg=True)
    with pytest.raises(ParamsError, match=r"^secagg: .*'fedkper'.*score"):
        check_secagg(make_algo("fedkper"), "fedkper")
    with pytest.raises(DeploymentError, match="secagg: the site of node 0 holds clients \\[0, 2\\]"):
        run_deployed(jobs["fedavg"], d / "arrays.npz", d / "samples.parquet", d / "partition.parquet",
                     tmp_path / "dep2", _sites(d, tmp_path, [[0, 2], [1]]), secagg=True)


def _applicable():
    from medpfl.algorithms import REGISTRY
    from medpfl.deploy.secagg import secagg_not_applicable
    from tests.conftest import make_algo

    return sorted(n for n in REGISTRY if secagg_not_applicable(make_algo(n, model=_model(n))) is None)


def _model(method):
    return "cnn4bn" if method == "fedbn" else "cnn4"  # FedBN needs BatchNorm layers


def test_secagg_applies_to_exactly_the_listed_methods():
    """The list in docs/deployment.md is the rule's."""
    assert _applicable() == SECAGG_METHODS


SECAGG_METHODS = ["apfl", "ditto", "fedala", "fedavg", "fedbabu", "fedbn", "fedgkd", "fedntd", "fedper", "fedprox",
                  "fedrep", "fedrod", "moon", "perfedavg", "pfpslwc"]


@pytest.mark.parametrize("method,overrides", [(m, {}) for m in SECAGG_METHODS]
                         + [("apfl", {"weighting": "uniform"}), ("fedbn", {"weighting": "uniform"})])
def test_the_secure_mean_gives_each_applicable_methods_own_aggregate(method, overrides):
    """m rows equal to the secure mean (weights secagg_weight) with weights of ones give the
    method's own aggregate of the m uploads: what lets SecAgg+ stand in for the server's reads."""
    from medpfl.deploy.secagg import mean_uploads, secagg_weight
    from medpfl.fl.program import Federation, RoundInfo
    from medpfl.models import build_model
    from tests.conftest import make_algo

    algo = make_algo(method, model=_model(method), **overrides)
    torch.manual_seed(0)
    module = build_model(_model(method), 3, 4, 28)
    params = {k: v.detach().clone() for k, v in [*module.named_parameters(), *module.named_buffers()]}
    n = torch.tensor([10.0, 30.0, 45.0])
    server = algo.init_server(params, Federation(num_clients=3, num_samples=(10, 30, 45), num_classes=4))
    decl = type(algo).model_upload
    shapes = algo.upload_spec()[decl.upload].shapes
    g = torch.Generator().manual_seed(0)
    ups = {k: (torch.randn(3, *s, generator=g) if params[k].is_floating_point()
               else torch.randint(0, 50, (3, *s), generator=g)).to(params[k].dtype) for k, s in shapes.items()}
    rnd = RoundInfo(round=0, rounds=1, lr=0.1, num_clients=3, seed=0, base_lr=0.1, batch_size=8)
    clients = torch.arange(3)
    own = algo.aggregate(server, {decl.upload: ups, "num_samples": n}, clients, rnd)
    w = torch.tensor([float(secagg_weight(algo, int(x))) for x in n], dtype=torch.float64)
    mean = [(w.view(-1, *[1] * s_.dim()) * ups[k].double()).sum(0).numpy() / float(w.sum())
            for k, s_ in sorted((k, ups[k][0]) for k in ups)]
    ref = {k: torch.zeros(s, dtype=params[k].dtype) for k, s in shapes.items()}
    trick = algo.aggregate(server, mean_uploads(algo, {decl.reference: ref}, mean, 3, "cpu"), clients, rnd)
    a, b = _by_path(own), _by_path(trick)
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-5, rtol=0, msg=k)


def _by_path(tree):
    import torch.utils._pytree as pytree

    return {pytree.keystr(p): t for p, t in pytree.tree_flatten_with_path(tree)[0] if isinstance(t, torch.Tensor)}
