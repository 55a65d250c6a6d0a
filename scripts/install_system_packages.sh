#!/usr/bin/env bash
# The Debian packages the tests use beyond Python, installed where missing:
#   chromium          headless browser of tests/test_ui_browser.py and scripts/mlflow_pages.py
#   slurm-wlm, munge  a one-node SLURM cluster on localhost (tests/test_slurm.py)
#   postgresql        the MLflow tracking server's database (tests/test_tracking_server.py)
# Needs root (or password-less sudo). Where neither is possible, or the package registry is
# unreachable, it says so and exits 0: the tests that need a package skip with the reason.
set -uo pipefail
missing=()
command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || missing+=(chromium)
command -v slurmctld >/dev/null 2>&1 && command -v slurmd >/dev/null 2>&1 || missing+=(slurm-wlm)
command -v munged >/dev/null 2>&1 || missing+=(munge)
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing+=(postgresql)
[[ ${#missing[@]} -eq 0 ]] && { echo "system packages: all present"; exit 0; }
if [[ $(id -u) -eq 0 ]]; then sudo=(); elif sudo -n true 2>/dev/null; then sudo=(sudo -n); else
  echo "system packages: ${missing[*]} missing and no root: the tests that need them will skip"; exit 0; fi
export DEBIAN_FRONTEND=noninteractive
if ! "${sudo[@]}" apt-get install -y -q "${missing[@]}" >/tmp/medpfl-apt.log 2>&1; then
  "${sudo[@]}" apt-get update -q >>/tmp/medpfl-apt.log 2>&1
  "${sudo[@]}" apt-get install -y -q "${missing[@]}" >>/tmp/medpfl-apt.log 2>&1 \
    || { echo "system packages: installing ${missing[*]} failed (/tmp/medpfl-apt.log): the tests that need them will skip"; exit 0; }
fi
echo "system packages: installed ${missing[*]}"
