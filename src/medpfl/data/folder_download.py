"""The network path of the folder data sets' download stage: fetch the official files into a
download folder in the official layout, so that :func:`medpfl.data.sources.fetch_folder` can
verify them and write the manifest exactly as for a mirror folder.

Order in :func:`medpfl.data.sources.fetch_folder`: the mirror folders first (``$MEDPFL_DATA_MIRROR``
or the defaults), then an earlier finished download (the download folder, marked complete), then
the network (this module). ``MEDPFL_OFFLINE=1`` skips the network; a data set whose terms require
registration (:attr:`FolderDownload.registration`) is never fetched; both then stop with the
registry entry's one-line message naming the official URL and access terms.

Download folder: ``$MEDPFL_DATA_DOWNLOAD/<data set>/`` (default ``data/external/<data set>/``
below the working folder, the project root under Snakemake; git-ignored, not a DVC out). The
official root is ``<download folder>/<the entry's first root name>`` (PTB-XL:
``data/external/ptbxl/ptb-xl-a-large-publicly-available-electrocardiography-dataset-1.0.3/``).

One small downloader (stdlib ``urllib``; ``requests`` is not a dependency): each file streams to
``<download folder>/.partial/<relative path>.part`` (outside the root, so that no glob of the
registry ever sees it), resumed with an HTTP ``Range`` request where the server answers 206,
retried ``retries`` times with back-off on a network error or a short body, then checked (size
and digest where known) and renamed into place atomically (``os.replace``). A file whose check
fails is deleted (``.part`` included) and the error names the file, its URL and both digests.
Archives (ICBHI's zip, SPRSound's GitHub archive) are unpacked with :mod:`zipfile` (CRC-checked
member by member) into a staging folder renamed to the root when complete; only the members
under the archive's root folder are unpacked. PubMed's ``train.7z`` is kept packed (the reader
streams it).

Sources and what was verified (docs/multimodal.md, "Downloading the folder data sets"):

- ``ptbxl``: PhysioNet ``https://physionet.org/files/ptb-xl/1.0.3/``, its ``SHA256SUMS.txt``
  first, then every listed file the reader needs (``ptbxl_database.csv``, ``scp_statements.csv``,
  ``records500/*``: 21,799 records, two files each), each checked against it. The URL scheme is
  PhysioNet's (``wget -r`` of that folder, quoted on the data set's page); not fetched from here.
- ``adftd``: OpenNeuro's public S3 bucket ``https://s3.amazonaws.com/openneuro.org/ds004504/``:
  ``participants.tsv`` (1,706 bytes, SHA-256 of tag 1.0.8's git blob, computed from
  github.com/OpenNeuroDatasets/ds004504) and the 88 ``derivatives/sub-0NN/eeg/*_eyesclosed_eeg.set``
  (size and SHA-256 from their git-annex keys, :mod:`medpfl.data.adftd_checksums`). The bucket
  serves the newest version: a later version's changed file fails the check. Not fetched from here.
- ``medabstracts``, ``pubmed200k``: ``raw.githubusercontent.com`` at a pinned commit (the
  repositories' ``main`` / ``master`` heads, read from their git history), each file checked
  against its **git blob id** (SHA-1 of ``"blob <size>\\0" + content``) in that commit's tree.
- ``icbhi``: ``https://bhichallenge.med.auth.gr/sites/default/files/ICBHI_final_database/``
  ``ICBHI_final_database.zip`` + ``ICBHI_challenge_train_test.txt`` (the addresses third-party
  code cites; the page describes the database as freely available for research; whether the site
  asks for registration, and the zip's size and inner layout, were not verified: the unpacker
  takes ``ICBHI_final_database/`` inside the zip, or the zip's top when the files lie there).
  No published checksums (zip CRCs only).
- ``sprsound``: GitHub's archive of the repository at a pinned commit (``.../archive/<commit>.zip``,
  ≈739 MB, top folder ``SPRSound-<commit>/``), its ``BioCAS2022/`` taken as the root; no
  published checksums (zip CRCs only). The commit is the one in the search index used here; that
  it is the repository's current head was not verified.

Errors: :class:`DataError`, one line naming the file and URL; :class:`DownloadUnavailable` (a
DataError) when the network cannot be reached, turned by ``fetch_folder`` into the entry's
one-line message.
"""

from __future__ import annotations

