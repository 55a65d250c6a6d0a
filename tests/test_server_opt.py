"""Server optimizers (``train.server_optimizer``, ``medpfl.fl.server_opt``): FedAvgM (Hsu et al.
2019) and FedAdagrad / FedAdam / FedYogi (Reddi et al., ICLR 2021, Algorithm 2) on hand-computed
two-step cases; buffers taken from the aggregate; the config (defaults, keys, variants, the job
description unchanged without it, MLflow params); the methods it refuses; in the engine: no
change without it, FedAvgM(β = 0, η = 1) = FedAvg to the bit, a killed and resumed run equals an
uninterrupted one, both executors agree, and a non-averaging aggregate (SCAFFOLD) stepped on top."""

from __future__ import annotations

import copy
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from medpfl.compose import validate_params
from medpfl.config import (
    SERVER_OPTIMIZER_DEFAULTS,
    EvalConfig,
    ParamsError,
    ServerOptimizerConfig,
    TrainConfig,
    train_job,
)
from medpfl.fl.engine import Engine
from medpfl.fl.program import Federation, RoundInfo
from medpfl.fl.server_opt import STATE_KEY, ServerOptimizer, make_server_optimizer
from medpfl.tracking import flatten
from tests.conftest import assert_trees_close, make_algo

REPO = Path(__file__).resolve().parents[1]
EXACT = {"atol": 1e-12, "rtol": 0.0}


def _t(*v):
    return torch.tensor(v, dtype=torch.float64)


def _opt(name, names=("w", "s"), **kw) -> ServerOptimizer:
    return ServerOptimizer(ServerOptimizerConfig(name=name, **kw), names)


def _two_steps(opt: ServerOptimizer, x0: dict, deltas: list[dict]):
    """Run ``opt`` through the engine's call (``apply``) for each round's Δ (aggregate = x_t + Δ);
    returns the server states after each step."""
    server, out = {"model": x0}, []
    for d in deltas:
        aggregate = {k: server["model"][k] + d.get(k, torch.zeros_like(v)) for k, v in server["model"].items()}
        server = opt.apply(server, {"model": aggregate})
        out.append(server)
    return out


# ----- hand-computed cases (two server steps each) ------------------------------------------
def test_fedavgm_hand_case():
    """FedAvgM, η = 0.5, β = 0.9 (u_t = β u_{t-1} + Δ_t, x_{t+1} = x_t + η u_t, u_{-1} = 0).

    w = [1, 0]. Round 0: Δ = [2, -4] -> u_0 = [2, -4], x_1 = [1 + 0.5*2, 0 + 0.5*(-4)] = [2, -2].
    Round 1: Δ = [-1, 0] -> u_1 = 0.9*[2, -4] + [-1, 0] = [0.8, -3.6],
    x_2 = [2 + 0.4, -2 - 1.8] = [2.4, -3.8] (the second entry keeps moving with Δ = 0: momentum).
    s = 5 with Δ = 0 twice stays 5, u = 0."""
    opt = _opt("fedavgm", lr=0.5, momentum=0.9)
    s1, s2 = _two_steps(opt, {"w": _t(1.0, 0.0), "s": _t(5.0)},
                        [{"w": _t(2.0, -4.0)}, {"w": _t(-1.0, 0.0)}])
    torch.testing.assert_close(s1["model"]["w"], _t(2.0, -2.0), **EXACT)
    torch.testing.assert_close(s1[STATE_KEY]["u"]["w"], _t(2.0, -4.0), **EXACT)
    torch.testing.assert_close(s2["model"]["w"], _t(2.4, -3.8), **EXACT)
    torch.testing.assert_close(s2[STATE_KEY]["u"]["w"], _t(0.8, -3.6), **EXACT)
    assert torch.equal(s2["model"]["s"], _t(5.0)) and torch.equal(s2[STATE_KEY]["u"]["s"], _t(0.0))
    assert set(s2[STATE_KEY]) == {"u"}


