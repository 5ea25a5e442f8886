"""Names the gateway, the operator and the manifests share (defined once, imported everywhere)."""

from __future__ import annotations

GROUP = "accelstack.io"
VERSION = "v1alpha1"
KIND = "InferenceEndpoint"
PLURAL = "inferenceendpoints"

# Labels the operator puts on what it creates; the EndpointSlice controller copies a Service's labels onto its
# slices, so the gateway finds an endpoint's replicas (and their pool) by these two.
LABEL_ENDPOINT = "accelstack.io/inference-endpoint"
LABEL_POOL = "accelstack.io/pool"
POOL_PRIMARY = "primary"
POOL_BURST = "burst"
POOLS = (POOL_PRIMARY, POOL_BURST)

# API keys are Secrets with this label; the token is under data[SECRET_KEY_FIELD].
LABEL_API_KEY = "accelstack.io/api-key"
SECRET_KEY_FIELD = "key"
ANNOTATION_WORKSPACE = "accelstack.io/workspace"
ANNOTATION_RATE_LIMIT = "accelstack.io/rate-limit"  # requests per second, e.g. "20"
ANNOTATION_BURST = "accelstack.io/rate-limit-burst"

# The port name a CG pod serves the OpenAI API on (Service port and EndpointSlice port).
PORT_NAME = "http"

METRIC_PREFIX = "accelstack_gateway_"
