#!/usr/bin/env bash
# Image entry point: the demo by default; --check verifies the build and runs a 2-rank smoke test;
# anything else is executed as given (e.g. horovodrun ...).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$(command -v python)}
launcher=$(dirname "$python")/horovodrun
case "${1:-demo}" in
  demo)
    shift || true
    exec "$launcher" -np "${NP:-4}" -H "localhost:${NP:-4}" "$python" -m hvd_averaging.examples.train --out "${OUT:-$here/results/demo}" "$@" ;;
  --check)
    "$launcher" --check-build
    exec "$launcher" -np 2 -H localhost:2 "$python" -m hvd_averaging.examples.smoke ;;
  *)
    exec "$@" ;;
esac
