"""ctseg: liver and liver-tumour segmentation with a spatially partitioned 3D U-Net."""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ctseg")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "0.0.0+unknown"


def __getattr__(name: str):
    # The version is looked up when asked for, not on import: reading the package's
    # metadata is most of `import ctseg`'s time, before any command can take Ctrl-C.
    if name == "__version__":
        return _version()
    # `from ctseg import Segmenter, segment` without importing JAX with `import ctseg`:
    # the commands choose the devices before JAX starts.
    if name in ("Segmenter", "Segmentation", "segment"):
        from ctseg.parallel.held_output import held_start_output

        # Importing JAX imports the plugins installed beside it (the `targets` extra), which
        # say on stderr that this machine has no GPU: held, as the commands hold it.
        with held_start_output():
            from ctseg.inference import api
        return getattr(api, name)
    raise AttributeError(f"module 'ctseg' has no attribute {name!r}")
