"""The data plane: the OpenAI-compatible endpoint in front of the engine (`appliance gateway`),
with API keys, fair admission, usage accounting and workload telemetry."""
