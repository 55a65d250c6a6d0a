"""The five registry entries added for FHBench (medabstracts, pubmed200k, adftd, icbhi, sprsound; ptbxl is
in test_multimodal_pipeline.py), per-data-set train overrides (``dataset_train``), the GPU study file
``config/fhbench-all.yaml``, and one slow run of a text, a time-series and an audio data set through
preprocess -> partition -> one training round with their tiny backbones.

The data are the tiny official layouts of ``tests/fixtures_multimodal.py`` (the reader tests' writers).
Expected values are derived from those writers' contents (see each test)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

pytest.importorskip("mne")
pytest.importorskip("py7zr")
pytest.importorskip("tokenizers")

import fixtures_multimodal as fx  # noqa: E402
from helpers import REPO, make_env, snakemake, tiny_params, write_params  # noqa: E402

from medpfl.compose import load_params, validate_params  # noqa: E402
from medpfl.config import train_job  # noqa: E402
from medpfl.data import adftd, audio, multimodal, sources, text  # noqa: E402
from medpfl.data.preprocess import load_processed, preprocess_folder  # noqa: E402
from medpfl.errors import DataError, ParamsError  # noqa: E402

NEW = ("medabstracts", "pubmed200k", "adftd", "icbhi", "sprsound")


@pytest.fixture(scope="module")
def mirror(tmp_path_factory) -> Path:
    return fx.write_mirror(tmp_path_factory.mktemp("mirror"), "test")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    return fx.write_tokenizer(tmp_path_factory.mktemp("tok"))


def _process(name, mirror, out: Path, tokenizer=None):
    entry = multimodal.FOLDER_DATASETS[name]
    how = sources.fetch(name, out / f"{name}.manifest.json", mirrors=[mirror])
    opts = {"tokenizer": str(tokenizer), "max_length": 16} if entry.kind == "tokens" else {}
    s = preprocess_folder(out / f"{name}.manifest.json", out / f"{name}.npz", out / f"{name}.parquet", entry, opts)
    return how, s, load_processed(out / f"{name}.npz", out / f"{name}.parquet")


def test_entries_match_their_readers():
    reg = multimodal.FOLDER_DATASETS
    assert set(NEW) | {"ptbxl"} == set(reg)
    assert reg["medabstracts"].class_names == text.MEDABS_CLASS_NAMES
    assert reg["pubmed200k"].class_names == text.PUBMED_CLASS_NAMES
    assert reg["adftd"].class_names == adftd.CLASS_NAMES
    assert reg["icbhi"].class_names == audio.ICBHI_CLASSES
    assert reg["sprsound"].class_names == audio.SPRSOUND_CLASSES
    for n in NEW:
        e = reg[n]
        assert hasattr(__import__(f"medpfl.data.{e.module}", fromlist=[e.reader]), e.reader)
        assert (e.tokenizer, e.max_length) == (("roberta-base", 512) if e.kind == "tokens" else (None, 512))
    assert reg["adftd"].url == adftd.OFFICIAL_URL and reg["icbhi"].url == audio.ICBHI_OFFICIAL_URL
    assert reg["sprsound"].url == audio.SPRSOUND_OFFICIAL_URL and reg["pubmed200k"].url == text.PUBMED_OFFICIAL_URL


@pytest.mark.parametrize("name", NEW)
def test_manifest_lists_the_files_the_reader_needs(name, mirror, tmp_path, tokenizer):
    how, _, _ = _process(name, mirror, tmp_path, tokenizer)
    man = json.loads((tmp_path / f"{name}.manifest.json").read_text())
    root = fx.root_of(mirror, name)
    assert man["root"] == str(root.resolve()) and man["dataset"] == name
    assert man["checksums"].startswith("recorded at download")  # none of the five publishes a checksum file
    wanted = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()
              and any(__import__("fnmatch").fnmatchcase(p.relative_to(root).as_posix(), g)
                      for g in multimodal.FOLDER_DATASETS[name].files)}
    assert set(man["files"]) == wanted and wanted
    for rel, (size, _) in man["files"].items():
        assert (root / rel).stat().st_size == size
    if name == "pubmed200k":
        assert set(man["files"]) == {"train.7z", "test.txt"}  # dev.txt is not read
    if name == "adftd":  # the derivatives only, never the raw recordings
        assert all(r == "participants.tsv" or r.startswith("derivatives/") for r in man["files"])


def test_text_sets_tokenised_without_subjects(mirror, tmp_path, tokenizer):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    _, s, d = _process("medabstracts", mirror, tmp_path, tokenizer)
    # the writer's rows: train labels 3, 5, 1 then test 4, 2 -> minus one
    assert d.kind == "tokens" and d.images.shape == (5, 16) and d.images.dtype == np.int64
    assert s["label"].tolist() == [2, 4, 0, 3, 1] and s["split"].tolist() == ["train"] * 3 + ["test"] * 2
    assert "subject_id" not in s.columns and d.pad_token_id == tok.pad_token_id
    assert d.images[0].tolist() == tok([fx.MEDABS_TRAIN[0][1]], padding="max_length", truncation=True,
                                       max_length=16)["input_ids"][0]
    _, s, d = _process("pubmed200k", mirror, tmp_path, tokenizer)
    want = [text.PUBMED_LABELS[lab] for split in ("train", "test") for _, sents in fx.PUBMED[split]
            for lab, _ in sents]
    assert d.images.shape == (len(want), 16) and s["label"].tolist() == want
    assert tuple(d.class_names) == text.PUBMED_CLASS_NAMES


def test_adftd_timeseries_by_subject(mirror, tmp_path):
    _, s, d = _process("adftd", mirror, tmp_path)
    # three subjects C, F, A of 1537 samples at 500 Hz -> 786 at 256 Hz -> two 1-s windows each
    assert d.kind == "timeseries" and d.images.shape == (6, 19, 512) and d.images.dtype == np.float32
    assert s["subject_id"].tolist() == [1, 1, 2, 2, 3, 3] and s["label"].tolist() == [0, 0, 1, 1, 2, 2]
    assert (s["split"] == "train").all()  # no official split: pooled
    assert np.all(d.images[:, :, :256] == 0)  # left zero-padding to 512


def test_icbhi_waveforms_by_patient_with_official_split(mirror, tmp_path):
    _, s, d = _process("icbhi", mirror, tmp_path)
    # files by name (101, 107, 130), cycles by onset; (crackles, wheezes) -> 0 normal, 1, 2, 3 both
    assert d.kind == "waveform" and d.images.shape == (6, audio.N_SAMPLES) and d.images.dtype == np.float32
    assert s["subject_id"].tolist() == [101, 101, 101, 107, 130, 130]
    assert s["label"].tolist() == [0, 1, 3, 2, 2, 0]
    assert s["split"].tolist() == ["test"] * 4 + ["train"] * 2
    assert tuple(d.class_names) == audio.ICBHI_CLASSES


def test_sprsound_events_by_patient(mirror, tmp_path):
    _, s, d = _process("sprsound", mirror, tmp_path)
    events = [(stem, ev) for stem, r in fx.SPRS_RECS.items() for ev in r[5]]
    assert d.images.shape == (len(events), audio.N_SAMPLES)
    assert set(s["subject_id"]) == {int(stem.split("_")[0]) for stem, _ in events}
    assert sorted(s["label"]) == sorted(audio.SPRSOUND_LABELS[t] for _, (_, _, t) in events)
    test_stems = {stem for stem, r in fx.SPRS_RECS.items() if r[0] > 0 and r[5]}
    assert (s["split"] == "test").sum() == sum(len(fx.SPRS_RECS[t][5]) for t in test_stems)


def test_a_missing_root_names_url_and_terms(tmp_path):
    with pytest.raises(DataError, match=r"ICBHI_final_database.*bhichallenge.*free for research"):
        sources.fetch("icbhi", tmp_path / "icbhi.manifest.json", mirrors=[tmp_path])


def test_icbhi_without_its_split_list_is_not_a_root(mirror, tmp_path):
    import shutil

    m = tmp_path / "m"
    shutil.copytree(fx.root_of(mirror, "icbhi"), m / "ICBHI_final_database")
    (m / "ICBHI_final_database" / audio.ICBHI_SPLIT_FILE).unlink()
    with pytest.raises(DataError, match=r"lacks ICBHI_challenge_train_test\.txt"):
        sources.fetch("icbhi", tmp_path / "icbhi.manifest.json", mirrors=[m])


# ------------------------------------------------------------------------------------------ config


def test_fhbench_all_validates_with_each_data_sets_backbone_batch_and_lr():
    p = load_params(REPO / "params.yaml", [REPO / "config/fhbench-all.yaml"])
    want = {  # spec B.3 per-dataset table
        "organsmnist_224": ("vit_lora", 32, 1e-3, 0.2), "medabstracts": ("roberta-lora", 16, 8e-3, 0.5),
        "pubmed200k": ("roberta-lora", 16, 5e-3, 0.005), "adftd": ("moment-lora", 32, 5e-2, 0.2),
        "ptbxl": ("moment-lora", 32, 1e-1, 0.2), "icbhi": ("wav2vec2-lora", 16, 1e-1, 0.3),
        "sprsound": ("wav2vec2-lora", 16, 3e-2, 0.3)}
    pairs = dict(p.dataset_partitions())
    assert len(pairs) == 9 and set(p.methods) == {"fedavg", "fedprox", "scaffold", "apfl", "apple", "fedala", "epfl"}
    for d, (model, batch, lr, frac) in want.items():
        t = train_job(p, d, pairs[d], "epfl", 1)["train"]
        assert (t["model"], t["batch_size"], t["optimizer"]["lr"]) == (model, batch, lr)
        assert t["optimizer"]["momentum"] == 0.0 and t["rounds"] == 200
        assert p.partitions[pairs[d]].data_fraction == frac and p.partitions[pairs[d]].alpha == 0.1
    paper = yaml.safe_load((REPO / "config/papers/fhbench-table2-all.yaml").read_text())
    assert set(paper["values"]) == {f"{d}/{q}" for d, q in pairs.items()}


def test_fhbench_cpu_study_validates():
    p = load_params(REPO / "params.yaml", [REPO / "config/fhbench-multimodal-cpu.yaml"])
    models = {d: train_job(p, d, q, "fedavg", 1)["train"]["model"] for d, q in p.dataset_partitions()}
    assert set(models.values()) == {"vit_lora", "roberta-lora", "moment-lora", "wav2vec2-lora"}


def _params(**extra):
    base = tiny_params({"path": "unused", "md5": "0" * 32, "n_channels": 1, "num_classes": 2}, methods=("fedavg",))
    return {**base, **extra}


def test_dataset_train_merges_under_the_method_and_names_bad_keys():
    p = validate_params(_params(dataset_train={"synth": {"batch_size": 7, "optimizer": {"lr": 0.5}}},
                                methods=["fedavg", "fast"], method_params={"fast": {"algorithm": "fedavg",
                                                                                     "train": {"optimizer": {"lr": 2.0}}}}))
    t = p.run_train("fedavg", "synth")
    assert (t.batch_size, t.optimizer.lr, t.optimizer.momentum) == (7, 0.5, p.train.optimizer.momentum)
    assert (p.run_train("fast", "synth").optimizer.lr, p.run_train("fast", "synth").batch_size) == (2.0, 7)
    assert "dataset_train" not in validate_params(_params()).study_dict()  # not dumped at its default
    with pytest.raises(ParamsError, match=r"dataset_train\.nope: not one of data\.datasets"):
        validate_params(_params(dataset_train={"nope": {"batch_size": 4}}))
    with pytest.raises(ParamsError, match=r"dataset_train\.synth\.batch_sise: unknown key"):
        validate_params(_params(dataset_train={"synth": {"batch_sise": 4}}))


# ------------------------------------------------------------------------------------------ Snakemake


@pytest.mark.slow
def test_one_set_of_each_modality_trains_one_round(mirror, tokenizer, tmp_path):
    """medabstracts (tokens), adftd (timeseries), icbhi (waveform): download -> preprocess -> a subject or
    Dirichlet partition -> one FedAvg round with each one's tiny backbone, per data set via dataset_train."""
    cpu = yaml.safe_load((REPO / "config/fhbench-multimodal-cpu.yaml").read_text())["dataset_train"]
    work = tmp_path / "w"
    work.mkdir()
    params = _params(
        data={"datasets": ["medabstracts", "adftd", "icbhi"],
              "multimodal": {"medabstracts": {"tokenizer": str(tokenizer), "max_length": 32}}},
        partitions=[{"name": "iid", "scheme": "iid", "num_clients": 2, "min_samples": 2, "pool": "all", "datasets": ["medabstracts"],
                     "local_test": {"fraction": 0.4, "rule": "random"}},
                    {"name": "subj", "scheme": "subject", "num_clients": 2, "min_samples": 2, "pool": "all", "datasets": ["adftd", "icbhi"],
                     "local_test": {"fraction": 0.4, "rule": "random"}}],
        dataset_train={d: {**cpu[d], "batch_size": 4} for d in ("medabstracts", "adftd", "icbhi")})
    params["train"].update({"rounds": 1, "executor": "sequential"})
    write_params(work, params)
    runs = [f"results/ci/runs/{d}/{q}/fedavg/seed1/metrics.json"
            for d, q in (("medabstracts", "iid"), ("adftd", "subj"), ("icbhi", "subj"))]
    snakemake(work, *runs, env=make_env(work, mirror=mirror), timeout=600)
    for run, model in zip(runs, ("roberta-lora", "moment-lora", "wav2vec2-lora")):
        folder = (work / run).parent
        rounds = pd.read_parquet(folder / "rounds.parquet")
        assert len(rounds) == 1 and (rounds["bytes_up"] > 0).all()
        assert json.loads((folder / "job.json").read_text())["train"]["model"] == model
        summary = json.loads((work / run).read_text())["summary"]
        assert summary["rounds"] == 1 and summary["trainable_params"] > 0
        assert 0.0 <= summary["final_client_acc_mean"] <= 1.0
