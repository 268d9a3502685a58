# The two commands of the README: `make serve` and `make test`.
# Both install what is missing (idempotently) first.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8080
APT_PKGS := libvulkan1 mesa-vulkan-drivers
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: serve test install install-serve install-test system-deps shaders lint typecheck

# serving needs the package alone; the tests add pytest, openai, ruff, mypy and the
# reference stack (transformers, torch): two stamps, so `make serve` never pulls torch
serve: install-serve
	$(VENV)/bin/trio-llm serve --host $(HOST) --port $(PORT)

test: install-test
	$(VENV)/bin/ruff check src tests bench scenarios
	$(VENV)/bin/mypy
	$(VENV)/bin/python -m pytest -q -ra -n auto --dist loadfile -m "not serial"
	$(VENV)/bin/python -m pytest -q -ra -m serial

install: install-test

install-serve: system-deps $(VENV)/.installed-serve
	$(VENV)/bin/trio-llm compile-shaders

install-test: system-deps $(VENV)/.installed-test
	$(VENV)/bin/trio-llm compile-shaders

system-deps:
	@missing=""; for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then echo "installing:$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing >/dev/null; fi

$(VENV)/.created:
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	touch $@

$(VENV)/.installed-serve: pyproject.toml | $(VENV)/.created
	$(PY) -m pip install -q -e .
	touch $@

# the test install holds everything serving needs, so it stamps both
$(VENV)/.installed-test: pyproject.toml | $(VENV)/.created
	$(PY) -m pip install -q -e '.[test,reference]'
	touch $@ $(VENV)/.installed-serve

shaders: install-serve
