"""The installed package's version, from its metadata."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("mgkit")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without install
    __version__ = "0+unknown"
