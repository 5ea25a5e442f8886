"""accelstack simulator: drives the policy core from trace files with a virtual clock."""
