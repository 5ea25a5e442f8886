"""The CG operator: reconciles InferenceEndpoints into Deployments, Services, GPRs, PDBs, NetworkPolicies, HPAs."""
