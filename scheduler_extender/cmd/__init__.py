"""Process entry points: ``accelstack-extender`` and ``accelstack-controller`` (flags, wiring, shutdown)."""