import fnmatch
import hashlib
import http.client
import json
import os
import shutil
import time
import urllib.error
import urllib.request
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Callable

from medpfl.data.multimodal import FolderDataset, read_checksum_file
from medpfl.errors import DataError
from medpfl.io import sha256sum

OFFLINE_ENV = "MEDPFL_OFFLINE"
DOWNLOAD_ENV = "MEDPFL_DATA_DOWNLOAD"
DEFAULT_DOWNLOAD = Path("data") / "external"
COMPLETE_MARKER = ".medpfl-download-complete.json"
PARTIAL_DIR = ".partial"
CHUNK = 1 << 20


class DownloadUnavailable(DataError):
    """The network (or the server) could not be reached after the retries: not a bad file."""


@dataclass(frozen=True)
class Check:
    """A published check of one file: ``algo`` ``sha256`` (hex digest of the content) or
    ``git-blob`` (git's blob id: SHA-1 of ``b"blob <size>\\0" + content``, hex); ``size`` in bytes
    when published (checked first, cheaply)."""

    algo: str
    digest: str
    size: int | None = None

    def __post_init__(self) -> None:
        if self.algo not in ("sha256", "git-blob"):
            raise ValueError(f"Check.algo must be sha256 or git-blob, got {self.algo!r}")


@dataclass(frozen=True)
class FolderDownload:
    """How to fetch one folder data set from its official distribution.

    Fields:
      base_url: every file's URL is ``base_url + <relative path>`` (tests point it at a local server).
      files: relative paths under the official root to fetch (without published checks unless in ``checks``).
      checks: ``{relative path: Check}`` of files with published checks (fetched too), or a
        callable returning it (ADFTD's 88 keys are read lazily from :mod:`medpfl.data.adftd_checksums`).
      sums_file: a ``sha256sum``-style file at the root, fetched first; then every file it lists
        that matches the entry's ``files`` globs is fetched and checked against it (PTB-XL).
      archive: an archive's name under ``base_url`` (``zip``), unpacked before ``files`` are fetched.
      archive_roots: where the official root lies inside the archive, tried in order; a ``*``
        component matches any one folder (GitHub's ``<repo>-<ref>/`` top), ``""`` the archive's top.
      archive_check: the archive's own published check, if any.
      registration: True when the terms require a registration or an agreement: never fetched.
      size: the approximate download size (docs and the progress line).
      verified: what of these URLs and checks was verified, and how (one line, for the docs).
    """

    base_url: str
    files: tuple[str, ...] = ()
    checks: dict[str, Check] | Callable[[], dict[str, Check]] = field(default_factory=dict)
    sums_file: str | None = None
    archive: str | None = None
    archive_roots: tuple[str, ...] = ("",)
    archive_check: Check | None = None
    registration: bool = False
    size: str = ""
    verified: str = ""

    def all_checks(self) -> dict[str, Check]:
        """``checks`` as a dict (calling it when it is a callable)."""
        return dict(self.checks() if callable(self.checks) else self.checks)


def _adftd_checks() -> dict[str, Check]:
    from medpfl.data.adftd import parse_annex_key, recording_path  # noqa: PLC0415
    from medpfl.data.adftd_checksums import DERIVATIVE_KEYS  # noqa: PLC0415

    out = {"participants.tsv": Check("sha256", "bd17cf02ec9733c9029d4a6d977b2918309b3c667ff9ceb1b5dce6e3cebccbc1",
                                     1706)}
    for sid, key in sorted(DERIVATIVE_KEYS.items()):
        size, digest = parse_annex_key(key)
        out[str(recording_path(f"sub-{sid:03d}")).replace(os.sep, "/")] = Check("sha256", digest, size)
    return out


MEDABS_COMMIT = "70a2d9106c724729be8b3c4ddb00d1b14ec300c8"  # branch main, 2024-11-07
PUBMED_COMMIT = "17ed2cb0590decfca0266add0c76f254f67232b4"  # branch master, 2023-10-30
SPRSOUND_COMMIT = "174500e401f4ebf54061414c2fe082c7dccfb9d2"  # the search index's snapshot (head not verified)

