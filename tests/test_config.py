"""Tests of medpfl.config: the params schema (strict keys, value checks with the dotted key in the
message), YAML overlays, method variants, train_job, and the algorithm registry's defaults."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import yaml

from medpfl.algorithms import REGISTRY, resolve_method
from medpfl.algorithms.fedkper import FedKPer
from medpfl.compose import load_params, validate_params
from medpfl.config import Params, ParamsError, deep_merge, read_yaml, train_job
from medpfl.data.sources import dataset_job

REPO = Path(__file__).resolve().parents[1]
PARAMS = REPO / "params.yaml"


@pytest.fixture(scope="module")
def base() -> dict:
    return yaml.safe_load(PARAMS.read_text())


def _with(base: dict, path: str, value) -> dict:
    """A deep copy of ``base`` with the dotted ``path`` set to ``value``."""
    d = copy.deepcopy(base)
    node = d
    *parents, last = path.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value
    return d


def _partitions(base: dict, parts: dict[str, dict]) -> dict:
    """``base`` with its partitions replaced by ``parts`` ({name: keys}), written in the same
    form params.yaml uses (a mapping, or a list of entries with a ``name`` key)."""
    d = copy.deepcopy(base)
    if isinstance(base.get("partitions"), list):
        d["partitions"] = [{"name": n, **copy.deepcopy(v)} for n, v in parts.items()]
    else:
        d["partitions"] = copy.deepcopy(parts)
    return d


def _error(data: dict, source: str = "test.yaml") -> str:
    with pytest.raises(ParamsError) as e:
        validate_params(data, source)
    assert str(e.value).startswith(source)
    return str(e.value)


# ----------------------------------------------------------------------------- the repository's file


def test_repository_params_validate(base):
    p = load_params(PARAMS)
    assert isinstance(p, Params)
    assert p.methods == base["methods"]
    assert p.seeds == base["seeds"]
    assert p.train.rounds == base["train"]["rounds"]
    assert p.data.datasets == base["data"]["datasets"]
    assert len(p.partitions) >= 1
    for m in p.methods:
        cls, cfg = p.method_config(m)
        assert cls is REGISTRY[m]


def test_defaults_are_valid_and_empty_file_is_defaults(tmp_path):
    assert validate_params({}) == Params()
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_params(empty) == Params()


# ----------------------------------------------------------------------------- unknown keys


@pytest.mark.parametrize("path", ["studdy", "train.particpation", "train.optimizer.lrr", "train.sampling.shceme",
                                  "eval.evry", "data.custom_sets", "mlflow.uri"])
def test_unknown_keys_name_the_dotted_key(base, path):
    msg = _error(_with(base, path, 1))
    assert f"{path}: unknown key" in msg


def test_unknown_partition_keys_name_the_dotted_key(base):
    msg = _error(_partitions(base, {"dir0.1": {"alpha": 0.1, "alhpa": 1}}))
    assert "partitions.dir0.1.alhpa: unknown key" in msg
    msg = _error(_partitions(base, {"dir0.1": {"alpha": 0.1, "local_test": {"fraction": 0.2, "frac": 1}}}))
    assert "partitions.dir0.1.local_test.frac: unknown key" in msg


# ----------------------------------------------------------------------------- values


@pytest.mark.parametrize("path,value,key", [
    ("train.participation", 0, "train.participation"),
    ("train.participation", 1.5, "train.participation"),
    ("train.rounds", 0, "train.rounds"),
    ("train.batch_size", 0, "train.batch_size"),
    ("train.local_epochs", 0, "train.local_epochs"),
    ("train.optimizer.lr", 0.0, "train.optimizer.lr"),
    ("train.optimizer.momentum", 1.0, "train.optimizer.momentum"),
    ("train.device", "gpu", "train.device"),
    ("train.device", "cuda:x", "train.device"),
    ("train.executor", "parallel", "train.executor"),
    ("train.model", "resnet", "train.model: unknown model 'resnet'"),
    ("train.model_args", {"hidden": 20}, "train.model_args: unknown argument 'hidden' for train.model=cnn4"),
    ("train.model_args", [20], "train.model_args"),
    ("eval.every", 0, "eval.every"),
    ("seeds", [-1], "seeds"),
    ("seeds", [1, 2, 1], "seeds"),
    ("seeds", [], "seeds"),
    ("methods", ["fedavg", "fedavg"], "methods"),
    ("methods", ["fedavgg"], "methods"),
    ("methods", [], "methods"),
    ("study", "my study", "study"),
    ("data.datasets", ["bloodmnist_32"], "bloodmnist_32"),
    ("data.datasets", ["nosuchmnist"], "nosuchmnist"),
    ("data.datasets", ["bloodmnist", "bloodmnist"], "duplicate"),
])
def test_bad_values_name_the_key(base, path, value, key):
    msg = _error(_with(base, path, value))
    assert key in msg


@pytest.mark.parametrize("alpha", [0, -0.1])
def test_nonpositive_alpha(base, alpha):
    msg = _error(_partitions(base, {"dir0.1": {"alpha": alpha}}))
    # the partition's dotted name and the field are both named
    assert "partitions.dir0.1.alpha: must be > 0" in msg


def test_pathological_needs_classes_per_client(base):
    msg = _error(_partitions(base, {"path2": {"scheme": "pathological", "num_clients": 10}}))
    assert "partitions.path2" in msg and "classes_per_client" in msg
    ok = validate_params(_partitions(base, {"path2": {"scheme": "pathological", "classes_per_client": 2}}))
    assert ok.partitions["path2"].classes_per_client == 2


def test_iid_needs_no_alpha(base):
    p = validate_params(_partitions(base, {"iid": {"scheme": "iid", "alpha": None}}))
    assert p.partitions["iid"].alpha is None
    msg = _error(_partitions(base, {"dir": {"scheme": "dirichlet", "alpha": None}}))
    assert "partitions.dir" in msg and "alpha" in msg


def test_bad_method_params(base):
    msg = _error(_with(base, "method_params", {"fedkper": {"lambda_capp": 3}}))
    assert "method_params.fedkper.lambda_capp" in msg
    msg = _error(_with(base, "method_params", {"fedkper": {"tau": -1}}))
    assert "method_params.fedkper.tau" in msg
    msg = _error(_with(base, "method_params", {"fedprox": {"mu": "strong"}}))
    assert "method_params.fedprox.mu" in msg


def test_variant_with_unknown_algorithm(base):
    data = _with(base, "method_params", {"myvar": {"algorithm": "fedkpr"}})
    data["methods"] = ["fedavg", "myvar"]
    msg = _error(data)
    assert "method_params.myvar.algorithm" in msg and "fedkpr" in msg
    # also when the variant is declared but not listed in methods
    msg = _error(_with(base, "method_params", {"myvar": {"algorithm": "fedkpr"}}))
    assert "method_params.myvar.algorithm" in msg


def test_bad_partition_name(base):
    msg = _error(_partitions(base, {"dir 0.1": {"alpha": 0.1}}))
    assert "dir 0.1" in msg


# ----------------------------------------------------------------------------- files and overlays


def test_deep_merge_later_wins_and_does_not_mutate():
    a = {"train": {"rounds": 30, "optimizer": {"lr": 0.01, "momentum": 0.9}}, "seeds": [1, 2], "study": "a"}
    b = {"train": {"optimizer": {"lr": 0.1}}, "seeds": [3], "new": {"x": 1}}
    a0 = copy.deepcopy(a)
    m = deep_merge(a, b)
    assert m == {"train": {"rounds": 30, "optimizer": {"lr": 0.1, "momentum": 0.9}}, "seeds": [3], "study": "a",
                 "new": {"x": 1}}
    assert a == a0
    # a scalar replaces a mapping and vice versa
    assert deep_merge({"x": {"y": 1}}, {"x": 2}) == {"x": 2}
    assert deep_merge({"x": 2}, {"x": {"y": 1}}) == {"x": {"y": 1}}


def test_overlays_merge_with_later_files_winning(tmp_path, base):
    ov1 = tmp_path / "ov1.yaml"
    ov1.write_text("study: quick\ntrain:\n  rounds: 3\n  optimizer: {lr: 0.05}\nseeds: [1, 2]\n")
    ov2 = tmp_path / "ov2.yaml"
    ov2.write_text("train:\n  rounds: 5\nmethods: [fedavg, fedprox]\n")
    p = load_params(PARAMS, [ov1, ov2])
    assert p.study == "quick"
    assert p.train.rounds == 5  # ov2 wins over ov1
    assert p.train.optimizer.lr == 0.05  # from ov1
    assert p.train.optimizer.momentum == base["train"]["optimizer"]["momentum"]  # kept from params.yaml
    assert p.train.batch_size == base["train"]["batch_size"]  # kept from params.yaml
    assert p.seeds == [1, 2]
    assert p.methods == ["fedavg", "fedprox"]
    assert p.partitions == load_params(PARAMS).partitions


def test_overlay_errors_name_all_files_and_the_key(tmp_path):
    ov = tmp_path / "bad.yaml"
    ov.write_text("train:\n  optimizer:\n    lrr: 0.1\n")
    with pytest.raises(ParamsError) as e:
        load_params(PARAMS, [ov])
    msg = str(e.value)
    assert str(PARAMS) in msg and str(ov) in msg and "train.optimizer.lrr" in msg


def test_read_yaml_errors(tmp_path):
    with pytest.raises(ParamsError, match="parameter file not found"):
        read_yaml(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ParamsError, match=r"bad\.yaml: not valid YAML"):
        read_yaml(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- a\n- b\n")
    with pytest.raises(ParamsError, match=r"list\.yaml: expected a mapping at the top level, got list"):
        read_yaml(lst)


# ----------------------------------------------------------------------------- methods and jobs


def test_method_variant_resolves_to_fedkper_without_clipping(base):
    data = _with(base, "method_params", {"fedkper_noclip": {"algorithm": "fedkper", "clip_grad_norm": None}})
    data["methods"] = ["fedkper", "fedkper_noclip"]
    p = validate_params(data)
    cls, cfg = p.method_config("fedkper_noclip")
    assert cls is FedKPer and cfg.clip_grad_norm is None
    cls, cfg = p.method_config("fedkper")
    assert cls is FedKPer and cfg.clip_grad_norm == 5.0  # the paper's max-norm 5
    # overriding a key of the registered name itself
    cls, cfg = resolve_method("fedkper", {"fedkper": {"score_eps": 1e-6}})
    assert cfg.score_eps == 1e-6 and cfg.clip_grad_norm == 5.0


def test_train_job_is_json_ready_with_resolved_params(base):
    data = _with(base, "method_params", {"fedkper_noclip": {"algorithm": "fedkper", "clip_grad_norm": None}})
    data["methods"] = ["fedavg", "fedkper_noclip"]
    p = validate_params(data)
    part = next(iter(p.partitions))
    job = train_job(p, "bloodmnist", part, "fedkper_noclip", 2)
    round_trip = json.loads(json.dumps(job))
    assert round_trip == job
    assert job["method"] == "fedkper_noclip" and job["algorithm"] == "fedkper"
    assert job["method_params"]["clip_grad_norm"] is None
    assert job["method_params"]["lambda_cap"] == 10.0
    assert job["seed"] == 2 and job["dataset"] == "bloodmnist" and job["partition"] == part
    assert job["num_clients"] == p.partitions[part].num_clients
    assert job["train"] == p.train.model_dump() and job["train"]["rounds"] == base["train"]["rounds"]
    assert job["eval"] == p.eval.model_dump()
    plain = train_job(p, "bloodmnist", part, "fedkper", 1)
    assert plain["method_params"]["clip_grad_norm"] == 5.0
    with pytest.raises(ParamsError, match="no partition named 'nope'"):
        train_job(p, "bloodmnist", "nope", "fedavg", 1)


def test_dataset_job_carries_custom_entries(base):
    data = copy.deepcopy(base)
    data["data"] = {"datasets": ["bloodmnist", "synth"],
                    "custom": {"synth": {"path": "x.npz", "md5": "0" * 32, "n_channels": 3, "num_classes": 4}}}
    p = validate_params(data)
    assert dataset_job(p, "bloodmnist") == {"dataset": "bloodmnist", "custom": {}}
    job = dataset_job(p, "synth")
    assert job["custom"]["synth"]["md5"] == "0" * 32
    json.dumps(job)
    data["data"]["custom"]["synth"]["md5"] = "XYZ"
    assert "data.custom.synth.md5" in _error(data)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_registered_algorithms_cite_a_paper_and_have_explicit_defaults(name):
    cls = REGISTRY[name]
    assert cls.name == name
    assert isinstance(cls.paper, str) and cls.paper.strip()
    cfg = cls.Config()  # every field has a default
    assert all(not f.is_required() for f in cls.Config.model_fields.values())
    # strict: unknown keys are rejected
    with pytest.raises(ParamsError, match=f"method_params.{name}.no_such_key"):
        resolve_method(name, {name: {"no_such_key": 1}})
    assert resolve_method(name)[1] == cfg


def test_at_least_one_partition(base):
    assert "at least one partition is required" in _error(_partitions(base, {}))


def test_partitions_restricted_to_datasets(base):
    d = _with(base, "data.datasets", ["bloodmnist", "bloodmnist_64"])
    d["partitions"] = [{"name": "k20", "datasets": ["bloodmnist"], "num_clients": 20},
                       {"name": "k50", "datasets": ["bloodmnist_64", "organsmnist"], "num_clients": 50},
                       {"name": "all", "num_clients": 5}]
    p = validate_params(d)
    assert p.dataset_partitions() == [("bloodmnist", "k20"), ("bloodmnist", "all"), ("bloodmnist_64", "k50"),
                                      ("bloodmnist_64", "all")]
    train_job(p, "bloodmnist_64", "k50", "fedavg", 1)
    with pytest.raises(ParamsError, match="partitions.k20.datasets: does not include 'bloodmnist_64'"):
        train_job(p, "bloodmnist_64", "k20", "fedavg", 1)


def test_partition_naming_an_unknown_dataset_or_none_that_applies(base):
    d = copy.deepcopy(base)
    d["partitions"] = [{"name": "k20", "datasets": ["bloodmnsit"]}]
    assert "partitions.k20.datasets" in _error(d) and "bloodmnsit" in _error(d)
    d["partitions"] = [{"name": "k20", "datasets": ["organsmnist"]}]  # a real data set this study does not run
    assert "no partition applies" in _error(d)


def test_table1_study_overlays_resolve():
    full = load_params(PARAMS, [REPO / "config" / "fedkper-table1.yaml"])
    # the paper's 12 rows, then the other reading of FedBABU's local accuracy (not a paper row)
    assert len(full.methods) == 13 and full.methods[-1] == "fedbabu-pervisit"
    assert full.seeds == [1, 2, 3] and full.train.rounds == 100
    assert full.method_config("fedbabu")[1].personalization == "final"
    assert full.method_config("fedbabu-pervisit")[1].personalization == "per_visit"
    assert full.method_config("fedbabu-pervisit")[1].finetune_epochs == full.method_config("fedbabu")[1].finetune_epochs
    assert {d: full.partitions[p].num_clients for d, p in full.dataset_partitions()} == {
        "bloodmnist": 20, "organsmnist": 50, "organcmnist": 30}  # paper Sec. 4.1
    cpu = load_params(PARAMS, [REPO / "config" / "fedkper-table1.yaml", REPO / "config" / "fedkper-table1-cpu.yaml"])
    assert cpu.dataset_partitions() == [("bloodmnist", "fedkper-dir0.1")] and cpu.seeds == [1, 2, 3]
    assert cpu.report.paper_table == "config/papers/fedkper-table1.yaml"


#: The client schedule every study in config/ was run with (its authors' or the code's): none may
#: take the default study's seed_round from params.yaml by leaving train.sampling out.
STUDY_SCHEMES = {"fedkper": "round_seeded", "fhbench": "round_seeded", "fedmic": "stream", "pfedkd": "stream",
                 "pfpslwc": "stream"}


def _overlay_chain(path: Path) -> list[Path]:
    """The overlays a study file's header runs it with (``--configfile A B``), else the file alone."""
    for line in path.read_text().splitlines():
        m = re.search(r"--configfile ((?:config/\S+\.yaml ?)+)", line)
        if m and path.name in m.group(1):
            return [REPO / f for f in m.group(1).split()]
    return [path]


