"""Progress of ``medpfl train``: a live bar on a terminal, exactly one log line per round
otherwise (under Snakemake the log goes to a file)."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys

import pytest

from medpfl.progress import RoundProgress, round_text, use_bar
from tests.conftest import prepare_train_job

LOG = logging.getLogger("medpfl.train")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


SC = [{"global_test_acc": 0.5, "local_bal_acc_mean": 0.25}, {"global_test_acc": 0.8125, "local_bal_acc_mean": 0.75}]


def test_use_bar_follows_the_stream():
    assert use_bar(FakeTTY()) is True
    assert use_bar(io.StringIO()) is False
    closed = io.StringIO()
    closed.close()
    assert use_bar(closed) is False


def test_not_a_terminal_logs_one_line_per_round(caplog):
    caplog.set_level(logging.INFO, logger="medpfl.train")
    stream = io.StringIO()
    with RoundProgress(2, "fedavg", LOG, stream=stream) as p:
        assert not p.bar
        for r, sc in enumerate(SC):
            p.update(r, sc, 1.25)
    lines = [r.getMessage() for r in caplog.records if r.name == "medpfl.train"]
    assert lines == ["round 1/2 global_test_acc=0.500 local_bal_acc_mean=0.250 (1.2s)",
                     "round 2/2 global_test_acc=0.812 local_bal_acc_mean=0.750 (1.2s)"]
    assert stream.getvalue() == ""  # no bar characters


def test_a_terminal_shows_a_bar_with_the_latest_accuracies(caplog):
    caplog.set_level(logging.INFO, logger="medpfl.train")
    tty = FakeTTY()
    with RoundProgress(2, "fedavg", LOG, stream=tty) as p:
        assert p.bar
        for r, sc in enumerate(SC):
            p.update(r, sc, 1.25)
    out = ANSI.sub("", tty.getvalue())
    assert "fedavg rounds" in out and "2/2" in out
    assert "global 0.812" in out and "local 0.750" in out
    assert not [r for r in caplog.records if r.getMessage().startswith("round ")]  # the bar replaces the lines


def test_log_messages_print_above_the_bar():
    tty = FakeTTY()
    handler = logging.StreamHandler(tty)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with RoundProgress(2, "fedavg", LOG, stream=tty) as p:
            assert handler.stream is not tty  # routed through the bar's console
            logging.getLogger("medpfl.fl.engine").warning("resuming from checkpoint at round 1")
            p.update(1, SC[1], 1.0)
        assert handler.stream is tty  # restored
    finally:
        root.removeHandler(handler)
    assert "WARNING resuming from checkpoint at round 1" in ANSI.sub("", tty.getvalue())


def test_round_text_matches_the_log_line():
    assert round_text({"personalized_acc_mean": 0.5, "global_test_acc": 0.25, "lr": 0.1}) == \
        "global_test_acc=0.250 personalized_acc_mean=0.500"


# ----- the command, in a pseudo-terminal and with stderr to a file ----------------------------
@pytest.fixture(scope="module")
def tiny_job(tmp_path_factory):
    d = tmp_path_factory.mktemp("progress")
    job, _ = prepare_train_job(d, method="fedavg", counts=(120, 12, 40), data_seed=3, num_clients=3, mlflow=False,
                               train={"rounds": 2, "local_epochs": 1, "batch_size": 32})
    (d / "job.json").write_text(json.dumps(job))
    return d


def _cmd(d, out):
    return [sys.executable, "-m", "medpfl.cli", "train", "--job", f"@{d / 'job.json'}", "--arrays", str(d / "arrays.npz"),
            "--samples", str(d / "samples.parquet"), "--partition-table", str(d / "partition.parquet"),
            "--out-dir", str(d / out), "--threads", "1"]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "160", "TERM": "xterm"}


def test_cli_stderr_to_a_file_keeps_one_line_per_round(tiny_job):
    r = subprocess.run(_cmd(tiny_job, "logged"), env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rounds = [line for line in r.stderr.splitlines() if re.search(r"medpfl\.train: round \d+/2 ", line)]
    assert len(rounds) == 2 and "round 1/2 global_test_acc=" in rounds[0] and "round 2/2 " in rounds[1]
    assert "━" not in r.stderr


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_cli_on_a_terminal_shows_the_bar(tiny_job):
    import select

    master, slave = os.openpty()
    proc = subprocess.Popen(_cmd(tiny_job, "tty"), env=_env(), stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], 300)
        if not ready:
            proc.kill()
            pytest.fail("no output for 300 s")
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=60) == 0
    out = ANSI.sub("", b"".join(chunks).decode("utf-8", "replace"))
    assert "fedavg synth/p seed 1 rounds" in out and "2/2" in out and "global " in out and "local " in out
    assert not re.search(r"medpfl\.train: round \d+/2", out)  # no per-round log lines on a terminal
    assert "environment " in out  # the other log lines still show
