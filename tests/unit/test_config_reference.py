"""The configuration reference (docs/reference/configuration.md) is generated from the settings
models by scripts/gen_config_ref.py; the committed page must be what the generator writes now,
so a field added, renamed or re-described in areal/config.py fails here until it is regenerated."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from pydantic import BaseModel

from areal.config import MonitorSettings, RunSettings

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gen_config_ref.py"
PAGE = ROOT / "docs" / "reference" / "configuration.md"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_ref", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _leaf_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, f in model.model_fields.items():
        tp = f.annotation
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            out += _leaf_paths(tp, f"{prefix}{name}.")
        else:
            out.append(prefix + name)
    return out


def test_the_committed_reference_is_current():
    expected = _generator().render()
    current = PAGE.read_text() if PAGE.exists() else ""
    assert current == expected, (
        f"{PAGE.relative_to(ROOT)} is stale: the settings models changed. Regenerate it with "
        "`python scripts/gen_config_ref.py` and commit the result."
    )


def test_every_field_has_a_row_with_a_description():
    row = re.compile(r"^\| `([^`]+)` \| `[^`]*` \| `[^`]*` \| (.*) \|$")
    rows = dict(m.groups() for m in map(row.match, _generator().render().splitlines()) if m)
    for path in _leaf_paths(RunSettings) + list(MonitorSettings.model_fields):
        assert path in rows, f"{path} has no row"
        assert rows[path].strip(), f"{path} has no description"


def test_check_fails_on_a_stale_page_and_names_the_command(tmp_path, capsys):
    gen = _generator()
    stale = tmp_path / "configuration.md"
    stale.write_text(gen.render().replace("| `seed` |", "| `seed_renamed` |"))
    assert gen.main(["--check", "--out", str(stale)]) == 1
    assert "python scripts/gen_config_ref.py" in capsys.readouterr().err
    stale.write_text(gen.render())
    assert gen.main(["--check", "--out", str(stale)]) == 0
