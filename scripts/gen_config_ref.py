"""Write the configuration reference (docs/reference/configuration.md) from the settings models.

    python scripts/gen_config_ref.py           # (re)write the page
    python scripts/gen_config_ref.py --check   # exit 1 when the committed page is stale

Every field of `RunSettings` (areal/config.py), nested parts included, becomes one row: its
dotted path, type, default, bounds and the model's own `Field(description=...)`. The fields
`areal tap | top | metrics-exporter` read from the environment (`MonitorSettings`) follow. The
page is a pure function of the models, so a test can render it in memory and compare.
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from pathlib import Path
from typing import Any

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: import the checkout's package
    sys.path.insert(0, str(ROOT))

OUT = ROOT / "docs" / "reference" / "configuration.md"
REGENERATE = "python scripts/gen_config_ref.py"

# One line per section where the part's model has no docstring of its own.
SECTION_INTRO = {
    "nats": "The NATS server the run uses, JetStream delivery, history limits, accounts and TLS.",
    "model": "The policy model: a local Hugging Face directory, or a built-in preset.",
    "weights": "How the trainer publishes weights and rollout workers fetch them.",
    "security": "The run's keys: signed weight announcements and keyed message ids.",
    "data": "Where tasks come from, and which of them are held out for evaluation.",
    "algo": "The RL algorithm: batch shape, staleness bound, decoupled PPO, advantages.",
    "rollout": "Generation: engine, sampling, interruption, concurrency, workflows.",
    "reward": "Scoring: the reward function and its process pool.",
    "train": "The trainer: engine, ranks, optimiser, packing, checkpoints.",
    "eval": "Evaluation on the held-out set while training goes on.",
}


def _type_name(tp: Any) -> str:
    """A readable type: `int`, `str | None`, `"a" | "b"`, `dict[str, int]`."""
    if tp is type(None):
        return "None"
    if tp is Any:
        return "any"
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is typing.Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_type_name(a) for a in args)}]"
    return getattr(tp, "__name__", str(tp))


def _yaml_value(v: Any) -> str:
    """A default as it would be written in the run YAML."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return v if v else '""'
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_yaml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_yaml_value(x) for x in v) + "]"
    return repr(v)


def _default(f: FieldInfo) -> str:
    if f.default is not PydanticUndefined:
        return _yaml_value(f.default)
    if f.default_factory is not None:
        return _yaml_value(f.default_factory())  # type: ignore[call-arg]
    return "(required)"


def _num(x: Any) -> str:
    return str(int(x)) if isinstance(x, float) and x.is_integer() else str(x)


def _bounds(f: FieldInfo) -> str:
    out = []
    for m in f.metadata:
        if isinstance(m, at.Ge):
            out.append(f">= {_num(m.ge)}")
        elif isinstance(m, at.Gt):
            out.append(f"> {_num(m.gt)}")
        elif isinstance(m, at.Le):
            out.append(f"<= {_num(m.le)}")
        elif isinstance(m, at.Lt):
            out.append(f"< {_num(m.lt)}")
        elif isinstance(m, at.MinLen):
            out.append(f"length >= {m.min_length}")
        elif isinstance(m, at.MaxLen):
            out.append(f"length <= {m.max_length}")
    return ", ".join(out)


def _code(text: str) -> str:
    """`text` as an inline code span (MkDocs' tables keep a `|` inside one in its cell)."""
    return "`" + text + "`"


def _prose(text: str) -> str:
    """A description for a table cell: pipes escaped, `<...>` outside code spans shown as text."""
    parts = text.replace("\n", " ").split("`")
    for i in range(0, len(parts), 2):  # the even parts are outside code spans
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts).replace("|", "\\|")


def _is_part(f: FieldInfo) -> bool:
    tp = f.annotation
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _optional_part(f: FieldInfo) -> type[BaseModel] | None:
    """X for a field of type ``X | None`` with X a settings model (its fields get rows too)."""
    args = [a for a in typing.get_args(f.annotation) if a is not type(None)]
    if len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return args[0]
    return None


def _table(model: type[BaseModel], prefix: str, header: bool = True) -> list[str]:
    rows = ["| field | type | default | description |", "|---|---|---|---|"] if header else []
    for name, f in model.model_fields.items():
        if _is_part(f):
            continue
        desc = _prose(f.description or "")
        bounds = _bounds(f)
        if bounds:
            desc = f"{desc} ({_code(bounds)})" if desc else _code(bounds)
        rows.append(
            f"| {_code(prefix + name)} | {_code(_type_name(f.annotation))} | "
            f"{_code(_default(f))} | {desc} |"
        )
        sub = _optional_part(f)
        if sub is not None:
            rows += _table(sub, f"{prefix}{name}.", header=False)
    return rows


def _env_name(path: str) -> str:
    return "AREAL_" + path.upper().replace(".", "__")


def render() -> str:
    from areal.config import MonitorSettings, RunSettings

    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by `" + REGENERATE + "` from areal/config.py: do not edit. -->",
        "",
        "Every setting of a run, generated from the settings models in `areal/config.py`. A run",
        "reads them from its YAML file, from `AREAL_...` environment variables (`__` between",
        "levels: `nats.url` is `AREAL_NATS__URL`) and from `--set key=value`, which wins; see",
        "[Configuration](../configuration.md) for the order and for how a bad value is reported.",
        "Defaults are written as they would be in the YAML; `null` means unset.",
        "",
        "## Top level",
        "",
        *_table(RunSettings, ""),
    ]
    for name, f in RunSettings.model_fields.items():
        if not _is_part(f):
            continue
        part = f.annotation
        assert isinstance(part, type) and issubclass(part, BaseModel)
        intro = (part.__doc__ or "").strip() if part.__doc__ else SECTION_INTRO.get(name, "")
        intro = " ".join(intro.split())
        lines += ["", f"## `{name}`", ""]
        if intro:
            lines += [intro, ""]
        lines += [
            f"In YAML under `{name}:`; environment `{_env_name(name)}__<FIELD>`.",
            "",
            *_table(part, name + "."),
        ]
    monitor_doc = " ".join((MonitorSettings.__doc__ or "").split())
    lines += [
        "",
        "## Monitor commands",
        "",
        monitor_doc,
        "",
        *_table(MonitorSettings, ""),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    ap.add_argument("--out", type=Path, default=OUT, help=f"page to write (default {OUT})")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text() if args.out.exists() else None
        if current != text:
            what = "is missing" if current is None else "is stale"
            print(
                f"{args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out} "
                f"{what}: the settings models changed; regenerate it with `{REGENERATE}` "
                "and commit the result",
                file=sys.stderr,
            )
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
