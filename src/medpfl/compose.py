"""Where the params schema meets the rest of the project: the checks of a study against the model
zoo, the data-set catalogue and the method registry, and the entry points that read params with
them for the pipeline and the CLI.

:mod:`medpfl.config` is schemas only and imports none of the project's registries (so that
``medpfl.algorithms`` and ``medpfl.fl`` can import it with no import circle); it asks the checks
that need them of a :class:`medpfl.config.Catalogue`, given as pydantic's validation context.
:data:`CATALOGUE` is the project's: this module imports the registries and nothing imports this
module but the pipeline's and the CLI's entry points (``workflow/rules/common.smk``,
:mod:`medpfl.cli`, :mod:`medpfl.doctor`, scripts and benchmarks).

Read params with :func:`load_params` / :func:`validate_params`: the same errors as always, naming
the file and the dotted key (:class:`medpfl.errors.ParamsError`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel

from medpfl import config
from medpfl.algorithms import resolve_method
from medpfl.data.multimodal import FOLDER_DATASETS
from medpfl.data.sources import check_dataset_name, parse_synthetic_name
from medpfl.fl import privacy, server_opt
from medpfl.models import check_model_name, resolve_model_args


class ProjectCatalogue:
    """The :class:`medpfl.config.Catalogue` of this project: the model zoo
    (:mod:`medpfl.models.zoo`), the data sets (:mod:`medpfl.data.sources`), the method registry
    (:mod:`medpfl.algorithms`) and what server optimizers (:mod:`medpfl.fl.server_opt`) and
    upload transforms (:mod:`medpfl.fl.privacy`) each method allows."""

    def check_model_name(self, name: str) -> str:
        return check_model_name(name)

    def resolve_model_args(self, name: str, args: dict[str, Any]) -> dict[str, Any]:
        return resolve_model_args(name, args)

    def check_dataset_name(self, name: str) -> None:
        check_dataset_name(name)

    def is_synthetic_name(self, name: str) -> bool:
        return parse_synthetic_name(name) is not None

    def folder_dataset_kind(self, name: str) -> str | None:
        entry = FOLDER_DATASETS.get(name)
        return entry.kind if entry is not None else None

    def resolve_method(self, name: str, method_params: dict[str, Any]) -> tuple[type, BaseModel]:
        return resolve_method(name, method_params)

    def check_server_optimizer(self, method: str, algo_cls: type, cfg: BaseModel, key: str, optimizer: str) -> None:
        server_opt.check_applicable(method, algo_cls, cfg, key, optimizer)

    def check_upload(self, method: str, algo_cls: type, key: str) -> None:
        privacy.check_applicable(method, algo_cls, key)


CATALOGUE = ProjectCatalogue()


def validate_params(data: dict, source: str = "params.yaml") -> config.Params:
    """Validate a params mapping against the schema and the project (:data:`CATALOGUE`); raise
    :class:`medpfl.errors.ParamsError` naming ``source`` and the key."""
    return config.validate_params(data, source, catalogue=CATALOGUE)


def load_params(path: str | Path = "params.yaml", overlays: list[str | Path] = ()) -> config.Params:
    """Read ``params.yaml`` plus study overlays (later files win) and validate them
    (:func:`validate_params`)."""
    return config.load_params(path, overlays, catalogue=CATALOGUE)
