"""Property-based tests (hypothesis): generated configurations and data files are either
accepted and run, or rejected with a message naming the params key or the file, never a raw
traceback from deep inside."""

from __future__ import annotations

import copy
import re
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from medpfl.compose import load_params, validate_params
from medpfl.config import EvalConfig, ParamsError, TrainConfig
from medpfl.data.partition import PartitionError, build_partition
from medpfl.data.preprocess import load_official_npz
from medpfl.data.sources import DataError
from medpfl.fl.engine import Engine
from tests.conftest import REPO, make_algo

BASE = load_params(REPO / "params.yaml").model_dump(mode="json")
BASE["partitions"] = [{"name": k, **v} for k, v in BASE["partitions"].items()]

# every leaf path of the default params, to mutate
def _paths(d, prefix=()):
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(d, list) and d and isinstance(d[0], dict):
        for i, v in enumerate(d):
            yield from _paths(v, prefix + (i,))
    else:
        yield prefix


PATHS = [p for p in _paths(BASE) if p and p[-1] != "name"]
VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 10**6), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8), st.lists(st.integers(-2, 3), max_size=3), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
# a dotted key, where a key of other characters is quoted in brackets (server_data[':'])
KEY_LINE = re.compile(r"""^  - (?:[A-Za-z0-9_.+-]|\[(?:'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*")\])+: .+""", re.M)


def _set(d, path, value):
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value


@st.composite
def mutated_params(draw):
    p = copy.deepcopy(BASE)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["value", "value", "unknown_key", "drop"]))
        path = draw(st.sampled_from(PATHS))
        if kind == "value":
            _set(p, path, draw(VALUES))
        elif kind == "unknown_key":
            parent = p
            for k in path[:-1]:
                parent = parent[k]
            if isinstance(parent, dict):
                parent[draw(st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=10))] = draw(VALUES)
        else:
            parent = p
            for k in path[:-1]:
                parent = parent[k]
            if isinstance(parent, dict):
                parent.pop(path[-1], None)
    if draw(st.booleans()):
        p["methods"] = draw(st.lists(st.sampled_from(["fedavg", "fedprox", "fedkper", "local", "fedbogus", "FedAvg", ""]),
                                     min_size=0, max_size=4))
    return p


def _with_odd_key():
    """The case a CI run drew: a mapping key that is a colon (``server_data: {':': 0}``)."""
    p = copy.deepcopy(BASE)
    p["partitions"][0]["server_data"] = {":": 0}
    return p


def test_generated_params_are_accepted_or_rejected_with_the_key():
    seen: Counter = Counter()

    @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(mutated_params())
    @example(_with_odd_key())
    def check(data):
        try:
            validate_params(data, "generated.yaml")
            seen["accepted"] += 1
        except ParamsError as e:
            msg = str(e)
            assert msg.startswith("generated.yaml"), msg
            assert KEY_LINE.search(msg) or re.search(r"(methods|method_params\.[^:]+):", msg), msg
            seen["rejected"] += 1

    check()
    # the generator reaches both outcomes (else the property above says nothing)
    assert seen["rejected"] > 50 and seen["accepted"] > 0, dict(seen)


def test_generated_partitions_cover_every_sample_or_name_the_key():
    seen: Counter = Counter()
    labels = np.random.RandomState(0).randint(0, 5, size=300)

    @settings(max_examples=150, deadline=None)
    @given(scheme=st.sampled_from(["dirichlet", "iid", "pathological"]), num_clients=st.integers(1, 400),
           alpha=st.floats(1e-4, 1e3), min_samples=st.integers(1, 60), cpc=st.integers(1, 6),
           fraction=st.floats(0.01, 0.9), rule=st.sampled_from(["stratified", "random", "fedkper"]),
           seed=st.integers(0, 99))
    def check(scheme, num_clients, alpha, min_samples, cpc, fraction, rule, seed):
        own = {"dirichlet": {"alpha": alpha, "max_draws": 20}, "iid": {},  # each scheme takes its own keys only
               "pathological": {"classes_per_client": cpc}}[scheme]
        cfg_data = {"scheme": scheme, "num_clients": num_clients, "min_samples": min_samples, "seed": seed, **own,
                    "local_test": {"fraction": fraction, "rule": rule}}
        try:
            params = validate_params({"partitions": [{"name": "gen", **cfg_data}]}, "generated.yaml")
            table = build_partition(np.arange(300) + 1000, labels, params.partitions["gen"], "gen")
        except (ParamsError, PartitionError) as e:
            assert "partitions.gen" in str(e), str(e)
            seen["rejected"] += 1
            return
        assert sorted(table["sample_id"].tolist()) == list(range(1000, 1300))
        assert table.groupby("client_id")["local_split"].apply(lambda s: {"train", "test"} <= set(s)).all()
        seen["accepted"] += 1

    check()
    assert seen["accepted"] > 0 and seen["rejected"] > 0, dict(seen)


