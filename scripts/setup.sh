#!/usr/bin/env bash
# Create .venv/ in the repository root and install tactix (editable) with what its tests need.
#
#   scripts/setup.sh            then  .venv/bin/tactix demo   or   .venv/bin/python -m pytest
#
# torch: an already-importable torch in .venv is kept; otherwise $TACTIX_TORCH is installed
# (default torch==2.13.0, the CPU build that this project's CI machines carry on local disk).
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv
py=.venv/bin/python
if ! "$py" -c "import torch" >/dev/null 2>&1; then
  "$py" -m pip install -q "${TACTIX_TORCH:-torch==2.13.0}"
fi
# numpy only silences torch's import-time warning; tactix itself does not use it.
# ruff and mypy are the repository's lint and type gates (tests/test_static_checks.py runs them).
"$py" -m pip install -q numpy ruff mypy -e "./core[testing]"
for plugin in plugins/* examples/*; do
  if [ -f "$plugin/pyproject.toml" ]; then
    extra=""  # a plugin's own test tools, where it declares them
    if grep -q "^testing = " "$plugin/pyproject.toml"; then extra="[testing]"; fi
    "$py" -m pip install -q -e "./$plugin$extra"
  fi
done
"$py" -c "import tactix; print('tactix', tactix.__version__, 'installed in .venv')"
