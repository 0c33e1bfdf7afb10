"""The intake HTTP service: native task API, health and metrics."""
