#!/usr/bin/env bash
# The test command: installs what is missing (via ./train_ae.sh --install-only), runs the suite.
# Extra arguments go to pytest (e.g. ./run_tests.sh -m "not slow", ./run_tests.sh -k config;
# ./run_tests.sh -n 0: one process, no workers).
set -uo pipefail
cd "$(dirname "$0")"
./train_ae.sh --install-only || exit 1
# The W&B and MLflow extras, for the tests of --logger=wandb,mlflow (offline): installed when
# missing (~140 MB, a minute or two), bounded in time; where that fails those tests skip, saying why.
if ! .venv/bin/python -c "import wandb, mlflow" 2>/dev/null; then
  timeout 600 .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[wandb,mlflow]" \
    || echo "run_tests: the wandb/mlflow extras could not be installed; their tests skip" >&2
fi
# Parallel workers (pytest-xdist): many end-to-end tests mostly wait (timeouts, process startup,
# SLURM), so 3 workers on 2 cores finish far sooner than one; AE_TEST_WORKERS sets how many. The
# tests that must not run side by side are one xdist_group (SERIAL, tests/support/runs.py).
# One OpenMP thread per process: the workers and the runs they launch are several processes a
# core already, and torch's threads spin while they wait for one another (a 1-rank run, which the
# launcher gives every core, took twice the CPU with 2 threads). A run's own setting, if given, wins.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# ae's own bytecode, written once: where PYTHONDONTWRITEBYTECODE is set (as on the CI machine),
# every launcher, torchrun and rank process would compile ae's sources again (~0.5 CPU s each).
.venv/bin/python -m compileall -q -j 0 ae logging_cfg bench tests train_ae.py >/dev/null || true
.venv/bin/python -m pytest -n "${AE_TEST_WORKERS:-3}" --dist loadgroup "$@"
rc=$?
# pytest exit 5 = "no tests collected": that is a failure here, never a pass.
if [ "$rc" -eq 5 ]; then echo "run_tests: no tests were collected" >&2; exit 1; fi
exit "$rc"
