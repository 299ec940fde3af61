#!/usr/bin/env bash
# The real-SGLang leg: builds (once per machine; cached in ${AREAL_ENGINE_CACHE:-~/.cache/areal_async/engines}) a
# venv of the oldest and of the newest SGLang release the project supports, and runs tests/test_sglang_conformance.py
# against a real server of each, started by the project's own launcher on this CPU: the checks shared with the fake
# (so that the fake cannot drift), the real-only checks and `python -m areal_async.run server.backend=sglang` end
# to end. AREAL_REQUIRE_SGLANG=1: a real test that would skip fails instead.
#
# Usage: .ci/sglang_leg.sh [RELEASE ...]   (default: 0.5.10 0.5.23)
set -euo pipefail
cd "$(dirname "$0")/.."
RELEASES=("$@")
[ ${#RELEASES[@]} -gt 0 ] || RELEASES=(0.5.10 0.5.23)
CACHE=${AREAL_ENGINE_CACHE:-$HOME/.cache/areal_async/engines}
bash scripts/install_sglang.sh "${RELEASES[@]}"
for release in "${RELEASES[@]}"; do
  start=$(date +%s)
  AREAL_REQUIRE_SGLANG=1 AREAL_SGLANG_PYTHON="$CACHE/sglang-$release/bin/python" \
    .venv/bin/python -m pytest -q -p no:cacheprovider -p no:randomly tests/test_sglang_conformance.py -k real
  echo "sglang leg $release: $(( $(date +%s) - start )) s"
done
