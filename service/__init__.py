"""What every accelstack process shares: flags and their checks, structured logs, Prometheus metrics and
health endpoints, the hardened HTTP listeners and body reading, and sharing an event loop fairly."""
