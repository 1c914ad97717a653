"""ctseg: liver and liver-tumour segmentation with a spatially partitioned 3D U-Net."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("ctseg")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
