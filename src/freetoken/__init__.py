"""freetoken: serve Mixture-of-Experts LLMs larger than the GPU, exactly."""

__version__ = "0.1.0"