@pytest.mark.parametrize("beta1, expect", [
    (0.0, {"x1": (0.5, 1.0), "x2": (1.25, 0.5), "m2": (3.0, -1.0)}),
    (0.5, {"x1": (0.25, 1.0), "x2": (0.6875, 0.75), "m2": (1.75, -0.5)}),
])
def test_fedadagrad_hand_case(beta1, expect):
    """FedAdagrad, η = 1, τ = 0.75 (v_{-1} = τ² = 0.5625), m_t = β1 m + (1 - β1) Δ,
    v_t = v_{t-1} + Δ², x_{t+1} = x_t + η m_t / (√v_t + τ).

    w = [0, 1]; Δ_0 = [1, 0], Δ_1 = [3, -1].
    v_0 = [0.5625 + 1, 0.5625] = [1.5625, 0.5625] (√: 1.25, 0.75);
    v_1 = [1.5625 + 9, 0.5625 + 1] = [10.5625, 1.5625] (√: 3.25, 1.25): v only grows.
    β1 = 0 (the default): m_0 = [1, 0], x_1 = [0 + 1/(1.25 + 0.75), 1 + 0] = [0.5, 1];
    m_1 = [3, -1], x_2 = [0.5 + 3/(3.25 + 0.75), 1 - 1/(1.25 + 0.75)] = [1.25, 0.5].
    β1 = 0.5: m_0 = [0.5, 0], x_1 = [0.25, 1]; m_1 = [0.25 + 1.5, -0.5] = [1.75, -0.5],
    x_2 = [0.25 + 1.75/4, 1 - 0.5/2] = [0.6875, 0.75]."""
    opt = _opt("fedadagrad", names=("w",), lr=1.0, tau=0.75, beta1=beta1)
    s1, s2 = _two_steps(opt, {"w": _t(0.0, 1.0)}, [{"w": _t(1.0, 0.0)}, {"w": _t(3.0, -1.0)}])
    torch.testing.assert_close(s1[STATE_KEY]["v"]["w"], _t(1.5625, 0.5625), **EXACT)
    torch.testing.assert_close(s1["model"]["w"], _t(*expect["x1"]), **EXACT)
    torch.testing.assert_close(s2[STATE_KEY]["v"]["w"], _t(10.5625, 1.5625), **EXACT)
    torch.testing.assert_close(s2[STATE_KEY]["m"]["w"], _t(*expect["m2"]), **EXACT)
    torch.testing.assert_close(s2["model"]["w"], _t(*expect["x2"]), **EXACT)


def test_fedadam_hand_case():
    """FedAdam, η = 0.6, β1 = 0.5, β2 = 0.96, τ = 0.5 (v_{-1} = 0.25),
    v_t = β2 v_{t-1} + (1 - β2) Δ², no bias correction (Algorithm 2).

    w = [1, -1]; Δ_0 = [2.5, -2.5]: m_0 = ±1.25, v_0 = 0.96*0.25 + 0.04*6.25 = 0.24 + 0.25 = 0.49
    (√ 0.7), x_1 = ±(1 + 0.6*1.25/(0.7 + 0.5)) = ±(1 + 0.625) = ±1.625.
    Δ_1 = [-3.5, 3.5]: m_1 = 0.5*1.25 - 0.5*3.5 = -1.125 (and +1.125),
    v_1 = 0.96*0.49 + 0.04*12.25 = 0.4704 + 0.49 = 0.9604 (√ 0.98),
    x_2 = 1.625 - 0.6*1.125/(0.98 + 0.5) = 1.625 - 0.675/1.48 = 173/148 (and -173/148).
    s = 2 with Δ = 0: m stays 0, v decays 0.25 -> 0.24 -> 0.2304, s stays 2 exactly."""
    opt = _opt("fedadam", lr=0.6, beta1=0.5, beta2=0.96, tau=0.5)
    s1, s2 = _two_steps(opt, {"w": _t(1.0, -1.0), "s": _t(2.0)},
                        [{"w": _t(2.5, -2.5)}, {"w": _t(-3.5, 3.5)}])
    torch.testing.assert_close(s1[STATE_KEY]["v"]["w"], _t(0.49, 0.49), **EXACT)
    torch.testing.assert_close(s1["model"]["w"], _t(1.625, -1.625), **EXACT)
    torch.testing.assert_close(s2[STATE_KEY]["m"]["w"], _t(-1.125, 1.125), **EXACT)
    torch.testing.assert_close(s2[STATE_KEY]["v"]["w"], _t(0.9604, 0.9604), **EXACT)
    torch.testing.assert_close(s2["model"]["w"], _t(173 / 148, -173 / 148), **EXACT)
    torch.testing.assert_close(s2[STATE_KEY]["v"]["s"], _t(0.2304), **EXACT)
    assert torch.equal(s2["model"]["s"], _t(2.0)) and torch.equal(s2[STATE_KEY]["m"]["s"], _t(0.0))


