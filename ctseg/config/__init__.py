"""Experiment configuration: TOML files parsed into frozen dataclasses, checked.

A config has the sections ``data``, ``model``, ``mesh``, ``train``, ``augment`` and
``predict``
(`sections`); `parse` reads TOML and `--set` overrides into a `Config` and writes
it back; `checks` holds the relations between keys; `reference` generates the
configuration reference from the fields' docs.
"""

from ctseg.config.checks import check, check_seed, grid_problem, split_problem
from ctseg.config.parse import from_dict, load, to_dict, to_toml, with_mesh
from ctseg.config.reference import reference_markdown
from ctseg.config.sections import (
    SECTIONS,
    AugmentConfig,
    Config,
    DataConfig,
    InferenceOptions,
    MeshConfig,
    ModelConfig,
    PredictConfig,
    TrainConfig,
)
from ctseg.config.tile import TileRequest

__all__ = [
    "SECTIONS",
    "AugmentConfig",
    "Config",
    "DataConfig",
    "InferenceOptions",
    "MeshConfig",
    "ModelConfig",
    "PredictConfig",
    "TileRequest",
    "TrainConfig",
    "check",
    "check_seed",
    "from_dict",
    "grid_problem",
    "load",
    "reference_markdown",
    "split_problem",
    "to_dict",
    "to_toml",
    "with_mesh",
]
