"""Where the kinds the gateway and the operator read and write live in the REST API (``kubeapi`` descriptors)."""

from __future__ import annotations

from inference.names import GROUP, KIND, PLURAL, VERSION
from kubeapi.resources import Resource

INFERENCE_ENDPOINTS = Resource(GROUP, VERSION, PLURAL, KIND)
ENDPOINT_SLICES = Resource("discovery.k8s.io", "v1", "endpointslices", "EndpointSlice")
DEPLOYMENTS = Resource("apps", "v1", "deployments", "Deployment")
REPLICA_SETS = Resource("apps", "v1", "replicasets", "ReplicaSet")
PDBS = Resource("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget")
NETWORK_POLICIES = Resource("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy")
HPAS = Resource("autoscaling", "v2", "horizontalpodautoscalers", "HorizontalPodAutoscaler")