def test_fedyogi_hand_case():
    """FedYogi, η = 1, β1 = 0.5, β2 = 0.5, τ = 0.75 (v_{-1} = 0.5625),
    v_t = v_{t-1} - (1 - β2) Δ² sign(v_{t-1} - Δ²): v moves toward Δ² by (1 - β2) Δ² (Adam would
    move it by (1 - β2)(Δ² - v)).

    w = [0, -1]. Round 0, Δ = [3, 0.75]:
      w[0]: Δ² = 9 > v: v_0 = 0.5625 + 0.5*9 = 5.0625 (√ 2.25), m_0 = 1.5,
            x_1 = 0 + 1.5/(2.25 + 0.75) = 0.5 (FedAdam would have v_0 = 4.78125);
      w[1]: Δ² = 0.5625 = v: sign 0, v_0 = 0.5625 (√ 0.75), m_0 = 0.375, x_1 = -1 + 0.375/1.5 = -0.75.
    Round 1, Δ = [2, 0]:
      w[0]: Δ² = 4 < v: v_1 = 5.0625 - 0.5*4 = 3.0625 (√ 1.75), m_1 = 0.75 + 1 = 1.75,
            x_2 = 0.5 + 1.75/(1.75 + 0.75) = 1.2;
      w[1]: Δ² = 0 < v: v_1 = 0.5625, m_1 = 0.1875, x_2 = -0.75 + 0.1875/1.5 = -0.625."""
    opt = _opt("fedyogi", names=("w",), lr=1.0, beta1=0.5, beta2=0.5, tau=0.75)
    s1, s2 = _two_steps(opt, {"w": _t(0.0, -1.0)}, [{"w": _t(3.0, 0.75)}, {"w": _t(2.0, 0.0)}])
    torch.testing.assert_close(s1[STATE_KEY]["v"]["w"], _t(5.0625, 0.5625), **EXACT)
    torch.testing.assert_close(s1[STATE_KEY]["m"]["w"], _t(1.5, 0.375), **EXACT)
    torch.testing.assert_close(s1["model"]["w"], _t(0.5, -0.75), **EXACT)
    torch.testing.assert_close(s2[STATE_KEY]["v"]["w"], _t(3.0625, 0.5625), **EXACT)
    torch.testing.assert_close(s2[STATE_KEY]["m"]["w"], _t(1.75, 0.1875), **EXACT)
    torch.testing.assert_close(s2["model"]["w"], _t(1.2, -0.625), **EXACT)


