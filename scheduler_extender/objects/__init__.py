"""API objects as the policy core sees them, read by every process of the control plane: the GPR codec, pods'
requests, the node ledger, the informer-fed cluster view, kube-scheduler's own node filters, workspaces as pure
functions, and the API calls on them (on :mod:`kubeapi`). Imports only :mod:`scheduler_extender.core`,
:mod:`kubeapi` and :mod:`service`."""
