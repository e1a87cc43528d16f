# qmtp: `make demo` runs the shipped demo model (models/qmtp-demo), `make test` runs the CPU suite.
# Both create .venv with Python 3.12 on first use.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-all venv clean-venv oracle-fixtures device-wheels

$(STAMP): pyproject.toml
	@test -x $(PY) || $$(scripts/find_python312.sh) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m qmtp.generate --flagfile=configs/demo.flags

# The suite in a few fresh pytest processes (scripts/pytest_groups.py says why); same markers and flags.
test: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) scripts/pytest_groups.py -q -x --timeout=900

# The HTTP server's and the load test's packages (fastapi, uvicorn, httpx and what they need) as Python 3.12
# x86-64 wheels in .device-wheels/, at the versions of .venv, for a GPU machine that has JAX but not them:
# carry the folder there (the device tool's carry); scripts/gpu_check.sh's server steps unpack it.
device-wheels: $(STAMP)
	rm -rf .device-wheels && mkdir -p .device-wheels
	$(PY) -m pip freeze --exclude-editable > .device-wheels/constraints.txt
	$(PY) -m pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
	  --platform manylinux_2_17_x86_64 -c .device-wheels/constraints.txt -d .device-wheels fastapi uvicorn httpx
	@ls .device-wheels/*.whl | wc -l | xargs echo "device-wheels: wheels in .device-wheels:"

# Includes tests marked slow (still CPU only).
test-all: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) scripts/pytest_groups.py -q -m 'not gpu'

# Regenerates tests/fixtures/oracle/* (dense and MoE) with HF transformers (scripts/make_oracle_fixtures.py)
# in its own venv, .venv-oracle (git-ignored): Python 3.11 ($PYTHON if it is 3.11, else python3.11,
# pyenv's newest 3.11.x, or python3 if it is 3.11), CPU torch, offline. torch goes in first and pinned,
# so that transformers cannot pull in another torch. ORACLE_ARGS="--only qwen3_5" builds one fixture.
ORACLE_VENV := .venv-oracle
ORACLE_TORCH := torch==2.13.0
ORACLE_PINS := transformers==5.24.0 safetensors==0.8.0 numpy==2.4.6
oracle-fixtures:
	@set -eu; say() { echo "[oracle-fixtures] $$*"; }; \
	is311() { "$$1" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' 2>/dev/null; }; \
	if [ -x $(ORACLE_VENV)/bin/python ] && is311 $(ORACLE_VENV)/bin/python; then \
	  say "using existing $(ORACLE_VENV) ($$($(ORACLE_VENV)/bin/python --version))"; \
	else \
	  if [ -e $(ORACLE_VENV) ]; then say "$(ORACLE_VENV) is not a Python 3.11 venv; recreating it"; rm -rf $(ORACLE_VENV); fi; \
	  py=; \
	  for c in "$${PYTHON:-}" python3.11; do \
	    if [ -n "$$c" ] && command -v "$$c" >/dev/null 2>&1 && is311 "$$c"; then py=$$(command -v "$$c"); break; fi; \
	  done; \
	  if [ -z "$$py" ] && command -v pyenv >/dev/null 2>&1; then \
	    for v in $$(pyenv versions --bare 2>/dev/null | grep -E '^3\.11(\.[0-9]+)?$$' | sort -V -r); do \
	      p="$$(pyenv root)/versions/$$v/bin/python3"; if is311 "$$p"; then py=$$p; break; fi; \
	    done; \
	  fi; \
	  if [ -z "$$py" ] && command -v python3 >/dev/null 2>&1 && is311 python3; then py=$$(command -v python3); fi; \
	  if [ -z "$$py" ]; then \
	    echo "error: the oracle needs Python 3.11 (torch 2.13.0 CPU wheel); none found. Install it or set PYTHON=" >&2; exit 1; \
	  fi; \
	  say "creating $(ORACLE_VENV) with $$py ($$("$$py" --version))"; \
	  "$$py" -m venv $(ORACLE_VENV); \
	fi; \
	say "pip install $(ORACLE_TORCH)"; \
	$(ORACLE_VENV)/bin/python -m pip install --quiet "$(ORACLE_TORCH)"; \
	say "pip install $(ORACLE_PINS) $(ORACLE_TORCH)"; \
	$(ORACLE_VENV)/bin/python -m pip install --quiet $(ORACLE_PINS) "$(ORACLE_TORCH)"; \
	$(ORACLE_VENV)/bin/python -c 'import torch, transformers, safetensors, numpy; print("[oracle-fixtures] versions: torch", torch.__version__, "| transformers", transformers.__version__, "| safetensors", safetensors.__version__, "| numpy", numpy.__version__)'; \
	say "running scripts/make_oracle_fixtures.py $(ORACLE_ARGS) (HF_HUB_OFFLINE=1, CPU only)"; \
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 USE_HUB_KERNELS=0 CUDA_VISIBLE_DEVICES="" \
	  $(ORACLE_VENV)/bin/python scripts/make_oracle_fixtures.py $(ORACLE_ARGS); \
	say "fixtures:"; \
	ls -l tests/fixtures/oracle/*/

clean-venv:
	rm -rf $(VENV)
