"""accelstack scheduler extender, GPR controller and policy core."""