#: The official downloads, by data set name (the keys of :data:`medpfl.data.multimodal.FOLDER_DATASETS`).
#: Not part of any job description: where the bytes came from does not change them (the manifest
#: records the verified files either way), so editing a URL re-runs nothing.
DOWNLOADS: dict[str, FolderDownload] = {
    "ptbxl": FolderDownload(
        base_url="https://physionet.org/files/ptb-xl/1.0.3/", sums_file="SHA256SUMS.txt",
        size="about 1.7 GB of records500 + CSVs (43,598 + 2 files; size not verified)",
        verified="URL scheme: PhysioNet's published wget -r path (not fetched from here); every file checked "
                 "against SHA256SUMS.txt"),
    "adftd": FolderDownload(
        base_url="https://s3.amazonaws.com/openneuro.org/ds004504/", checks=_adftd_checks,
        size="about 2.95 GB (88 derivative .set files + participants.tsv; sum of the annex key sizes)",
        verified="checks verified (git-annex keys and participants.tsv of tag 1.0.8, "
                 "github.com/OpenNeuroDatasets/ds004504); the S3 address follows OpenNeuro's public bucket, "
                 "not fetched from here"),
    "medabstracts": FolderDownload(
        base_url=f"https://raw.githubusercontent.com/sebischair/Medical-Abstracts-TC-Corpus/{MEDABS_COMMIT}/",
        checks={"medical_tc_train.csv": Check("git-blob", "ed1553cef13d5ff1f6c92794ea93d6c953b3c173"),
                "medical_tc_test.csv": Check("git-blob", "15c31c7b8eed2bfb85dbd547479542c901cc6beb", 3586836),
                "medical_tc_labels.csv": Check("git-blob", "080de23ae3bac7676088dabd2e51515a3bb7ae92", 157)},
        size="about 18 MB (test file 3,586,836 bytes; train size not verified)",
        verified="commit, paths and git blob ids read from the repository's git history; raw URL not fetched "
                 "from here"),
    "pubmed200k": FolderDownload(
        base_url=f"https://raw.githubusercontent.com/Franck-Dernoncourt/pubmed-rct/{PUBMED_COMMIT}/PubMed_200k_RCT/",
        checks={"train.7z": Check("git-blob", "097cc3dd77e49303f02746d599cc6f156023046d"),
                "dev.txt": Check("git-blob", "492c421287124ba4b51e245875a9a390cfee52ee"),
                "test.txt": Check("git-blob", "c21cdd84408f7ed9a7a04c034e67e14755ed96a2")},
        size="not verified (train.7z, dev.txt, test.txt; no Git LFS)",
        verified="commit, paths and git blob ids read from the repository's git history (no .gitattributes: "
                 "plain git blobs, not LFS pointers); raw URL not fetched from here"),
    "icbhi": FolderDownload(
        base_url="https://bhichallenge.med.auth.gr/sites/default/files/ICBHI_final_database/",
        archive="ICBHI_final_database.zip", archive_roots=("ICBHI_final_database", ""),
        files=("ICBHI_challenge_train_test.txt",),
        size="not verified",
        verified="not verified: the addresses third-party code cites; registration not verified; no checksums"),
    "sprsound": FolderDownload(
        base_url="https://github.com/SJTU-YONGFU-RESEARCH-GRP/SPRSound/archive/",
        archive=f"{SPRSOUND_COMMIT}.zip", archive_roots=("*/BioCAS2022",),
        size="about 739 MB (the repository snapshot; the archive was not fetched from here)",
        verified="GitHub's archive URL scheme; the commit from the search index (not verified as the head); no "
                 "checksums"),
}


