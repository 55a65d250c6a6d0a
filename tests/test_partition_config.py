"""Tests of the per-scheme partition configs (medpfl.config: one pydantic class per
``partitions.<name>.scheme``, a discriminated union) and their partitioners (medpfl.data.partition:
one class per scheme on the base ``Partitioner``): the job descriptions that decide Snakemake's
re-runs stay byte-identical to those of the flat config (commit 86ead2f), a key foreign to an
entry's scheme fails with one line naming the key path and the scheme, and every scheme has both
classes and its keys in docs/pipeline.md."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from medpfl.cli import main
from medpfl.compose import load_params, validate_params
from medpfl.config import (
    PARTITION_CONFIGS,
    DrawnPartitionConfig,
    ParamsError,
    PartitionConfigBase,
    canonical_json,
    partition_config,
    partition_from_job,
    partition_job,
)
from medpfl.data.partition import PARTITIONERS, Partitioner, make_partitioner

REPO = Path(__file__).resolve().parents[1]
PARAMS = REPO / "params.yaml"

# The partition rule's job description (workflow/rules/common.smk ``partition_json``, the
# canonical JSON of ``partition_job``) as the flat PartitionConfig of commit 86ead2f wrote it, for
# params.yaml and committed overlays: (overlay in config/, "dataset/partition", the JSON). These
# strings must never change: Snakemake re-runs a partition whose description changed and then,
# by modification time, every training job after it. Computed with the code of 86ead2f.
COMMITTED = [
    (None, 'bloodmnist/dir0.1',
     '{"config":{"alpha":0.1,"classes_per_client":null,"clustered":false,"datasets":null,'
     '"local_test":{"fraction":0.2,"rule":"stratified"},"max_draws":1000,"min_samples":10,"n_clusters":null,'
     '"num_clients":20,"scheme":"dirichlet","seed":1,"self_balancing":true,"size_start":1165,"size_stop":3834,'
     '"top_k":null},"dataset":"bloodmnist","name":"dir0.1"}'),
    ('fedkper-paper.yaml', 'bloodmnist/fedkper-dir0.1',
     '{"config":{"alpha":0.1,"classes_per_client":null,"clustered":false,"datasets":null,'
     '"local_test":{"fraction":0.2,"rule":"fedkper"},"max_draws":1000,"min_samples":10,"n_clusters":null,'
     '"num_clients":20,"scheme":"dirichlet","seed":1,"self_balancing":true,"size_start":1165,"size_stop":3834,'
     '"top_k":null},"dataset":"bloodmnist","name":"fedkper-dir0.1"}'),
    ('fedmic-bloodmnist-cpu.yaml', 'bloodmnist/lam0.1-n20',
     '{"config":{"alpha":0.1,"classes_per_client":null,"clustered":false,"datasets":null,'
     '"local_test":{"fraction":0.2,"ratios":[0.7,0.2,0.1],"rule":"ratios"},"max_draws":1000,"min_samples":10,'
     '"n_clusters":null,"num_clients":20,"pool":"all","scheme":"dirichlet","seed":1,"self_balancing":false,'
     '"server_data":{"count":null,"fraction":0.5,"source":"val"},"size_start":1165,"size_stop":3834,'
     '"top_k":null},"dataset":"bloodmnist","name":"lam0.1-n20"}'),
    ('fhbench-bloodmnist.yaml', 'bloodmnist/pairs0.1-n20',
     '{"config":{"alpha":0.1,"classes_per_client":null,"clustered":false,"data_fraction":0.2,"datasets":null,'
     '"local_test":{"fraction":0.2,"ratios":[0.4,0.3,0.3],"rule":"ratios"},"max_draws":1000,"min_samples":10,'
     '"n_clusters":null,"num_clients":20,"pool":"all","scheme":"dirichlet_pairs","seed":2025,'
     '"self_balancing":true,"size_start":1165,"size_stop":3834,"top_k":null},"dataset":"bloodmnist",'
     '"name":"pairs0.1-n20"}'),
    ('pfedkd-mnist.yaml', 'mnist/a0.05-n20',
     '{"config":{"alpha":0.05,"classes_per_client":null,"clustered":false,"datasets":null,'
     '"local_test":{"fraction":0.25,"rule":"ordered"},"max_draws":1000,"min_samples":10,"n_clusters":null,'
     '"num_clients":20,"scheme":"per_client_dirichlet","seed":1,"self_balancing":true,"size_start":1165,'
     '"size_stop":3834,"top_k":null},"dataset":"mnist","name":"a0.05-n20"}'),
    ('pfedkd-mnist.yaml', 'mnist/a0.5-top2-n50',
     '{"config":{"alpha":0.5,"classes_per_client":null,"clustered":false,"datasets":null,'
     '"local_test":{"fraction":0.25,"rule":"ordered"},"max_draws":1000,"min_samples":10,"n_clusters":null,'
     '"num_clients":50,"scheme":"per_client_dirichlet","seed":1,"self_balancing":true,"size_start":1165,'
     '"size_stop":3834,"top_k":2},"dataset":"mnist","name":"a0.5-top2-n50"}'),
    ('pfedkd-synthetic.yaml', 'synthetic_0.5_0.5/natural',
     '{"config":{"alpha":null,"classes_per_client":null,"clustered":false,"datasets":null,'
     '"local_test":{"fraction":0.2,"rule":"stratified"},"max_draws":1000,"min_samples":10,"n_clusters":null,'
     '"num_clients":100,"scheme":"natural","seed":1,"self_balancing":true,"size_start":1165,"size_stop":3834,'
     '"top_k":null},"dataset":"synthetic_0.5_0.5","name":"natural"}'),
    ('pfpslwc-cifar10.yaml', 'cifar10/b0.3-n10',
     '{"config":{"alpha":0.3,"classes_per_client":null,"clustered":false,"datasets":null,'
     '"local_test":{"fraction":0.2,"rule":"official_test"},"max_draws":1000,"min_samples":10,"n_clusters":null,'
     '"num_clients":10,"scheme":"dirichlet","seed":1,"self_balancing":false,"size_start":1165,"size_stop":3834,'
     '"top_k":null},"dataset":"cifar10","name":"b0.3-n10"}'),
    ('pfpslwc-cifar10.yaml', 'cifar10/shards5-n10',
     '{"config":{"alpha":0.1,"classes_per_client":null,"clustered":false,"datasets":null,'
     '"local_test":{"fraction":0.2,"rule":"official_test"},"max_draws":1000,"min_samples":10,"n_clusters":null,'
     '"num_clients":10,"scheme":"shards","seed":1,"self_balancing":true,"shards_per_client":5,"size_start":1165,'
     '"size_stop":3834,"top_k":null},"dataset":"cifar10","name":"shards5-n10"}'),
]


# Entries of the schemes and options the committed configs do not use: (data set, the params
# entry, its job description at 86ead2f). ``alpha: null`` on iid is the legacy "not applicable".
OTHER_SCHEMES = [
    ('bloodmnist', {'name': 'x-iid', 'scheme': 'iid', 'num_clients': 10},
     '{"config":{"alpha":0.1,"classes_per_client":null,"clustered":false,"datasets":null,'
     '"local_test":{"fraction":0.2,"rule":"stratified"},"max_draws":1000,"min_samples":10,"n_clusters":null,'
     '"num_clients":10,"scheme":"iid","seed":1,"self_balancing":true,"size_start":1165,"size_stop":3834,'
     '"top_k":null},"dataset":"bloodmnist","name":"x-iid"}'),
    ('bloodmnist', {'name': 'x-iid-alphanull', 'scheme': 'iid', 'num_clients': 4, 'alpha': None, 'min_samples': 3},
     '{"config":{"alpha":null,"classes_per_client":null,"clustered":false,"datasets":null,'
     '"local_test":{"fraction":0.2,"rule":"stratified"},"max_draws":1000,"min_samples":3,"n_clusters":null,'
     '"num_clients":4,"scheme":"iid","seed":1,"self_balancing":true,"size_start":1165,"size_stop":3834,'
     '"top_k":null},"dataset":"bloodmnist","name":"x-iid-alphanull"}'),
    ('bloodmnist', {'name': 'x-iid-df', 'scheme': 'iid', 'num_clients': 8, 'pool': 'all', 'data_fraction': 0.3,
                   'seed': 7, 'local_test': {'rule': 'random', 'fraction': 0.3}},
     '{"config":{"alpha":0.1,"classes_per_client":null,"clustered":false,"data_fraction":0.3,"datasets":null,'
     '"local_test":{"fraction":0.3,"rule":"random"},"max_draws":1000,"min_samples":10,"n_clusters":null,'
     '"num_clients":8,"pool":"all","scheme":"iid","seed":7,"self_balancing":true,"size_start":1165,'
     '"size_stop":3834,"top_k":null},"dataset":"bloodmnist","name":"x-iid-df"}'),
    ('bloodmnist', {'name': 'x-path2', 'scheme': 'pathological', 'num_clients': 10, 'classes_per_client': 2,
                   'min_samples': 5},
     '{"config":{"alpha":0.1,"classes_per_client":2,"clustered":false,"datasets":null,'
     '"local_test":{"fraction":0.2,"rule":"stratified"},"max_draws":1000,"min_samples":5,"n_clusters":null,'
     '"num_clients":10,"scheme":"pathological","seed":1,"self_balancing":true,"size_start":1165,'
     '"size_stop":3834,"top_k":null},"dataset":"bloodmnist","name":"x-path2"}'),
    ('bloodmnist', {'name': 'x-shards2', 'scheme': 'shards', 'num_clients': 12, 'shards_per_client': 2,
                   'local_test': {'rule': 'stratified', 'fraction': 0.25}},
     '{"config":{"alpha":0.1,"classes_per_client":null,"clustered":false,"datasets":null,'
     '"local_test":{"fraction":0.25,"rule":"stratified"},"max_draws":1000,"min_samples":10,"n_clusters":null,'
     '"num_clients":12,"scheme":"shards","seed":1,"self_balancing":true,"shards_per_client":2,"size_start":1165,'
     '"size_stop":3834,"top_k":null},"dataset":"bloodmnist","name":"x-shards2"}'),
    ('bloodmnist', {'name': 'x-pcd-clu', 'scheme': 'per_client_dirichlet', 'num_clients': 6, 'alpha': 0.5,
                   'clustered': True, 'n_clusters': 3, 'size_start': 50, 'size_stop': 200},
     '{"config":{"alpha":0.5,"classes_per_client":null,"clustered":true,"datasets":null,'
     '"local_test":{"fraction":0.25,"rule":"ordered"},"max_draws":1000,"min_samples":10,"n_clusters":3,'
     '"num_clients":6,"scheme":"per_client_dirichlet","seed":1,"self_balancing":true,"size_start":50,'
     '"size_stop":200,"top_k":null},"dataset":"bloodmnist","name":"x-pcd-clu"}'),
    ('bloodmnist', {'name': 'x-pcd-int', 'scheme': 'per_client_dirichlet', 'num_clients': 4, 'alpha': 2,
                   'size_start': 30, 'size_stop': 60, 'local_test': {'rule': 'stratified', 'fraction': 0.25}},
     '{"config":{"alpha":2.0,"classes_per_client":null,"clustered":false,"datasets":null,'
     '"local_test":{"fraction":0.25,"rule":"stratified"},"max_draws":1000,"min_samples":10,"n_clusters":null,'
     '"num_clients":4,"scheme":"per_client_dirichlet","seed":1,"self_balancing":true,"size_start":30,'
     '"size_stop":60,"top_k":null},"dataset":"bloodmnist","name":"x-pcd-int"}'),
    ('bloodmnist', {'name': 'x-pairs-drawn', 'scheme': 'dirichlet_pairs', 'num_clients': 7, 'alpha': 0.5,
                   'pair_sizes': 'drawn',
                   'local_test': {'rule': 'ratios', 'ratios': [0.7, 0.2, 0.1], 'rounding': 'nearest'}},
     '{"config":{"alpha":0.5,"classes_per_client":null,"clustered":false,"datasets":null,'
     '"local_test":{"fraction":0.2,"ratios":[0.7,0.2,0.1],"rounding":"nearest","rule":"ratios"},'
     '"max_draws":1000,"min_samples":10,"n_clusters":null,"num_clients":7,"pair_sizes":"drawn",'
     '"scheme":"dirichlet_pairs","seed":1,"self_balancing":true,"size_start":1165,"size_stop":3834,'
     '"top_k":null},"dataset":"bloodmnist","name":"x-pairs-drawn"}'),
    ('bloodmnist', {'name': 'x-dir-srv', 'scheme': 'dirichlet', 'num_clients': 8, 'alpha': 0.3,
                   'server_data': {'count': 100}, 'local_test': {'rule': 'fedkper'}},
     '{"config":{"alpha":0.3,"classes_per_client":null,"clustered":false,"datasets":null,'
     '"local_test":{"fraction":0.2,"rule":"fedkper"},"max_draws":1000,"min_samples":10,"n_clusters":null,'
     '"num_clients":8,"scheme":"dirichlet","seed":1,"self_balancing":true,"server_data":{"count":100,'
     '"fraction":null,"source":"val"},"size_start":1165,"size_stop":3834,"top_k":null},"dataset":"bloodmnist",'
     '"name":"x-dir-srv"}'),
    ('bloodmnist', {'name': 'x-int-alpha', 'num_clients': 5, 'alpha': 1, 'data_fraction': 1, 'min_samples': 3,
                   'seed': 2},
     '{"config":{"alpha":1.0,"classes_per_client":null,"clustered":false,"datasets":null,'
     '"local_test":{"fraction":0.2,"rule":"stratified"},"max_draws":1000,"min_samples":3,"n_clusters":null,'
     '"num_clients":5,"scheme":"dirichlet","seed":2,"self_balancing":true,"size_start":1165,"size_stop":3834,'
     '"top_k":null},"dataset":"bloodmnist","name":"x-int-alpha"}'),
    ('synthetic_0.5_0.5', {'name': 'x-nat', 'scheme': 'natural', 'num_clients': 100},
     '{"config":{"alpha":0.1,"classes_per_client":null,"clustered":false,"datasets":null,'
     '"local_test":{"fraction":0.2,"rule":"stratified"},"max_draws":1000,"min_samples":10,"n_clusters":null,'
     '"num_clients":100,"scheme":"natural","seed":1,"self_balancing":true,"size_start":1165,"size_stop":3834,'
     '"top_k":null},"dataset":"synthetic_0.5_0.5","name":"x-nat"}'),
]


def _params(entries: list[dict], datasets=("bloodmnist",)) -> dict:
    return {"data": {"datasets": list(datasets)}, "partitions": entries}


def _error(data: dict, source: str = "test.yaml") -> list[str]:
    """The error lines of an invalid params mapping (after the first, which names the file)."""
    with pytest.raises(ParamsError) as e:
        validate_params(data, source)
    first, *lines = str(e.value).split("\n")
    assert first == f"{source}: invalid parameters"
    return lines


# ----------------------------------------------------------------------------- job descriptions


@pytest.mark.parametrize(("overlay", "key", "expected"), COMMITTED, ids=[k for _, k, _ in COMMITTED])
def test_committed_partition_job_descriptions_are_unchanged(overlay, key, expected):
    params = load_params(PARAMS, [REPO / "config" / overlay] if overlay else [])
    dataset, name = key.split("/")
    assert (dataset, name) in params.dataset_partitions()
    assert canonical_json(partition_job(params, dataset, name)) == expected
    cfg = params.partitions[name]
    assert params.study_dict()["partitions"][name] == cfg.job_dict()  # the report rule's description
    assert partition_from_job(cfg.job_dict()) == cfg  # what the partition stage reads back


@pytest.mark.parametrize(("dataset", "entry", "expected"), OTHER_SCHEMES, ids=[e["name"] for _, e, _ in OTHER_SCHEMES])
def test_other_schemes_job_descriptions_are_unchanged(dataset, entry, expected):
    params = validate_params(_params([entry], [dataset]))
    assert canonical_json(partition_job(params, dataset, entry["name"])) == expected
    cfg = params.partitions[entry["name"]]
    assert partition_from_job(cfg.job_dict()) == cfg and partition_from_job(cfg.job_dict()).job_dict() == cfg.job_dict()
    assert partition_config(cfg.model_dump()) == cfg and partition_config(cfg.model_dump()).job_dict() == cfg.job_dict()


def test_params_yaml_study_description_keeps_the_flat_partitions():
    """The report rule's ``study`` param (``Params.study_dict``) writes each partition as the flat
    job dict, so the report of an existing study is not re-run for the new schema either."""
    params = load_params(PARAMS)
    (_, _, expected), = [c for c in COMMITTED if c[0] is None]
    flat = yaml.safe_load(expected)["config"]  # JSON is YAML
    assert params.study_dict()["partitions"] == {"dir0.1": flat}
    assert params.model_dump(mode="json")["partitions"]["dir0.1"] != flat  # the schema's own dump differs


def test_a_job_with_a_foreign_value_is_rejected():
    job = partition_config(scheme="iid", num_clients=4).job_dict()
    assert partition_from_job(job).scheme == "iid"
    with pytest.raises(ParamsError, match=r"self_balancing=False does not belong to the iid scheme"):
        partition_from_job({**job, "self_balancing": False})
    with pytest.raises(ParamsError, match=r"unknown scheme 'dirchlet'"):
        partition_from_job({**job, "scheme": "dirchlet"})


# ----------------------------------------------------------------------------- errors


def test_a_key_of_another_scheme_names_the_key_path_and_the_scheme():
    lines = _error(_params([{"name": "iid10", "scheme": "iid", "num_clients": 10, "classes_per_client": 2}]))
    assert lines == ["  - partitions.iid10.classes_per_client: not a key of the iid scheme (a key of pathological); "
                     "the iid scheme takes num_clients, seed, datasets, server_data, pool, data_fraction, local_test, "
                     "min_samples"]
    lines = _error(_params([{"name": "pfed", "scheme": "per_client_dirichlet", "alpha": 0.5, "min_samples": 5}]))
    assert len(lines) == 1 and lines[0].startswith(
        "  - partitions.pfed.min_samples: not a key of the per_client_dirichlet scheme (a key of dirichlet, iid, "
        "pathological, shards, subject); the per_client_dirichlet scheme takes ")
    lines = _error(_params([{"name": "nat", "scheme": "natural", "num_clients": 5, "local_test": {"rule": "random"}}]))
    assert lines == ["  - partitions.nat.local_test: not a key of the natural scheme (a key of dirichlet, iid, "
                     "pathological, shards, per_client_dirichlet, dirichlet_pairs, subject); the natural scheme takes "
                     "num_clients, seed, datasets, server_data"]


def test_a_misspelt_key_names_the_scheme_its_default_included():
    # no scheme: the default, dirichlet
    lines = _error(_params([{"name": "d", "alhpa": 0.5}]))
    assert lines == ["  - partitions.d.alhpa: unknown key for the dirichlet scheme (check the spelling); the dirichlet "
                     "scheme takes num_clients, seed, datasets, server_data, pool, data_fraction, local_test, alpha, "
                     "self_balancing, min_samples, max_draws"]
    # nested keys keep their own message
    assert _error(_params([{"name": "d", "local_test": {"frac": 0.1}}])) == [
        "  - partitions.d.local_test.frac: unknown key (check the spelling; see params.yaml for the allowed keys)"]


def test_alpha_on_a_scheme_without_a_dirichlet_draw():
    """``alpha: null`` stays accepted where the flat config allowed it (config/pfedkd-synthetic.yaml);
    a value is rejected naming the scheme."""
    ok = validate_params(_params([{"name": "i", "scheme": "iid", "alpha": None}]))
    assert ok.partitions["i"].alpha is None and ok.partitions["i"].job_dict()["alpha"] is None
    assert validate_params(_params([{"name": "i", "scheme": "iid"}])).partitions["i"].job_dict()["alpha"] == 0.1
    lines = _error(_params([{"name": "i", "scheme": "shards", "shards_per_client": 2, "alpha": 0.5}]))
    assert len(lines) == 1 and lines[0].startswith("  - partitions.i.alpha: the shards scheme takes no alpha")


def test_an_unknown_scheme_names_the_scheme_key():
    assert _error(_params([{"name": "x", "scheme": "dirchlet"}])) == [
        "  - partitions.x.scheme: unknown scheme 'dirchlet'; one of dirichlet, iid, pathological, shards, "
        "per_client_dirichlet, natural, dirichlet_pairs, subject"]


def test_check_params_prints_one_line_naming_key_and_scheme(tmp_path, capsys):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(_params([{"name": "sh", "scheme": "shards", "shards_per_client": 2,
                                             "self_balancing": False}])))
    assert main(["check-params", str(path)]) == 2
    err = capsys.readouterr().err.strip().split("\n")
    assert err[0] == f"medpfl check-params: error: {path}: invalid parameters"
    assert err[1:] == ["  - partitions.sh.self_balancing: not a key of the shards scheme (a key of dirichlet); the "
                       "shards scheme takes num_clients, seed, datasets, server_data, pool, data_fraction, local_test, "
                       "shards_per_client, min_samples"]


# ----------------------------------------------------------------------------- classes


def test_every_scheme_has_a_config_class_and_a_partitioner():
    assert list(PARTITIONERS) and set(PARTITIONERS) == set(PARTITION_CONFIGS)
    for scheme, cfg_cls in PARTITION_CONFIGS.items():
        assert issubclass(cfg_cls, PartitionConfigBase) and cfg_cls.model_fields["scheme"].default == scheme
        assert issubclass(PARTITIONERS[scheme], Partitioner) and PARTITIONERS[scheme].scheme == scheme
        assert issubclass(cfg_cls, DrawnPartitionConfig) == PARTITIONERS[scheme].draws
    shared = {s for s, c in PARTITIONERS.items() if c.shares_samples}
    left_out = {s for s, c in PARTITIONERS.items() if c.leaves_out}
    assert shared == {"per_client_dirichlet"} and left_out == {"dirichlet_pairs"}


@pytest.mark.parametrize("entry", [e for _, e, _ in OTHER_SCHEMES], ids=[e["name"] for _, e, _ in OTHER_SCHEMES])
def test_make_partitioner_passes_the_schemes_keys(entry):
    cfg = partition_config({k: v for k, v in entry.items() if k != "name"})
    part = make_partitioner(cfg, "partitions.x")
    assert type(part) is PARTITIONERS[cfg.scheme] and part.key == "partitions.x" and part.num_clients == cfg.num_clients
    for name in ("alpha", "min_samples", "max_draws", "self_balancing", "classes_per_client", "shards_per_client",
                 "size_start", "size_stop", "top_k", "clustered", "n_clusters"):
        if name in cfg.scheme_keys():
            assert getattr(part, name) == getattr(cfg, name), name
    if cfg.scheme == "dirichlet_pairs":
        assert part.equal_sizes == (cfg.pair_sizes == "equal") and part.max_draws == cfg.max_draws


def test_the_natural_partitioner_draws_nothing():
    cfg = partition_config(scheme="natural", num_clients=2)
    assert cfg.pool == "train" and cfg.data_fraction == 1.0 and cfg.local_test is None
    part = make_partitioner(cfg, "partitions.n")
    labels = np.array([0, 1, 0, 1, 1])
    natural = (np.array([0, 0, 1, 1, 1]), np.array(["train", "test", "train", "test", "train"]))
    splits = part.client_splits(labels, None, None, natural=natural)
    assert [(tr.tolist(), te.tolist()) for tr, te in splits] == [([0], [1]), ([2, 4], [3])]


# ----------------------------------------------------------------------------- docs


def test_docs_list_each_schemes_own_keys():
    """docs/pipeline.md's table of partition keys: one row per scheme with exactly the keys the
    scheme adds to the common ones (``PartitionConfigBase.scheme_keys``)."""
    text = (REPO / "docs" / "pipeline.md").read_text()
    common = set(DrawnPartitionConfig.scheme_keys())
    for scheme, cls in PARTITION_CONFIGS.items():
        row = re.search(rf"^\| `{scheme}`[^|]*\|([^|\n]*)\|", text, re.M)  # the second column
        assert row, scheme
        listed = set(re.findall(r"`([a-z_]+)`", row.group(1)))
        assert listed == set(cls.scheme_keys()) - common, scheme
