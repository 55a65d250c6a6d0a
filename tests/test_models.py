"""The model zoo (medpfl.models): every model by its params name meets the contract (forward
shapes, features, parts), ``mlr`` and ``mlp`` have the pFedKD-WCL sizes, names and arguments are
validated with the params key in the message, and the models run through both executors with
equal results, on image and on vector data."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from torch.func import functional_call, stack_module_state, vmap

from medpfl.algorithms import REGISTRY
from medpfl.compose import validate_params
from medpfl.config import EvalConfig, ParamsError, TrainConfig, train_job
from medpfl.fl.data import FederatedData
from medpfl.fl.engine import Engine
from medpfl.fl.functional import make_forward, model_state, template_on
from medpfl.models import MODEL_NAMES, ZOO, build_model, resolve_model_args
from tests.conftest import assert_trees_close, make_algo

VECTOR_D = 60  # Synthetic(alpha, beta)'s feature dimension
FLAT_MODELS = [n for n in MODEL_NAMES if ZOO[n].input == "any"]
#: the models that take images (and the flat ones, which take anything float); the sequence models
#: (token ids, waveforms, time series) have their own tests (tests/test_hf_models.py)
IMAGE_MODELS = [n for n in MODEL_NAMES if ZOO[n].input in ("image", "any")]


def _n_params(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


# ----------------------------------------------------------------------------- the zoo's contract


def test_zoo_holds_the_models():
    assert {"cnn4", "cnn4bn", "mlr", "mlp"} <= set(MODEL_NAMES)
    assert {"mlr", "mlp"} <= set(FLAT_MODELS)


@pytest.mark.parametrize("name", IMAGE_MODELS)
def test_every_model_meets_the_contract_on_images(name):
    """forward(x, mask=None, with_features=False): logits [B, C]; (z, logits) with features; the
    head applied to z gives the logits; head_name names the classifier; parts cover the state."""
    torch.manual_seed(0)
    m = build_model(name, 3, 4, 28, ZOO[name].tiny_args)
    x = torch.randn(5, 3, 28, 28)
    m.train(False)
    logits = m(x)
    assert logits.shape == (5, 4)
    z, logits2 = m(x, mask=torch.ones(5, dtype=torch.bool), with_features=True)
    torch.testing.assert_close(logits2, logits)
    f = make_forward(m)
    assert z.shape == (5, f.feature_dim)
    state = model_state(m)
    torch.testing.assert_close(f.head(state, z), logits)
    assert set(f.parts["head"]) == {k for k in state if k.startswith(m.head_name + ".")} != set()
    assert set(f.parts["head"]) | set(f.parts["body"]) == set(state)


@pytest.mark.parametrize("name", FLAT_MODELS)
def test_flat_models_take_images_and_vectors(name):
    torch.manual_seed(0)
    img = build_model(name, 1, 10, 28)
    assert img(torch.randn(7, 1, 28, 28)).shape == (7, 10)
    vec = build_model(name, VECTOR_D, 10, None)
    assert vec(torch.randn(7, VECTOR_D)).shape == (7, 10)
    z, logits = vec(torch.randn(7, VECTOR_D), with_features=True)
    assert logits.shape == (7, 10) and z.shape == (7, make_forward(vec).feature_dim)
    # flattening: an image and its flattened vector give the same logits on equal weights
    x = torch.randn(3, 1, 28, 28)
    flat = build_model(name, 784, 10, None)
    flat.load_state_dict(img.state_dict())
    torch.testing.assert_close(flat(x.flatten(1)), img(x))


@pytest.mark.parametrize("name", FLAT_MODELS)
def test_flat_models_run_under_vmap(name):
    """The stacked executor's use: one forward per client over stacked parameters."""
    torch.manual_seed(0)
    models = [build_model(name, VECTOR_D, 10, None) for _ in range(3)]
    params, _ = stack_module_state(models)
    x = torch.randn(3, 5, VECTOR_D)
    tmpl = build_model(name, VECTOR_D, 10, None).to("meta")
    out = vmap(lambda p, xb: functional_call(tmpl, p, (xb,)))(params, x)
    for k, m in enumerate(models):
        torch.testing.assert_close(out[k], m(x[k]))


def test_image_models_refuse_vector_data_by_name():
    for name in sorted(set(IMAGE_MODELS) - set(FLAT_MODELS)):
        with pytest.raises(ValueError, match=rf"train\.model={name} needs image samples .*\[60\].*mlr or mlp"):
            build_model(name, VECTOR_D, 10, None)


