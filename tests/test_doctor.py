"""`medpfl doctor` on a throw-away setup: good data passes, a corrupt file fails with advice, and
a missing MLflow store is reported missing without being created (in a project or outside one)."""

import json
import os

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


def _files(folder) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _line(out: str, name: str) -> str:
    return next(line for line in out.splitlines() if line[6:].startswith(name + " "))


def test_doctor_reports_each_check(tmp_path, monkeypatch, capsys):
    _setup(tmp_path, monkeypatch)
    store = tmp_path / "mlruns.db"  # conftest's MLFLOW_TRACKING_URI
    assert os.environ["MLFLOW_TRACKING_URI"] == f"sqlite:///{store}" and not store.exists()
    assert main(["doctor", "--no-pipeline"]) == 0  # a store that does not exist yet is no failure
    out = capsys.readouterr().out
    assert "ok  params" in out
    assert "data synth" in out and "mirror" in out  # not downloaded yet, but the mirror has it
    mlflow = _line(out, "mlflow")
    assert mlflow.startswith("warn") and "missing" in mlflow and "first `snakemake` run" in mlflow, mlflow
    assert not store.exists(), "doctor created the MLflow store it was checking"
    assert "gpu" in out

    assert main(["mlflow-init", "--study", "t", "--experiment", "t", "--out", str(tmp_path / "parent.json")]) == 0
    assert store.exists()
    capsys.readouterr()
    assert main(["doctor", "--no-pipeline"]) == 0
    assert _line(capsys.readouterr().out, "mlflow").startswith("  ok")


def test_doctor_outside_a_project_creates_nothing(tmp_path, monkeypatch, capsys):
    """No params.yaml, MLflow's default store (mlruns.db in the current folder): every check
    runs, the store is reported missing, and the folder stays empty."""
    here = tmp_path / "elsewhere"
    here.mkdir()
    monkeypatch.chdir(here)
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert main(["doctor"]) == 1  # the params check fails
    out = capsys.readouterr().out
    assert "FAIL  params" in out
    mlflow = _line(out, "mlflow")
    assert mlflow.startswith("warn") and f"{here / 'mlruns.db'}: missing" in mlflow, mlflow
    assert "ok" not in mlflow.split()[0]
    assert _files(here) == [], f"doctor created files outside a project: {_files(here)}"


def test_doctor_store_in_a_missing_folder_fails_and_creates_nothing(tmp_path, monkeypatch, capsys):
    here = tmp_path / "elsewhere"
    here.mkdir()
    monkeypatch.chdir(here)
    store = tmp_path / "no-such-folder" / "mlruns.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}")
    before = _files(tmp_path)
    assert main(["doctor"]) == 1
    mlflow = _line(capsys.readouterr().out, "mlflow")
    assert mlflow.startswith("FAIL") and "missing" in mlflow and str(store.parent) in mlflow, mlflow
    assert _files(tmp_path) == before, "doctor created files"


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


def test_doctor_warns_when_the_study_parent_is_in_another_store(tmp_path, monkeypatch, capsys):
    """After switching stores (to a tracking server, say), the study's jobs keep logging where its
    parent run is: doctor says so and how to move it; with the same store it is ok."""
    _setup(tmp_path, monkeypatch)
    assert main(["mlflow-init", "--study", "default", "--experiment", "t", "--out",
                 str(tmp_path / "results" / "default" / "mlflow_parent.json")]) == 0
    capsys.readouterr()
    assert main(["doctor", "--no-pipeline"]) == 0
    assert _line(capsys.readouterr().out, "mlflow study").startswith("  ok")
    server = "http://127.0.0.1:9"  # nothing answers there: the store check fails, the study check warns
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server)
    assert main(["doctor", "--no-pipeline"]) == 1
    out = capsys.readouterr().out
    assert _line(out, "mlflow").startswith("FAIL") and server in _line(out, "mlflow")
    study = _line(out, "mlflow study")
    assert study.startswith("warn") and f"not in {server}" in study and "delete" in study, study
    assert "mlflow_parent.json" in study