# ----- what is optimized, dtypes ------------------------------------------------------------
def test_buffers_come_from_the_aggregate_and_have_no_state():
    """Only the named (trainable) parameters are stepped; BatchNorm statistics and the int64
    counter are the aggregate's, as they are; the inputs are not modified."""
    opt = _opt("fedadam", names=("w",))
    x = {"w": _t(1.0, 2.0), "bn.running_mean": _t(0.0, 0.0), "bn.num_batches_tracked": torch.tensor(3)}
    agg = {"w": _t(1.5, 2.0), "bn.running_mean": _t(0.3, -0.1), "bn.num_batches_tracked": torch.tensor(7)}
    keep = copy.deepcopy((x, agg))
    out = opt.apply({"model": x, "c": _t(9.0)}, {"model": agg, "c": _t(4.0)})
    assert out["model"]["bn.running_mean"] is agg["bn.running_mean"]
    assert out["model"]["bn.num_batches_tracked"] is agg["bn.num_batches_tracked"]
    assert set(out[STATE_KEY]["m"]) == set(out[STATE_KEY]["v"]) == {"w"}
    assert torch.equal(out["c"], _t(4.0))  # the method's other server entries: its aggregate's
    assert not torch.equal(out["model"]["w"], agg["w"])
    assert_trees_close(keep[0], x, atol=0)
    assert_trees_close(keep[1], agg, atol=0)


def test_float32_state_float64_arithmetic_and_fedavgm_identity():
    """The state is stored in the parameters' dtype; with β = 0, η = 1 FedAvgM returns the
    aggregate itself, bit for bit (x + (x̄ - x) in float64)."""
    gen = torch.Generator().manual_seed(0)
    x = {"w": torch.randn(64, 32, generator=gen), "b": torch.randn(32, generator=gen)}
    agg = {k: v + 1e-3 * torch.randn(v.shape, generator=gen) for k, v in x.items()}
    out = _opt("fedavgm", names=("w", "b"), lr=1.0, momentum=0.0).apply({"model": x}, {"model": agg})
    assert all(torch.equal(out["model"][k], agg[k]) for k in x)
    adam = _opt("fedadam", names=("w", "b")).apply({"model": x}, {"model": agg})
    assert all(t.dtype == torch.float32 for part in adam[STATE_KEY].values() for t in part.values())
    assert all(adam["model"][k].dtype == torch.float32 for k in x)


def test_missing_or_integer_parameter_is_an_error():
    with pytest.raises(ValueError, match="'z' is not in the global model"):
        _opt("fedadam", names=("z",)).init_state({"w": _t(1.0)})
    with pytest.raises(ValueError, match="not floating point"):
        _opt("fedavgm", names=("n",)).init_state({"n": torch.tensor(1)})


# ----- config ---------------------------------------------------------------------------------
def test_defaults_are_the_documented_ones():
    """η per optimizer: its most frequent best value over the paper's six tasks (the authors'
    optimization/docs/hyperparameters.md); β1 = 0.9, β2 = 0.99 (paper Sec. 5); τ = 1e-3 (the
    authors' README); FedAvgM momentum 0.9; FedAdagrad β1 = 0 (Keras Adagrad, no momentum)."""
    assert SERVER_OPTIMIZER_DEFAULTS == {
        "fedavgm": {"lr": 1.0, "momentum": 0.9},
        "fedadagrad": {"lr": 0.1, "beta1": 0.0, "tau": 1e-3},
        "fedadam": {"lr": 0.01, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3},
        "fedyogi": {"lr": 0.01, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3},
    }
    assert TrainConfig(server_optimizer="fedyogi").server_optimizer == \
        ServerOptimizerConfig(name="fedyogi", lr=0.01, beta1=0.9, beta2=0.99, tau=1e-3)
    assert ServerOptimizerConfig(name="fedadam", tau=0.1).model_dump() == \
        {"name": "fedadam", "lr": 0.01, "beta1": 0.9, "beta2": 0.99, "tau": 0.1}
    assert ServerOptimizerConfig(name="fedavgm").model_dump() == {"name": "fedavgm", "lr": 1.0, "momentum": 0.9}


@pytest.fixture(scope="module")
def base() -> dict:
    data = yaml.safe_load((REPO / "params.yaml").read_text())
    data["methods"] = ["fedavg"]
    return data


def _error(data: dict) -> str:
    with pytest.raises(ParamsError) as e:
        validate_params(data, "test.yaml")
    return str(e.value)


