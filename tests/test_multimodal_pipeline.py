"""Folder data sets through download -> preprocess -> partition -> the engine's data side.

A tiny PTB-XL 1.0.3 in the official layout (``tests/test_ptbxl.py``'s writer: WFDB records by
``wfdb.wrsamp``, the two CSVs) with a matching ``SHA256SUMS.txt`` sits in a temporary mirror
folder under the official root folder name.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

pytest.importorskip("wfdb")

from helpers import REPO, make_env, snakemake, tiny_params, write_params  # noqa: E402
from test_ptbxl import RECORDS, make_ptbxl  # noqa: E402

from medpfl.cli import main  # noqa: E402
from medpfl.compose import validate_params  # noqa: E402
from medpfl.config import TransformConfig, partition_config  # noqa: E402
from medpfl.data import multimodal, sources  # noqa: E402
from medpfl.data.partition import build_partition  # noqa: E402
from medpfl.data.preprocess import load_processed, preprocess_folder  # noqa: E402
from medpfl.errors import DataError, ParamsError, PartitionError  # noqa: E402
from medpfl.fl.data import FederatedData  # noqa: E402
from medpfl.io import tree_hash  # noqa: E402
from medpfl.models import build_model  # noqa: E402
from medpfl.models.zoo import InputSpec, build_model_for_data  # noqa: E402
from medpfl.models import zoo  # noqa: E402

ENTRY = multimodal.FOLDER_DATASETS["ptbxl"]
ROOT_NAME = ENTRY.root_names[0]
# kept records (test_ptbxl.RECORDS: patients 12 "other" and 13 "mixed" are dropped), in ecg_id order
KEPT = [1, 2, 6, 7, 8]
SUBJECT_OF = {e: int(RECORDS[e][0]) for e in KEPT}  # 10, 11, 14, 14, 15


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def write_sums(root: Path) -> None:
    """SHA256SUMS.txt as PhysioNet publishes it: '<hex> <relative path>' for every file."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != "SHA256SUMS.txt")
    (root / "SHA256SUMS.txt").write_text("".join(f"{_sha(p)} {p.relative_to(root).as_posix()}\n" for p in files))


@pytest.fixture(scope="module")
def mirror(tmp_path_factory) -> Path:
    m = tmp_path_factory.mktemp("mirror")
    root = m / ROOT_NAME
    root.mkdir()
    make_ptbxl(root)
    (root / "RECORDS").write_text("records500/00000/00001_hr\n")  # listed, not needed by the reader
    write_sums(root)
    return m


@pytest.fixture(scope="module")
def processed(mirror, tmp_path_factory):
    d = tmp_path_factory.mktemp("proc")
    sources.fetch("ptbxl", d / "ptbxl.manifest.json", mirrors=[mirror])
    samples = preprocess_folder(d / "ptbxl.manifest.json", d / "ptbxl.npz", d / "ptbxl.samples.parquet", ENTRY)
    return d, samples


def _copy_mirror(mirror: Path, dst: Path) -> Path:
    shutil.copytree(mirror, dst)
    return dst


# ------------------------------------------------------------------------------------------ registry


def test_registry_entry_and_spec():
    from medpfl.data import ptbxl

    assert ENTRY.kind == "timeseries" and ENTRY.class_names == ptbxl.SUPERCLASSES and ENTRY.num_classes == 5
    assert ENTRY.access_terms == ptbxl.ACCESS_TERMS
    spec = sources.dataset_spec("ptbxl")
    assert spec.layout == "folder" and spec.raw_filename == "ptbxl.manifest.json" and spec.kind == "timeseries"
    sources.check_dataset_name("ptbxl")
    assert set(multimodal.FOLDER_DATASETS) == {"ptbxl", "medabstracts", "pubmed200k", "adftd", "icbhi", "sprsound"}


