"""Device kernels (Triton) with pure-torch references that define their semantics."""
