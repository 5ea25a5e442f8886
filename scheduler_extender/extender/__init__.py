"""The scheduler extender kube-scheduler calls (process ``accelstack-extender``, the verbs listener): the wire
format, filter/prioritize/preempt decisions, and bind with its ledger."""