@pytest.mark.parametrize("value, msg", [
    ({"name": "fedavgm", "tau": 0.1}, "train.server_optimizer: tau does not apply to fedavgm (its keys: name, lr, "
                                      "momentum)"),
    ({"name": "fedadagrad", "beta2": 0.9}, "beta2 does not apply to fedadagrad"),
    ({"name": "fedadam", "momentum": 0.9}, "momentum does not apply to fedadam"),
    ({"name": "fedadam", "epsilon": 1e-3}, "train.server_optimizer.epsilon: unknown key"),
    ({"name": "adam"}, "train.server_optimizer.name"),
    ({"lr": 0.1}, "train.server_optimizer.name: Field required"),
    ({"name": "fedadam", "lr": 0}, "train.server_optimizer.lr"),
    ({"name": "fedyogi", "beta2": 1.0}, "train.server_optimizer.beta2"),
    ({"name": "fedadagrad", "tau": 0}, "train.server_optimizer.tau"),
    ({"name": "fedavgm", "momentum": 1.0}, "train.server_optimizer.momentum"),
])
def test_bad_server_optimizer_keys_name_the_key(base, value, msg):
    data = copy.deepcopy(base)
    data["train"]["server_optimizer"] = value
    assert msg in _error(data)


def test_job_description_unchanged_without_it_and_complete_with_it(base):
    """No key in the job (hence in Snakemake's params and the checkpoint fingerprint) unless set;
    set, the job holds every resolved value, and MLflow's params (the flattened job) name them."""
    p = validate_params(base)
    part = next(iter(p.partitions))
    job = train_job(p, p.data.datasets[0], part, "fedavg", 1)
    assert "server_optimizer" not in job["train"]
    assert "server_optimizer" not in TrainConfig().model_dump()
    assert "server_optimizer" not in TrainConfig(server_optimizer=None).model_dump()
    data = copy.deepcopy(base)
    data["train"]["server_optimizer"] = {"name": "fedadam", "lr": 0.03}
    with_opt = train_job(validate_params(data), p.data.datasets[0], part, "fedavg", 1)
    assert with_opt["train"]["server_optimizer"] == {"name": "fedadam", "lr": 0.03, "beta1": 0.9, "beta2": 0.99,
                                                     "tau": 1e-3}
    assert {k: v for k, v in with_opt["train"].items() if k != "server_optimizer"} == job["train"]
    assert TrainConfig.model_validate(with_opt["train"]).server_optimizer.lr == 0.03  # medpfl train reads it back
    flat = flatten(with_opt)
    assert flat["train.server_optimizer.name"] == "fedadam" and flat["train.server_optimizer.tau"] == 1e-3


def test_variants_declare_server_optimizers(base):
    """``method_params.<variant>.train.server_optimizer``: another name starts from its own
    defaults (nothing of the study's optimizer leaks in), keys without a name merge into the
    study's, null turns it off for one method."""
    data = copy.deepcopy(base)
    data["train"]["server_optimizer"] = {"name": "fedadam", "lr": 0.05}
    data["methods"] = ["fedavg", "fedavg-fedyogi", "fedavg-m", "fedavg-lr", "fedavg-plain", "local"]
    data["method_params"] = {
        "fedavg-fedyogi": {"algorithm": "fedavg", "train": {"server_optimizer": {"name": "fedyogi"}}},
        "fedavg-m": {"algorithm": "fedavg", "train": {"server_optimizer": "fedavgm"}},
        "fedavg-lr": {"algorithm": "fedavg", "train": {"server_optimizer": {"lr": 0.5}}},
        "fedavg-plain": {"algorithm": "fedavg", "train": {"server_optimizer": None}},
        "local": {"train": {"server_optimizer": None}},
    }
    p = validate_params(data)
    dump = {m: p.method_train(m).model_dump().get("server_optimizer") for m in data["methods"]}
    assert dump["fedavg"] == {"name": "fedadam", "lr": 0.05, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3}
    assert dump["fedavg-fedyogi"] == {"name": "fedyogi", "lr": 0.01, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3}
    assert dump["fedavg-m"] == {"name": "fedavgm", "lr": 1.0, "momentum": 0.9}
    assert dump["fedavg-lr"] == {**dump["fedavg"], "lr": 0.5}
    assert dump["fedavg-plain"] is None and dump["local"] is None


