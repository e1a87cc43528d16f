# qmtp: `make demo` runs the shipped demo model (models/qmtp-demo), `make test` runs the CPU suite.
# Both create .venv with Python 3.12 on first use.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-all venv clean-venv oracle-fixtures

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

# Includes tests marked slow (still CPU only).
test-all: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) scripts/pytest_groups.py -q -m 'not gpu'

# Regenerates tests/fixtures/oracle with HF transformers in a separate Python 3.11 + torch venv.
oracle-fixtures:
	scripts/make_oracle_fixtures.sh

clean-venv:
	rm -rf $(VENV)
