# Two commands for a fresh machine (see README.md):
#   make run    set up and serve the built-in tiny model (OpenAI API on http://localhost:8000)
#   make test   set up and run the whole test suite (what CI runs)

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PORT   ?= 8000
PROMPT ?= Alice was beginning to get

.PHONY: run generate test setup setup-test lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

setup: $(BIN)/python
	$(BIN)/pip install --quiet -e .

setup-test: $(BIN)/python
	$(BIN)/pip install --quiet -e '.[test]'

run: setup
	$(BIN)/ketch serve --model tiny --port $(PORT)

generate: setup
	$(BIN)/ketch generate --max-tokens 80 "$(PROMPT)"

lint: setup-test
	$(BIN)/ruff check .

# pytest exits 5 when a selection collects no tests: report it instead of failing obscurely.
test: setup-test lint
	@$(BIN)/pytest -q $(PYTEST_ARGS); status=$$?; \
	if [ $$status -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi; exit $$status

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
