"""ctseg: liver and liver-tumour segmentation with a spatially partitioned 3D U-Net."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("ctseg")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"


def __getattr__(name: str):
    # `from ctseg import Segmenter, segment` without importing JAX with `import ctseg`:
    # the commands choose the devices before JAX starts.
    if name in ("Segmenter", "Segmentation", "segment"):
        from ctseg.parallel.devices import held_start_output

        # Importing JAX imports the plugins installed beside it (the `targets` extra), which
        # say on stderr that this machine has no GPU: held, as the commands hold it.
        with held_start_output():
            from ctseg.inference import api

        return getattr(api, name)
    raise AttributeError(f"module 'ctseg' has no attribute {name!r}")
