# The two commands of the README: `make serve` and `make test`.
# Both install what is missing (idempotently) first.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8080
APT_PKGS := libvulkan1 mesa-vulkan-drivers glslc
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: serve test install system-deps venv shaders lint typecheck

serve: install
	$(VENV)/bin/trio-llm serve --host $(HOST) --port $(PORT)

test: install
	$(VENV)/bin/ruff check src tests bench scenarios
	$(VENV)/bin/mypy
	$(VENV)/bin/python -m pytest -q -ra

install: system-deps $(VENV)/.installed shaders

system-deps:
	@missing=""; for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then echo "installing:$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing >/dev/null; fi

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,reference]'
	touch $@

shaders: $(VENV)/.installed
	$(VENV)/bin/trio-llm compile-shaders
