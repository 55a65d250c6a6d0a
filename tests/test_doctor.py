"""`medpfl doctor` on a throw-away setup: good data passes, a corrupt file fails with advice."""

import json

from medpfl.cli import main
from medpfl.data.synthetic import write_synthetic_npz


def _setup(tmp_path, monkeypatch):
    md5 = write_synthetic_npz(tmp_path / "synth.npz")
    (tmp_path / "params.yaml").write_text(json.dumps({
        "data": {"datasets": ["synth"], "custom": {"synth": {"path": str(tmp_path / "synth.npz"), "md5": md5,
                                                             "n_channels": 3, "num_classes": 4}}},
        "partitions": [{"name": "d", "num_clients": 4, "alpha": 0.5}], "methods": ["fedavg"]}))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MEDPFL_DATA_MIRROR", str(tmp_path))


def test_doctor_reports_each_check(tmp_path, monkeypatch, capsys):
    _setup(tmp_path, monkeypatch)
    assert main(["doctor", "--no-pipeline"]) == 0
    out = capsys.readouterr().out
    assert "ok  params" in out
    assert "data synth" in out and "mirror" in out  # not downloaded yet, but the mirror has it
    assert "ok  mlflow" in out
    assert "gpu" in out


def test_doctor_fails_on_a_corrupt_raw_file(tmp_path, monkeypatch, capsys):
    _setup(tmp_path, monkeypatch)
    raw = tmp_path / "data" / "raw" / "synth.npz"
    raw.parent.mkdir(parents=True)
    raw.write_bytes(b"not the file")
    assert main(["doctor", "--no-pipeline"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  data synth" in out and str(raw) in out and "delete it" in out


def test_doctor_fails_on_bad_params(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("train: {rounds: 0}\n")
    assert main(["doctor", "--no-pipeline"]) == 1
    assert "train.rounds" in capsys.readouterr().out
