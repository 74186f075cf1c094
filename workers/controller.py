"""Controller replica: reads the dataset and admits tasks under the staleness rule."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from areal.bus.client import Bus
from areal.config import RunSettings
from areal.config_views import ControllerView, fields_from
from areal.launch.worker import RoleSpec, resolve_model_path
from areal.launch.worker import main as worker_main

if TYPE_CHECKING:  # heavy: imported inside build() at run time
    from areal.services.controller import Controller


@dataclass(frozen=True)
class ControllerParts:
    view: ControllerView
    source: Any  # areal.services.controller.TaskSource
    prompts: Any  # areal.data.prompts.PromptBuilder


def prepare(settings: RunSettings, worker_id: str) -> ControllerParts:
    from areal.data.prompts import PromptBuilder
    from areal.data.sources import make_sources
    from areal.data.tokenizer import load_tokenizer

    view = ControllerView.of(settings)
    source, _ = make_sources(view.data, view.seed)  # the training side of the held-out split
    prompts = PromptBuilder(view.prompt, load_tokenizer(resolve_model_path(settings)))
    prompts.ids(source.get(0))  # a template that does not fit the data fails before connecting
    return ControllerParts(view, source, prompts)


def admission_policy(view: ControllerView) -> Any:
    """B, η (`algo.batch_size`, `.max_staleness`) and `train.total_steps`."""
    from areal.core.admission import AdmissionPolicy

    return fields_from(AdmissionPolicy, view.algo, view)


def build(parts: ControllerParts, bus: Bus) -> Controller:
    from areal.services.controller import Controller

    v = parts.view
    return Controller(
        bus, parts.source, parts.prompts, policy=admission_policy(v), group_size=v.algo.group_size
    )


SPEC = RoleSpec("controller", prepare, build)


def main(argv: list[str] | None = None) -> int:
    return worker_main(SPEC, argv)


if __name__ == "__main__":
    sys.exit(main())