def test_default_study_samples_clients_per_seed():
    assert load_params(PARAMS).train.sampling.scheme == "seed_round"
    assert validate_params({}).train.sampling.scheme == "round_seeded"  # the key's default is unchanged


@pytest.mark.parametrize("path", sorted((REPO / "config").glob("*.yaml")), ids=lambda p: p.name)
def test_paper_studies_keep_their_client_schedule(path):
    p = load_params(PARAMS, _overlay_chain(path))
    family = path.name.split("-")[0]
    assert p.train.sampling.scheme == STUDY_SCHEMES[family] and p.train.sampling.seed is None
    for m in p.methods:  # no method variant changes it either
        assert p.method_train(m).sampling.scheme == STUDY_SCHEMES[family]


def test_method_train_overrides_apply_to_that_method_only(base):
    data = _with(base, "method_params", {
        "fedavg-mlp": {"algorithm": "fedavg", "train": {"model": "mlp", "model_args": {"hidden": 20},
                                                       "local_epochs": 7, "optimizer": {"momentum": 0.0}}},
        "fedavg-mlr": {"algorithm": "fedavg", "train": {"model": "mlr"}}})
    data["methods"] = ["fedavg", "fedavg-mlp", "fedavg-mlr"]
    p = validate_params(data)
    part = next(iter(p.partitions))
    plain, mlp, mlr = (train_job(p, "bloodmnist", part, m, 1)["train"] for m in data["methods"])
    assert plain == p.train.model_dump()
    assert mlp["model"] == "mlp" and mlp["model_args"] == {"hidden": 20} and mlp["local_epochs"] == 7
    # a nested mapping merges key by key: the study's lr and decay stay
    assert mlp["optimizer"]["momentum"] == 0.0 and mlp["optimizer"]["lr"] == p.train.optimizer.lr
    assert {k: v for k, v in mlp.items() if k not in ("model", "model_args", "local_epochs", "optimizer")} == \
        {k: v for k, v in plain.items() if k not in ("model", "model_args", "local_epochs", "optimizer")}
    assert mlr["model"] == "mlr" and "model_args" not in mlr
    # the override is not a method hyper-parameter
    assert "train" not in train_job(p, "bloodmnist", part, "fedavg-mlp", 1)["method_params"]


