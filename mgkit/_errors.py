"""The errors mgkit raises for bad contexts and misplaced arrays (both are ValueErrors)."""


class ContextError(ValueError):
    """A context map or context name is invalid, or names a device that does not exist."""


class DeviceMismatchError(ValueError):
    """Arrays on different contexts were used together in one operation."""
