"""The leader-elected controllers (process ``accelstack-controller``): the GPR pass and the writer that carries it
out, the workspace controller, and the duration/wait history."""