# ----------------------------------------------------------------------------- mlr and mlp


def test_parameter_counts():
    assert _n_params(build_model("mlr", 1, 10, 28)) == 784 * 10 + 10 == 7850
    assert _n_params(build_model("mlp", 1, 10, 28)) == 784 * 128 + 128 + 128 * 10 + 10 == 101770
    assert _n_params(build_model("mlr", VECTOR_D, 10, None)) == 60 * 10 + 10
    assert _n_params(build_model("mlp", VECTOR_D, 10, None, {"hidden": 20})) == 60 * 20 + 20 + 20 * 10 + 10


def test_layers_and_pytorch_default_init():
    torch.manual_seed(3)
    m = build_model("mlp", 1, 10, 28, {"hidden": 20})
    torch.manual_seed(3)
    ref = torch.nn.Sequential(torch.nn.Linear(784, 20), torch.nn.ReLU(), torch.nn.Linear(20, 10))
    torch.testing.assert_close(m.fc1.weight, ref[0].weight, atol=0, rtol=0)
    torch.testing.assert_close(m.classifier.bias, ref[2].bias, atol=0, rtol=0)
    x = torch.randn(4, 1, 28, 28)
    torch.testing.assert_close(m(x), ref(x.flatten(1)))
    torch.manual_seed(3)
    r = build_model("mlr", VECTOR_D, 10, None)
    torch.manual_seed(3)
    lin = torch.nn.Linear(VECTOR_D, 10)
    x = torch.randn(4, VECTOR_D)
    torch.testing.assert_close(r(x), lin(x))


def test_parts_mlp_body_is_first_layer_head_last():
    f = make_forward(build_model("mlp", 1, 10, 28).to("meta"))
    assert f.parts["body"] == ("fc1.weight", "fc1.bias")
    assert f.parts["head"] == ("classifier.weight", "classifier.bias")
    assert f.feature_dim == 128


def test_parts_mlr_is_all_head_and_its_body_fails_clearly():
    f = make_forward(build_model("mlr", 1, 10, 28).to("meta"))
    assert f.parts["head"] == ("classifier.weight", "classifier.bias") and f.parts["body"] == ()
    assert f.feature_dim == 784  # its features: the flattened input
    with pytest.raises(ValueError, match=r"train\.model=mlr: the model's 'body' part is empty"):
        f.part_shapes("body")
    with pytest.raises(ValueError, match=r"train\.model=mlr: no model part 'nope'"):
        f.part_shapes("nope")


# ----------------------------------------------------------------------------- simplecnn


