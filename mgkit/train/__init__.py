"""Training on many contexts: the trainer, its compiled step, data, history and checkpoints."""

__all__ = []
