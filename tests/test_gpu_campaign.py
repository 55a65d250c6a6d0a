"""``benchmarks/gpu_campaign.py``: the 64 MiB travel check on a fake checkout, the results files'
keys (a part that fails still writes its file), ``collect`` on returned files, and (slow) the
dry run of every part on the CPU with a carry folder built as ``prepare`` builds it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from benchmarks import gpu_campaign as gc
from tests.conftest import SHARED_BLOOD


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)


def test_travel_size_counts_the_tree_and_the_carry(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    _git(root, "init", "-q")
    (root / ".gitignore").write_text("/.gpu/\n/big.bin\n")
    (root / "tracked.txt").write_bytes(b"x" * 1000)
    (root / "results" / "study" / "archive").mkdir(parents=True)
    (root / "results" / "study" / "archive" / "r.parquet").write_bytes(b"r" * 4000)
    _git(root, "add", ".gitignore", "tracked.txt", "results")
    (root / "untracked.txt").write_bytes(b"u" * 500)  # travels: untracked, not ignored
    (root / "big.bin").write_bytes(b"b" * 100_000)  # ignored: stays
    (root / "shared").mkdir()
    (root / "shared" / "s.txt").write_bytes(b"s" * 300)  # a shared/ folder in the checkout travels
    carry = root / ".gpu"
    (carry / "wheels").mkdir(parents=True)
    (carry / "wheels" / "a.whl").write_bytes(b"w" * 2000)
    (carry / "data.npz").write_bytes(b"d" * 3000)
    gitignore = len((root / ".gitignore").read_bytes())
    rep = gc.travel_size(root, [carry], limit_mib=1)
    assert rep["tree_bytes"] == 1000 + 4000 + 500 + 300 + gitignore
    assert rep["carry_bytes"] == {".gpu": 5000}
    assert rep["total_bytes"] == rep["tree_bytes"] + 5000 and rep["ok"]
    assert dict(rep["biggest"])["results/study"] == 4000
    tight = gc.travel_size(root, [carry], limit_mib=(rep["total_bytes"] - 1) / gc.MIB)
    assert not tight["ok"]


def test_the_carry_folder_must_be_ignored(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    _git(root, "init", "-q")
    with pytest.raises(gc.CampaignError, match="not ignored"):
        gc.ensure_ignored(root, root / ".gpu", add_exclude=False)
    gc.ensure_ignored(root, root / ".gpu", add_exclude=True)  # appends /.gpu/ to .git/info/exclude
    assert "/.gpu/" in (root / ".git" / "info" / "exclude").read_text()
    gc.ensure_ignored(root, root / ".gpu", add_exclude=False)


def test_the_wheels_are_pinned_by_the_lock():
    pins = gc.lock_pins(gc.WHEELS)
    assert pins["pydantic"] and pins["pandera"] and set(pins) == set(gc.WHEELS)


def _ctx(tmp_path) -> gc.Ctx:
    import time

    return gc.Ctx(device="cpu", rounds=1, dry_run=True, out=tmp_path / "out", work=tmp_path / "work",
                  carry=tmp_path / "carry", deadline=time.monotonic() + 60)


def test_a_part_writes_its_file_with_the_common_keys_also_when_it_fails(tmp_path, monkeypatch):
    from benchmarks import gpu_parts

    def ok(ctx, checkpoint):
        checkpoint({"half": True})
        return {k: None for k in gc.RESULT_KEYS[5]}

    def broken(ctx, checkpoint):
        raise RuntimeError("boom")

    monkeypatch.setattr(gpu_parts, "part5_large", ok)
    monkeypatch.setattr(gpu_parts, "part2_executors", broken)
    ctx = _ctx(tmp_path)
    good = gc.run_part(5, ctx, {"part": ["5"]}, {"gpu": None})
    bad = gc.run_part(2, ctx, {"part": ["2"]}, {"gpu": None})
    assert good["status"] == "ok" and bad["status"] == "error" and "boom" in bad["error"]
    for name, obj in (("part5-large", good), ("part2-executors", bad)):
        on_disk = json.loads((ctx.out / f"{name}.json").read_text())
        assert set(gc.COMMON_KEYS) <= set(on_disk) and on_disk["status"] == obj["status"]
    assert gc.check_keys(good) == [] and gc.check_keys(bad) == []
    assert gc.check_keys({**good, "result": {}}) == ["result.runs"]


def test_collect_names_the_results_after_the_gpu(tmp_path):
    machine = {"gpu": {"name": "NVIDIA H100 80GB HBM3", "memory_gib": 79.2, "multiprocessors": 132,
                       "capability": "9.0"}, "versions": {"torch": "2.11.0"}, "cpu_model": "x"}
    back = tmp_path / "back"
    back.mkdir()
    for part, name in gc.PARTS.items():
        if part == 4:
            continue
        obj = {"campaign": 1, "part": part, "name": name, "status": "ok", "dry_run": False, "device": "cuda",
               "machine": machine, "args": {}, "started": "2026-12-01T10:00:00+00:00", "wall_s": 1.0,
               "result": {k: None for k in gc.RESULT_KEYS[part]}, "error": None, "notes": []}
        (back / f"part{part}-{name}.json").write_text(json.dumps(obj))
    assert gc.main(["collect", str(back), "--out-dir", str(tmp_path / "res")]) == 0
    merged = json.loads((tmp_path / "res" / "nvidia-h100-80gb-hbm3-2026-12-01.json").read_text())
    assert merged["machine_name"] == "NVIDIA H100 80GB HBM3" and len(merged["parts"]) == 4
    assert all(v == [] for v in merged["missing_keys"].values())
    md = (tmp_path / "res" / "nvidia-h100-80gb-hbm3-2026-12-01.md").read_text()
    assert md.startswith("# GPU campaign: NVIDIA H100 80GB HBM3 (2026-12-01)")


# ----------------------------------------------------------------------------- slow: the dry run
@pytest.fixture(scope="module")
def carry(tmp_path_factory):
    """A carry folder as ``prepare`` builds it, without wheels (pydantic and pandera import here):
    the official BloodMNIST file, the sample table, the partitions, and PFLlib when a fetched
    copy is on this machine (else part 3 reports it absent)."""
    if not SHARED_BLOOD.is_file():
        pytest.skip("needs ../shared/data/medmnist/bloodmnist.npz")
    c = tmp_path_factory.mktemp("carry")
    man = {"wheels": [], "data": gc.prepare_data(c / "data", SHARED_BLOOD),
           "pfllib": gc.prepare_pfllib(c / "pfllib", gc.PFLLIB_MIRROR if gc.PFLLIB_MIRROR.exists() else None,
                                       gc.HARNESS)}
    (c / "manifest.json").write_text(json.dumps(man))
    return c


@pytest.mark.slow
def test_prepared_data_leaves_room_in_the_carry(carry):
    """The data carried (official file, sample table, partitions) plus room for the wheels (3.4 MiB
    measured) and PFLlib's system/ (0.7 MiB) stays under 48 MiB, leaving 16 MiB of the 64 for the
    working tree."""
    data = gc._entry_bytes(carry / "data")
    assert data + 6 * gc.MIB <= 48 * gc.MIB, data / gc.MIB


@pytest.mark.slow
@pytest.mark.parametrize("part", sorted(gc.PARTS))
def test_dry_run_of_each_part_writes_its_results_file(carry, tmp_path, part):
    out = tmp_path / "out"
    rc = gc.main(["run", "--part", str(part), "--device", "cpu", "--rounds", "1", "--dry-run", "--out", str(out),
                  "--work", str(tmp_path / "work"), "--carry", str(carry), "--budget-s", "3000"])
    name = gc.results_name(part, _ctx(tmp_path))
    obj = json.loads((out / f"{name}.json").read_text())
    assert rc == 0 and obj["status"] in ("ok", "absent"), obj.get("error") or obj.get("notes")
    assert gc.check_keys(obj) == [] and obj["dry_run"] and obj["device"] == "cpu"
    if part == 4:
        assert (out / "part4-table1-runs.tar.gz").is_file()


@pytest.mark.slow
def test_dry_run_of_part4_with_stacked_seeds(carry, tmp_path):
    """``--stack-seeds``: each method's 2 dry-run seeds train in one process (train.stack_seeds),
    both seeds' runs evaluated, its own results file and tarball."""
    out = tmp_path / "out"
    rc = gc.main(["run", "--part", "4", "--stack-seeds", "--device", "cpu", "--rounds", "1", "--dry-run", "--out",
                  str(out), "--work", str(tmp_path / "work"), "--carry", str(carry), "--budget-s", "3000"])
    obj = json.loads((out / "part4-table1-stacked.json").read_text())
    assert rc == 0 and obj["status"] == "ok", obj.get("error") or obj.get("notes")
    res = obj["result"]
    assert res["stack_seeds"] and res["processes"] == 2
    assert sorted((r["method"], r["seed"], r["rc"], r["seeds_in_process"]) for r in res["runs"]) == \
        [("fedavg", 1, 0, 2), ("fedavg", 2, 0, 2), ("fedkper", 1, 0, 2), ("fedkper", 2, 0, 2)]
    assert all("evaluate_error" not in r for r in res["runs"])
    assert (out / "part4-table1-stacked-runs.tar.gz").is_file()
