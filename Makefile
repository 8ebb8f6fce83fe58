# make help lists the targets. Everything installs into the repo (.venv); nothing by hand.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
DB     ?= marketplace.db
CHAIN_DB ?= chain-demo.db
HOST   ?= 127.0.0.1
PORT   ?= 8080
FUZZ_EXAMPLES ?= 200

.DEFAULT_GOAL := help
.PHONY: help run serve seed chain-demo test test-replicas fuzz bench contracts clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-13s %s\n", $$1, $$2}'

# The service's packages (requirements.txt) for make run; the tests' too (requirements-dev.txt) for make test. A
# .venv without a working pip (python3-venv was missing when it was made) is made again, never a dead end.
$(VENV)/stamp: requirements.txt
	@$(PY) -m pip --version >/dev/null 2>&1 || { rm -rf $(VENV) && $(PYTHON) -m venv $(VENV); } || { rm -rf $(VENV); \
		echo "make: '$(PYTHON) -m venv' failed: install Debian's python3-venv (sudo apt-get install python3-venv)"; exit 1; }
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	touch $@

$(VENV)/dev-stamp: $(VENV)/stamp requirements-dev.txt
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	touch $@

# anvil (a local EVM) and solc for the chain tests, pinned by package.json and package-lock.json.
# npm install, not npm ci: the lock lacks anvil's optional packages for other platforms (the registry
# here has only linux-amd64), which npm ci refuses; npm install keeps the locked versions.
node_modules/.stamp: package.json package-lock.json
	npm install --no-audit --no-fund
	touch $@

run: $(VENV)/stamp  ## serve the demo on http://127.0.0.1:8080 (HOST=0.0.0.0 PORT=8080; seeds a new database first)
	@test -f $(DB) || { rm -f $(DB).new && $(PY) marketplace.py seed --db $(DB).new --keys-file demo-keys.txt \
		&& mv $(DB).new $(DB); }
	@test ! -f demo-keys.txt || echo "The demo's API keys, with their roles: demo-keys.txt"
	$(PY) marketplace.py serve --db $(DB) --host $(HOST) --port $(PORT) --open-arbitration \
		--rate-limit-scale 100 --allow-private-webhooks

seed: $(VENV)/stamp  ## load the demo fixtures into a new database (DB=marketplace.db); keys in demo-keys.txt
	$(PY) marketplace.py seed --db $(DB) --keys-file demo-keys.txt

# A new chain each time, so a new database each time (CHAIN_DB; its keys in chain-demo-keys.txt). Ctrl-C ends both.
chain-demo: $(VENV)/stamp node_modules/.stamp  ## rehearse contract mode: a local chain, test USDC, the JobEscrow, funded wallets (HOST, PORT)
	@rm -f $(CHAIN_DB) $(CHAIN_DB)-wal $(CHAIN_DB)-shm $(CHAIN_DB).anvil.log
	$(PY) marketplace.py chain-demo --db $(CHAIN_DB) --host $(HOST) --port $(PORT) --open-arbitration \
		--rate-limit-scale 100 --allow-private-webhooks --fee-percent 2 --sweep-interval 5

test: $(VENV)/dev-stamp node_modules/.stamp  ## run the whole test suite
	$(PY) -m pytest -q

test-replicas: $(VENV)/dev-stamp node_modules/.stamp  ## the 11-minute test of a replica started before the primary's first compaction
	MARKETPLACE_TEST_REPLICAS=1 $(PY) -m pytest -q tests/test_replica_freeze.py

fuzz: $(VENV)/dev-stamp  ## long fuzzing, not in make test: the state machine (500 runs) and each API operation (FUZZ_EXAMPLES=200)
	HYPOTHESIS_PROFILE=fuzz SCHEMATHESIS_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -p no:cacheprovider \
		tests/test_properties.py tests/test_schemathesis.py

bench: $(VENV)/dev-stamp  ## measure the server with wrk against a bare ceiling (BENCH_ARGS="--jobs 100000")
	@command -v wrk >/dev/null || { echo "make bench needs wrk: sudo apt-get install wrk"; exit 2; }
	$(PY) bench/bench.py $(BENCH_ARGS)

contracts: node_modules/.stamp  ## rebuild contracts/JobEscrow.json and fixtures/TestUSDC.json from their .sol
	node contracts/compile.js

clean:  ## remove the virtual environment and the local database
	rm -rf $(VENV) $(DB) $(DB)-wal $(DB)-shm $(DB).litestream.yml .pytest_cache \
		$(CHAIN_DB) $(CHAIN_DB)-wal $(CHAIN_DB)-shm $(CHAIN_DB).anvil.log chain-demo-keys.txt
