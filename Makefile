# The two commands of the README: `make run` (4-worker training with LEGACY compression) and
# `make test`. Both set up the environment first if it is not there yet.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-done
CONTROLLER ?= gloo
NP ?= 4

.PHONY: setup run test test-quick unit lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh scripts/constraints.txt scripts/build_horovod.sh scripts/torchvision_on_cpu_torch.py
	scripts/setup.sh
	touch $@

run: setup
	$(VENV)/bin/horovodrun -np $(NP) -H localhost:$(NP) --$(CONTROLLER) $(PY) examples/train_digits.py

# Two pytest-xdist workers (tests/conftest.py says how they share the suite). Prints its own wall
# time at the end: CI allows 90 minutes with the set-up, and the suite's budget is 30 (the slowest
# tests are listed by --durations).
XDIST := -n 2 --dist loadgroup
# Waiting OpenMP threads sleep rather than spin: the tests run more threads than there are cores
# (tests/conftest.py says why).
test test-quick unit: export OMP_WAIT_POLICY = PASSIVE

test: setup
	@start=$$(date +%s); \
	$(PY) -m ruff check . && $(PY) -m pytest $(XDIST) --durations=40; status=$$?; \
	echo "make test: $$(( ($$(date +%s) - start) / 60 )) min $$(( ($$(date +%s) - start) % 60 )) s"; exit $$status

# The quick loop for one's own edits (a few minutes): lint, the unit tests but the exhaustive
# sweeps marked `slow`, and one real launch under each launcher (horovodrun and torchrun), the
# tests marked `smoke`.
test-quick: setup
	$(PY) -m ruff check .
	$(PY) -m pytest $(XDIST) tests/unit tests/benchmarks -m "not distributed and not slow"
	$(PY) -m pytest tests/distributed -m smoke

unit: setup
	$(PY) -m pytest tests/unit tests/benchmarks -m "not distributed"

lint: setup
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) .cache .pytest_cache
