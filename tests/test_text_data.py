"""FHBench text sets (medpfl.data.text): Medical Abstracts CSVs and PubMed 200k RCT ``###id``
files written in their official layouts, and tokenisation with a tiny BPE tokenizer trained here."""

from __future__ import annotations

import csv

import numpy as np
import pandas as pd
import pytest

py7zr = pytest.importorskip("py7zr")

from medpfl.data import text  # noqa: E402
from medpfl.errors import DataError, MissingWeightsError  # noqa: E402

# ----------------------------------------------------------------------------- Medical Abstracts
# (condition_label, medical_abstract) rows; texts as the corpus has them: quoted, commas, a
# trailing space, one with an embedded quote and a line break
MEDABS_TRAIN = [
    (3, "Obstructive sleep apnea in loud snorers. Eight snorers, age 39 +/- 5.3 yr, were studied. "),
    (5, 'Neutrophil function after "BMT": a consecutive entry trial.\nSecond line of the abstract. '),
    (1, "Flow cytometric DNA analysis of parathyroid tumors. "),
]
MEDABS_TEST = [
    (4, "Paraneoplastic vasculitic neuropathy: a treatable neuropathy. "),
    (2, "Duplex Doppler ultrasound of the abdominal vasculature, a review. "),
]
# the corpus' label file, rows deliberately not in label order
MEDABS_LABELS = [(2, "digestive system diseases"), (1, "neoplasms"), (3, "nervous system diseases"),
                 (5, "general pathological conditions"), (4, "cardiovascular diseases")]


def _write_medabs_csv(path, rows, header=("condition_label", "medical_abstract")) -> None:
    # the official files quote every abstract, not the label: csv.QUOTE_NONNUMERIC
    df = pd.DataFrame(rows, columns=list(header))
    df.to_csv(path, index=False, quoting=csv.QUOTE_NONNUMERIC)


def make_medabs(root, train=MEDABS_TRAIN, test=MEDABS_TEST, labels=MEDABS_LABELS) -> None:
    """The Medical-Abstracts-TC-Corpus repository layout: three CSVs at the root."""
    root.mkdir(parents=True, exist_ok=True)
    _write_medabs_csv(root / text.MEDABS_TRAIN_CSV, train)
    _write_medabs_csv(root / text.MEDABS_TEST_CSV, test)
    if labels is not None:
        pd.DataFrame(labels, columns=["condition_label", "condition_name"]).to_csv(
            root / text.MEDABS_LABELS_CSV, index=False)


def test_medabs_train_then_test_label_minus_one_text_unchanged(tmp_path):
    make_medabs(tmp_path)
    s = text.load_medical_abstracts(tmp_path)
    t = s.table
    rows = MEDABS_TRAIN + MEDABS_TEST
    assert s.x is None
    assert list(t.columns) == ["sample_id", "label", "split", "source_row", "text"]
    assert t["sample_id"].tolist() == list(range(len(rows)))
    assert t["label"].dtype == np.int64 and t["sample_id"].dtype == np.int64
    assert t["label"].tolist() == [c - 1 for c, _ in rows]
    assert t["text"].tolist() == [a for _, a in rows]  # quotes, line break, trailing space kept
    assert t["split"].tolist() == ["train"] * len(MEDABS_TRAIN) + ["test"] * len(MEDABS_TEST)
    assert t["source_row"].tolist() == list(range(len(MEDABS_TRAIN))) + list(range(len(MEDABS_TEST)))
    # names by index from the label file (written out of order)
    assert s.class_names == tuple(name for _, name in sorted(MEDABS_LABELS))
    assert s.class_names == text.MEDABS_CLASS_NAMES


def test_medabs_class_names_from_file_or_constant(tmp_path):
    make_medabs(tmp_path / "a", labels=None)
    assert text.load_medical_abstracts(tmp_path / "a").class_names == text.MEDABS_CLASS_NAMES
    renamed = [(i, f"class {i}") for i in (5, 4, 3, 2, 1)]
    make_medabs(tmp_path / "b", labels=renamed)
    assert text.load_medical_abstracts(tmp_path / "b").class_names == tuple(f"class {i}" for i in range(1, 6))