def test_simplecnn_layers_sizes_and_parts():
    """LeNet-5 shaped (PFPS-LWC spec B.1): 62,006 parameters on CIFAR-10 (3x32x32, 10 classes),
    the classic count; 16x4x4 flattened features at 28 px; 84-d features; BatchNorm adds 2x(6+16)
    parameters and is the ``bn`` part (parameters and buffers), empty without it."""
    plain = build_model("simplecnn", 3, 10, 32)
    assert _n_params(plain) == 62006
    assert build_model("simplecnn", 3, 8, 28).fc1.in_features == 16 * 4 * 4
    f = make_forward(plain)
    assert f.feature_dim == 84 and f.parts["bn"] == ()
    assert set(f.parts["head"]) == {"classifier.weight", "classifier.bias"}
    bn = build_model("simplecnn", 3, 10, 32, model_args={"batch_norm": True})
    assert _n_params(bn) == 62006 + 2 * (6 + 16)
    fb = make_forward(bn)
    assert set(fb.parts["bn"]) == {f"bn{i}.{n}" for i in (1, 2) for n in
                                   ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")}
    assert set(fb.parts["bn"]) <= set(fb.parts["body"])
    with pytest.raises(ValueError, match="at least 14 px"):
        build_model("simplecnn", 3, 10, 12)
    with pytest.raises(ValueError, match=r"train\.model_args: .*batch_norm"):
        build_model("simplecnn", 3, 10, 32, model_args={"batch_norm": "maybe"})


def test_simplecnn_bn_masked_statistics_ignore_padding():
    """Training-mode BatchNorm statistics over the real samples only: padded rows change nothing."""
    torch.manual_seed(0)
    m = build_model("simplecnn", 3, 4, 28, model_args={"batch_norm": True})
    x = torch.randn(6, 3, 28, 28)
    mask = torch.tensor([True] * 4 + [False] * 2)
    out_masked = m(torch.cat([x[:4], 100 * torch.randn(2, 3, 28, 28)]), mask=mask)[:4]
    torch.manual_seed(0)
    m3 = build_model("simplecnn", 3, 4, 28, model_args={"batch_norm": True})
    torch.testing.assert_close(out_masked, m3(x[:4]))


@pytest.mark.parametrize("batch_norm", [False, True])
def test_simplecnn_fedavg_stacked_equals_sequential(fed_data, batch_norm):
    args = {"batch_norm": batch_norm}
    seq = _run(fed_data, "fedavg", "sequential", "simplecnn", args)
    stk = _run(fed_data, "fedavg", "stacked", "simplecnn", args)
    _assert_equal_runs(seq, stk)


def test_parts_bn_is_every_batchnorm_entry_found_by_type():
    """cnn4bn's ``bn`` part (FedBN's local layers) is every parameter and buffer of its BatchNorm
    layers, found by module type; cnn4's is empty (a method needing it then stops, naming the part)."""
    m = build_model("cnn4bn", 3, 4, 28)
    f = make_forward(m.to("meta"))
    bn_modules = [n for n, mod in m.named_modules() if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm)]
    assert bn_modules == ["bn1", "bn2"]
    expected = [f"{b}.{k}" for b in bn_modules for k in ("weight", "bias", "running_mean", "running_var",
                                                          "num_batches_tracked")]
    assert list(f.parts["bn"]) == expected
    assert set(f.parts["bn"]) <= set(f.parts["body"]) and set(f.buffers) == {k for k in expected if "running" in k
                                                                             or "num_batches" in k}
    g = make_forward(build_model("cnn4", 3, 4, 28).to("meta"))
    assert g.parts["bn"] == ()
    with pytest.raises(ValueError, match=r"train\.model=cnn4: the model's 'bn' part is empty"):
        g.part_names("bn")



def test_batchnorm_state_names_helper():
    """The one helper behind every model's ``bn`` part: state_dict keys of the BatchNorm layers in
    module order (parameters, then buffers), nested or top-level, what a layer lacks left out."""
    from medpfl.models.cnn import MaskedBatchNorm2d, batchnorm_state_names

    nn = torch.nn
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Sequential(MaskedBatchNorm2d(4), nn.ReLU()),
                      nn.BatchNorm1d(4, affine=False), nn.BatchNorm2d(4, track_running_stats=False), nn.Linear(4, 2))
    names = batchnorm_state_names(m)
    assert names == ("1.0.weight", "1.0.bias", "1.0.running_mean", "1.0.running_var", "1.0.num_batches_tracked",
                     "2.running_mean", "2.running_var", "2.num_batches_tracked", "3.weight", "3.bias")
    assert set(names) <= set(m.state_dict()) | {n for n, _ in m.named_parameters()}
    assert batchnorm_state_names(nn.BatchNorm2d(2)) == ("weight", "bias", "running_mean", "running_var",
                                                       "num_batches_tracked")
    assert batchnorm_state_names(build_model("cnn4", 3, 4, 28)) == ()


# ----------------------------------------------------------------------------- names and arguments


def test_model_args_defaults_and_validation():
    assert resolve_model_args("mlp", None) == {"hidden": 128}  # the paper's width [P]
    assert resolve_model_args("mlp", {"hidden": 20}) == {"hidden": 20}  # the official Synthetic code [C]
    assert resolve_model_args("mlr", {}) == {} and resolve_model_args("cnn4", None) == {}
    assert build_model("mlp", 1, 10, 28, {"hidden": 20}).fc1.out_features == 20


@pytest.mark.parametrize("model,args,match", [
    ("resnet9", None, r"train\.model: unknown model 'resnet9'; known: cnn4, cnn4bn, simplecnn, .*mlr, mlp"),
    ("mlp", {"hiden": 20}, r"train\.model_args: unknown argument 'hiden' for train\.model=mlp "
                           r"\(its arguments: hidden\)"),
    ("mlr", {"hidden": 20}, r"train\.model_args: unknown argument 'hidden' for train\.model=mlr "
                            r"\(it takes no arguments\)"),
    ("mlp", {"hidden": 0}, r"train\.model_args: hidden: .*greater than or equal to 1 \(train\.model=mlp\)"),
    ("mlp", {"hidden": "wide"}, r"train\.model_args: hidden: .*integer"),
])
def test_bad_model_or_args_name_the_params_key(model, args, match):
    with pytest.raises(ValueError, match=match):
        build_model(model, 1, 10, 28, args)
    params = {"train": {"model": model, **({"model_args": args} if args is not None else {})}}
    with pytest.raises(ParamsError, match=match.replace(r"train\.model: ", r"- train\.model: ")):
        validate_params(params, "test.yaml")