@pytest.mark.parametrize("method", ["local", "fedper", "fedrep", "pfpslwc", "fedproto", "fedbn", "apple", "epfl"])
def test_methods_without_a_global_model_are_refused_naming_method_and_key(base, method):
    data = copy.deepcopy(base)
    data["methods"] = ["fedavg", method]
    data["train"]["server_optimizer"] = "fedadam"
    msg = _error(data)
    assert (f"train.server_optimizer: fedadam cannot run with method {method!r}: it has no global model"
            in msg), msg
    assert f"set method_params.{method}.train.server_optimizer: null" in msg
    data["method_params"] = {"v": {"algorithm": method, "train": {"server_optimizer": "fedyogi"}}}
    data["train"].pop("server_optimizer")
    data["methods"] = ["v"]
    assert f"method_params.v.train.server_optimizer: fedyogi cannot run with method 'v' ({method})" in _error(data)


@pytest.mark.parametrize("method", ["fedkd", "fedmic", "fedgkd"])
def test_methods_holding_copies_of_the_global_model_are_refused(base, method):
    data = copy.deepcopy(base)
    data["methods"] = [method]
    data["train"]["server_optimizer"] = "fedavgm"
    assert f"train.server_optimizer: fedavgm cannot run with method {method!r}: its " in _error(data)


def test_fedgkd_is_refused_only_while_its_teacher_buffer_is_sent(base):
    data = copy.deepcopy(base)
    data["methods"] = ["gkd1", "gkd0"]
    data["method_params"] = {"gkd1": {"algorithm": "fedgkd", "buffer_size": 1},
                             "gkd0": {"algorithm": "fedgkd", "kl_weight": 0.0}}
    data["train"]["server_optimizer"] = "fedadam"
    validate_params(data)


def test_engine_refuses_too(fed_data):
    """The engine checks the built method itself (a job written by hand, ``medpfl train --job``)."""
    train = TrainConfig(rounds=1, server_optimizer="fedadam")
    with pytest.raises(ParamsError, match="train.server_optimizer: fedadam cannot run with method 'fedper'"):
        Engine(make_algo("fedper"), fed_data, train, EvalConfig(), seed=1, executor_kind="sequential")
    assert make_server_optimizer(None, make_algo("fedper")) is None


