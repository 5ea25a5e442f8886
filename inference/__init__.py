"""Inference endpoints: the ``InferenceEndpoint`` resource, the CG operator and the OpenAI-compatible gateway."""