def test_model_args_not_a_mapping():
    with pytest.raises(ParamsError, match=r"train\.model_args"):
        validate_params({"train": {"model": "mlp", "model_args": 20}})
    with pytest.raises(ValueError, match=r"train\.model_args: must be a mapping"):
        build_model("mlp", 1, 10, 28, 20)


def test_job_description_carries_resolved_args_and_none_for_models_without():
    """cnn4's job (Snakemake params, checkpoint fingerprint) is unchanged by model_args; mlp's
    records the width it ran with, defaults filled in; the job validates back to the same."""
    base = validate_params({})
    job = train_job(base, "bloodmnist", "dir0.1", "fedavg", 1)
    assert "model_args" not in job["train"] and job["train"]["model"] == "cnn4"
    p = validate_params({"train": {"model": "mlp"}})
    job = train_job(p, "bloodmnist", "dir0.1", "fedavg", 1)
    assert job["train"]["model_args"] == {"hidden": 128}
    assert TrainConfig.model_validate(job["train"]) == p.train
    assert validate_params({"train": {"model": "mlp", "model_args": None}}).train.model_args == {"hidden": 128}


# ----------------------------------------------------------------------------- through the engine


@pytest.fixture(scope="module")
def vector_data() -> FederatedData:
    """5 clients of 60-d vector samples (uint8, normalised on the fly like images), 4 classes
    from a random linear map, on the CPU."""
    g = np.random.default_rng(0)
    n, k = 300, 5
    x = g.integers(0, 256, size=(n, VECTOR_D), dtype=np.uint8)
    y = np.argmax((x / 127.5 - 1) @ g.normal(size=(VECTOR_D, 4)), axis=1).astype(np.int64)
    perm = g.permutation(n)
    gtest, pool = perm[:60], perm[60:]
    sizes = [30, 40, 50, 55, 65]
    cuts = np.split(pool, np.cumsum(sizes)[:-1])
    train = [torch.as_tensor(c[: int(0.8 * len(c))]) for c in cuts]
    test = [torch.as_tensor(c[int(0.8 * len(c)):]) for c in cuts]
    hist = np.stack([np.bincount(y[t.numpy()], minlength=4) for t in train])
    return FederatedData(images=torch.as_tensor(x), labels=torch.as_tensor(y), num_classes=4,
                         global_test=torch.as_tensor(gtest), client_train=train, client_test=test,
                         train_hist=torch.as_tensor(hist, dtype=torch.float32), device=torch.device("cpu"))


def _run(data: FederatedData, method: str, executor: str, model: str, model_args=None, rounds: int = 2):
    algo = make_algo(method, num_classes=data.num_classes, model=model, model_args=model_args,
                     in_channels=data.in_channels, image_size=data.image_size)
    train = TrainConfig(rounds=rounds, participation=0.6, local_epochs=1, batch_size=16, checkpoint_every=0,
                        model=model, model_args=model_args)
    return Engine(algo, data, train, EvalConfig(), seed=1, executor_kind=executor, fingerprint="models").run()


def _assert_equal_runs(seq, stk, atol=1e-5):
    pd.testing.assert_frame_equal(seq.records.drop(columns=["loss"]).reset_index(drop=True),
                                  stk.records.drop(columns=["loss"]).reset_index(drop=True))
    np.testing.assert_allclose(seq.records["loss"], stk.records["loss"], atol=atol)
    assert seq.rounds["bytes_up"].tolist() == stk.rounds["bytes_up"].tolist()
    assert_trees_close(seq.server, stk.server, atol=atol)
    assert_trees_close(seq.client_states, stk.client_states, atol=atol)


