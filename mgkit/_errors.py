"""The errors mgkit raises for bad contexts and misplaced arrays (both are ValueErrors)."""


class ContextError(ValueError):
    """A context map or context name is invalid, or names a device that does not exist."""


class DeviceMismatchError(ValueError):
    """Arrays on different contexts were used together in one operation."""


def missing(where: str, does: str, package: str, install: str, instead: str) -> ImportError:
    """The error for a library a feature needs and the machine lacks: ``where`` ``does`` (what it
    needs the library for) with ``package``, which is not installed; how to install it, and what
    works without it."""
    return ImportError(
        f"{where} {does} {package}, which is not installed. Install it with `{install}` and restart "
        f"the kernel; {instead}"
    )
