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

# Two pytest processes at once, each about half of the suite's time: tests/distributed (jobs under
# horovodrun and torchrun, one at a time) in one; tests/unit, then tests/benchmarks (the benchmarks'
# own tests and quick runs), then the zoo's and the simulator's launches and LATER_LAUNCHES (which
# even the halves out) in the other. The first's report is printed after the second's. Before them,
# numba's disk cache is filled (one process per dtype), so that the many processes they start load
# the compiled loops instead of each compiling them. Prints its own wall time at the end (CI allows
# 90 minutes with the set-up, and the suite's budget is 30), and each half the tests that cost the
# most CPU, their jobs included (tests/cpu_time.py): on two cores the CPU is what the time is made of.
test test-quick unit: export OMP_WAIT_POLICY = PASSIVE
# Horovod's background thread negotiates every HOROVOD_CYCLE_TIME ms even when idle (about a third
# of a core per rank at its 1 ms default): with four ranks on two cores that takes the cores from the
# ranks doing the work. Tests wait for results, never for latency, so they negotiate less often.
test test-quick unit: export HOROVOD_CYCLE_TIME = 5

#: Launches that run in the second process, after tests/unit and tests/benchmarks, to even the halves out.
LATER_LAUNCHES = tests/distributed/test_legacy.py::test_legacy_schedules_match_the_rules[gloo-8] \
	tests/distributed/test_legacy.py::test_legacy_schedules_match_the_rules[mpi-4] \
	tests/distributed/test_resume.py::test_a_resumed_run_ends_bit_identical[4-mpi]

test: setup
	@start=$$(date +%s); $(PY) -m ruff check . || exit 1; \
	$(PY) -m grace_legacy.compressors.kernels.warm float32 & warm=$$!; \
	$(PY) -m grace_legacy.compressors.kernels.warm float64 || exit 1; wait $$warm || exit 1; \
	tmp=$$(mktemp -d); \
	later="tests/distributed/test_zoo.py tests/distributed/test_simulate.py $(LATER_LAUNCHES)"; \
	$(PY) -m pytest tests/distributed $$(printf -- '--deselect=%s ' $$later) --basetemp $$tmp/launches \
		--durations=25 --cpu-top=25 > $$tmp/launches.log 2>&1 & launches=$$!; \
	$(PY) -m pytest tests/unit tests/benchmarks $$later --basetemp $$tmp/unit --durations=25 --cpu-top=25; unit=$$?; \
	wait $$launches; jobs=$$?; cat $$tmp/launches.log; rm -rf $$tmp; \
	echo "make test: $$(( ($$(date +%s) - start) / 60 )) min $$(( ($$(date +%s) - start) % 60 )) s"; \
	[ $$unit -eq 0 ] && [ $$jobs -eq 0 ]

# The quick loop for one's own edits (under 3 minutes): lint, the unit tests but the exhaustive
# sweeps marked `slow`, and one real launch under each launcher (horovodrun and torchrun), the
# tests marked `smoke`. The unit tests run in two pytest-xdist workers: they are Python, and one
# Python process keeps one core busy.
test-quick: setup
	$(PY) -m ruff check .
	$(PY) -m pytest -n 2 tests/unit tests/benchmarks -m "not distributed and not slow"
	$(PY) -m pytest tests/distributed -m smoke

unit: setup
	$(PY) -m pytest tests/unit tests/benchmarks -m "not distributed"

lint: setup
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) .cache .pytest_cache
