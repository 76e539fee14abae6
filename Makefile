# Both targets install what they need first (as root, on Debian 12).
.PHONY: install demo test bench

install:
	./scripts/install.sh

demo: install
	.venv/bin/tokenprobe demo

test: install
	.venv/bin/python -m pytest -q -rs

bench: install
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
