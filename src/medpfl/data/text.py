"""FHBench's two text data sets (Medical Abstracts, PubMed 200k RCT): readers and tokenisation.

First building block of FHBench's text track. Like :mod:`medpfl.data.ptbxl` it is **not yet
wired** into the download -> preprocess -> partition stages (no Snakemake rule, no
:class:`DatasetSpec`), and no model (``roberta-lora``) consumes it yet (``docs/multimodal.md``).

The readers return the *strings* (``table["text"]``, ``x`` is None); :func:`tokenize` turns
them into int64 token ids ``[N, 512]`` padded with the tokenizer's ``pad_token_id`` (the model
derives its attention mask from ``input_ids != pad_token_id``). Tokenise **after** the data
fraction is drawn: all 2.3 M PubMed sentences at 512 tokens would take 9.4 GB as int64.

Sources
-------
- [MA] Medical-Abstracts-TC-Corpus, https://github.com/sebischair/Medical-Abstracts-TC-Corpus
  (Schopf et al. 2023, CC BY-SA 3.0): ``medical_tc_train.csv`` and ``medical_tc_test.csv``, a
  header ``condition_label,medical_abstract``, one abstract per row (quoted; the label 1-5);
  ``medical_tc_labels.csv`` (``condition_label,condition_name``) names the five classes.
- [PM] PubMed 200k RCT, https://github.com/Franck-Dernoncourt/pubmed-rct (Dernoncourt & Lee
  2017, built on the MEDLINE/PubMed 2016 baseline; no licence file, its README defers to NLM's
  terms): folder ``PubMed_200k_RCT/`` with ``train.7z`` (holding ``train.txt``; GitHub's
  100 MiB limit), ``dev.txt``, ``test.txt``. Each abstract is a ``###<PMID>`` line, then one
  ``LABEL<TAB>sentence`` line per sentence, then a blank line.
- [P] the FHBench paper, Appendix A, and [C] its code (github wph6/FHBench,
  ``NLP_Lora/datautil/prepare_data.py`` and ``NLP_Lora/llm_lora_fed.py``), as summarised in
  ``/work/shared/docs/methods-pfedkdwcl-epfl.md`` part B (B.3 per-data-set table, B.4) and
  ``/work/shared/docs/fhbench-multimodal-notes.md``.

Rules implemented (each with its source)
----------------------------------------
Medical Abstracts:

1. Rows [C]: ``medical_tc_train.csv`` then ``medical_tc_test.csv``, concatenated in file order;
   ``split`` keeps which file a row came from.
2. Label [C]: ``condition_label - 1`` (0-4); text: ``medical_abstract`` as it is in the file
   (no stripping or lower-casing; the CSV reader unquotes it).
3. Class names [MA]: from ``medical_tc_labels.csv`` when it is in the folder, else
   :data:`MEDABS_CLASS_NAMES` (the same five names, copied from that file).
4. Fraction [C]: FHBench uses a 50 % subset; it is **not** drawn here (the partition stage's
   data fraction draws it), so both the full and the subset readings stay possible.

PubMed 200k RCT:

5. Files [C]: ``train.txt`` then ``test.txt`` (``dev.txt`` is not used; ``splits=`` can add it).
   ``train.txt`` is read from a plain ``train.txt`` in the folder if present, else streamed out
   of ``train.7z`` with ``py7zr`` (never written to disk).
6. Parsing [PM, C]: a ``###`` line starts an abstract (its id, the PMID, is ``abstract_id``); a
   blank line ends it; every other line is one sentence ``LABEL<TAB>sentence`` split at its
   one tab; label and sentence are stripped of surrounding white space; ``sentence_index`` is
   the sentence's 0-based position in its abstract.
7. Text [C]: the sentence lower-cased (``str.lower``).
8. Labels [C]: sklearn's ``LabelEncoder`` fitted on the train labels, i.e. alphabetical:
   BACKGROUND 0, CONCLUSIONS 1, METHODS 2, OBJECTIVE 3, RESULTS 4 (:data:`PUBMED_CLASS_NAMES`).
   Fixed here, so a label outside the five is an error rather than a new class.
9. Fraction [C]: FHBench uses 0.5 % of the sentences; as rule 4, drawn by the partition stage.

Tokens (both sets):

10. [C] ``AutoTokenizer.from_pretrained("roberta-base")``, then
    ``tokenizer(text, padding="max_length", truncation=True)`` with no ``max_length``, i.e. the
    tokenizer's ``model_max_length``, 512 for ``roberta-base``; spec B.3 ("padding=max_length
    (512)") and B.4 note 16 ("Text is padded to 512 tokens") for both sets. :data:`MAX_LENGTH`.
    Truncation keeps the first tokens and the special tokens (``<s> ... </s>``).

Errors: :class:`medpfl.errors.DataError` naming the file (and the data row or line) for a
missing root, file or column, an unreadable CSV, ``.7z`` or text file, a label outside its set,
an empty abstract, a sentence line without exactly one tab or outside an abstract, a ``###``
line whose id is not an integer. :class:`medpfl.errors.MissingWeightsError` from
:func:`load_tokenizer` when the tokenizer is neither cached nor downloadable.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from medpfl.errors import DataError, MissingWeightsError

# --------------------------------------------------------------------------- Medical Abstracts
MEDABS_OFFICIAL_URL = "https://github.com/sebischair/Medical-Abstracts-TC-Corpus"
MEDABS_ACCESS_TERMS = "CC BY-SA 3.0 (public GitHub repository, no registration)"
MEDABS_TRAIN_CSV = "medical_tc_train.csv"
MEDABS_TEST_CSV = "medical_tc_test.csv"
MEDABS_LABELS_CSV = "medical_tc_labels.csv"
MEDABS_COLUMNS = ("condition_label", "medical_abstract")
#: class names by label index (``condition_label - 1``), as in ``medical_tc_labels.csv`` [MA]
MEDABS_CLASS_NAMES = ("neoplasms", "digestive system diseases", "nervous system diseases",
                      "cardiovascular diseases", "general pathological conditions")

# --------------------------------------------------------------------------- PubMed 200k RCT
PUBMED_OFFICIAL_URL = "https://github.com/Franck-Dernoncourt/pubmed-rct"
PUBMED_ACCESS_TERMS = ("no licence file; built on the MEDLINE/PubMed 2016 baseline, NLM terms "
                       "(https://www.nlm.nih.gov/web_policies.html#copyright); public GitHub repository")
PUBMED_FOLDER = "PubMed_200k_RCT"
PUBMED_TRAIN_7Z = "train.7z"
PUBMED_TRAIN_TXT = "train.txt"
PUBMED_DEV_TXT = "dev.txt"
PUBMED_TEST_TXT = "test.txt"
#: sentence labels in sklearn ``LabelEncoder`` (alphabetical) order [C]
PUBMED_CLASS_NAMES = ("BACKGROUND", "CONCLUSIONS", "METHODS", "OBJECTIVE", "RESULTS")
PUBMED_LABELS = {name: i for i, name in enumerate(PUBMED_CLASS_NAMES)}
PUBMED_SPLITS = ("train", "test")  # FHBench [C]; "dev" is available through ``splits=``
_PUBMED_FILES = {"train": PUBMED_TRAIN_TXT, "dev": PUBMED_DEV_TXT, "test": PUBMED_TEST_TXT}

# --------------------------------------------------------------------------- tokens
MAX_LENGTH = 512  # tokens per text, both sets (module rule 10)
DEFAULT_TOKENIZER = "roberta-base"  # FHBench [C]


@dataclass
class TextSamples:
    """A text data set as read from its official files (not tokenised).

    ``x``: always None for text (the interface's slot for the model input; the strings are in
    ``table["text"]``, :func:`tokenize` makes the int64 ``[N, L]`` ids). ``table``: one row per
    sample, ``sample_id`` int64 0..N-1 in row order, ``label`` int64 0..num_classes-1, ``split``
    str ("train"/"test"), the source's own ids (see the loaders), ``text`` str. ``class_names``:
    label names by class index.
    """

    x: np.ndarray | None
    table: pd.DataFrame
    class_names: tuple[str, ...]


def _check_root(root: str | Path, name: str, url: str, terms: str) -> Path:
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{root}: {name} folder not found; get it from {url} ({terms})")
    return root


def _check_limit(limit: int | None) -> None:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be a non-negative int or None, got {limit!r}")


# =========================================================================== Medical Abstracts
def read_medabs_class_names(root: str | Path) -> tuple[str, ...]:
    """Class names by label index: ``medical_tc_labels.csv`` if present, else the constant.

    The file must have ``condition_label`` (exactly 1..5, any row order) and ``condition_name``;
    name ``i`` is that of ``condition_label == i + 1``. Raises DataError naming the file.
    """
    path = Path(root) / MEDABS_LABELS_CSV
    if not path.exists():
        return MEDABS_CLASS_NAMES
    df = _read_csv(path, ("condition_label", "condition_name"))
    labels = pd.to_numeric(df["condition_label"], errors="coerce")
    want = list(range(1, len(MEDABS_CLASS_NAMES) + 1))
    if labels.isna().any() or sorted(labels.tolist()) != want or df["condition_name"].str.strip().eq("").any():
        raise DataError(f"{path}: condition_label must be exactly {want} with a condition_name each, "
                        f"got {df['condition_label'].tolist()}")
    by_label = dict(zip(labels.astype(int), df["condition_name"].astype(str)))
    return tuple(by_label[i] for i in want)


def _read_csv(path: Path, columns: tuple[str, ...]) -> pd.DataFrame:
    if not path.is_file():
        raise DataError(f"{path}: file not found (the Medical-Abstracts-TC-Corpus keeps it at its root, "
                        f"{MEDABS_OFFICIAL_URL})")
    try:
        # every field as the file's string: no "NA"/"null" -> NaN guessing (an empty field is "")
        df = pd.read_csv(path, encoding="utf-8", dtype=str, keep_default_na=False)
    except Exception as e:  # noqa: BLE001 - any parse failure is reported with the file name
        raise DataError(f"{path}: cannot be read as a UTF-8 CSV ({type(e).__name__}: {e})") from e
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise DataError(f"{path}: missing column(s) {', '.join(missing)} (expected {', '.join(columns)})")
    return df


def read_medabs_csv(path: str | Path, limit: int | None = None) -> pd.DataFrame:
    """One of the corpus' CSVs -> ``source_row`` (int64, 0-based data row), ``label`` (int64,
    ``condition_label - 1``), ``text`` (str, ``medical_abstract`` unchanged), in file order.

    ``limit``: only the first ``limit`` rows. Raises DataError naming the file and the data row
    for a label that is not an integer in 1..5 or an empty abstract.
    """
    path = Path(path)
    df = _read_csv(path, MEDABS_COLUMNS)
    if limit is not None:
        df = df.iloc[:limit]
    n_classes = len(MEDABS_CLASS_NAMES)
    raw = df["condition_label"]
    num = pd.to_numeric(raw, errors="coerce")
    bad = num.isna() | (num != num.round()) | (num < 1) | (num > n_classes)
    if bad.any():
        i = int(np.flatnonzero(bad.to_numpy())[0])
        raise DataError(f"{path}: data row {i} (0-based, after the header): condition_label {raw.iloc[i]!r} "
                        f"is not an integer in 1..{n_classes}")
    text = df["medical_abstract"]
    empty = text.str.strip() == ""
    if empty.any():
        i = int(np.flatnonzero(empty.to_numpy())[0])
        raise DataError(f"{path}: data row {i} (0-based, after the header): empty medical_abstract")
    return pd.DataFrame({
        "source_row": np.arange(len(df), dtype="int64"),
        "label": (num.to_numpy() - 1).astype("int64"),
        "text": text.astype(str).to_numpy(),
    })


def load_medical_abstracts(root: str | Path, limit: int | None = None) -> TextSamples:
    """Read the Medical-Abstracts-TC-Corpus at ``root`` (its repository folder) the FHBench way.

    Returns :class:`TextSamples` with ``x`` None and ``table`` columns ``sample_id`` (int64),
    ``label`` (int64, 0-4 = ``condition_label - 1``), ``split`` ("train" for rows of
    ``medical_tc_train.csv``, then "test"), ``source_row`` (int64, the row in its CSV, 0-based
    after the header), ``text`` (str). Module rules 1-4: all rows, no 50 % subset here.
    ``limit``: only the first ``limit`` rows of *each* CSV (smoke runs; both splits present).
    Full set: 11,550 + 2,888 = 14,438 rows [MA, spec B.4]. Raises DataError (module docstring).
    """
    _check_limit(limit)
    root = _check_root(root, "Medical-Abstracts-TC-Corpus", MEDABS_OFFICIAL_URL, MEDABS_ACCESS_TERMS)
    class_names = read_medabs_class_names(root)
    parts = []
    for split, name in (("train", MEDABS_TRAIN_CSV), ("test", MEDABS_TEST_CSV)):
        part = read_medabs_csv(root / name, limit)
        part.insert(1, "split", split)
        parts.append(part)
    table = pd.concat(parts, ignore_index=True)
    table.insert(0, "sample_id", np.arange(len(table), dtype="int64"))
    table = table[["sample_id", "label", "split", "source_row", "text"]]
    return TextSamples(x=None, table=table, class_names=class_names)


# =========================================================================== PubMed 200k RCT
class _Enough(Exception):
    """Raised inside the stream to stop reading once ``limit`` sentences are kept."""


class _PubmedParser:
    """Push parser for the ``###id`` / ``LABEL<TAB>sentence`` / blank-line format (rules 6-8).

    Fed one line at a time (without its line break); labels and ids go to compact typed arrays
    (17 bytes a sentence), the sentences to a list of str.
    """

    def __init__(self, path: Path, split: str, limit: int | None,
                 labels: array, ids: array, index: array, texts: list[str], splits: list[str]):
        self.path, self.split, self.limit = path, split, limit
        self.labels, self.ids, self.index, self.texts, self.splits = labels, ids, index, texts, splits
        self.lineno = 0
        self.kept = 0
        self.abstract: int | None = None
        self.next_index = 0

    def feed(self, line: str) -> None:
        self.lineno += 1
        if line.startswith("###"):
            head = line[3:].strip()
            try:
                self.abstract = int(head)
            except ValueError:
                raise DataError(f"{self.path}: line {self.lineno}: abstract id {head!r} after ### is not an "
                                "integer (a PMID)") from None
            self.next_index = 0
            return
        if not line.strip():
            self.abstract = None
            return
        if self.abstract is None:
            raise DataError(f"{self.path}: line {self.lineno}: sentence line outside an abstract (no ###<id> "
                            "line since the last blank line)")
        parts = line.split("\t")
        if len(parts) != 2:
            raise DataError(f"{self.path}: line {self.lineno}: expected LABEL<TAB>sentence (one tab), "
                            f"found {len(parts) - 1} tab(s)")
        label = parts[0].strip()
        code = PUBMED_LABELS.get(label)
        if code is None:
            raise DataError(f"{self.path}: line {self.lineno}: label {label!r} not in {list(PUBMED_CLASS_NAMES)}")
        if self.limit is not None and self.kept >= self.limit:
            raise _Enough
        self.labels.append(code)
        self.ids.append(self.abstract)
        self.index.append(self.next_index)
        self.texts.append(parts[1].strip().lower())
        self.splits.append(self.split)
        self.next_index += 1
        self.kept += 1


def _stream_text(path: Path, feed: Callable[[str], None]) -> None:
    if not path.is_file():
        raise DataError(f"{path}: file not found (PubMed 200k RCT keeps it in {PUBMED_FOLDER}/, "
                        f"{PUBMED_OFFICIAL_URL})")
    try:
        with open(path, encoding="utf-8", newline=None) as f:
            for line in f:
                feed(line.rstrip("\n"))
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e})") from e
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e})") from e


def _stream_7z(path: Path, member: str, feed: Callable[[str], None]) -> None:
    """Decompress ``member`` of the ``.7z`` at ``path`` with py7zr and feed its lines as they come."""
    import py7zr  # noqa: PLC0415 - only needed for the PubMed train archive
    from py7zr.io import Py7zIO, WriterFactory  # noqa: PLC0415

    class _LineSink(Py7zIO):
        def __init__(self) -> None:
            self.tail = b""
            self.n = 0
            self.lineno = 0

        def _emit(self, raw: bytes) -> None:
            self.lineno += 1
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: {member}: line {self.lineno} is not UTF-8 ({e})") from e
            feed(text[:-1] if text.endswith("\r") else text)

        def write(self, s: bytes | bytearray) -> int:
            lines = (self.tail + bytes(s)).split(b"\n")
            self.tail = lines.pop()
            for raw in lines:
                self._emit(raw)
            self.n += len(s)
            return len(s)

        def close(self) -> None:  # called once the member is fully decompressed (CRC not yet checked)
            if self.tail:
                self._emit(self.tail)
                self.tail = b""

        def read(self, size: int | None = None) -> bytes:
            return b""

        def seek(self, offset: int, whence: int = 0) -> int:
            return 0

        def flush(self) -> None:
            return None

        def size(self) -> int:
            return self.n

    class _Factory(WriterFactory):
        def create(self, filename: str) -> Py7zIO:
            return _LineSink()

    if not path.is_file():
        raise DataError(f"{path}: file not found (PubMed 200k RCT keeps it in {PUBMED_FOLDER}/, "
                        f"{PUBMED_OFFICIAL_URL}; a plain {PUBMED_TRAIN_TXT} next to it is read instead)")
    try:
        with py7zr.SevenZipFile(path, mode="r") as z:
            names = z.getnames()
            if member not in names:
                raise DataError(f"{path}: no member {member!r} in the archive (members: {names[:5]})")
            z.extract(targets=[member], factory=_Factory())
    except (DataError, _Enough):
        raise
    except Exception as e:  # noqa: BLE001 - py7zr raises Bad7zFile, CrcError, LZMAError, EOFError, ...
        raise DataError(f"{path}: cannot be read as a 7z archive holding {member} ({type(e).__name__}: {e})") from e


def _pubmed_folder(root: Path) -> Path:
    sub = root / PUBMED_FOLDER
    return sub if sub.is_dir() else root


def load_pubmed_rct(root: str | Path, splits: Sequence[str] = PUBMED_SPLITS,
                    limit: int | None = None) -> TextSamples:
    """Read PubMed 200k RCT at ``root`` the FHBench way (module rules 5-9): one row per sentence.

    ``root``: the repository folder (holding ``PubMed_200k_RCT/``) or that folder itself.
    ``splits``: the files read, in this order (FHBench: ``("train", "test")``; "dev" may be added).
    ``limit``: only the first ``limit`` sentences of *each* file (smoke runs; with it the
    ``train.7z`` stream stops early and its CRC is not checked).

    Returns :class:`TextSamples` with ``x`` None and ``table`` columns ``sample_id`` (int64),
    ``label`` (int64, BACKGROUND 0, CONCLUSIONS 1, METHODS 2, OBJECTIVE 3, RESULTS 4), ``split``
    (str), ``abstract_id`` (int64, the PMID of the ``###`` line: the grouping key; text has no
    subjects), ``sentence_index`` (int64, 0-based within the abstract), ``text`` (str,
    lower-cased). Rows: file by file in ``splits`` order, lines in file order. No 0.5 % subset.

    Memory: ``train.7z`` is decompressed as a stream, never to disk or whole into memory; the
    Python strings are the peak. Measured on a synthetic 241,200-sentence ``train.7z`` (~110
    characters a sentence): 128 MB peak (tracemalloc), 38 MB for the final table; so about
    1.2 GB peak and 0.4 GB kept for the real ~2.3 M sentences (an extrapolation), ~30 s on
    this CPU (3 s for the synthetic file).
    Raises DataError naming the file and line (module docstring).
    """
    _check_limit(limit)
    bad = [s for s in splits if s not in _PUBMED_FILES]
    if bad or len(set(splits)) != len(splits) or not splits:
        raise ValueError(f"splits must be distinct names among {list(_PUBMED_FILES)}, got {list(splits)}")
    root = _check_root(root, "PubMed 200k RCT", PUBMED_OFFICIAL_URL, PUBMED_ACCESS_TERMS)
    folder = _pubmed_folder(root)
    labels, ids, index = array("b"), array("q"), array("q")
    texts: list[str] = []
    split_col: list[str] = []
    for split in splits:
        name = _PUBMED_FILES[split]
        txt = folder / name
        if split == "train" and not txt.is_file():
            source, member = folder / PUBMED_TRAIN_7Z, PUBMED_TRAIN_TXT
        else:
            source, member = txt, None
        parser = _PubmedParser(source if member is None else Path(f"{source}:{member}"), split, limit,
                               labels, ids, index, texts, split_col)
        try:
            if member is None:
                _stream_text(source, parser.feed)
            else:
                _stream_7z(source, member, parser.feed)
        except _Enough:
            pass
    n = len(texts)
    table = pd.DataFrame({
        "sample_id": np.arange(n, dtype="int64"),
        "label": np.frombuffer(labels, dtype=np.int8).astype("int64") if n else np.zeros(0, "int64"),
        "split": split_col,
        "abstract_id": np.frombuffer(ids, dtype=np.int64).copy() if n else np.zeros(0, "int64"),
        "sentence_index": np.frombuffer(index, dtype=np.int64).copy() if n else np.zeros(0, "int64"),
        "text": texts,
    })
    table["split"] = table["split"].astype(str)
    table["text"] = table["text"].astype(str)
    return TextSamples(x=None, table=table, class_names=PUBMED_CLASS_NAMES)


# =========================================================================== tokens
def _truthy(value: str | None) -> bool:
    return (value or "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache folder, read from the environment *now*.

    ``HF_HUB_CACHE`` if set, else ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``,
    else ``~/.cache/huggingface/hub`` (huggingface_hub's documented order; it reads them once at
    import, so this function lets a later change of the variables take effect).
    """
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def load_tokenizer(name_or_path: str | Path = DEFAULT_TOKENIZER, offline: bool | None = None,
                   cache_dir: str | Path | None = None):
    """``transformers.AutoTokenizer.from_pretrained(name_or_path, local_files_only=offline)``.

    ``name_or_path``: a hub id (FHBench: ``roberta-base``) or a folder written by
    ``save_pretrained``. ``offline``: None reads ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``
    now (truthy: 1, ON, YES, TRUE). ``cache_dir``: None = :func:`hub_cache_dir`.

    Raises :class:`MissingWeightsError` naming the model id, the cache folder and the variables
    to set when the tokenizer files are neither cached nor downloadable (or the folder has none).
    """
    if offline is None:
        offline = _truthy(os.environ.get("HF_HUB_OFFLINE")) or _truthy(os.environ.get("TRANSFORMERS_OFFLINE"))
    cache = Path(cache_dir).expanduser() if cache_dir is not None else hub_cache_dir()
    from transformers import AutoTokenizer  # noqa: PLC0415 - heavy import, only when tokenising

    try:
        return AutoTokenizer.from_pretrained(str(name_or_path), local_files_only=bool(offline), cache_dir=str(cache))
    except (OSError, ValueError) as e:
        if Path(name_or_path).is_dir():
            raise MissingWeightsError(
                f"tokenizer {str(name_or_path)!r}: the folder has no loadable tokenizer files "
                f"({type(e).__name__}); write one there with tokenizer.save_pretrained()") from None
        mode = "offline (HF_HUB_OFFLINE)" if offline else "and could not be downloaded"
        raise MissingWeightsError(
            f"tokenizer {str(name_or_path)!r} is not in the Hugging Face cache {cache} {mode} "
            f"({type(e).__name__}); on a machine with internet run `huggingface-cli download {name_or_path}` "
            f"(or AutoTokenizer.from_pretrained('{name_or_path}')) and copy its cache here: set HF_HOME "
            f"(cache = $HF_HOME/hub) or HF_HUB_CACHE to that folder") from None


