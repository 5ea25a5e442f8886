"""Node health for accelstack: node-problem-detector custom plugins (GPUs, NR1 modules), the remediation
controller that taints unhealthy nodes, and the per-device Prometheus exporter."""