@st.composite
def npz_arrays(draw):
    """Official-layout arrays with random faults: shapes, dtypes, NaN, label range, missing keys."""
    n = {s: draw(st.integers(0, 6)) for s in ("train", "val", "test")}
    fault = draw(st.sampled_from(["none", "shape", "dtype_float_nan", "dtype_float_range", "labels_range",
                                  "labels_shape", "labels_count", "missing_key", "channels"]))
    arrays = {}
    for s, k in n.items():
        x = np.random.RandomState(k).randint(0, 256, size=(k, 8, 8, 3)).astype(np.uint8)
        y = np.random.RandomState(k).randint(0, 4, size=(k, 1)).astype(np.uint8)
        arrays[f"{s}_images"], arrays[f"{s}_labels"] = x, y
    s = draw(st.sampled_from(["train", "val", "test"]))
    if fault == "shape":
        arrays[f"{s}_images"] = arrays[f"{s}_images"].reshape(len(arrays[f"{s}_images"]), 8 * 8 * 3)
    elif fault == "dtype_float_nan":
        x = arrays[f"{s}_images"].astype(np.float32)
        if x.size:
            x.flat[0] = np.nan
        arrays[f"{s}_images"] = x
    elif fault == "dtype_float_range":
        arrays[f"{s}_images"] = arrays[f"{s}_images"].astype(np.float32) * 3.5 - 100
    elif fault == "labels_range":
        arrays[f"{s}_labels"] = arrays[f"{s}_labels"].astype(np.int64) + draw(st.sampled_from([-9, 4, 100]))
    elif fault == "labels_shape":
        arrays[f"{s}_labels"] = np.repeat(arrays[f"{s}_labels"], 2, axis=1)
    elif fault == "labels_count":
        arrays[f"{s}_labels"] = arrays[f"{s}_labels"][:-1] if len(arrays[f"{s}_labels"]) else np.zeros((1, 1), np.uint8)
    elif fault == "missing_key":
        arrays.pop(draw(st.sampled_from(sorted(arrays))))
    elif fault == "channels":
        arrays[f"{s}_images"] = arrays[f"{s}_images"][..., :1]
    return fault, arrays


def _valid_npz_arrays(k: int = 6) -> dict:
    """A well-formed file of ``k`` samples per split (8x8 RGB, 4 classes): always tried, so the
    accepting branch is exercised on every run, however few valid cases the draw holds."""
    rs = np.random.RandomState(0)
    return {f"{s}_{kind}": (rs.randint(0, 256, size=(k, 8, 8, 3)) if kind == "images" else rs.randint(0, 4, size=(k, 1)))
            .astype(np.uint8) for s in ("train", "val", "test") for kind in ("images", "labels")}


def test_generated_data_files_load_or_fail_naming_the_file(tmp_path):
    seen: Counter = Counter()

    @settings(max_examples=200, deadline=None)
    @given(case=npz_arrays(), truncate=st.booleans())
    @example(case=("none", _valid_npz_arrays()), truncate=False)
    @example(case=("none", _valid_npz_arrays()), truncate=True)
    def check(case, truncate):
        seen["tried"] += 1
        fault, arrays = case
        path = tmp_path / f"gen-{seen['tried']}.npz"
        np.savez(path, **arrays)
        if truncate:
            raw = path.read_bytes()
            path.write_bytes(raw[: len(raw) // 2])
        try:
            out = load_official_npz(path, num_classes=4, n_channels=3)
        except DataError as e:
            assert str(path) in str(e), str(e)
            seen["rejected"] += 1
            return
        assert not truncate, "a truncated file was accepted"
        assert fault in ("none", "dtype_float_range", "labels_range"), f"fault {fault!r} was not detected"
        for x, y in out.values():
            assert x.dtype == np.uint8 and x.ndim == 4 and x.shape[1] == 3
            assert y.dtype == np.int64 and y.min(initial=0) >= 0 and y.max(initial=0) < 4
        seen["accepted"] += 1

    check()
    assert seen["accepted"] > 0 and seen["rejected"] > 0, dict(seen)


# Plain SGD on the small CNN diverges (NaN weights) for large steps: with batch size 1, lr 0.05
# and momentum 0.9 already (effective step lr / (1 - momentum) = 0.5), and lr 0.2 without
# momentum. The generated configs keep the effective step at or below 0.06, where every run must
# stay finite; a NaN there is a bug, not a hyper-parameter choice.
MAX_LR, MAX_MOMENTUM = 0.03, 0.5


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(method=st.sampled_from(["fedavg", "fedprox", "fedkper", "local"]),
       executor=st.sampled_from(["sequential", "stacked"]), rounds=st.integers(1, 2),
       participation=st.floats(0.01, 1.0), batch_size=st.integers(1, 64), epochs=st.integers(1, 2),
       every=st.integers(1, 3), lr=st.floats(1e-4, MAX_LR), momentum=st.floats(0.0, MAX_MOMENTUM))
# the largest steps of the range, every client, batch size 1: always tried
@example(method="fedavg", executor="sequential", rounds=2, participation=1.0, batch_size=1, epochs=1, every=1,
         lr=MAX_LR, momentum=MAX_MOMENTUM)
@example(method="local", executor="stacked", rounds=2, participation=1.0, batch_size=1, epochs=1, every=1,
         lr=MAX_LR, momentum=MAX_MOMENTUM)
def test_generated_training_configs_run_and_stay_finite(fed_data, method, executor, rounds, participation, batch_size,
                                                        epochs, every, lr, momentum):
    train = TrainConfig(rounds=rounds, participation=participation, local_epochs=epochs, batch_size=batch_size,
                        optimizer={"lr": lr, "momentum": momentum})
    res = Engine(make_algo(method), fed_data, train, EvalConfig(every=every), seed=0, executor_kind=executor).run()
    assert res.rounds["round"].tolist() == list(range(rounds))
    la = res.records[res.records["view"] == "local_after_training"]
    assert len(la) == sum(len(s.split()) for s in res.rounds["sampled_clients"])
    assert res.records["accuracy"].between(0, 1).all()
    assert np.isfinite(res.records["loss"].to_numpy(dtype=float)).all(), "a loss is NaN or infinite"
    if res.global_params is not None:
        bad = [k for k, v in res.global_params.items() if not torch.isfinite(v).all()]
        assert not bad, f"non-finite global parameters {bad} (lr={lr}, momentum={momentum})"