def test_medabs_limit_per_file(tmp_path):
    make_medabs(tmp_path)
    t = text.load_medical_abstracts(tmp_path, limit=2).table
    assert t["split"].tolist() == ["train", "train", "test", "test"]
    assert t["text"].tolist() == [MEDABS_TRAIN[0][1], MEDABS_TRAIN[1][1], MEDABS_TEST[0][1], MEDABS_TEST[1][1]]
    assert t["sample_id"].tolist() == [0, 1, 2, 3]


def test_medabs_missing_root_names_source_and_terms(tmp_path):
    with pytest.raises(DataError) as e:
        text.load_medical_abstracts(tmp_path / "nowhere")
    msg = str(e.value)
    assert "nowhere" in msg and text.MEDABS_OFFICIAL_URL in msg and text.MEDABS_ACCESS_TERMS in msg
    assert "\n" not in msg


def test_medabs_missing_test_csv_named(tmp_path):
    make_medabs(tmp_path)
    (tmp_path / text.MEDABS_TEST_CSV).unlink()
    with pytest.raises(DataError, match=text.MEDABS_TEST_CSV):
        text.load_medical_abstracts(tmp_path)


@pytest.mark.parametrize("label", [0, 6, "x"])
def test_medabs_bad_label_names_file_and_row(tmp_path, label):
    make_medabs(tmp_path, test=[MEDABS_TEST[0], (label, "An abstract. ")])
    with pytest.raises(DataError, match=rf"{text.MEDABS_TEST_CSV}: data row 1 .*condition_label"):
        text.load_medical_abstracts(tmp_path)


def test_medabs_damaged_files_named(tmp_path):
    make_medabs(tmp_path)
    _write_medabs_csv(tmp_path / text.MEDABS_TRAIN_CSV, MEDABS_TRAIN, header=("label", "medical_abstract"))
    with pytest.raises(DataError, match=rf"{text.MEDABS_TRAIN_CSV}: missing column\(s\) condition_label"):
        text.load_medical_abstracts(tmp_path)
    make_medabs(tmp_path, train=[(1, "  ")])
    with pytest.raises(DataError, match=rf"{text.MEDABS_TRAIN_CSV}: data row 0 .*empty medical_abstract"):
        text.load_medical_abstracts(tmp_path)
    make_medabs(tmp_path, labels=MEDABS_LABELS[:4])
    with pytest.raises(DataError, match=text.MEDABS_LABELS_CSV):
        text.load_medical_abstracts(tmp_path)
    make_medabs(tmp_path)
    (tmp_path / text.MEDABS_TRAIN_CSV).write_bytes(b'condition_label,medical_abstract\n1,"caf\xe9 "\n')
    with pytest.raises(DataError, match=rf"{text.MEDABS_TRAIN_CSV}: cannot be read"):
        text.load_medical_abstracts(tmp_path)


# ----------------------------------------------------------------------------- PubMed 200k RCT
# {split: [(pmid, [(LABEL, sentence), ...]), ...]}; mixed case and stray spaces to lower/strip
PUBMED = {
    "train": [
        (24293578, [("OBJECTIVE", "To investigate the Efficacy of 6 weeks of daily Low-dose oral prednisolone ."),
                    ("METHODS", "A total of 125 patients with primary Knee OA were randomized 1:1 . "),
                    ("RESULTS", "Outcome measures included Pain reduction ."),
                    ("CONCLUSIONS", "Low-dose prednisolone had both short-term and longer sustained effect .")]),
        (24854809, [("BACKGROUND", "Emotional eating is associated with Overeating ."),
                    ("RESULTS", "  Trait Emotional eating was measured .")]),
    ],
    "dev": [(24290286, [("BACKGROUND", "IgE sensitization to Aspergillus fumigatus ."),
                        ("METHODS", "Dev sentences must not appear .")])],
    "test": [(24845963, [("BACKGROUND", "This study analyzed Liver function abnormalities ."),
                         ("OBJECTIVE", "To Evaluate the safety ."),
                         ("METHODS", "Patients were Enrolled in 2012 .")])],
}


def pubmed_text(abstracts, newline="\n") -> str:
    """The official format: ``###id``, ``LABEL<TAB>sentence`` lines, a blank line after each abstract."""
    lines = []
    for pmid, sents in abstracts:
        lines.append(f"###{pmid}")
        lines += [f"{lab}\t{sent}" for lab, sent in sents]
        lines.append("")
    return newline.join(lines) + newline


