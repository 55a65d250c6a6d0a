"""A generated data set per run seed (``data.synthetic.<name>.seed_per_run``, issue 30): the run of
seed s reads Synthetic(alpha, beta) drawn with generator seed ``seed + s - 1``. Run seed 1 keeps the
data set's own files and jobs bit for bit (so earlier runs stay current); the other seeds get
their own ``<name>.gen<k>`` files, deterministic, through the usual stages; the key is validated
with errors naming it; the Snakemake DAG wires each run to its seed's files and caches them."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import yaml

from helpers import REPO, make_env, md5, planned_jobs, snakemake, write_params
from medpfl.cli import main
from medpfl.compose import validate_params
from medpfl.config import canonical_json, train_job
from medpfl.data.preprocess import load_processed
from medpfl.data.run_data import data_job, raw_filename
from medpfl.data.sources import dataset_job, download_job
from medpfl.errors import ParamsError

DS = "synthetic_0.5_0.5"


def _params(seed_per_run: bool | None, seeds=(1, 2, 3), gen_seed: int = 0, num_clients: int = 6) -> dict:
    syn = {"num_clients": num_clients, "seed": gen_seed}
    if seed_per_run is not None:
        syn["seed_per_run"] = seed_per_run
    return {"data": {"datasets": [DS], "synthetic": {DS: syn}},
            "partitions": [{"name": "natural", "scheme": "natural", "num_clients": num_clients, "alpha": None}],
            "methods": ["fedavg"], "seeds": list(seeds)}


def test_run_seeds_map_to_generator_seeds_and_data_names():
    p = validate_params(_params(True, seeds=(1, 2, 3), gen_seed=5))
    assert [p.data_name(DS, s) for s in (1, 2, 3)] == [DS, f"{DS}.gen6", f"{DS}.gen7"]
    assert p.data_names() == [(DS, "natural"), (f"{DS}.gen6", "natural"), (f"{DS}.gen7", "natural")]
    assert p.resolve_data_name(f"{DS}.gen7") == (DS, 7) and p.resolve_data_name(DS) == (DS, None)
    # off (the default): every run seed reads the one data set
    off = validate_params(_params(None))
    assert [off.data_name(DS, s) for s in (1, 2, 3)] == [DS] * 3 and off.data_names() == [(DS, "natural")]
    with pytest.raises(ParamsError, match=r"data\.synthetic\.synthetic_0\.5_0\.5\.seed_per_run: .*no seed_per_run"):
        off.resolve_data_name(f"{DS}.gen1")
    with pytest.raises(ParamsError, match=r"seeds \[1, 2, 3\] map to generator seeds \[5, 6, 7\]"):
        p.resolve_data_name(f"{DS}.gen5")  # run seed 1 reads the data set's own files, not a .gen5 copy


def test_run_seed_1_keeps_every_job_and_the_study_description():
    """The data, download, partition and seed-1 train jobs are those of a study without the key
    (Snakemake's params trigger re-runs nothing); seed 2's train job names its generator seed."""
    on, off = validate_params(_params(True)), validate_params(_params(None))
    assert data_job(on, DS) == dataset_job(off, DS) == dataset_job(on, DS)
    assert data_job(on, DS, download=True) == download_job(off, DS)
    assert "seed_per_run" not in data_job(on, DS)["synthetic"]  # not a generator argument
    assert canonical_json(train_job(on, DS, "natural", "fedavg", 1)) == canonical_json(
        train_job(off, DS, "natural", "fedavg", 1))
    assert train_job(on, DS, "natural", "fedavg", 2)["generator_seed"] == 1
    assert "generator_seed" not in train_job(off, DS, "natural", "fedavg", 2)
    assert data_job(on, f"{DS}.gen2")["synthetic"] == {**dataset_job(off, DS)["synthetic"], "seed": 2}
    assert raw_filename(on, f"{DS}.gen2") == f"{DS}.gen2.npz" and raw_filename(on, DS) == f"{DS}.npz"
    # the report's study description says the key where it is on, and only there
    assert on.study_dict()["data"]["synthetic"][DS]["seed_per_run"] is True
    assert off.study_dict() == validate_params(_params(False)).study_dict()
    assert "seed_per_run" not in off.study_dict()["data"]["synthetic"][DS]


def _generate(tmp_path, params, name: str, tag: str):
    """The download stage (generation) and preprocess of data name ``name``, through the CLI with
    the jobs the Snakefile passes; returns (raw MD5, processed arrays)."""
    raw = tmp_path / tag / "raw" / raw_filename(params, name)
    raw.parent.mkdir(parents=True, exist_ok=True)
    assert main(["download", "--job", canonical_json(data_job(params, name, download=True)), "--out", str(raw)]) == 0
    arrays, samples = tmp_path / tag / f"{name}.npz", tmp_path / tag / f"{name}.samples.parquet"
    assert main(["preprocess", "--job", canonical_json(data_job(params, name)), "--raw", str(raw), "--out",
                 str(arrays), "--samples", str(samples)]) == 0
    return md5(raw), md5(arrays), load_processed(arrays, samples)


def test_seed_1_data_bit_for_bit_seed_2_new_and_deterministic(tmp_path):
    on, off = validate_params(_params(True)), validate_params(_params(None))
    base_raw, base_arrays, base = _generate(tmp_path, off, DS, "off")
    raw1, arrays1, d1 = _generate(tmp_path, on, on.data_name(DS, 1), "on")
    assert (raw1, arrays1) == (base_raw, base_arrays)  # the same files, byte for byte
    raw2, arrays2, d2 = _generate(tmp_path, on, on.data_name(DS, 2), "on")
    raw2b, arrays2b, _ = _generate(tmp_path, on, on.data_name(DS, 2), "again")
    assert (raw2, arrays2) == (raw2b, arrays2b)  # deterministic
    assert raw2 != raw1
    # a new federation: other client sizes and other samples (FedProx's generator, one seed for all)
    sizes = [np.bincount(d.samples["natural_client"].to_numpy()) for d in (d1, d2)]
    assert len(sizes[0]) == len(sizes[1]) == 6 and not np.array_equal(sizes[0], sizes[1])
    with np.load(tmp_path / "on" / "raw" / f"{DS}.gen1.npz") as z:
        assert json.loads(str(z["params"]))["seed"] == 1  # drawn with generator seed 0 + 2 - 1


@pytest.mark.parametrize("syn, seeds, pattern", [
    ({"seed_per_run": "often"}, [1, 2], r"data\.synthetic\.synthetic_0\.5_0\.5\.seed_per_run: .*boolean"),
    ({"seed_per_runs": True}, [1, 2], r"data\.synthetic\.synthetic_0\.5_0\.5\.seed_per_runs: unknown key"),
    ({"seed_per_run": True, "seed": 0}, [0, 1],
     r"data\.synthetic\.synthetic_0\.5_0\.5\.seed_per_run: run seed 0 would draw with generator seed -1"),
], ids=["not-a-bool", "typo", "negative-generator-seed"])
def test_check_params_names_the_key(tmp_path, capsys, syn, seeds, pattern):
    data = yaml.safe_load((REPO / "params.yaml").read_text())
    data.update(_params(None, seeds=seeds))
    data["data"]["synthetic"][DS].update(syn)
    path = write_params(tmp_path, data)
    assert main(["check-params", str(path)]) == 2
    err = capsys.readouterr().err
    assert re.search(pattern, err), err
    # with run seed 0 the data set's seed 1 is fine: generator seeds 0 and 1
    if "seed" in syn:
        data["data"]["synthetic"][DS]["seed"] = 1
        assert main(["check-params", str(write_params(tmp_path, data))]) == 0


@pytest.mark.slow
def test_snakemake_builds_one_data_set_per_generator_seed_and_caches_them(tmp_path):
    """``data_all`` generates, preprocesses and partitions the data set and its ``.gen1`` copy;
    the training jobs of seed 1 read the data set's files and those of seed 2 the copy's; a
    second call has nothing to do."""
    work = tmp_path / "w"
    work.mkdir()
    data = yaml.safe_load((REPO / "params.yaml").read_text())
    data.update(_params(True, seeds=(1, 2), num_clients=5))
    data["study"] = "seeds"
    write_params(work, data)
    env = make_env(work)
    out = snakemake(work, "data_all", env=env).stdout
    jobs = planned_jobs(out)
    for rule in ("download", "preprocess", "partition"):
        assert sorted(w["dataset"] for r, w in jobs if r == rule) == [DS, f"{DS}.gen1"], out[-3000:]
    for name, gen in ((DS, 0), (f"{DS}.gen1", 1)):
        with np.load(work / "data" / "raw" / f"{name}.npz") as z:
            assert json.loads(str(z["params"]))["seed"] == gen
        assert (work / "data" / "partitions" / name / "natural" / "partition.parquet").is_file()
    assert "Nothing to be done" in snakemake(work, "data_all", env=env).stdout
    dry = snakemake(work, "train_all", "--dry-run", "--printshellcmds", env=env).stdout
    trains = [w for r, w in planned_jobs(dry) if r == "train"]
    assert sorted(w["seed"] for w in trains) == ["1", "2"] and {w["dataset"] for w in trains} == {DS}
    assert f"--arrays data/processed/{DS}.gen1.npz" in dry and f"--arrays data/processed/{DS}.npz" in dry
    assert f"data/partitions/{DS}.gen1/natural/partition.parquet" in dry
    assert not [r for r, _ in planned_jobs(dry) if r in ("download", "preprocess", "partition")]
