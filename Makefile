# Each target installs what it needs first (as root, on Debian 12): `install` the
# agent, the embedded store, the dashboard and the demo; `install-test` adds the
# test servers, browsers, Go, Prometheus, Alertmanager and podman.
.PHONY: install install-test demo test bench

install:
	./scripts/install.sh

install-test:
	./scripts/install.sh --test

demo: install
	.venv/bin/tokenprobe demo

test: install-test
	.venv/bin/python -m pytest -q -rs

bench: install-test
	.venv/bin/python -m benchmarks.bench_assembler
	.venv/bin/python -m benchmarks.bench_agent_overhead
	.venv/bin/python -m benchmarks.bench_hot_path
	.venv/bin/python -m benchmarks.bench_hot_path --steady
	.venv/bin/python -m benchmarks.bench_store_writes
	.venv/bin/python -m benchmarks.bench_store_writes --samplers --warm-up 5 --seconds 30
	.venv/bin/python -m benchmarks.bench_actuator
	.venv/bin/python -m benchmarks.bench_control_loop
	.venv/bin/python -m benchmarks.bench_connection_churn --agent
	.venv/bin/python -m benchmarks.bench_rescan
