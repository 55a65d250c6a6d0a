"""The report of a study that has not finished: its finished runs only.

A long study (``config/pfedkd-mnist.yaml``: tens of core-hours) runs over several sessions, and its
``report_all`` target waits for every run. This script evaluates the runs Snakemake recorded as
complete (their ``metrics.json``, through Snakemake, so the evaluate rule and its caching are the
study's own) and runs ``medpfl report`` over them, with the study's paper table and reference
method, into ``results/<study>/report-partial/`` (git-ignored; the study's report stays
``results/<study>/report/``):

    python scripts/partial_report.py pfedkd-mnist --configfile config/pfedkd-mnist.yaml

The tables say "ours / paper / difference / rank" as the full report does, with the ranks taken
among the finished rows only. Nothing is logged to MLflow (the parent run gets the full report).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from study_archive import finished_runs, snakemake_cmd


def partial_report(study: str, configfiles: list[str], results: Path, out_dir: Path | None, cores: int,
                   snakefile: Path | None = None) -> Path:
    """Evaluate the finished runs of ``study`` and report them; returns the report's ``table.md``.

    Raises SystemExit when the study has no finished run or a Snakemake or ``medpfl report`` call
    fails (their output is shown)."""
    from medpfl.compose import load_params

    params = load_params("params.yaml", [c for c in configfiles if Path(c).name != "params.yaml"])
    if params.study != study:
        sys.exit(f"partial_report: the config files name study {params.study!r}, not {study!r}")
    runs = finished_runs(results / study / "runs")
    if not runs:
        sys.exit(f"partial_report: no finished run of study {study!r} in {results / study / 'runs'}")
    cmd = snakemake_cmd([(r / "metrics.json").as_posix() for r in runs], cores, snakefile, configfiles)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"partial_report: evaluating the finished runs failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    out_dir = out_dir or results / study / "report-partial"
    report = [sys.executable, "-m", "medpfl.cli", "report", "--runs", *[r.as_posix() for r in runs],
              "--out-dir", str(out_dir), "--title", f"medpfl study {study}: the {len(runs)} finished runs"]
    if params.report.paper_table:
        report += ["--paper-table", params.report.paper_table]
    if params.report.reference:
        report += ["--reference", params.report.reference]
    done = subprocess.run(report, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"partial_report: medpfl report failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    print(f"partial_report: {len(runs)} finished run(s) of {study} reported in {out_dir / 'table.md'}")
    return out_dir / "table.md"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("study")
    parser.add_argument("--configfile", nargs="+", default=[],
                        help="the study's config file(s), as given to snakemake (default: params.yaml only)")
    parser.add_argument("--results", type=Path, default=Path("results"))
    parser.add_argument("--out-dir", type=Path, help="default: results/<study>/report-partial")
    parser.add_argument("--snakefile", type=Path, help="default: ./Snakefile")
    parser.add_argument("--cores", type=int, default=1)
    args = parser.parse_args(argv)
    partial_report(args.study, args.configfile, args.results, args.out_dir, args.cores, args.snakefile)


if __name__ == "__main__":
    main()