def offline() -> bool:
    """Whether ``$MEDPFL_OFFLINE`` is set to a true value (``1``, ``true``, ``yes``)."""
    return os.environ.get(OFFLINE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def download_dir(name: str) -> Path:
    """The download folder of data set ``name``: ``$MEDPFL_DATA_DOWNLOAD/<name>`` or
    ``data/external/<name>`` below the working folder."""
    base = os.environ.get(DOWNLOAD_ENV)
    return (Path(base) if base else DEFAULT_DOWNLOAD) / name


def completed_root(entry: FolderDataset, dest: Path) -> Path | None:
    """The root of an earlier finished download into ``dest`` (its marker file present), else None."""
    root = dest / entry.root_names[0]
    return root if (dest / COMPLETE_MARKER).is_file() and root.is_dir() else None


# ----- one file -----------------------------------------------------------------------------------
def file_digest(path: Path, algo: str) -> str:
    """``sha256`` hex of the content, or ``git-blob``: SHA-1 of ``b"blob <size>\\0" + content``."""
    if algo == "sha256":
        return sha256sum(path, CHUNK)
    h = hashlib.sha1()  # noqa: S324  (git's object id, not a security check)
    h.update(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def check_file(path: Path, check: Check) -> str | None:
    """None when ``path`` passes ``check``, else what is wrong (one phrase)."""
    size = path.stat().st_size
    if check.size is not None and size != check.size:
        return f"{size} bytes, expected {check.size}"
    got = file_digest(path, check.algo)
    if got != check.digest.lower():
        name = "SHA-256" if check.algo == "sha256" else "git blob id"
        return f"{name} mismatch: expected {check.digest}, got {got}"
    return None


_RETRY_HTTP = {408, 429, 500, 502, 503, 504}


def fetch_file(url: str, target: Path, partial: Path, check: Check | None = None, *, retries: int = 3,
               timeout: float = 60.0, backoff: float = 1.0) -> bool:
    """Download ``url`` to ``target`` through ``partial`` (``.part``; resumed with ``Range`` when
    the server answers 206), check it, rename it into place. Returns False when ``target`` was
    already there (and passes ``check``), True when downloaded.

    Raises:
        DataError: the finished file fails ``check`` (both files deleted; names the file and URL),
            or the server answers a 4xx status (not retried).
        DownloadUnavailable: the network or server failed ``retries`` times (the ``.part`` stays
            for the next run to resume).
    """
    if target.is_file():
        if check is None or check_file(target, check) is None:
            return False
        target.unlink()  # a stale or damaged earlier copy: fetch again
    partial.parent.mkdir(parents=True, exist_ok=True)
    last = ""
    for attempt in range(max(1, retries)):
        have = partial.stat().st_size if partial.is_file() else 0
        req = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                status = getattr(resp, "status", 200)
                if have and status == 206:
                    mode, expected = "ab", resp.headers.get("Content-Length")
                else:
                    mode, expected, have = "wb", resp.headers.get("Content-Length"), 0
                written = 0
                with open(partial, mode) as f:
                    while block := resp.read(CHUNK):
                        f.write(block)
                        written += len(block)
                if expected is not None and written != int(expected):
                    raise http.client.IncompleteRead(b"", int(expected) - written)
            break
        except urllib.error.HTTPError as e:
            if e.code == 416 and have:  # Range beyond the end: the .part is whole already (or wrong)
                break
            if e.code not in _RETRY_HTTP:
                raise DataError(f"{url}: HTTP {e.code} {e.reason}; {target.name} was not downloaded") from None
            last = f"HTTP {e.code} {e.reason}"
        except (urllib.error.URLError, http.client.HTTPException, OSError, TimeoutError) as e:
            last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
        if attempt + 1 < retries:
            time.sleep(min(backoff * 2**attempt, 30))
    else:
        raise DownloadUnavailable(f"{url}: {last} ({retries} attempts; the partial file {partial} is kept and "
                                  "resumed next time)")
    if check is not None:
        bad = check_file(partial, check)
        if bad:
            partial.unlink()
            raise DataError(f"{target}: {bad} for {url}; the file was deleted: the server's copy is not the official "
                            "release or was damaged in transfer")
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(partial, target)
    return True


# ----- archives -----------------------------------------------------------------------------------
def _archive_prefix(names: list[str], roots: tuple[str, ...], archive: Path) -> str:
    """The member prefix (``""`` or ``"a/b/"``) of the first of ``roots`` found among ``names``."""
    for r in roots:
        if r == "":
            return ""
        parts = r.strip("/").split("/")
        for n in names:
            comp = n.split("/")
            if len(comp) > len(parts) and all(fnmatch.fnmatchcase(c, p) for c, p in zip(comp, parts)):
                return "/".join(comp[:len(parts)]) + "/"
    raise DataError(f"{archive}: no folder {' or '.join(repr(r) for r in roots)} inside; not the official archive")


def unpack_zip(archive: Path, roots: tuple[str, ...], root: Path) -> int:
    """Unpack the members of ``archive`` under the first of ``roots`` (:func:`_archive_prefix`) into
    ``root`` (through a staging folder renamed at the end). Returns the number of files. Raises
    DataError for a member path leaving the folder, a CRC error or a damaged zip (naming the archive)."""
    staging = root.parent / f".unpack-{root.name}"
    if staging.exists():
        shutil.rmtree(staging)
    n = 0
    try:
        with zipfile.ZipFile(archive) as z:
            infos = z.infolist()
            prefix = _archive_prefix([i.filename for i in infos], roots, archive)
            for info in infos:
                if info.is_dir() or not info.filename.startswith(prefix):
                    continue
                rel = PurePosixPath(info.filename[len(prefix):])
                if rel.is_absolute() or ".." in rel.parts or not rel.parts:
                    raise DataError(f"{archive}: member {info.filename!r} leaves the folder; refused")
                dst = staging.joinpath(*rel.parts)
                dst.parent.mkdir(parents=True, exist_ok=True)
                with z.open(info) as src, open(dst, "wb") as out:
                    shutil.copyfileobj(src, out, CHUNK)  # zipfile checks each member's CRC-32 at its end
                n += 1
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as e:
        shutil.rmtree(staging, ignore_errors=True)
        raise DataError(f"{archive}: not a readable zip ({e}); delete it and download it again") from None
    except DataError:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    root.parent.mkdir(parents=True, exist_ok=True)
    if root.exists():
        shutil.rmtree(root)
    os.replace(staging, root)
    return n


# ----- one data set -------------------------------------------------------------------------------
def download_folder(entry: FolderDataset, spec: FolderDownload, dest: Path, *, retries: int = 3,
                    timeout: float = 60.0, backoff: float = 1.0, workers: int = 4,
                    log: Callable[[str], None] | None = None) -> Path:
    """Fetch data set ``entry`` from ``spec`` into ``dest`` in its official layout; return the
    root ``dest / entry.root_names[0]``. Files already there and passing their checks are kept
    (a re-run resumes); ``workers`` files are fetched at a time. Marks ``dest`` complete
    (:data:`COMPLETE_MARKER`) at the end. The caller verifies the root and writes the manifest.

    Raises:
        DataError: registration required; a file failing its check (naming file and URL); a bad archive.
        DownloadUnavailable: the network or server unreachable after the retries.
    """
    if spec.registration:
        raise DataError(f"{entry.name}: the terms require registration ({entry.access_terms}); the pipeline never "
                        f"downloads it: get it from {entry.url}")
    say = log or (lambda s: None)
    dest = Path(dest)
    root = dest / entry.root_names[0]
    partial = dest / PARTIAL_DIR
    kw = {"retries": retries, "timeout": timeout, "backoff": backoff}
    (dest / COMPLETE_MARKER).unlink(missing_ok=True)
    if spec.archive:
        if not root.is_dir():
            arch = dest / Path(spec.archive).name
            say(f"{entry.name}: {spec.base_url + spec.archive} ({spec.size})")
            fetch_file(spec.base_url + spec.archive, arch, partial / (Path(spec.archive).name + ".part"),
                       spec.archive_check, **kw)
            n = unpack_zip(arch, spec.archive_roots, root)
            say(f"{entry.name}: {n} files unpacked to {root}")
            arch.unlink()
    jobs: dict[str, Check | None] = {rel: None for rel in spec.files}
    jobs.update(spec.all_checks())
    if spec.sums_file:

        sums_path = root / spec.sums_file
        fetch_file(spec.base_url + spec.sums_file, sums_path, partial / (spec.sums_file + ".part"), **kw)
        for rel, digest in read_checksum_file(sums_path).items():
            if any(fnmatch.fnmatchcase(rel, pat) for pat in entry.files):
                jobs[rel] = Check("sha256", digest)
    say(f"{entry.name}: {len(jobs)} files from {spec.base_url} into {root}")

    def one(item):
        rel, check = item
        return fetch_file(spec.base_url + rel, root / rel, partial / (rel + ".part"), check, **kw)

    items = sorted(jobs.items())
    if workers > 1 and len(items) > 1:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = [pool.submit(one, it) for it in items]
            try:
                new = sum(f.result() for f in futures)
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)  # the first error stops the queue
                raise
    else:
        new = sum(one(it) for it in items)
    shutil.rmtree(partial, ignore_errors=True)
    (dest / COMPLETE_MARKER).write_text(json.dumps({"dataset": entry.name, "base_url": spec.base_url,
                                                    "archive": spec.archive, "files": len(jobs),
                                                    "downloaded": new}, sort_keys=True) + "\n")
    return root