def test_a_new_model_starts_from_its_own_default_arguments(base):
    data = copy.deepcopy(base)
    data["train"] = {**data.get("train", {}), "model": "mlp", "model_args": {"hidden": 64}}
    data["method_params"] = {"lin": {"algorithm": "fedavg", "train": {"model": "mlr"}}}
    data["methods"] = ["fedavg", "lin"]
    p = validate_params(data)
    assert p.method_train("fedavg").model_args == {"hidden": 64}
    assert p.method_train("lin").model == "mlr" and p.method_train("lin").model_args == {}


@pytest.mark.parametrize("train, key", [
    ({"model": "resnet9000"}, "method_params.v.train.model"),
    ({"local_epoch": 3}, "method_params.v.train.local_epoch"),
    ({"rounds": 0}, "method_params.v.train.rounds"),
    ({"model": "mlr", "model_args": {"hidden": 3}}, "method_params.v.train.model_args"),
    (5, "method_params.v.train"),
    ({"stack_seeds": True}, "method_params.v.train.stack_seeds: the switch is study-wide"),
])
def test_bad_method_train_overrides_name_the_key(base, train, key):
    data = _with(base, "method_params", {"v": {"algorithm": "fedavg", "train": train}})
    data["methods"] = ["v"]
    assert key in _error(data)


