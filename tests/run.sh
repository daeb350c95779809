#!/usr/bin/env bash
# The whole suite, as README's second command and .ci/run run it: the unit tests on both cores
# (pytest-xdist; they need no engine and share nothing), then the end-to-end tests one module after
# another (they share clusters, and each cluster wants the machine's cores). Arguments go to both
# runs (e.g. -x, -k NAME). Exit: the first run's failure, else the second's.
set -uo pipefail
cd "$(dirname "$0")/.."
.venv/bin/pytest -q -n 2 -m "not e2e" "$@"
unit=$?
.venv/bin/pytest -q -m e2e "$@"
e2e=$?
# 5: nothing collected (a -k that selects from one half only) is no failure of the other half.
if [ "$unit" -eq 5 ] && [ "$e2e" -eq 5 ]; then exit 5; fi
for rc in "$unit" "$e2e"; do
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then exit "$rc"; fi
done
exit 0
