#!/usr/bin/env bash
# Prints the path of a Python 3.12 interpreter, or fails with a message saying what to install.
# Order: $PYTHON, python3.12 on PATH, pyenv's 3.12.x, a plain python3 that is 3.12.
set -u
is_312() { "$1" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)' 2>/dev/null; }
for cand in "${PYTHON:-}" python3.12; do
  [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 && is_312 "$cand" && { command -v "$cand"; exit 0; }
done
if command -v pyenv >/dev/null 2>&1; then
  for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$' | sort -V -r); do
    p="$(pyenv root)/versions/$v/bin/python3"
    is_312 "$p" && { echo "$p"; exit 0; }
  done
fi
command -v python3 >/dev/null 2>&1 && is_312 python3 && { command -v python3; exit 0; }
echo "error: qmtp needs Python 3.12 (jax==0.11.2); none found. Install it (e.g. 'pyenv install 3.12') or set PYTHON=/path/to/python3.12" >&2
exit 1
