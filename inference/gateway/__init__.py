"""``accelstack-gateway``: the OpenAI-compatible gateway in front of the inference endpoints' replicas."""
