"""Tiny copies of FHBench's six folder data sets in their official layouts, in one mirror folder.

:func:`write_mirror` writes, under ``<mirror>/<the registry's first root name>``, each data set
with the writers of the reader tests (the real libraries: pandas CSVs, ``py7zr`` for PubMed's
``train.7z``, ``mne``/``eeglabio`` EEGLAB ``.set``, ``wfdb.wrsamp`` records, ``soundfile`` wavs):

==============  =======================================  ==================  ====================
data set        writer                                   ``size="test"``      ``size="study"``
==============  =======================================  ==================  ====================
medabstracts    ``test_text_data.make_medabs``           5 abstracts         100 (80 train)
pubmed200k      ``test_text_data.make_pubmed``           9 sentences         96 (72 train)
adftd           ``test_adftd.make_adftd``                3 subjects, 6 win.  8 subjects, 80 win.
ptbxl           ``test_ptbxl.make_ptbxl`` + SHA256SUMS   5 records, 50 win.  the same
icbhi           ``test_audio_data.write_icbhi``          6 cycles            8 recordings, 48
sprsound        ``test_audio_data.write_sprsound``       8 events            8 recordings, 48
==============  =======================================  ==================  ====================

``size="study"`` has enough samples per class for a few clients and FHBench's 4:3:3 local split
(the CPU study ``config/fhbench-multimodal-cpu.yaml``); its text carries class words so that a
tiny model can learn something. :func:`write_tokenizer` writes a tiny byte-level BPE tokenizer
in RoBERTa's shape (``<s>`` 0, ``<pad>`` 1, ``</s>`` 2; vocabulary :data:`TOKENIZER_VOCAB`),
loaded by ``AutoTokenizer.from_pretrained(folder)``.

Used by the tests (``tests/test_multimodal_registry.py``) and by
``scripts/fhbench_cpu_fixtures.py`` (which puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_adftd import make_adftd  # noqa: E402
from test_audio_data import ICBHI_RECS, SPRS_RECS, write_icbhi, write_sprsound  # noqa: E402
from test_ptbxl import make_ptbxl  # noqa: E402
from test_text_data import MEDABS_TEST, MEDABS_TRAIN, PUBMED, make_medabs, make_pubmed  # noqa: E402

from medpfl.data import multimodal  # noqa: E402

DATASETS = ("medabstracts", "pubmed200k", "adftd", "ptbxl", "icbhi", "sprsound")
SIZES = ("test", "study")
TOKENIZER_VOCAB = 300  # ids < 300: a tiny roberta-lora needs config.vocab_size >= this

_MEDABS_WORDS = ("tumour carcinoma neoplasm", "colon liver stomach", "nerve brain seizure",
                 "heart artery cardiac", "fever pain syndrome")
_PUBMED_WORDS = {"BACKGROUND": "is associated with", "CONCLUSIONS": "these results suggest",
                 "METHODS": "patients were randomized", "OBJECTIVE": "to evaluate the effect",
                 "RESULTS": "the outcome improved"}


def root_of(mirror: str | Path, name: str) -> Path:
    """``<mirror>/<the registry's first root name of name>``."""
    return Path(mirror) / multimodal.FOLDER_DATASETS[name].root_names[0]


def _medabs_rows(n: int, offset: int, rng: np.random.Generator) -> list[tuple[int, str]]:
    rows = []
    for i in range(n):
        k = (i + offset) % 5
        words = _MEDABS_WORDS[k].split()
        rows.append((k + 1, f"Case {i}: the {rng.choice(words)} and {rng.choice(words)} finding was studied. "))
    return rows


def _pubmed(n_abstracts: int, first_pmid: int) -> list[tuple[int, list[tuple[str, str]]]]:
    out = []
    for a in range(n_abstracts):
        out.append((first_pmid + a, [(lab, f"Sentence {a} {_PUBMED_WORDS[lab]} here .")
                                     for lab in ("OBJECTIVE", "BACKGROUND", "METHODS", "RESULTS", "CONCLUSIONS",
                                                 "RESULTS")]))
    return out


