#!/usr/bin/env bash
# The Ray leg: tests/test_ray_launcher.py on a real Ray cluster (a head and worker nodes on network-namespace hosts,
# one cluster for the module), outside the main suite's 15 minutes (the module takes 2.5-3.5 minutes on 2 cores).
# AREAL_REQUIRE_RAY=1 and AREAL_REQUIRE_NETNS=1: a test that would skip fails instead.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
AREAL_REQUIRE_RAY=1 AREAL_REQUIRE_NETNS=1 .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_ray_launcher.py "$@"
echo "ray leg: $(( $(date +%s) - start )) s"
