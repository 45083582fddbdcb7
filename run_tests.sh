#!/usr/bin/env bash
# The test command: installs what is missing (via ./train_ae.sh --install-only), runs the suite.
# Extra arguments go to pytest (e.g. ./run_tests.sh -m "not slow", ./run_tests.sh -k config).
set -uo pipefail
cd "$(dirname "$0")"
./train_ae.sh --install-only || exit 1
.venv/bin/python -m pytest "$@"
rc=$?
# pytest exit 5 = "no tests collected": that is a failure here, never a pass.
if [ "$rc" -eq 5 ]; then echo "run_tests: no tests were collected" >&2; exit 1; fi
exit "$rc"