def test_data_job_carries_the_entry_and_options_and_leaves_medmnist_unchanged():
    params = validate_params({"data": {"datasets": ["bloodmnist", "ptbxl"], "multimodal": {"ptbxl": {"limit": 3}}}})
    assert sources.dataset_job(params, "bloodmnist") == {"dataset": "bloodmnist", "custom": {}}
    job = sources.dataset_job(params, "ptbxl")
    assert job["folder"]["module"] == "ptbxl" and job["folder"]["kind"] == "timeseries" and job["options"] == {"limit": 3}
    assert "options" not in sources.download_job(params, "ptbxl")
    assert sources.download_job(params, "bloodmnist") == sources.dataset_job(params, "bloodmnist")


def test_multimodal_options_are_validated():
    with pytest.raises(ParamsError, match=r"data: multimodal\.ptbxl\.tokenizer: applies to text \(tokens\)"):
        validate_params({"data": {"datasets": ["ptbxl"], "multimodal": {"ptbxl": {"tokenizer": "roberta-base"}}}})
    with pytest.raises(ParamsError, match=r"data: multimodal\.nosuch: not a folder data set"):
        validate_params({"data": {"datasets": ["ptbxl"], "multimodal": {"nosuch": {"limit": 2}}}})
    with pytest.raises(ParamsError, match=r"data\.multimodal\.ptbxl\.limit"):
        validate_params({"data": {"datasets": ["ptbxl"], "multimodal": {"ptbxl": {"limit": 0}}}})


# ------------------------------------------------------------------------------------------ download


def test_download_writes_a_manifest_of_the_verified_files(mirror, tmp_path):
    out = tmp_path / "raw" / "ptbxl.manifest.json"
    where = sources.fetch("ptbxl", out, mirrors=[tmp_path / "empty", mirror])
    m = json.loads(out.read_text())
    root = mirror / ROOT_NAME
    assert str(root.resolve()) in where and m["root"] == str(root.resolve())
    assert m["dataset"] == "ptbxl" and m["version"] == "1.0.3" and m["url"] == ENTRY.url
    assert m["checksum_file_sha256"] == _sha(root / "SHA256SUMS.txt")
    expected = {"ptbxl_database.csv", "scp_statements.csv"} | {
        f"records500/00000/{e:05d}_hr.{x}" for e in RECORDS for x in ("hea", "dat")}
    assert set(m["files"]) == expected  # RECORDS and SHA256SUMS.txt are not reader files
    for rel, (size, digest) in m["files"].items():
        assert size == (root / rel).stat().st_size and digest == _sha(root / rel)
    assert not list(out.parent.glob(".medpfl-tmp-*"))  # written atomically
    # a second call keeps the manifest
    assert sources.fetch("ptbxl", out, mirrors=[mirror]).startswith("existing")


def test_a_corrupted_file_is_named(mirror, tmp_path):
    m = _copy_mirror(mirror, tmp_path / "m")
    bad = m / ROOT_NAME / "records500" / "00000" / "00006_hr.dat"
    data = bytearray(bad.read_bytes())
    data[100] ^= 0xFF  # same size, other bytes
    bad.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"00006_hr\.dat: SHA-256 mismatch") as e:
        sources.fetch("ptbxl", tmp_path / "ptbxl.manifest.json", mirrors=[m])
    assert str(bad) in str(e.value) and not (tmp_path / "ptbxl.manifest.json").exists()
    (m / ROOT_NAME / "records500" / "00000" / "00007_hr.hea").unlink()
    bad.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"00006_hr\.dat: SHA-256 mismatch|00007_hr\.hea: missing"):
        sources.fetch("ptbxl", tmp_path / "ptbxl.manifest.json", mirrors=[m])


