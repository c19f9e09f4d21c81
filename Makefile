# Two commands for a fresh Debian 12 machine (run as root, or with sudo):
#   make demo   provision, then run the default scenario end to end
#   make test   provision, then run the whole test suite (unit + system tests)
# and, on a host with libvirt (KVM, or QEMU's emulator where the host cannot nest):
#   make vm-test   the suite in a freshly booted lab VM made from the Vagrantfile; a JSON summary (runs/vm-test/)
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
SCENARIO ?= scenarios/default.yaml
PYTEST_ARGS ?=
VM_TEST_ARGS ?=

.PHONY: provision demo test unit system bench clean doctor vm-test

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

# builds the box if Vagrant lacks it, vagrant up, provision, `make test` inside, results out, vagrant destroy
vm-test:
	bash scripts/provision.sh --with-lab-vm --no-ovs-start
	$(PY) -m testbed.benchmarks.bench_labvm $(VM_TEST_ARGS)
