# kvserve: `make serve` starts the serving cluster on the default model; `make test` runs the tests.
# Both set up .venv on a fresh machine first, from the locks in requirements/ (the CPU build of torch included).
# Ray runs with token authentication on (RAY_AUTH_MODE=token): `kvserve serve` writes ~/.ray/auth_token (0600);
# the tests use a token of their own session (tests/e2e/conftest.py), never ~/.ray/auth_token.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Dependencies come from the locks in requirements/ (requirements/README.md): the versions CI ran,
# with their hashes, the same on every machine until `make lock` refreshes them. serve.lock is what
# `make serve` installs; test.lock (a superset at the same versions) what `make test` and CI install.
SERVE_STAMP := $(VENV)/.kvserve-serve
TEST_STAMP := $(VENV)/.kvserve-test
# pip byte-compiles what it installs one file at a time; --no-compile, then compileall on every core
# (the compile step below) does the same in less time. It is not left to Python's first imports:
# where PYTHONDONTWRITEBYTECODE is set (this project's machines set it) nothing compiled on import is
# kept, and every process (each Ray worker) would compile torch, Ray and transformers again.
PIP_VERSION := 26.3
# torch is the CPU build, torch==2.13.0+cpu: the machine's find-links carry it here; elsewhere add
# PyTorch's CPU index (`make serve PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu`).

.PHONY: setup serve lint test test-thorough test-latest test-deps lock bench bench-load clean

# install(lock, venv): a venv holding exactly the lock (hashes checked; --no-deps: the lock is the
# whole environment, resolved by `make lock`), then kvserve itself, editable, with no dependency
# resolution left to pip. The C++ CPU kernels are built once here (not at the first request).
define install
	test -x $(2)/bin/python || $(PY) -m venv $(2)
	$(2)/bin/pip install -q --no-compile "pip==$(PIP_VERSION)"
	$(2)/bin/pip install -q --no-compile --require-hashes --no-deps -r $(1)
	$(2)/bin/pip install -q --no-compile --no-deps --no-build-isolation -e .
	@# compile: best effort (a few packages ship files that do not compile, as pip ignores them too)
	$(2)/bin/python -m compileall -q -j 0 $$($(2)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))') kvserve \
		> /dev/null 2>&1 || true
	$(2)/bin/python -m kvserve.kernels.cpu_backend || echo "CPU kernels not built (no C++ compiler?): the torch path runs instead"
endef

$(SERVE_STAMP): requirements/serve.lock pyproject.toml Makefile
	$(call install,requirements/serve.lock,$(VENV))
	touch $(SERVE_STAMP)

$(TEST_STAMP): requirements/test.lock pyproject.toml Makefile
	$(call install,requirements/test.lock,$(VENV))
	touch $(SERVE_STAMP) $(TEST_STAMP)

setup: $(SERVE_STAMP)

serve: $(SERVE_STAMP)
	$(BIN)/kvserve serve $(ARGS)

# redis-server and prometheus (Debian) for the tests that start them (tests/deployments/test_rate_limiter_redis.py,
# tests/e2e/test_prometheus.py, ...): installed with apt-get when missing and root (or sudo)
# allows; otherwise those tests skip with a reason (install them by hand: apt-get install
# redis-server prometheus).
test-deps:
	@need=""; command -v redis-server >/dev/null || need="$$need redis-server"; \
	command -v prometheus >/dev/null || need="$$need prometheus"; \
	if [ -n "$$need" ]; then \
	  SUDO=""; [ "$$(id -u)" -ne 0 ] && SUDO="sudo -n"; \
	  echo "installing$$need with apt-get (for the tests that start them)"; \
	  ( $$SUDO apt-get update -q >/dev/null && $$SUDO env DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -q --no-install-recommends $$need >/dev/null ) \
	  || echo "could not install$$need: the tests that need them will skip (apt-get install$$need)"; \
	fi

# Two profiles (docs/index.md): `make test` is the fast one, the rule being green in <= 15 minutes
# on a 2-core box: tests marked `thorough` are deselected, and the tests that take a size (fuzz
# examples, requests, steps) run a small one. `make test-thorough` runs every test at its full
# size (KVSERVE_TEST_PROFILE=thorough), for CI on a bigger box or a nightly run. PYTEST_ARGS comes
# last, so `make test PYTEST_ARGS='-m thorough'` (the thorough-only tests) overrides the -m.
#
# Both run two pytest-xdist workers (TEST_WORKERS; 0 runs in one process): the tests that start
# Ray (tests/e2e, tests/cluster) in order in one worker, the in-process ones beside it in the
# other at a lower CPU priority, so that they use the cores the Ray tests' waits leave idle
# (tests/conftest.py: pytest_xdist_make_scheduler, pytest_runtest_setup).
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadgroup

FAST_PYTEST = -m pytest -q -ra --durations=15 $(XDIST) -m "not thorough" $(PYTEST_ARGS)

# The format and the lint rules ([tool.ruff] in pyproject.toml), first: `ruff format .` fixes the first.
lint: $(TEST_STAMP)
	$(BIN)/ruff format --check --quiet .
	$(BIN)/ruff check --quiet .

test: $(TEST_STAMP) test-deps lint
	$(BIN)/python $(FAST_PYTEST)

test-thorough: $(TEST_STAMP) test-deps
	KVSERVE_TEST_PROFILE=thorough $(BIN)/python -m pytest -q -ra --durations=30 $(XDIST) $(PYTEST_ARGS)

bench: $(TEST_STAMP)
	$(BIN)/python benchmarks/throughput.py --peer vllm

# load test (benchmarks/load_test.py, aiohttp: why not guidellm/locust is in its docstring):
# the sustainable rate at a TTFT SLO, then 1x, 2x, 3x it, against a `kvserve serve` it starts
bench-load: $(TEST_STAMP)
	$(BIN)/python benchmarks/load_test.py --start-server $(ARGS)

clean:
	rm -rf $(VENV) $(LATEST) build *.egg-info

# The locks, refreshed: every requirement resolved again at the newest allowed version (uv's
# resolver, pinned in test.lock), serve.lock at test.lock's versions. Commit both after `make test`
# passes on them (requirements/README.md).
# TORCH_FROM: where the CPU torch wheel is found (this machine's find-links; elsewhere
# TORCH_FROM="--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match").
TORCH_FROM ?= --find-links /opt/wheels
UV_COMPILE = $(BIN)/uv pip compile pyproject.toml --generate-hashes --python-version 3.11 \
	--python-platform x86_64-manylinux_2_28 $(TORCH_FROM) --custom-compile-command "make lock" \
	-c requirements/constraints.txt --override requirements/overrides.txt
lock: $(TEST_STAMP)
	$(UV_COMPILE) --upgrade --extra test -o requirements/test.lock
	$(UV_COMPILE) --extra serve -c requirements/test.lock -o requirements/serve.lock
	@# uv builds kvserve's metadata in the checkout; a kvserve.egg-info left there would shadow the
	@# installed one (its entry points: the executor backends) for every python started here
	rm -rf kvserve.egg-info

# The suite against the newest allowed versions of everything (not the lock), in a venv of its
# own: an upstream release that breaks kvserve is seen here before a user sees it.
LATEST := .venv-latest
test-latest: $(TEST_STAMP) test-deps
	@mkdir -p $(LATEST)
	$(UV_COMPILE) --upgrade --extra test -o $(LATEST)/latest.lock
	$(call install,$(LATEST)/latest.lock,$(LATEST))
	$(LATEST)/bin/python -m pip list --format=freeze > $(LATEST)/versions.txt
	$(LATEST)/bin/python $(FAST_PYTEST)