def test_a_missing_root_is_one_line_with_url_and_terms(tmp_path, monkeypatch, capsys):
    with pytest.raises(DataError) as e:
        sources.fetch("ptbxl", tmp_path / "x.manifest.json", mirrors=[tmp_path])
    msg = str(e.value)
    assert "\n" not in msg and ENTRY.url in msg and ENTRY.access_terms in msg and "MEDPFL_DATA_MIRROR" in msg
    monkeypatch.setenv(sources.MIRROR_ENV, str(tmp_path))
    job = json.dumps({"dataset": "ptbxl", "custom": {}})
    assert main(["download", "--job", job, "--out", str(tmp_path / "ptbxl.manifest.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ENTRY.url in err[0]


def test_a_root_without_checksums_is_recorded(mirror, tmp_path, monkeypatch):
    """A source without published checksums: sizes and SHA-256 of what was found are recorded."""
    m = _copy_mirror(mirror, tmp_path / "m")
    (m / ROOT_NAME / "SHA256SUMS.txt").unlink()
    entry = multimodal.FolderDataset(**{**ENTRY.__dict__, "checksums": None})
    monkeypatch.setitem(multimodal.FOLDER_DATASETS, "ptbxl", entry)
    out = tmp_path / "ptbxl.manifest.json"
    sources.fetch("ptbxl", out, mirrors=[m])
    man = json.loads(out.read_text())
    assert "recorded" in man["checksums"] and len(man["files"]) == 2 + 2 * len(RECORDS)
    rel = "records500/00000/00002_hr.dat"
    assert man["files"][rel] == [(m / ROOT_NAME / rel).stat().st_size, _sha(m / ROOT_NAME / rel)]


# ------------------------------------------------------------------------------------------ preprocess


def test_preprocess_writes_timeseries_and_subjects(processed):
    d, samples = processed
    data = load_processed(d / "ptbxl.npz", d / "ptbxl.samples.parquet")
    assert data.kind == "timeseries" and data.pad_token_id is None and data.class_names == ENTRY.class_names
    assert data.images.dtype == np.float32 and data.images.shape == (10 * len(KEPT), 12, 512)
    assert data.num_classes == 5
    assert list(samples.columns) == ["sample_id", "split", "index_in_split", "label", "subject_id"]
    assert samples["subject_id"].dtype == np.int64
    assert samples["subject_id"].tolist() == [SUBJECT_OF[e] for e in KEPT for _ in range(10)]
    assert (samples["split"] == "train").all() and samples["index_in_split"].tolist() == list(range(50))
    assert samples["label"].tolist()[::10] == [0, 1, 4, 4, 2]
    with np.load(d / "ptbxl.npz") as z:
        assert str(z["kind"]) == "timeseries" and "norm_mean" not in z.files
    from medpfl.data import ptbxl

    ref = ptbxl.load_ptbxl(Path(json.loads((d / "ptbxl.manifest.json").read_text())["root"]))
    np.testing.assert_array_equal(data.images, ref.x)


def test_preprocess_limit_and_changed_files(mirror, tmp_path):
    m = _copy_mirror(mirror, tmp_path / "m")
    man = tmp_path / "ptbxl.manifest.json"
    sources.fetch("ptbxl", man, mirrors=[m])
    s = preprocess_folder(man, tmp_path / "a.npz", tmp_path / "a.parquet", ENTRY, {"limit": 2})
    assert len(s) == 20 and s["subject_id"].unique().tolist() == [10, 11]
    # a file changed after the download: its size no longer matches the manifest
    f = m / ROOT_NAME / "records500" / "00000" / "00002_hr.dat"
    f.write_bytes(f.read_bytes() + b"\0\0")
    with pytest.raises(DataError, match=r"00002_hr\.dat: \d+ bytes, \d+ when .*manifest\.json was written"):
        preprocess_folder(man, tmp_path / "b.npz", tmp_path / "b.parquet", ENTRY)
    # same size, other bytes: only the sha256 check sees it
    f.write_bytes(f.read_bytes()[:-2])
    g = m / ROOT_NAME / "records500" / "00000" / "00001_hr.dat"
    raw = bytearray(g.read_bytes())
    raw[50] ^= 1
    g.write_bytes(bytes(raw))
    preprocess_folder(man, tmp_path / "c.npz", tmp_path / "c.parquet", ENTRY, {"limit": 1})
    with pytest.raises(DataError, match=r"00001_hr\.dat: SHA-256 differs"):
        preprocess_folder(man, tmp_path / "c.npz", tmp_path / "c.parquet", ENTRY, verify="sha256")


def _tiny_tokenizer(folder: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>"])
    tok.train_from_iterator(["the heart rate is normal", "tumour of the colon", "nerve damage"] * 5, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def test_a_tokens_data_set_is_tokenised_with_the_configured_tokenizer(tmp_path, monkeypatch):
    """The generic tokens path with a stand-in text reader (the real one is on the text branch)."""
    root = tmp_path / "m" / "texts"
    root.mkdir(parents=True)
    (root / "texts.csv").write_text("text,label,split\nthe heart rate is normal,0,train\nnerve damage,1,test\n"
                                    "tumour of the colon,1,train\n")
    write_sums(root)
    fake = types.ModuleType("medpfl.data._faketext")

    def load_texts(r, limit=None):
        t = pd.read_csv(Path(r) / "texts.csv")
        t.insert(0, "sample_id", np.arange(len(t), dtype=np.int64))
        return types.SimpleNamespace(x=None, table=t, class_names=("a", "b"))

    def tokenize(texts, tokenizer, max_length=512):
        return np.asarray(tokenizer(list(texts), padding="max_length", truncation=True, max_length=max_length)
                          ["input_ids"], dtype=np.int64)

    fake.load_texts, fake.tokenize = load_texts, tokenize
    monkeypatch.setitem(sys.modules, "medpfl.data._faketext", fake)
    entry = multimodal.FolderDataset(name="texts", module="_faketext", reader="load_texts", kind="tokens",
                                     num_classes=2, class_names=("a", "b"), url="https://example.invalid/texts",
                                     access_terms="test only", version="0", root_names=("texts",),
                                     checksums="SHA256SUMS.txt", files=("texts.csv",))
    monkeypatch.setitem(multimodal.FOLDER_DATASETS, "texts", entry)
    tok = _tiny_tokenizer(tmp_path / "tok")
    sources.fetch("texts", tmp_path / "texts.manifest.json", mirrors=[tmp_path / "m"])
    s = preprocess_folder(tmp_path / "texts.manifest.json", tmp_path / "t.npz", tmp_path / "t.parquet", entry,
                          {"tokenizer": str(tmp_path / "tok"), "max_length": 8})
    data = load_processed(tmp_path / "t.npz", tmp_path / "t.parquet")
    assert data.kind == "tokens" and data.images.dtype == np.int64 and data.images.shape == (3, 8)
    assert data.pad_token_id == tok.pad_token_id
    want = tok(["the heart rate is normal"], padding="max_length", truncation=True, max_length=8)["input_ids"][0]
    assert data.images[0].tolist() == want and data.images[1, -1] == tok.pad_token_id
    assert s["split"].tolist() == ["train", "test", "train"] and s["index_in_split"].tolist() == [0, 0, 1]
    assert "subject_id" not in s.columns
    with pytest.raises(Exception, match=r"data\.multimodal\.texts\.tokenizer"):
        preprocess_folder(tmp_path / "texts.manifest.json", tmp_path / "u.npz", tmp_path / "u.parquet", entry,
                          {"tokenizer": str(tmp_path / "no-such-tokenizer")})
    # token ids reach a batch untouched
    table = pd.DataFrame({"sample_id": [0, 2, 1], "client_id": [0, 0, 0], "local_split": ["train", "train", "test"],
                          "label": [0, 1, 1]})
    fd = FederatedData.build(data, table, torch.device("cpu"))
    x = fd.x(torch.tensor([1, 0]))
    assert x.dtype == torch.int64 and torch.equal(x, torch.as_tensor(data.images[[1, 0]]))
    assert fd.sample_shape == (8,) and fd.kind == "tokens" and fd.pad_token_id == tok.pad_token_id


# ------------------------------------------------------------------------------------------ partition


def _pool(processed):
    d, s = processed
    return s["sample_id"].to_numpy(), s["label"].to_numpy(), s["subject_id"].to_numpy()


@pytest.mark.parametrize("assign", ["balanced", "round_robin"])
def test_subject_partition_keeps_subjects_whole(processed, assign):
    ids, labels, subj = _pool(processed)
    cfg = partition_config(scheme="subject", num_clients=2, min_samples=5, assign=assign,
                           local_test={"rule": "stratified", "fraction": 0.2})
    table = build_partition(ids, labels, cfg, "subj", subjects=subj)
    assert sorted(table["sample_id"]) == ids.tolist()  # every sample assigned once
    owner = pd.Series(subj[table["sample_id"]]).groupby(table["client_id"].to_numpy()).agg(set)
    assert not (owner[0] & owner[1]) and owner[0] | owner[1] == {10, 11, 14, 15}
    assert set(table["local_split"]) == {"train", "test"}
    again = build_partition(ids, labels, cfg, "subj", subjects=subj)
    pd.testing.assert_frame_equal(table, again)  # seeded


def test_balanced_assignment_rule():
    """Subjects in the seeded order, each to the least-loaded client (ties: the lower id)."""
    from medpfl.data.partition import SubjectPartitioner

    subjects = np.repeat([7, 8, 9, 5], [30, 10, 10, 10])  # subject 7 has 30 samples
    labels = np.zeros(len(subjects), dtype=np.int64)
    order = np.random.RandomState(3).permutation(4)  # over the sorted ids 5, 7, 8, 9
    clients = SubjectPartitioner(2, "balanced", 1).partition_subjects(labels, subjects, np.random.RandomState(3))
    load, owner = [0, 0], {}
    for s_ in order:
        c = int(np.argmin(load))
        owner[[5, 7, 8, 9][s_]] = c
        load[c] += int((subjects == [5, 7, 8, 9][s_]).sum())
    for c in range(2):
        assert set(subjects[clients[c]]) == {s_ for s_, o in owner.items() if o == c}


def test_subject_partition_errors_name_the_key(processed):
    ids, labels, subj = _pool(processed)
    cfg = partition_config(scheme="subject", num_clients=2, min_samples=5)
    with pytest.raises(PartitionError, match=r"partitions\.nosubj\.scheme=subject: the data set has no subject_id"):
        build_partition(ids, labels, cfg, "nosubj")
    with pytest.raises(PartitionError, match=r"partitions\.many\.num_clients=5 exceeds the 4 subjects"):
        build_partition(ids, labels, partition_config(scheme="subject", num_clients=5), "many", subjects=subj)


def test_dirichlet_with_data_fraction_works_unchanged(processed):
    ids, labels, subj = _pool(processed)
    cfg = partition_config(scheme="dirichlet", num_clients=2, alpha=1.0, min_samples=5, data_fraction=0.6, seed=3)
    table = build_partition(ids, labels, cfg, "dir", subjects=subj)
    assert len(table) == 30 and table["sample_id"].is_unique
    # the same as without subjects: Dirichlet ignores them
    pd.testing.assert_frame_equal(table, build_partition(ids, labels, cfg, "dir"))


def test_subject_partition_with_data_fraction_moves_no_subject(processed):
    ids, labels, subj = _pool(processed)
    cfg = partition_config(scheme="subject", num_clients=2, min_samples=3, data_fraction=0.5, seed=2)
    table = build_partition(ids, labels, cfg, "sf", subjects=subj)
    assert len(table) == 25
    per = pd.Series(table["client_id"].to_numpy()).groupby(subj[table["sample_id"]]).nunique()
    assert (per == 1).all()


# ------------------------------------------------------------------------------------------ engine data side


def test_federated_data_yields_untouched_float32_timeseries(processed):
    d, samples = processed
    data = load_processed(d / "ptbxl.npz", d / "ptbxl.samples.parquet")
    cfg = partition_config(scheme="subject", num_clients=2, min_samples=5)
    ids, labels, subj = _pool(processed)
    table = build_partition(ids, labels, cfg, "s", subjects=subj)
    fd = FederatedData.build(data, table, torch.device("cpu"))
    assert fd.kind == "timeseries" and fd.sample_shape == (12, 512) and fd.image_size is None
    assert fd.global_test.numel() == 0  # all samples in the train split
    idx = fd.client_train[0][:4]
    x = fd.x(idx)
    assert x.dtype == torch.float32 and x.shape == (4, 12, 512)
    assert torch.equal(x, torch.as_tensor(data.images[idx.numpy()]))
    assert fd.x(idx.view(2, 2)).shape == (2, 2, 12, 512)
    with pytest.raises(ParamsError, match=r"train\.transform=.*image data sets only; this data set has timeseries"):
        FederatedData.build(data, table, torch.device("cpu"), transform=TransformConfig(channels=3))
    # models: a flattening model takes time series, an image model is refused naming train.model
    m = build_model_for_data("mlp", fd, {"hidden": 4})
    assert m(x).shape == (4, 5)
    with pytest.raises(ValueError, match=r"train\.model"):
        build_model_for_data("cnn4", fd)


def test_waveform_and_kind_checks():
    wav = torch.randn(6, 32)
    table = pd.DataFrame({"sample_id": range(6), "client_id": 0, "local_split": ["train"] * 4 + ["test"] * 2,
                          "label": [0, 1] * 3})
    fd = FederatedData(images=wav, labels=torch.tensor([0, 1] * 3), num_classes=2,
                       global_test=torch.empty(0, dtype=torch.int64),
                       client_train=[torch.arange(4)], client_test=[torch.arange(4, 6)],
                       train_hist=torch.ones(1, 2), device=torch.device("cpu"), kind="waveform")
    assert fd.sample_shape == (32,) and torch.equal(fd.x(torch.tensor([5])), wav[[5]])
    assert len(table) == 6
    with pytest.raises(DataError, match=r"timeseries samples must be 3-D"):
        FederatedData(images=wav, labels=torch.zeros(6, dtype=torch.int64), num_classes=2,
                      global_test=torch.empty(0, dtype=torch.int64), client_train=[torch.arange(4)],
                      client_test=[torch.arange(4, 6)], train_hist=torch.ones(1, 2), device=torch.device("cpu"),
                      kind="timeseries")


def test_a_sequence_model_gets_kind_shape_and_pad(monkeypatch):
    seen = {}

    def build(shape, num_classes, args, spec):
        seen.update(shape=shape, kind=spec.kind, pad=spec.pad_token_id)
        return torch.nn.Linear(1, num_classes)

    monkeypatch.setitem(zoo.ZOO, "fake-seq", zoo.ZooEntry(build, "test", input="tokens"))
    build_model("fake-seq", 16, 3, None, None, spec=InputSpec("tokens", (16,), 1))
    assert seen == {"shape": (16,), "kind": "tokens", "pad": 1}
    with pytest.raises(ValueError, match=r"train\.model=fake-seq needs token ids .*this data set's samples are image"):
        build_model("fake-seq", 3, 3, 28, None, spec=InputSpec("image", (3, 28, 28)))
    with pytest.raises(ValueError, match=r"train\.model=mlr takes float samples; this data set's samples are token ids"):
        build_model("mlr", 16, 3, None, None, spec=InputSpec("tokens", (16,), 1))


# ------------------------------------------------------------------------------------------ code hash


def test_preprocess_code_hash_is_per_data_set(tmp_path):
    """bloodmnist's preprocess hash does not depend on ptbxl.py (nor on a new reader module);
    ptbxl's does."""
    src = tmp_path / "src" / "medpfl" / "data"
    shutil.copytree(REPO / "src" / "medpfl" / "data", src, ignore=shutil.ignore_patterns("__pycache__"))

    def h(name, stage="preprocess"):
        return tree_hash([src / f for f in sources.dataset_code_files(name, stage)])

    assert "ptbxl.py" not in sources.dataset_code_files("bloodmnist", "preprocess")
    assert sources.dataset_code_files("ptbxl", "partition") == sources.dataset_code_files("bloodmnist", "partition")
    before = {n: h(n) for n in ("bloodmnist", "ptbxl")} | {"part": h("bloodmnist", "partition")}
    (src / "ptbxl.py").write_text((src / "ptbxl.py").read_text() + "\n# edited\n")
    (src / "audio.py").write_text("# a new reader\n")
    (src / "multimodal.py").write_text((src / "multimodal.py").read_text() + "\n# a new entry\n")
    after = {n: h(n) for n in ("bloodmnist", "ptbxl")} | {"part": h("bloodmnist", "partition")}
    assert after["bloodmnist"] == before["bloodmnist"] and after["part"] == before["part"]
    assert after["ptbxl"] != before["ptbxl"]
    (src / "preprocess.py").write_text((src / "preprocess.py").read_text() + "\n# generic edit\n")
    assert h("bloodmnist") != before["bloodmnist"]


# ------------------------------------------------------------------------------------------ Snakemake


@pytest.mark.slow
def test_snakemake_download_preprocess_partition(mirror, tmp_path):
    """One end-to-end run through partition for the tiny PTB-XL: the download rule's
    ``manifest.json`` output, preprocess, a subject and a Dirichlet partition."""
    work = tmp_path / "w"
    work.mkdir()
    params = tiny_params({"path": "unused", "md5": "0" * 32, "n_channels": 1, "num_classes": 2})
    params["data"] = {"datasets": ["ptbxl"], "multimodal": {"ptbxl": {"limit": 4}}}
    params["partitions"] = [
        {"name": "subj", "scheme": "subject", "num_clients": 2, "min_samples": 5},
        {"name": "dir", "scheme": "dirichlet", "num_clients": 2, "alpha": 1.0, "min_samples": 5, "data_fraction": 0.8},
    ]
    write_params(work, params)
    env = make_env(work, mirror=mirror)
    targets = [f"data/partitions/ptbxl/{p}/partition.parquet" for p in ("subj", "dir")]
    out = snakemake(work, *targets, env=env, timeout=300).stdout
    assert "rule download" in out or "localrule download" in out
    man = json.loads((work / "data" / "raw" / "ptbxl.manifest.json").read_text())
    assert man["root"] == str((mirror / ROOT_NAME).resolve())
    data = load_processed(work / "data/processed/ptbxl.npz", work / "data/processed/ptbxl.samples.parquet")
    assert data.kind == "timeseries" and data.images.shape == (40, 12, 512)  # limit: 4 records
    subj = pd.read_parquet(work / "data/partitions/ptbxl/subj/partition.parquet")
    owner = subj.assign(s=data.samples["subject_id"].to_numpy()[subj["sample_id"]]).groupby("s")["client_id"].nunique()
    assert (owner == 1).all() and len(subj) == 40
    assert len(pd.read_parquet(work / "data/partitions/ptbxl/dir/partition.parquet")) == 32
    stats = json.loads((work / "data/partitions/ptbxl/subj/client_stats.json").read_text())
    assert stats["class_names"] == list(ENTRY.class_names)
    # nothing left to do
    dry = snakemake(work, *targets, "--dry-run", env=env).stdout
    assert "Nothing to be done" in dry