def test_pfedkd_study_overlays_resolve():
    mnist = load_params(PARAMS, [REPO / "config" / "pfedkd-mnist.yaml"])
    assert {p: (mnist.partitions[p].num_clients, mnist.partitions[p].alpha, mnist.partitions[p].top_k)
            for _, p in mnist.dataset_partitions()} == {
        "a0.5-top2-n20": (20, 0.5, 2), "a0.5-top2-n50": (50, 0.5, 2), "a0.05-n20": (20, 0.05, None),
        "a0.05-n50": (50, 0.05, None)}  # paper Table 1's four columns
    assert mnist.train.rounds == 600 and mnist.train.participation == 0.25 and mnist.train.batch_size == 20
    assert (mnist.train.optimizer.momentum, mnist.train.optimizer.weight_decay, mnist.train.optimizer.lr_decay) == \
        (0.0, 0.0, 1.0)
    for model in ("mlr", "mlp"):
        for algo in ("fedavg", "fedprox", "perfedavg", "pfedme", "fedgkd", "pfedkdwcl"):
            tr = mnist.method_train(f"{algo}-{model}")
            assert tr.model == model and tr.model_args == ({"hidden": 128} if model == "mlp" else {})
    assert mnist.method_config("fedprox-mlr")[1].mu == 0.01
    assert mnist.method_config("pfedme-mlr")[1].lam == 5.0 and mnist.method_config("pfedme-mlp")[1].lam == 15.0
    syn = load_params(PARAMS, [REPO / "config" / "pfedkd-synthetic.yaml"])
    assert syn.dataset_partitions() == [("synthetic_0.5_0.5", "natural")] and syn.train.participation == 0.1
    assert syn.method_train("fedavg-mlp").model_args == {"hidden": 20}  # the official code's synthetic MLP
    assert syn.method_config("pfedme-mlp")[1].lam == 30.0
    assert syn.method_config("pfedkdwcl-legacy-mlr")[1].legacy_last_client_grad