def make_pubmed(root, data=PUBMED, train_as="7z", sub=text.PUBMED_FOLDER):
    """The pubmed-rct repository layout: ``PubMed_200k_RCT/{train.7z,dev.txt,test.txt}``.

    ``train_as``: "7z" (the official ``train.7z`` holding ``train.txt``, written with py7zr),
    "txt" (an unpacked ``train.txt``) or None (no train file).
    """
    folder = root / sub if sub else root
    folder.mkdir(parents=True, exist_ok=True)
    for split in ("dev", "test"):
        (folder / f"{split}.txt").write_text(pubmed_text(data[split]), encoding="utf-8")
    train = pubmed_text(data["train"])
    if train_as == "7z":
        with py7zr.SevenZipFile(folder / text.PUBMED_TRAIN_7Z, "w") as z:
            z.writestr(train.encode("utf-8"), text.PUBMED_TRAIN_TXT)
    elif train_as == "txt":
        (folder / text.PUBMED_TRAIN_TXT).write_text(train, encoding="utf-8")
    return folder


def _expected(splits=("train", "test"), data=PUBMED):
    rows = []
    for split in splits:
        for pmid, sents in data[split]:
            for i, (lab, sent) in enumerate(sents):
                rows.append((split, pmid, i, lab, sent.strip().lower()))
    return rows


def _check_table(t, rows):
    assert list(t.columns) == ["sample_id", "label", "split", "abstract_id", "sentence_index", "text"]
    for col in ("sample_id", "label", "abstract_id", "sentence_index"):
        assert t[col].dtype == np.int64, col
    assert t["sample_id"].tolist() == list(range(len(rows)))
    assert t["split"].tolist() == [r[0] for r in rows]
    assert t["abstract_id"].tolist() == [r[1] for r in rows]
    assert t["sentence_index"].tolist() == [r[2] for r in rows]
    assert [text.PUBMED_CLASS_NAMES[k] for k in t["label"]] == [r[3] for r in rows]
    assert t["text"].tolist() == [r[4] for r in rows]


def test_pubmed_label_order_is_alphabetical():
    assert text.PUBMED_CLASS_NAMES == tuple(sorted(text.PUBMED_CLASS_NAMES))
    assert text.PUBMED_LABELS == {"BACKGROUND": 0, "CONCLUSIONS": 1, "METHODS": 2, "OBJECTIVE": 3, "RESULTS": 4}


def test_pubmed_train_7z_then_test_lowercased_dev_excluded(tmp_path):
    make_pubmed(tmp_path, train_as="7z")
    s = text.load_pubmed_rct(tmp_path)
    assert s.x is None and s.class_names == text.PUBMED_CLASS_NAMES
    _check_table(s.table, _expected())
    assert not s.table["text"].str.contains("dev sentences").any()
    assert (s.table["text"] == s.table["text"].str.lower()).all()
    assert s.table["text"].iloc[0].startswith("to investigate the efficacy")


def test_pubmed_plain_train_txt_same_as_7z(tmp_path):
    make_pubmed(tmp_path / "z", train_as="7z")
    make_pubmed(tmp_path / "t", train_as="txt")
    a = text.load_pubmed_rct(tmp_path / "z").table
    b = text.load_pubmed_rct(tmp_path / "t").table
    pd.testing.assert_frame_equal(a, b)
    # a garbage train.7z next to a plain train.txt is not read: the unpacked file wins
    (tmp_path / "t" / text.PUBMED_FOLDER / text.PUBMED_TRAIN_7Z).write_bytes(b"not an archive")
    pd.testing.assert_frame_equal(text.load_pubmed_rct(tmp_path / "t").table, b)


def test_pubmed_dev_on_request_and_folder_as_root(tmp_path):
    folder = make_pubmed(tmp_path)
    t = text.load_pubmed_rct(folder, splits=("train", "dev", "test")).table  # the folder itself as root
    _check_table(t, _expected(("train", "dev", "test")))
    with pytest.raises(ValueError, match="splits"):
        text.load_pubmed_rct(folder, splits=("train", "val"))


@pytest.mark.parametrize("train_as", ["7z", "txt"])
def test_pubmed_limit_per_file(tmp_path, train_as):
    make_pubmed(tmp_path, train_as=train_as)
    t = text.load_pubmed_rct(tmp_path, limit=5).table
    rows = _expected()
    n_train = sum(len(s) for _, s in PUBMED["train"])
    _check_table(t, rows[:5] + rows[n_train:n_train + 3])  # 5 of 6 train sentences, all 3 test