@pytest.mark.parametrize("model,model_args", [("mlr", None), ("mlp", None), ("mlp", {"hidden": 20})])
@pytest.mark.parametrize("kind", ["image", "vector"])
def test_fedavg_stacked_equals_sequential(fed_data, vector_data, kind, model, model_args):
    data = fed_data if kind == "image" else vector_data
    seq = _run(data, "fedavg", "sequential", model, model_args)
    stk = _run(data, "fedavg", "stacked", model, model_args)
    _assert_equal_runs(seq, stk)
    g = seq.server["model"]
    d_in = 3 * 28 * 28 if kind == "image" else VECTOR_D
    hidden = (model_args or {}).get("hidden", 128)
    want = {"classifier.weight": (4, d_in)} if model == "mlr" else {"fc1.weight": (hidden, d_in),
                                                                    "classifier.weight": (4, hidden)}
    assert {k: tuple(g[k].shape) for k in want} == want
    assert not torch.equal(g["classifier.weight"], _run(data, "fedavg", "sequential", model, model_args,
                                                        rounds=1).server["model"]["classifier.weight"])


SPLITTING = ("fedper", "fedbabu", "fedas", "fedrep", "pfpslwc")  # share or train the body apart from the head


def required_parts(method: str) -> tuple[str, ...]:
    """The model parts a method cannot run without: its ``requires_parts`` (FedBN: ``bn``,
    FedProto: ``body``), and ``body`` for the methods that split the model (:data:`SPLITTING`)."""
    need = REGISTRY[method].requires_parts
    return need + (("body",) if method in SPLITTING and "body" not in need else ())


def _runs_or_names_the_missing_part(data, method: str, model: str, model_args=None, check_stacked=False):
    """The method runs on the model when the model has every part it needs (on both executors
    alike where it is stackable, with ``check_stacked``); else it stops at once with an error that
    names ``train.model`` and the missing part."""
    parts = make_forward(template_on(build_model(model, 3, 4, 28, model_args), "cpu")).parts
    missing = [p for p in required_parts(method) if not parts.get(p)]
    try:
        seq = _run(data, method, "sequential", model, model_args, rounds=1)
    except ValueError as e:
        assert missing, f"{method} failed on {model}, which has every part it needs: {e}"
        assert "train.model" in str(e) and any(f"'{p}'" in str(e) for p in missing), str(e)
        return
    assert not missing, f"{method} ran on {model}, which lacks its part(s) {missing}"
    if check_stacked and REGISTRY[method].not_stackable_because is None:
        _assert_equal_runs(seq, _run(data, method, "stacked", model, model_args, rounds=1))


@pytest.mark.parametrize("method", sorted(REGISTRY))
def test_every_method_runs_on_mlp_and_on_mlr_or_names_the_missing_part(fed_data, method):
    """On mlp every method runs (on both executors alike where it is stackable), unless it needs a
    part mlp does not have (FedBN: BatchNorm); on mlr (all head) a method runs, or fails at once
    naming the missing part and train.model; those that share or train the body apart from the
    head must fail so on mlr (rather than, e.g., share nothing), as must FedBN on both."""
    _runs_or_names_the_missing_part(fed_data, method, "mlp", {"hidden": 16}, check_stacked=True)
    _runs_or_names_the_missing_part(fed_data, method, "mlr")


@pytest.mark.parametrize("method", sorted(REGISTRY))
def test_every_method_runs_on_a_batchnorm_model(fed_data, method):
    """Every method trains simplecnn with BatchNorm (the PFPS-LWC studies' model), on both
    executors alike where it is stackable; methods that differentiate a training-mode forward
    inside their objective (pFedMe's inner solution, Per-FedAvg's inner step) must let BatchNorm
    update its running statistics there (``grad_of_trainable``) instead of failing."""
    args = {"batch_norm": True}
    if REGISTRY[method].requires_parts and not all(
            make_forward(template_on(build_model("simplecnn", 3, 4, 28, args), "cpu")).parts.get(p)
            for p in REGISTRY[method].requires_parts):  # EPFL: LoRA parts, which no CNN has
        _runs_or_names_the_missing_part(fed_data, method, "simplecnn", args)
        return
    seq = _run(fed_data, method, "sequential", "simplecnn", args, rounds=1)
    if REGISTRY[method].not_stackable_because is None:
        # float order differs between the executors (and with the thread count); pFedMe's nested
        # inner steps through masked BatchNorm amplify it to ~1e-4 on near-zero entries
        _assert_equal_runs(seq, _run(fed_data, method, "stacked", "simplecnn", args, rounds=1), atol=1e-3)