def test_pfedkd_synthetic_1500_overlay_changes_only_the_rounds_and_methods():
    base = load_params(PARAMS, [REPO / "config" / "pfedkd-synthetic.yaml"])
    long = load_params(PARAMS, [REPO / "config" / "pfedkd-synthetic.yaml", REPO / "config" / "pfedkd-synthetic-1500.yaml"])
    assert long.study == "pfedkd-synthetic-1500" and long.methods == ["perfedavg-mlr", "perfedavg-mlp"]
    assert long.train.rounds == 1500 and base.train.rounds == 600
    assert long.train.model_copy(update={"rounds": 600}) == base.train
    for m in long.methods:
        assert long.method_config(m)[1] == base.method_config(m)[1]
        assert long.method_train(m) == base.method_train(m).model_copy(update={"rounds": 1500})
    assert long.dataset_partitions() == base.dataset_partitions()


def test_stack_seeds_is_study_wide_and_not_in_job_descriptions(base):
    """``train.stack_seeds`` validates at the study level (with the stacked executor only) and is
    never written into a run's train section, so turning it on changes no job description."""
    p = validate_params(_with(base, "train.stack_seeds", True))
    assert p.train.stack_seeds and "stack_seeds" not in p.method_train(p.methods[0]).model_dump()
    bad = _with(base, "train.stack_seeds", True)
    bad["train"]["executor"] = "sequential"
    assert "train.stack_seeds" in _error(bad)
