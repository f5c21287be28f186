# Two commands for a fresh machine (see README.md):
#   make run    set up and serve the built-in tiny model (OpenAI API on http://localhost:8000)
#   make test   set up and run the whole test suite (what CI runs)
# A real Kubernetes control plane on this machine (root, Go 1.26; see README "Kubernetes"):
#   make cluster-up     build it if needed, start it, print `export KUBECONFIG=...`
#   make cluster-down   stop it; nothing is left running

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PORT   ?= 8000
PROMPT ?= Alice was beginning to get

CLUSTER_DIR ?= /tmp/ketch-cluster
# Where hack/build-control-plane.sh puts the binaries (outside the repository, by version).
KETCH_BIN_CACHE ?= $(HOME)/.cache/ketch
export KETCH_BIN_CACHE

.PHONY: run generate test setup setup-test lint clean control-plane cluster-up cluster-down

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# xds-protos ships an old copy of opentelemetry/proto/ that overwrites opentelemetry-proto's
# files when it installs after it; the OTLP trace exporters cannot load that copy
# (--otlp-traces-endpoint), so opentelemetry-proto's own files are put back when it happened.
OTEL_PROTO_OK = from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope
OTEL_PROTO_VERSION = import importlib.metadata as m; print(m.version("opentelemetry-proto"))
define fix_otel_proto
	$(BIN)/python -c '$(OTEL_PROTO_OK)' 2>/dev/null || $(BIN)/pip install --quiet \
	  --force-reinstall --no-deps "opentelemetry-proto==$$($(BIN)/python -c '$(OTEL_PROTO_VERSION)')"
endef

setup: $(BIN)/python
	$(BIN)/pip install --quiet -e .
	$(fix_otel_proto)

setup-test: $(BIN)/python
	$(BIN)/pip install --quiet -e '.[test]'
	$(fix_otel_proto)

run: setup
	$(BIN)/ketch serve --model tiny --port $(PORT)

generate: setup
	$(BIN)/ketch generate --max-tokens 80 "$(PROMPT)"

lint: setup-test
	$(BIN)/ruff check .

control-plane:
	@hack/build-control-plane.sh >&2

cluster-up: setup control-plane
	@PATH="$$(hack/build-control-plane.sh --bin-path):$$PATH" PYTHONPATH=hack \
	  $(BIN)/python -m localcluster up --dir $(CLUSTER_DIR)

cluster-down:
	@PYTHONPATH=hack $(BIN)/python -m localcluster down --dir $(CLUSTER_DIR)

# pytest exits 5 when a selection collects no tests: report it instead of failing obscurely.
test: setup-test lint control-plane
	@$(BIN)/pytest -q $(PYTEST_ARGS); status=$$?; \
	if [ $$status -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi; exit $$status

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
