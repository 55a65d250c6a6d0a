"""Every module a DVC stage's commands run is one of the stage's deps in ``dvc.yaml``.

``dvc repro`` re-runs a stage only when a dep changed (docs/pipeline.md), so a module that shapes a
stage's outs but is not a dep (a config default, a file writer, the environment block of
``job.json``) would leave ``dvc status`` clean after an edit that changes the outs. Each stage's
entry modules are imported in a fresh interpreter and every ``medpfl`` module that import loads
must lie under one of the stage's deps, or be one of the modules whose effects are outside the
outs (``SIDE_EFFECTS_ONLY``).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from helpers import REPO

# Modules that change nothing a stage writes into its outs: the MLflow store (a side effect, in
# neither git nor DVC), the progress display, the package's version string.
SIDE_EFFECTS_ONLY = {"src/medpfl/tracking.py", "src/medpfl/progress.py", "src/medpfl/__init__.py"}

# What each stage's shell commands import (workflow/rules/*.smk: `medpfl <subcommand>`), and what
# builds its job descriptions in the Snakefile's workflow/rules/common.smk: medpfl.config
# (partition_job, train_job, study_dict) and medpfl.data.run_data (data_job, over
# medpfl.data.sources.dataset_job). common.smk reads the params with medpfl.compose, which
# imports the method registry, the model zoo and the engine's server-optimizer and upload checks:
# its checks only reject params, except the model arguments' defaults it fills into the train job
# (so it is an entry of the train stage).
STAGE_ENTRY_MODULES = {
    "data": ["medpfl.cli", "medpfl.config", "medpfl.data.sources", "medpfl.data.run_data",
             "medpfl.data.preprocess", "medpfl.data.partition"],
    "train": ["medpfl.cli", "medpfl.compose", "medpfl.config", "medpfl.train", "medpfl.evaluate",
              "medpfl.algorithms"],
    "report": ["medpfl.cli", "medpfl.config", "medpfl.report"],
}

_LOADED = """
import importlib, json, sys
from pathlib import Path
root = Path(sys.argv[1]).resolve()
for name in sys.argv[2:]:
    importlib.import_module(name)
files = set()
for name, mod in list(sys.modules.items()):
    f = getattr(mod, "__file__", None)
    if name.split(".")[0] == "medpfl" and f:
        files.add(Path(f).resolve().relative_to(root).as_posix())
print(json.dumps(sorted(files)))
"""


def _loaded(modules: list[str]) -> list[str]:
    out = subprocess.run([sys.executable, "-c", _LOADED, str(REPO), *modules], capture_output=True, text=True,
                         timeout=300, check=True, cwd=REPO).stdout
    return json.loads(out.splitlines()[-1])


def _covered(path: str, deps: list[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in deps)


@pytest.mark.parametrize("stage", sorted(STAGE_ENTRY_MODULES))
def test_every_module_a_stage_runs_is_a_dep(stage):
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    deps = stages[stage]["deps"]
    loaded = _loaded(STAGE_ENTRY_MODULES[stage])
    assert "src/medpfl/cli.py" in loaded and len(loaded) > 3, loaded  # the import really ran
    missing = [f for f in loaded if not _covered(f, deps) and f not in SIDE_EFFECTS_ONLY]
    assert not missing, f"dvc.yaml stage {stage!r} runs these modules but does not depend on them: {missing}"
    # the shared Snakemake helpers build every stage's job descriptions
    assert "workflow/rules/common.smk" in deps