def test_pubmed_crlf_and_last_abstract_without_blank_line(tmp_path):
    folder = make_pubmed(tmp_path)
    (folder / text.PUBMED_TEST_TXT).write_text(pubmed_text(PUBMED["test"], newline="\r\n").rstrip("\r\n"),
                                               encoding="utf-8", newline="")
    _check_table(text.load_pubmed_rct(tmp_path).table, _expected())


def test_pubmed_missing_files_named(tmp_path):
    with pytest.raises(DataError) as e:
        text.load_pubmed_rct(tmp_path / "nowhere")
    assert text.PUBMED_OFFICIAL_URL in str(e.value) and text.PUBMED_ACCESS_TERMS in str(e.value)
    folder = make_pubmed(tmp_path / "a", train_as=None)
    with pytest.raises(DataError, match=rf"{text.PUBMED_TRAIN_7Z}: file not found"):
        text.load_pubmed_rct(tmp_path / "a")
    folder = make_pubmed(tmp_path / "b")
    (folder / text.PUBMED_TEST_TXT).unlink()
    with pytest.raises(DataError, match=rf"{text.PUBMED_TEST_TXT}: file not found"):
        text.load_pubmed_rct(tmp_path / "b")
    (folder / text.PUBMED_DEV_TXT).unlink()  # dev is not needed for train + test
    with pytest.raises(DataError, match=text.PUBMED_TEST_TXT):
        text.load_pubmed_rct(tmp_path / "b")


def test_pubmed_damaged_7z_named(tmp_path):
    folder = make_pubmed(tmp_path)
    arc = folder / text.PUBMED_TRAIN_7Z
    good = arc.read_bytes()
    arc.write_bytes(good[: len(good) // 2])  # truncated download
    with pytest.raises(DataError, match=rf"{text.PUBMED_TRAIN_7Z}: cannot be read as a 7z archive"):
        text.load_pubmed_rct(tmp_path)
    with py7zr.SevenZipFile(arc, "w") as z:  # an archive without train.txt
        z.writestr(b"x", "other.txt")
    with pytest.raises(DataError, match=rf"{text.PUBMED_TRAIN_7Z}: no member 'train.txt'"):
        text.load_pubmed_rct(tmp_path)


def test_pubmed_corrupted_7z_payload_named(tmp_path):
    # a payload byte flipped: the LZMA decoder (or else the CRC of train.txt) must reject it
    big = {**PUBMED, "train": [(10_000 + i, [("METHODS", f"sentence number {i} of a longer file .")])
                               for i in range(200)]}
    folder = make_pubmed(tmp_path, data=big)
    arc = folder / text.PUBMED_TRAIN_7Z
    raw = bytearray(arc.read_bytes())
    raw[32 + 200] ^= 0xFF  # inside the packed stream (the 32-byte signature header comes first)
    arc.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=rf"{text.PUBMED_TRAIN_7Z}"):
        text.load_pubmed_rct(tmp_path)


@pytest.mark.parametrize("body, message", [
    ("###1\nMETHODS\tok .\nDISCUSSION\tnot a class .\n\n", r"line 3: label 'DISCUSSION'"),
    ("###1\nMETHODS no tab here .\n\n", r"line 2: expected LABEL<TAB>sentence .*found 0 tab"),
    ("###1\nMETHODS\ta\tb\n\n", r"line 2: .*found 2 tab"),
    ("METHODS\tbefore any id .\n\n", r"line 1: sentence line outside an abstract"),
    ("###1\nMETHODS\tok .\n\nRESULTS\tafter the blank line .\n", r"line 4: sentence line outside"),
    ("###abc\nMETHODS\tok .\n\n", r"line 1: abstract id 'abc'"),
])
@pytest.mark.parametrize("where", ["test", "train7z"])
def test_pubmed_bad_lines_named(tmp_path, body, message, where):
    folder = make_pubmed(tmp_path)
    if where == "test":
        (folder / text.PUBMED_TEST_TXT).write_text(body, encoding="utf-8")
        name = text.PUBMED_TEST_TXT
    else:
        with py7zr.SevenZipFile(folder / text.PUBMED_TRAIN_7Z, "w") as z:
            z.writestr(body.encode(), text.PUBMED_TRAIN_TXT)
        name = f"{text.PUBMED_TRAIN_7Z}:{text.PUBMED_TRAIN_TXT}"
    with pytest.raises(DataError, match=rf"{name}: {message}"):
        text.load_pubmed_rct(tmp_path)


# ----------------------------------------------------------------------------- tokens
CORPUS = [s.lower() for _, sents in sum(PUBMED.values(), []) for _, s in sents] + \
         [a for _, a in MEDABS_TRAIN + MEDABS_TEST]


@pytest.fixture(scope="module")
def tiny_tokenizer_dir(tmp_path_factory):
    """A byte-level BPE tokenizer in RoBERTa's shape (<s> 0, <pad> 1, </s> 2; <s> ... </s>),
    trained here and saved as a transformers tokenizer folder."""
    pytest.importorskip("tokenizers")
    from tokenizers import ByteLevelBPETokenizer
    from tokenizers.processors import RobertaProcessing
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS * 3, vocab_size=320, min_frequency=1,
                            special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    bpe._tokenizer.post_processor = RobertaProcessing(("</s>", bpe.token_to_id("</s>")),
                                                      ("<s>", bpe.token_to_id("<s>")))
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>", mask_token="<mask>", model_max_length=512)
    d = tmp_path_factory.mktemp("tok")
    fast.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir):
    return text.load_tokenizer(tiny_tokenizer_dir, offline=True)