# ----- a non-averaging aggregate: SCAFFOLD with a server learning rate ------------------------
def test_applies_on_top_of_scaffolds_server_step():
    """SCAFFOLD's aggregate is x + η_g mean(Δy) (buffers: the mean of the uploaded ones) and
    c + (m/N) mean(Δc). The server optimizer's Δ is that whole step, η_g included, and c is left to
    SCAFFOLD. mlr model (weight [2, 2], bias [2]), η_g = 0.5, two clients, uniform weights:
    mean(Δy) = weight [[2, 0], [0, -2]], bias [1, 3] -> Δ = η_g mean(Δy) = weight [[1, 0], [0, -1]],
    bias [0.5, 1.5]. FedAvgM with β = 0.5, η = 2, first step (u_{-1} = 0): u_0 = Δ,
    x_1 = x + 2Δ = weight [[3, 0], [0, -1]] (x = I), bias [1, 3]. c = 0 + (1/5) * (sum of Δc) =
    0.2 * [[1, 1], [1, 1]] on the weight."""
    algo = make_algo("scaffold", num_classes=2, model="mlr", in_channels=2, image_size=None, server_lr=0.5)
    x = {"classifier.weight": _t([1.0, 0.0], [0.0, 1.0]), "classifier.bias": _t(0.0, 0.0)}
    server = algo.init_server({k: v.clone() for k, v in x.items()}, Federation(5))
    uploads = {"delta": {"classifier.weight": torch.stack([_t([3.0, 0.0], [0.0, -1.0]), _t([1.0, 0.0], [0.0, -3.0])]),
                         "classifier.bias": torch.stack([_t(2.0, 2.0), _t(0.0, 4.0)])},
               "dc": {"classifier.weight": torch.stack([_t([0.5, 0.5], [0.5, 0.5])] * 2),
                      "classifier.bias": torch.zeros(2, 2, dtype=torch.float64)},
               "num_samples": _t(3.0, 9.0)}
    rnd = RoundInfo(round=0, rounds=1, lr=0.1, num_clients=5, seed=1, base_lr=0.1)
    aggregated = algo.aggregate(server, uploads, torch.tensor([0, 1]), rnd)
    opt = ServerOptimizer(ServerOptimizerConfig(name="fedavgm", lr=2.0, momentum=0.5), algo.forward.trainable)
    out = opt.apply(server, aggregated)
    torch.testing.assert_close(out["model"]["classifier.weight"], _t([3.0, 0.0], [0.0, -1.0]), **EXACT)
    torch.testing.assert_close(out["model"]["classifier.bias"], _t(1.0, 3.0), **EXACT)
    torch.testing.assert_close(out[STATE_KEY]["u"]["classifier.bias"], _t(0.5, 1.5), **EXACT)
    torch.testing.assert_close(out["c"]["classifier.weight"], _t([0.2, 0.2], [0.2, 0.2]), **EXACT)


# ----- in the engine ----------------------------------------------------------------------------
def _run(fed_data, method="fedavg", executor="sequential", rounds=3, server_optimizer=None, model="cnn4",
         checkpoint=None, callbacks=(), **overrides):
    algo = make_algo(method, model=model, **overrides)
    train = TrainConfig(rounds=rounds, participation=0.6, local_epochs=1, batch_size=16, checkpoint_every=1,
                        model=model, server_optimizer=server_optimizer)
    eng = Engine(algo, fed_data, train, EvalConfig(every=1), seed=1, executor_kind=executor,
                 checkpoint=checkpoint, callbacks=list(callbacks), fingerprint="test")
    return eng, eng.run()


def test_without_a_server_optimizer_the_engine_path_is_untouched(fed_data, monkeypatch):
    """``server_optimizer: null``: no optimizer is built, none is called, the server state holds
    only the method's own keys. (Records and server states of fedavg, scaffold, fedkd, fedper on
    both executors were also compared, bit for bit, with the engine before this change.)"""
    def boom(*a, **k):
        raise AssertionError("a server optimizer ran without train.server_optimizer")

    monkeypatch.setattr(ServerOptimizer, "apply", boom)
    eng, res = _run(fed_data, "scaffold", model="cnn4bn", rounds=2)
    assert eng.server_opt is None
    assert set(res.server) == {"model", "c"}


def test_fedavgm_without_momentum_at_lr_one_is_fedavg_to_the_bit(fed_data):
    _, avg = _run(fed_data, model="cnn4bn", rounds=2)
    _, m0 = _run(fed_data, model="cnn4bn", rounds=2, server_optimizer={"name": "fedavgm", "lr": 1.0, "momentum": 0.0})
    pd.testing.assert_frame_equal(avg.records, m0.records)  # losses too
    assert_trees_close(avg.server["model"], m0.server["model"], atol=0)
    assert set(m0.server) == {"model", STATE_KEY}


