"""Device kernels (Triton) with pure-torch references that define their semantics."""

from freetoken import settings

# Triton's CPU interpreter runs the kernels (tests: CPU tensors, TRITON_INTERPRET=1 set before
# triton is imported). Kernels take it as a constexpr where the interpreter's arithmetic
# differs from the GPU's; a CPU process without it compiles them as for the GPU.
INTERPRETED = settings.triton_interpret()
