"""Layers shared by every model family: the math lives here, once."""
