"""Admission webhooks (process ``accelstack-extender``): gate pods until their GPR is admitted, create auto-GPRs,
validate GPRs and workspaces."""
