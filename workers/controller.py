"""Controller replica: reads the dataset and admits tasks under the staleness rule."""

from __future__ import annotations

import sys

from areal.launch.worker import main as worker_main
from areal.launch.worker import resolve_model_path


async def build(settings, bus, worker_id):
    from areal.data.tasks import make_task_source
    from areal.data.tokenizer import load_tokenizer
    from areal.services.controller import Controller

    d = settings.data
    file_kw = (
        {}
        if d.source.startswith("synthetic:")
        else {"prompt_field": d.prompt_field, "answer_field": d.answer_field}
    )
    source = make_task_source(d.source, settings.seed, **file_kw, **d.task_kwargs)
    ctrl = Controller(
        bus,
        source,
        load_tokenizer(resolve_model_path(settings)),
        batch_size=settings.algo.batch_size,
        group_size=settings.algo.group_size,
        max_staleness=settings.algo.max_staleness,
        total_steps=settings.train.total_steps,
    )
    return ctrl.run


def main(argv: list[str] | None = None) -> int:
    return worker_main("controller", build, argv)


if __name__ == "__main__":
    sys.exit(main())
