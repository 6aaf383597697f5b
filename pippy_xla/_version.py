"""The installed package's version (``pippy_xla.__version__``)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("pippy_xla")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
