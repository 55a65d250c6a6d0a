"""Known errors fail with one clear message and exit status 2 (``medpfl.cli.main``, in process),
and a params typo stops Snakemake before any job runs; the parser documents every option, says how
to run a study, and names the nearest command for a typo."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
import yaml

import medpfl
from helpers import make_env, md5, snakemake, tiny_params, write_params, write_synthetic
from medpfl.cli import USER_COMMANDS, build_parser, main, package_version
from medpfl.data import sources


@pytest.fixture
def no_mirror(tmp_path, monkeypatch):
    """An empty mirror folder (never ../shared), and no back-off sleeps between download retries."""
    mirror = tmp_path / "empty-mirror"
    mirror.mkdir()
    monkeypatch.setenv("MEDPFL_DATA_MIRROR", str(mirror))
    monkeypatch.setattr(sources, "time", SimpleNamespace(sleep=lambda s: None))
    return mirror


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("synth") / "synth.npz")


def _job(entry: dict) -> str:
    return json.dumps({"dataset": "synth", "custom": {"synth": entry}})


def _fails(capsys, argv) -> str:
    """Run ``medpfl argv``; assert exit status 2 and one error line set; return stderr."""
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, f"medpfl {argv[0]} exited {code}, stderr:\n{err}"
    assert f"medpfl {argv[0]}: error:" in err and "Traceback" not in err
    return err


# ----- download ------------------------------------------------------------------------------
def test_download_ok(tmp_path, capsys, no_mirror, synth):
    """The baseline the failures below differ from: a good file with its declared MD5 is copied."""
    out = tmp_path / "raw" / "synth.npz"
    assert main(["download", "--job", _job(synth), "--out", str(out)]) == 0
    assert md5(out) == synth["md5"]
    assert "MD5 verified" in capsys.readouterr().out


def test_download_md5_mismatch_names_file(tmp_path, capsys, no_mirror, synth):
    """A valid .npz whose MD5 differs from the declared one."""
    out = tmp_path / "raw" / "synth.npz"
    err = _fails(capsys, ["download", "--job", _job({**synth, "md5": "0" * 32}), "--out", out])
    assert "MD5" in err and "synth.npz" in err and synth["path"] in err
    assert synth["md5"] in err  # what it got
    assert not out.exists(), "a file that failed its MD5 check was left at the output path"


def test_download_corrupt_bytes(tmp_path, capsys, no_mirror, synth):
    """Random bytes where the declared (good) file should be."""
    bad = tmp_path / "corrupt" / "synth.npz"
    bad.parent.mkdir()
    bad.write_bytes(bytes(range(256)) * 40)
    out = tmp_path / "raw" / "synth.npz"
    err = _fails(capsys, ["download", "--job", _job({**synth, "path": str(bad)}), "--out", out])
    assert "MD5" in err and str(bad) in err
    assert not out.exists()


def test_download_corrupt_mirror_file(tmp_path, capsys, monkeypatch, synth):
    """A corrupt copy in a mirror folder is reported by its path, not silently skipped."""
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    (mirror / "synth.npz").write_bytes(b"PK\x03\x04 truncated")
    monkeypatch.setenv("MEDPFL_DATA_MIRROR", str(mirror))
    err = _fails(capsys, ["download", "--job", _job(synth), "--out", tmp_path / "raw" / "synth.npz"])
    assert "MD5" in err and str(mirror / "synth.npz") in err


def test_download_unreachable_medmnist_mentions_mirror_env(tmp_path, capsys, monkeypatch, no_mirror):
    urls = []

    def offline(url, *args, **kwargs):
        urls.append(url)
        raise urllib.error.URLError("network is unreachable")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    out = tmp_path / "raw" / "bloodmnist.npz"
    err = _fails(capsys, ["download", "--dataset", "bloodmnist", "--out", out])
    assert "MEDPFL_DATA_MIRROR" in err and "bloodmnist.npz" in err and str(no_mirror) in err
    assert urls and all(u.startswith("https://") and "bloodmnist.npz" in u for u in urls), urls
    assert len(urls) >= 2, "the download was not retried"
    assert not out.exists() and not list(out.parent.glob("*")), "a partial file was left behind"


@pytest.mark.parametrize("name", ["bogusmnist", "bloodmnist_32"])
def test_download_unknown_dataset_name(tmp_path, capsys, no_mirror, name):
    err = _fails(capsys, ["download", "--dataset", name, "--out", tmp_path / f"{name}.npz"])
    assert name in err


# ----- preprocess ----------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["truncated", "random"])
def test_preprocess_unreadable_npz_names_file(tmp_path, capsys, synth, damage):
    raw = tmp_path / "raw.npz"
    data = open(synth["path"], "rb").read()
    raw.write_bytes(data[: len(data) // 3] if damage == "truncated" else bytes(range(256)) * 20)
    out = tmp_path / "processed.npz"
    err = _fails(capsys, ["preprocess", "--job", _job({**synth, "md5": md5(raw)}), "--raw", raw,
                          "--out", out, "--samples", tmp_path / "samples.parquet"])
    assert str(raw) in err
    assert not out.exists() and not (tmp_path / "samples.parquet").exists()


# ----- params --------------------------------------------------------------------------------
def _params_file(tmp_path, synth, **overrides) -> str:
    """The tiny study with nested overrides (``{"train": {"rounds": 0}}`` merges into train)."""
    p = tiny_params(synth)
    for section, value in overrides.items():
        if isinstance(value, dict) and isinstance(p.get(section), dict):
            for k, v in value.items():
                if isinstance(v, dict) and isinstance(p[section].get(k), dict):
                    p[section][k] = {**p[section][k], **v}
                else:
                    p[section][k] = v
        else:
            p[section] = value
    return str(write_params(tmp_path, p))


def test_check_params_ok(tmp_path, capsys, synth):
    assert main(["check-params", _params_file(tmp_path, synth)]) == 0
    assert "ok (study ci" in capsys.readouterr().out


@pytest.mark.parametrize("overrides, names", [
    ({"methods": ["fedavg", "fedbogus"]}, ["methods", "fedbogus"]),
    ({"train": {"particpation": 0.5}}, ["train.particpation"]),
    ({"partitions": {"d": {"alpha": 0}}}, ["partitions.d", "alpha"]),
    ({"partitions": {"d": {"num_clients": 0}}}, ["partitions.d.num_clients"]),
    ({"train": {"participation": 1.5}}, ["train.participation"]),
    ({"train": {"rounds": 0}}, ["train.rounds"]),
    ({"train": {"rounds": "two"}}, ["train.rounds"]),
    ({"train": {"optimizer": {"lr": -1}}}, ["train.optimizer.lr"]),
    ({"seeds": [1, 1]}, ["seeds"]),
    ({"train": {"cuda_graphs": True, "executor": "sequential"}}, ["train.cuda_graphs", "sequential"]),
    ({"train": {"cuda_graphs": True, "executor": "stacked", "device": "cpu"}}, ["train.cuda_graphs", "device is cpu"]),
], ids=["unknown-method", "typo", "alpha-0", "clients-0", "participation-1.5", "rounds-0", "rounds-str", "lr<0",
        "dup-seeds", "cuda-graphs-sequential", "cuda-graphs-cpu"])
def test_check_params_rejects(tmp_path, capsys, synth, overrides, names):
    path = _params_file(tmp_path, synth, **overrides)
    err = _fails(capsys, ["check-params", path])
    assert path in err
    for name in names:
        assert name in err, f"{name!r} not named in:\n{err}"


def test_check_params_missing_file(tmp_path, capsys):
    err = _fails(capsys, ["check-params", tmp_path / "nope.yaml"])
    assert "nope.yaml" in err


# ----- Snakemake -----------------------------------------------------------------------------
@pytest.mark.slow
def test_snakemake_params_typo_fails_before_any_job(tmp_path, synth):
    p = tiny_params(synth)
    p["train"]["particpation"] = 0.5
    write_params(tmp_path, p)
    proc = snakemake(tmp_path, env=make_env(tmp_path), check=False)
    assert proc.returncode != 0
    assert "train.particpation" in proc.stdout, proc.stdout[-3000:]
    assert "Job stats" not in proc.stdout
    for folder in ("data", "results", "logs"):
        assert not (tmp_path / folder).exists(), f"{folder}/ was created: a job ran"
    assert yaml.safe_load((tmp_path / "params.yaml").read_text())["train"]["particpation"] == 0.5


# ----- the parser ----------------------------------------------------------------------------
def _undocumented(parser: argparse.ArgumentParser, prog: str = "medpfl") -> list[str]:
    """``prog option`` for every option or positional (but -h) of ``parser`` and its commands
    without a help text."""
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                missing += _undocumented(sub, f"{prog} {name}")
            continue
        if not action.help or action.help == argparse.SUPPRESS:
            missing.append(f"{prog} {'/'.join(action.option_strings) or action.dest}")
    return missing


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


def test_every_option_of_every_command_has_help():
    assert _undocumented(build_parser()) == []


def test_the_help_check_finds_an_undocumented_option():
    """The walk above is not vacuous: an option added without help (to a command too) is named."""
    parser = build_parser()
    _commands(parser)["train"].add_argument("--new-option", type=int)
    parser.add_argument("--top-level")
    assert sorted(_undocumented(parser)) == ["medpfl --top-level", "medpfl train --new-option"]


def test_help_says_how_to_run_a_study_and_groups_the_commands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for how in ("snakemake --cores all", "--configfile config/<study>.yaml", "medpfl ui", "medpfl check-params",
                "medpfl doctor"):
        assert how in out, how
    assert "`" not in out and ":mod:" not in out, "raw markup in --help"
    user, stages = out.index("\ncommands:"), out.index("\nstage commands (Snakemake runs these")
    assert user < stages
    listed = {line.split()[0]: i for i, line in enumerate(out[user:].splitlines()) if line.startswith("  ")}
    assert set(listed) == set(_commands(build_parser())), "a command is missing from --help, or listed twice"
    boundary = out[:stages].count("\n") - out[:user].count("\n")
    for name in USER_COMMANDS:
        assert listed[name] < boundary, f"{name} listed under the stage commands"
    for name in ("download", "preprocess", "partition", "partition-figure", "mlflow-init", "train", "evaluate",
                 "report"):
        assert listed[name] > boundary, f"{name} not listed under the stage commands"


@pytest.mark.parametrize("name", ["train", "doctor", "synthetic"])
def test_command_help_describes_each_option(capsys, name):
    with pytest.raises(SystemExit) as e:
        main([name, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: medpfl {name}")
    for action in _commands(build_parser())[name]._actions:
        assert action.option_strings[-1] in out if action.option_strings else action.dest in out
    if name == "train":
        assert '"method_params"' in out and "@FILE" in out  # the --job JSON's shape
        assert "Snakemake stage command" in " ".join(out.split())
    if name == "synthetic":
        assert "(default: 400)" in out  # --train


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"medpfl {importlib.metadata.version('medpfl')}\n"
    assert package_version() == medpfl.__version__  # pyproject.toml and the package agree


@pytest.mark.parametrize("argv, nearest", [
    (["trian"], ["train"]),
    (["-v", "dcotor", "--no-pipeline"], ["doctor"]),
    (["partiton"], ["partition"]),
    (["check-param", "params.yaml"], ["check-params"]),
])
def test_mistyped_command_names_the_nearest(capsys, argv, nearest):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    word = next(a for a in argv if not a.startswith("-"))
    assert lines[0].startswith(f"medpfl: error: unknown command {word!r}; did you mean {nearest[0]}")


def test_unknown_command_far_from_any_lists_them(capsys):
    assert main(["xyzzy"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "did you mean" not in err
    assert all(name in err for name in _commands(build_parser()))
