"""BPF C sources loaded by the agent (tokenprobe.agent.capture.kernel.loader)."""
