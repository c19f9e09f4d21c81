# Two commands for a fresh Debian 12 machine (run as root, or with sudo):
#   make demo   provision, then run the default scenario end to end
#   make test   provision, then run the whole test suite (unit + system tests)
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
SCENARIO ?= scenarios/default.yaml
PYTEST_ARGS ?=

.PHONY: provision demo test unit system bench clean doctor

provision:
	bash scripts/provision.sh

demo: provision
	$(VENV)/bin/orchestrrl demo $(SCENARIO)

test: provision
	$(PY) -m pytest tests $(PYTEST_ARGS)

unit:
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

system:
	$(PY) -m pytest tests/system $(PYTEST_ARGS)

doctor:
	$(VENV)/bin/orchestrrl doctor

clean:
	$(VENV)/bin/orchestrrl clean
