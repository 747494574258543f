# The single source for setting up and running kafka-quota-proxy on a Debian/Ubuntu machine.
#   make test    install into .venv (and kcat, Java 17, stunnel4 via apt-get when run as root), lint (ruff),
#                type-check (mypy), run every test
#   make demo    install, start a local broker (Tansu) with the proxy in front and use it
#   make bench   install, run the benchmarks (bench/README.md)
# Override the interpreter with PYTHON=python3.12, pass arguments with DEMO_ARGS / BENCH_ARGS.

PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
APT_GET := DEBIAN_FRONTEND=noninteractive apt-get

.PHONY: venv install kcat java stunnel test demo bench clean

install: venv
venv: $(STAMP) kcat java stunnel

$(VPY):
	@if ! $(PYTHON) -c 'import ensurepip, venv' >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    $(APT_GET) update && $(APT_GET) install -y --no-install-recommends python3-venv; \
	  else \
	    echo "$(PYTHON) cannot create a virtualenv: install python3-venv (sudo apt-get install python3-venv)" >&2; \
	    exit 1; \
	  fi; \
	fi
	$(PYTHON) -m venv $(VENV)

# Reinstalled whenever pyproject.toml changes.
$(STAMP): $(VPY) pyproject.toml
	$(VPY) -m pip install --disable-pip-version-check -e '.[test]'
	@touch $@

# kcat (Debian package) is one of the real clients the integration tests drive.
kcat:
	@if ! command -v kcat >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    $(APT_GET) update && $(APT_GET) install -y --no-install-recommends kcat; \
	  else \
	    echo "kcat is not installed and this is not root: run 'sudo apt-get install kcat'" \
	         "(the kcat integration test fails without it)" >&2; \
	  fi; \
	fi

# Java 17 runs Spark for `kafka-quota-proxy report` and its tests (Debian: openjdk-17-jre-headless).
java:
	@if ! command -v java >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    $(APT_GET) update && $(APT_GET) install -y --no-install-recommends openjdk-17-jre-headless; \
	  else \
	    echo "java is not installed and this is not root: run 'sudo apt-get install openjdk-17-jre-headless'" \
	         "(report and the pipeline tests need it)" >&2; \
	  fi; \
	fi

# stunnel4 (Debian package) terminates TLS in front of Tansu, which cannot serve TLS itself: the broker
# the upstream-TLS tests connect to (tests/support/tls_broker.py).
stunnel:
	@if ! command -v stunnel4 >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    $(APT_GET) update && $(APT_GET) install -y --no-install-recommends stunnel4; \
	  else \
	    echo "stunnel4 is not installed and this is not root: run 'sudo apt-get install stunnel4'" \
	         "(the upstream TLS tests fail without it)" >&2; \
	  fi; \
	fi

test: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VPY) -m pytest -q -ra

demo: install
	$(VENV)/bin/kafka-quota-proxy demo $(DEMO_ARGS)

bench: install
	$(VPY) -m bench.run $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis .mypy_cache .ruff_cache