def _eeg(sid: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(sid)
    t = np.arange(n) / 500.0
    return 20.0 * rng.standard_normal((19, n)) + 30.0 * np.sin(2 * np.pi * (4 + 3 * (sid % 3)) * t)[None, :]


def _icbhi_study() -> dict:
    recs = {}
    for r in range(8):
        pid = 101 + r // 2
        stem = f"{pid}_{r % 2 + 1}b1_Al_sc_Meditron"
        cycles = [(0.5 + 2.0 * c, 2.3 + 2.0 * c, (c + r) % 2, ((c + r) // 2) % 2) for c in range(6)]
        recs[stem] = (4000, 1, 13.0, 150.0 + 20 * r, cycles, "train" if r % 4 < 3 else "test")
    return recs


def _sprs_study() -> dict:
    types = ("Normal", "Fine Crackle", "Wheeze", "Normal", "Coarse Crackle", "Rhonchi")
    recs = {}
    for r in range(8):
        pid = 40000000 + 1000 * (r // 2)
        part = 0 if r < 6 else r - 5
        events = [(str(500 + 1500 * e), str(1700 + 1500 * e), types[(e + r) % len(types)]) for e in range(6)]
        recs[f"{pid}_4.{r}_1_p{r % 4 + 1}_{100 + r}"] = (part, 8000, 10.0, 180.0 + 15 * r, "CAS", events)
    return recs


def write_sums(root: Path) -> None:
    """``SHA256SUMS.txt`` as PhysioNet publishes it: ``<hex> <relative path>`` for every file."""
    import hashlib

    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != "SHA256SUMS.txt")
    (root / "SHA256SUMS.txt").write_text(
        "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()} {p.relative_to(root).as_posix()}\n" for p in files))


def write_dataset(mirror: str | Path, name: str, size: str = "test") -> Path:
    """Write one tiny data set (``name`` of :data:`DATASETS`) under its official root folder
    name in ``mirror``; return that root. ``size``: ``test`` (the reader tests' fixtures) or
    ``study`` (more samples, see the module docstring). Raises ValueError for an unknown name or size."""
    if name not in DATASETS or size not in SIZES:
        raise ValueError(f"unknown data set {name!r} or size {size!r} ({DATASETS}, {SIZES})")
    root = root_of(mirror, name)
    rng = np.random.default_rng(0)
    if name == "medabstracts":
        if size == "test":
            make_medabs(root, MEDABS_TRAIN, MEDABS_TEST)
        else:
            make_medabs(root, _medabs_rows(80, 0, rng), _medabs_rows(20, 3, rng))
    elif name == "pubmed200k":
        data = PUBMED if size == "test" else {"train": _pubmed(12, 1000), "dev": _pubmed(1, 5000),
                                              "test": _pubmed(4, 9000)}
        make_pubmed(root, data, sub=None)
    elif name == "adftd":
        subjects = ({1: ("C", 1537), 2: ("F", 1537), 3: ("A", 1537)} if size == "test" else
                    {sid: ("CFA"[(sid - 1) % 3], 5000) for sid in range(1, 9)})
        make_adftd(root, {sid: (g, _eeg(sid, n)) for sid, (g, n) in subjects.items()}, raw_too=False)
    elif name == "ptbxl":
        root.mkdir(parents=True, exist_ok=True)
        make_ptbxl(root)
        write_sums(root)
    elif name == "icbhi":
        write_icbhi(root, ICBHI_RECS if size == "test" else _icbhi_study())
    else:
        write_sprsound(root.parent, SPRS_RECS if size == "test" else _sprs_study())
    return root


def write_mirror(mirror: str | Path, size: str = "test", datasets=DATASETS) -> Path:
    """Write every data set of ``datasets`` into ``mirror`` (created); return ``mirror``."""
    mirror = Path(mirror)
    mirror.mkdir(parents=True, exist_ok=True)
    for name in datasets:
        write_dataset(mirror, name, size)
    return mirror


def write_tokenizer(folder: str | Path, extra_texts=()) -> Path:
    """A byte-level BPE tokenizer in RoBERTa's shape, trained on the fixtures' texts (and
    ``extra_texts``), saved as a transformers tokenizer folder; returns ``folder``."""
    from tokenizers import ByteLevelBPETokenizer
    from tokenizers.processors import RobertaProcessing
    from transformers import PreTrainedTokenizerFast

    rng = np.random.default_rng(0)
    corpus = [t for _, t in MEDABS_TRAIN + MEDABS_TEST + _medabs_rows(40, 0, rng)]
    corpus += [s.lower() for split in PUBMED.values() for _, sents in split for _, s in sents]
    corpus += [s.lower() for _, sents in _pubmed(5, 1) for _, s in sents] + list(extra_texts)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus * 3, vocab_size=TOKENIZER_VOCAB, min_frequency=1,
                            special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    bpe._tokenizer.post_processor = RobertaProcessing(("</s>", bpe.token_to_id("</s>")),
                                                      ("<s>", bpe.token_to_id("<s>")))
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>", mask_token="<mask>", model_max_length=512)
    folder = Path(folder)
    fast.save_pretrained(folder)
    return folder
