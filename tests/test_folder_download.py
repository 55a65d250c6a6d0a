"""The folder data sets' network path (``medpfl.data.folder_download`` through ``sources.fetch``):
a local HTTP server (``http.server`` in a thread on 127.0.0.1, stopped at the end) serves tiny
copies in the official file layouts (``tests/fixtures_multimodal.py``'s writers) at the official
relative paths; the registry's base URLs are pointed at it.

Covered: PTB-XL file by file after its ``SHA256SUMS.txt``; ICBHI's zip (with and without a top
folder) plus its separate split list; SPRSound's GitHub archive (``<repo>-<ref>/BioCAS2022``);
Medical Abstracts from GitHub raw with git blob ids; download -> manifest -> preprocess equal to
the mirror path; a corrupted file; an interrupted transfer (resumed with ``Range``, or failing
cleanly); no server, ``MEDPFL_OFFLINE`` and registration-only sets -> the one-line error.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import shutil
import socket
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("wfdb")
pytest.importorskip("soundfile")

import fixtures_multimodal as fx  # noqa: E402

from medpfl.data import folder_download as fd  # noqa: E402
from medpfl.data import multimodal, sources  # noqa: E402
from medpfl.data.preprocess import load_processed, preprocess_folder  # noqa: E402
from medpfl.errors import DataError  # noqa: E402

REG = multimodal.FOLDER_DATASETS
FAST = {"retries": 2, "backoff": 0.0, "timeout": 5.0, "workers": 2}


class Server:
    """Serves ``routes`` (URL path -> bytes) with ``Range: bytes=N-`` support (206); ``faults``
    (URL path -> "truncate-once" | "truncate-always") send the full Content-Length but only half
    the body, then close. ``log`` records ``(path, Range header or None)`` of every GET."""

    def __init__(self):
        self.routes: dict[str, bytes] = {}
        self.faults: dict[str, str] = {}
        self.log: list[tuple[str, str | None]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def do_GET(self):  # noqa: N802
                outer.log.append((self.path, self.headers.get("Range")))
                body = outer.routes.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                start = 0
                rng = self.headers.get("Range")
                fault = outer.faults.get(self.path)
                if rng and rng.startswith("bytes=") and rng[6:].rstrip("-").isdigit():
                    start = int(rng[6:].rstrip("-"))
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                else:
                    self.send_response(200)
                part = body[start:]
                self.send_header("Content-Length", str(len(part)))
                self.end_headers()
                if fault == "truncate-always" or (fault == "truncate-once" and not rng):
                    self.wfile.write(part[: len(part) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.wfile.write(part)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def add_tree(self, prefix: str, root: Path) -> None:
        for p in sorted(root.rglob("*")):
            if p.is_file():
                self.routes[f"{prefix}{p.relative_to(root).as_posix()}"] = p.read_bytes()

    def requested(self) -> list[str]:
        return [p for p, _ in self.log]


@pytest.fixture
def server():
    s = Server()
    s.thread.start()
    yield s
    s.httpd.shutdown()
    s.httpd.server_close()
    s.thread.join(5)


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    """The tiny official layouts (the mirror path's fixtures)."""
    m = fx.write_mirror(tmp_path_factory.mktemp("src"), "test", ("ptbxl", "icbhi", "sprsound", "medabstracts"))
    (fx.root_of(m, "ptbxl") / "RECORDS").write_text("records500/00000/00001_hr\n")  # listed, not needed
    fx.write_sums(fx.root_of(m, "ptbxl"))
    return m


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    return fx.write_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture
def online(monkeypatch, tmp_path):
    monkeypatch.delenv(fd.OFFLINE_ENV, raising=False)
    monkeypatch.setenv(fd.DOWNLOAD_ENV, str(tmp_path / "external"))
    return tmp_path / "external"


def _point(monkeypatch, name: str, **changes) -> fd.FolderDownload:
    spec = dataclasses.replace(fd.DOWNLOADS[name], **changes)
    monkeypatch.setitem(fd.DOWNLOADS, name, spec)
    return spec


def _git_blob(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _zip(root: Path, top: str, skip=(), extra: dict[str, bytes] | None = None) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for p in sorted(root.rglob("*")):
            if p.is_file() and p.name not in skip:
                z.write(p, f"{top}{p.relative_to(root).as_posix()}")
        for k, v in (extra or {}).items():
            z.writestr(k, v)
    return buf.getvalue()


def _process(name, manifest: Path, out: Path, tokenizer=None):
    opts = {"tokenizer": str(tokenizer), "max_length": 16} if tokenizer else {}
    s = preprocess_folder(manifest, out / f"{name}.npz", out / f"{name}.parquet", REG[name], opts)
    return s, load_processed(out / f"{name}.npz", out / f"{name}.parquet")


def _same_as_mirror(name, src, manifest: Path, tmp_path: Path, tokenizer=None):
    """The downloaded copy gives the mirror copy's manifest files and processed data."""
    mine = json.loads(manifest.read_text())
    sources.fetch(name, tmp_path / "mirror.manifest.json", mirrors=[src])
    ref = json.loads((tmp_path / "mirror.manifest.json").read_text())
    assert mine["files"] == ref["files"] and mine["root"] != ref["root"]
    s1, d1 = _process(name, manifest, tmp_path / "a", tokenizer)
    s2, d2 = _process(name, tmp_path / "mirror.manifest.json", tmp_path / "b", tokenizer)
    assert np.array_equal(d1.images, d2.images) and s1["label"].tolist() == s2["label"].tolist()
    return mine, s1


# ------------------------------------------------------------------------------------------ PTB-XL


def _ptbxl(server, src, monkeypatch):
    server.add_tree("/ptb-xl/1.0.3/", fx.root_of(src, "ptbxl"))
    return _point(monkeypatch, "ptbxl", base_url=server.url + "/ptb-xl/1.0.3/")


def test_ptbxl_sums_first_then_each_needed_file(server, src, online, monkeypatch, tmp_path):
    _ptbxl(server, src, monkeypatch)
    out = tmp_path / "raw" / "ptbxl.manifest.json"
    where = sources.fetch("ptbxl", out, mirrors=[tmp_path / "no-mirror"])
    root = online / "ptbxl" / REG["ptbxl"].root_names[0]
    assert where.startswith(f"network {server.url}/ptb-xl/1.0.3/ -> {root}")
    got = server.requested()
    assert got[0] == "/ptb-xl/1.0.3/SHA256SUMS.txt"  # first
    assert "/ptb-xl/1.0.3/RECORDS" not in got  # listed in the sums, not a reader file
    man, s = _same_as_mirror("ptbxl", src, out, tmp_path)
    assert set(got[1:]) == {f"/ptb-xl/1.0.3/{rel}" for rel in man["files"]} and len(got) == len(man["files"]) + 1
    assert man["checksum_file_sha256"] == hashlib.sha256((root / "SHA256SUMS.txt").read_bytes()).hexdigest()
    assert len(s) == 50  # five kept records x ten 1-s windows (test_multimodal_pipeline)
    assert not (online / "ptbxl" / fd.PARTIAL_DIR).exists() and (online / "ptbxl" / fd.COMPLETE_MARKER).is_file()
    # offline, without the manifest: the finished download is found, nothing is requested
    out.unlink()
    monkeypatch.setenv(fd.OFFLINE_ENV, "1")
    n = len(server.log)
    assert sources.fetch("ptbxl", out, mirrors=[]).startswith(f"download {root}")
    assert len(server.log) == n


def test_a_corrupted_file_on_the_server_names_file_and_url(server, src, online, monkeypatch, tmp_path):
    _ptbxl(server, src, monkeypatch)
    rel = "records500/00000/00006_hr.dat"
    bad = bytearray(server.routes[f"/ptb-xl/1.0.3/{rel}"])
    bad[100] ^= 0xFF  # same size, other bytes
    server.routes[f"/ptb-xl/1.0.3/{rel}"] = bytes(bad)
    out = tmp_path / "ptbxl.manifest.json"
    with pytest.raises(DataError) as e:
        sources.fetch_folder(REG["ptbxl"], out, mirrors=[], **FAST)
    msg = str(e.value)
    assert "\n" not in msg and f"{rel}: SHA-256 mismatch" in msg and f"{server.url}/ptb-xl/1.0.3/{rel}" in msg
    dest = online / "ptbxl"
    assert not (dest / REG["ptbxl"].root_names[0] / rel).exists()
    assert not list(dest.rglob("*.part")) and not out.exists() and not (dest / fd.COMPLETE_MARKER).exists()


def test_an_interrupted_transfer_is_resumed_with_range(server, src, online, monkeypatch, tmp_path):
    _ptbxl(server, src, monkeypatch)
    path = "/ptb-xl/1.0.3/records500/00000/00002_hr.dat"
    server.faults[path] = "truncate-once"
    out = tmp_path / "ptbxl.manifest.json"
    sources.fetch_folder(REG["ptbxl"], out, mirrors=[], **FAST)
    tries = [r for p, r in server.log if p == path]
    half = (len(server.routes[path])) // 2
    assert tries == [None, f"bytes={half}-"]  # the second request resumes after the received half
    got = (online / "ptbxl" / REG["ptbxl"].root_names[0] / "records500/00000/00002_hr.dat").read_bytes()
    assert got == server.routes[path]
    assert json.loads(out.read_text())["files"]["records500/00000/00002_hr.dat"][0] == len(got)


def test_a_transfer_that_keeps_failing_stops_in_one_line(server, src, online, monkeypatch, tmp_path):
    _ptbxl(server, src, monkeypatch)
    path = "/ptb-xl/1.0.3/ptbxl_database.csv"
    server.faults[path] = "truncate-always"
    with pytest.raises(DataError) as e:
        sources.fetch_folder(REG["ptbxl"], tmp_path / "ptbxl.manifest.json", mirrors=[], **FAST)
    msg = str(e.value)
    assert "\n" not in msg and "the download failed" in msg and server.url + path in msg
    assert REG["ptbxl"].url in msg and REG["ptbxl"].access_terms in msg
    assert [p for p, _ in server.log].count(path) == 2  # FAST: two attempts
    root = online / "ptbxl" / REG["ptbxl"].root_names[0]
    assert not (root / "ptbxl_database.csv").exists() and not (online / "ptbxl" / fd.COMPLETE_MARKER).exists()
    # the next run resumes from the kept .part and finishes
    server.faults.clear()
    sources.fetch_folder(REG["ptbxl"], tmp_path / "ptbxl.manifest.json", mirrors=[], **FAST)
    n = len(server.routes[path])
    kept = n // 2 + (n - n // 2) // 2  # half, then half of the rest (the second, resumed attempt)
    assert [r for p, r in server.log if p == path] == [None, f"bytes={n // 2}-", f"bytes={kept}-"]
    assert (root / "ptbxl_database.csv").read_bytes() == server.routes[path]


# ------------------------------------------------------------------------------------------ no network


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_no_server_is_the_one_line_error(online, monkeypatch, tmp_path):
    _point(monkeypatch, "ptbxl", base_url=f"http://127.0.0.1:{_free_port()}/ptb-xl/1.0.3/")
    with pytest.raises(DataError) as e:
        sources.fetch_folder(REG["ptbxl"], tmp_path / "x.manifest.json", mirrors=[tmp_path], **FAST)
    msg = str(e.value)
    assert "\n" not in msg and REG["ptbxl"].url in msg and REG["ptbxl"].access_terms in msg
    assert "MEDPFL_DATA_MIRROR" in msg and "the download failed" in msg and "SHA256SUMS.txt" in msg


def test_offline_and_registration_never_request(server, src, online, monkeypatch, tmp_path):
    _ptbxl(server, src, monkeypatch)
    monkeypatch.setenv(fd.OFFLINE_ENV, "1")
    with pytest.raises(DataError, match=r"MEDPFL_OFFLINE is set: nothing was downloaded\)$") as e:
        sources.fetch("ptbxl", tmp_path / "x.manifest.json", mirrors=[tmp_path])
    assert "\n" not in str(e.value) and REG["ptbxl"].url in str(e.value)
    monkeypatch.delenv(fd.OFFLINE_ENV)
    _point(monkeypatch, "ptbxl", registration=True)
    with pytest.raises(DataError, match=r"registration required: never downloaded automatically"):
        sources.fetch("ptbxl", tmp_path / "x.manifest.json", mirrors=[tmp_path])
    assert server.log == []


# ------------------------------------------------------------------------------------------ zips


@pytest.mark.parametrize("top", ["ICBHI_final_database/", ""])
def test_icbhi_zip_plus_split_list(top, server, src, online, monkeypatch, tmp_path):
    root = fx.root_of(src, "icbhi")
    base = "/sites/default/files/ICBHI_final_database/"
    server.routes[base + "ICBHI_final_database.zip"] = _zip(root, top, skip=("ICBHI_challenge_train_test.txt",))
    server.routes[base + "ICBHI_challenge_train_test.txt"] = (root / "ICBHI_challenge_train_test.txt").read_bytes()
    _point(monkeypatch, "icbhi", base_url=server.url + base)
    out = tmp_path / "icbhi.manifest.json"
    sources.fetch("icbhi", out, mirrors=[])
    assert server.requested() == [base + "ICBHI_final_database.zip", base + "ICBHI_challenge_train_test.txt"]
    _, s = _same_as_mirror("icbhi", src, out, tmp_path)
    assert s["subject_id"].tolist() == [101, 101, 101, 107, 130, 130]  # test_multimodal_registry's values
    assert not (online / "icbhi" / "ICBHI_final_database.zip").exists()  # unpacked, then removed


def test_sprsound_github_archive_root_is_biocas2022(server, src, online, monkeypatch, tmp_path):
    ref = "0123abc"
    body = _zip(fx.root_of(src, "sprsound"), f"SPRSound-{ref}/BioCAS2022/",
                extra={f"SPRSound-{ref}/README.md": b"not read", f"SPRSound-{ref}/Classification/x.wav": b"RIFF"})
    server.routes[f"/archive/{ref}.zip"] = body
    _point(monkeypatch, "sprsound", base_url=server.url + "/archive/", archive=f"{ref}.zip")
    out = tmp_path / "sprsound.manifest.json"
    sources.fetch("sprsound", out, mirrors=[])
    dest = online / "sprsound"
    assert not (dest / "SPRSound" / "README.md").exists() and not (dest / "SPRSound" / "Classification").exists()
    man, s = _same_as_mirror("sprsound", src, out, tmp_path)
    assert man["root"] == str((dest / "SPRSound" / "BioCAS2022").resolve())
    assert len(s) == sum(len(r[5]) for r in fx.SPRS_RECS.values())  # one sample per annotated event


def test_a_zip_member_leaving_the_folder_is_refused(tmp_path):
    arch = tmp_path / "a.zip"
    with zipfile.ZipFile(arch, "w") as z:
        z.writestr("top/ok.txt", "x")
        z.writestr("top/../../evil.txt", "x")
    with pytest.raises(DataError, match=r"a\.zip: member 'top/\.\./\.\./evil\.txt' leaves the folder"):
        fd.unpack_zip(arch, ("top",), tmp_path / "root")
    assert not (tmp_path / "root").exists() and not (tmp_path / "evil.txt").exists()
    with pytest.raises(DataError, match=r"a\.zip: no folder 'BioCAS2022' inside"):
        fd.unpack_zip(arch, ("BioCAS2022",), tmp_path / "root")


# ------------------------------------------------------------------------------------------ GitHub raw


def test_medabstracts_from_github_raw_with_git_blob_ids(server, src, online, monkeypatch, tmp_path, tokenizer):
    root = fx.root_of(src, "medabstracts")
    prefix = "/sebischair/Medical-Abstracts-TC-Corpus/abc/"
    server.add_tree(prefix, root)
    checks = {p.name: fd.Check("git-blob", _git_blob(p.read_bytes())) for p in root.iterdir()}
    _point(monkeypatch, "medabstracts", base_url=server.url + prefix, checks=checks)
    out = tmp_path / "medabstracts.manifest.json"
    sources.fetch("medabstracts", out, mirrors=[])
    _, s = _same_as_mirror("medabstracts", src, out, tmp_path, tokenizer)
    assert s["label"].tolist() == [2, 4, 0, 3, 1]  # the writer's labels 3, 5, 1, 4, 2 minus one
    # a blob id that does not match: named, nothing kept
    shutil.rmtree(online / "medabstracts")
    out.unlink()
    _point(monkeypatch, "medabstracts", base_url=server.url + prefix,
           checks={**checks, "medical_tc_test.csv": fd.Check("git-blob", "0" * 40)})
    with pytest.raises(DataError, match=r"medical_tc_test\.csv: git blob id mismatch: expected 0{40}, got "
                                        rf"{checks['medical_tc_test.csv'].digest} for {server.url}{prefix}"):
        sources.fetch("medabstracts", out, mirrors=[])
    assert not (online / "medabstracts" / "Medical-Abstracts-TC-Corpus" / "medical_tc_test.csv").exists()


def test_git_blob_id_is_gits():
    """git hash-object of b"hello\\n" is ce013625030ba8dba906f756967f9e9ca394464a (git's documentation)."""
    assert _git_blob(b"hello\n") == "ce013625030ba8dba906f756967f9e9ca394464a"


def test_git_blob_check_reads_the_file(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"hello\n")
    assert fd.check_file(p, fd.Check("git-blob", "ce013625030ba8dba906f756967f9e9ca394464a")) is None
    assert "6 bytes, expected 7" in fd.check_file(p, fd.Check("sha256", "0" * 64, 7))


# ------------------------------------------------------------------------------------------ the table


def test_every_folder_data_set_has_a_download_and_adftd_checks_cover_its_globs():
    assert set(fd.DOWNLOADS) == set(REG)
    checks = fd.DOWNLOADS["adftd"].all_checks()
    assert len(checks) == 89 and checks["participants.tsv"].size == 1706
    import fnmatch

    assert all(any(fnmatch.fnmatchcase(rel, g) for g in REG["adftd"].files) for rel in checks)
    assert all(not s.registration for s in fd.DOWNLOADS.values())  # none of the six requires it (docs)
    for name, spec in fd.DOWNLOADS.items():
        assert spec.base_url.startswith("https://") and spec.base_url.endswith("/"), name