def test_tokenize_matches_tokenizer_and_pads(tok):
    texts = CORPUS[:6]
    ids = text.tokenize(texts, tok)
    assert ids.dtype == np.int64 and ids.shape == (6, text.MAX_LENGTH)
    direct = tok(texts, padding="max_length", truncation=True, max_length=512)["input_ids"]
    np.testing.assert_array_equal(ids, np.asarray(direct))
    assert tok.pad_token_id == 1 and tok.padding_side == "right"
    for row, t in zip(ids, texts):
        plain = tok(t)["input_ids"]  # unpadded, with <s> ... </s>
        assert plain[0] == tok.bos_token_id and plain[-1] == tok.eos_token_id
        assert row[: len(plain)].tolist() == plain
        assert (row[len(plain):] == tok.pad_token_id).all()
        assert int((row != tok.pad_token_id).sum()) == len(plain)  # the model's attention mask


def test_tokenize_truncation_keeps_first_tokens_and_end_token(tok):
    long = " ".join(CORPUS)
    plain = tok(long)["input_ids"]
    L = 16
    assert len(plain) > L
    row = text.tokenize([long], tok, max_length=L)[0]
    assert row.tolist() == plain[: L - 1] + [tok.eos_token_id]
    np.testing.assert_array_equal(row, tok([long], truncation=True, max_length=L)["input_ids"][0])
    # batches of any size give the same ids
    np.testing.assert_array_equal(text.tokenize(CORPUS, tok, max_length=L, batch_size=3),
                                  text.tokenize(CORPUS, tok, max_length=L))


def test_tokenize_loaded_table_end_to_end(tmp_path, tok):
    make_pubmed(tmp_path)
    t = text.load_pubmed_rct(tmp_path).table
    ids = text.tokenize(t["text"], tok, max_length=128)
    assert ids.shape == (len(t), 128)
    assert (ids[:, -1] == tok.pad_token_id).all()  # no sentence truncated at 128
    assert (ids[:, 0] == tok.bos_token_id).all()
    assert tok.decode([i for i in ids[1] if i != tok.pad_token_id], skip_special_tokens=True) == t["text"].iloc[1]


def test_tokenize_rejects_bad_input(tok):
    with pytest.raises(ValueError, match=r"texts\[1\] is NoneType"):
        text.tokenize(["a", None], tok)
    with pytest.raises(ValueError, match="max_length"):
        text.tokenize(["a"], tok, max_length=0)

    class NoPad:
        pad_token_id = None

    with pytest.raises(ValueError, match="no pad token"):
        text.tokenize(["a"], NoPad())


def test_load_tokenizer_offline_uncached_raises_missing_weights(tmp_path, monkeypatch):
    home = tmp_path / "hf_home"
    home.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    with pytest.raises(MissingWeightsError) as e:
        text.load_tokenizer("medpfl-test/no-such-tokenizer")
    msg = str(e.value)
    assert "medpfl-test/no-such-tokenizer" in msg and str(home / "hub") in msg and "HF_HOME" in msg
    assert "offline" in msg
    empty = tmp_path / "empty_folder"
    empty.mkdir()
    with pytest.raises(MissingWeightsError, match="no loadable tokenizer files"):
        text.load_tokenizer(empty, offline=True)
