"""Generated gRPC/protobuf modules for the upstream kubelet APIs (see protos/generate.py)."""