def tokenize(texts: Sequence[str] | Iterable[str], tokenizer, max_length: int = MAX_LENGTH,
             batch_size: int = 1024) -> np.ndarray:
    """Token ids of ``texts``: int64 ``[N, max_length]``, padded with ``tokenizer.pad_token_id``.

    Exactly ``tokenizer(batch, padding="max_length", truncation=True, max_length=max_length)``
    (FHBench [C], module rule 10): special tokens added (RoBERTa ``<s> ... </s>``), texts longer
    than ``max_length`` keep their first tokens and the end token, padding on the tokenizer's
    ``padding_side`` (right for RoBERTa). The attention mask is ``ids != pad_token_id``.
    ``batch_size`` bounds the Python lists held at once (the result is preallocated).

    Raises ValueError if the tokenizer has no pad token, a text is not a str, or
    ``max_length`` < 1.
    """
    texts = list(texts)
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)!r} has no pad token")
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise ValueError(f"texts[{i}] is {type(t).__name__}, not str")
    out = np.empty((len(texts), max_length), dtype=np.int64)
    for start in range(0, len(texts), batch_size):
        batch = texts[start:start + batch_size]
        enc = tokenizer(batch, padding="max_length", truncation=True, max_length=max_length,
                        return_attention_mask=False)
        ids = np.asarray(enc["input_ids"], dtype=np.int64)
        if ids.shape != (len(batch), max_length):
            raise ValueError(f"tokenizer returned ids of shape {ids.shape}, expected ({len(batch)}, {max_length})")
        out[start:start + len(batch)] = ids
    return out
