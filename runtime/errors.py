"""The error a checkpoint or its weight format raises when it cannot be served (its own module: the model loader
and the weight formats both raise it, and the loader builds on the formats)."""


class ModelError(ValueError):
    """The checkpoint cannot be served; the message says why and what to do."""
