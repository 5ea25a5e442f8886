"""The kubectl plugin ``kubectl-accelstack`` (runs on a user's machine, talks to the REST API)."""