def test_adaptive_run_steps_the_global_model_it_scores(fed_data):
    """FedYogi changes the global model (and so every record from round 0's global views on);
    the scored global model is the stepped one; the state holds every trainable parameter."""
    _, avg = _run(fed_data, rounds=2)
    eng, yogi = _run(fed_data, rounds=2, server_optimizer="fedyogi")
    def view0(r, view):
        return r.records[(r.records["round"] == 0) & (r.records["view"] == view)]

    pd.testing.assert_frame_equal(view0(avg, "local_after_training"), view0(yogi, "local_after_training"))  # same x_0
    assert (view0(avg, "global_test")["loss"].to_numpy() != view0(yogi, "global_test")["loss"].to_numpy()).all()
    assert yogi.global_params is yogi.server["model"]
    assert set(yogi.server[STATE_KEY]["v"]) == set(eng.algo.forward.trainable)


class _Kill(Exception):
    pass


def test_killed_and_resumed_run_equals_uninterrupted(fed_data, tmp_path):
    """The optimizer state is in the checkpointed server state: a run killed after round 2 and
    resumed ends with the records, model and (m, v) of an uninterrupted one, bit for bit."""
    opt = {"name": "fedadam", "lr": 0.03}
    _, full = _run(fed_data, rounds=4, server_optimizer=opt)
    ckpt = tmp_path / "checkpoint.pt"

    def die(r, row, recs):
        if r == 2:
            raise _Kill()

    with pytest.raises(_Kill):
        _run(fed_data, rounds=4, server_optimizer=opt, checkpoint=ckpt, callbacks=[die])
    saved = torch.load(ckpt, weights_only=False)
    assert saved["next_round"] == 2 and set(saved["server"][STATE_KEY]) == {"m", "v"}
    _, resumed = _run(fed_data, rounds=4, server_optimizer=opt, checkpoint=ckpt)
    assert resumed.resumed_from == 2
    pd.testing.assert_frame_equal(full.records, resumed.records)
    assert_trees_close(full.server, resumed.server, atol=0)


def test_stacked_equals_sequential(fed_data):
    """The server step runs after the executors, on the aggregate: FedAdam on FedAvg with
    BatchNorm (buffers from the aggregate) gives the same records and, to float tolerance, the
    same model and state on both executors."""
    opt = {"name": "fedadam", "lr": 0.03}
    _, seq = _run(fed_data, model="cnn4bn", server_optimizer=opt)
    _, stk = _run(fed_data, "fedavg", "stacked", model="cnn4bn", server_optimizer=opt)
    pd.testing.assert_frame_equal(seq.records.drop(columns=["loss"]), stk.records.drop(columns=["loss"]))
    torch.testing.assert_close(torch.tensor(seq.records["loss"].to_numpy()),
                               torch.tensor(stk.records["loss"].to_numpy()), atol=1e-5, rtol=1e-5)
    assert_trees_close(seq.server, stk.server, atol=2e-5, rtol=1e-4)


def test_medpfl_train_records_the_server_optimizer_in_job_and_mlflow(tmp_path):
    """The server optimizer is part of the job description: ``job.json`` and the MLflow run's
    params (``train.server_optimizer.*``) name it with every resolved value."""
    import json

    from mlflow.tracking import MlflowClient

    from medpfl.train import run_training
    from tests.conftest import prepare_train_job

    job, uri = prepare_train_job(tmp_path, method="fedavg", study="fedopt",
                                 train={"rounds": 2, "local_epochs": 1, "batch_size": 16,
                                        "server_optimizer": {"name": "fedyogi", "tau": 0.01}})
    out = tmp_path / "run"
    run_training(job, tmp_path / "arrays.npz", tmp_path / "samples.parquet", tmp_path / "partition.parquet", out,
                 parent_file=tmp_path / "parent.json")
    expect = {"name": "fedyogi", "lr": 0.01, "beta1": 0.9, "beta2": 0.99, "tau": 0.01}
    assert json.loads((out / "job.json").read_text())["train"]["server_optimizer"] == expect
    run_id = json.loads((out / "mlflow_run.json").read_text())["run_id"]
    params = MlflowClient(uri).get_run(run_id).data.params
    assert {k: params[f"train.server_optimizer.{k}"] for k in expect} == {k: str(v) for k, v in expect.items()}
