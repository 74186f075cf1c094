"""Start-up: the controller and the reward worker never import torch.

Every worker of a local run starts at once, and on a 2-core machine four processes importing
torch (~1.5 s of CPU each) delayed the trainer and the rollout worker, the two that need it, by
seconds (`bench/vs_trl.py` reports the start-up)."""

from __future__ import annotations

import subprocess
import sys

import pytest

# what each role's process imports: its worker module, what `prepare` and `build` import, and
# the shared worker shell (areal.launch.worker, the bus)
ROLE_IMPORTS = {
    "controller": [
        "workers.controller",
        "areal.data.prompts",
        "areal.data.sources",
        "areal.data.tokenizer",
        "areal.core.admission",
        "areal.services.controller",
    ],
    "reward": [
        "workers.reward",
        "areal.rewards.registry",
        "areal.services.reward",
        "areal.core.validate",
    ],
}


@pytest.mark.parametrize("role", sorted(ROLE_IMPORTS))
def test_role_imports_no_torch(role: str) -> None:
    mods = ["areal.launch.worker", "areal.bus.client", *ROLE_IMPORTS[role]]
    code = (
        "import importlib, sys\n"
        f"for m in {mods!r}: importlib.import_module(m)\n"
        "print(','.join(m for m in ('torch', 'transformers.modeling_utils') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "", f"{role} imports {out.stdout.strip()}"


def test_the_controller_loads_a_tokenizer_json_without_torch(tmp_path) -> None:
    from areal.data.tokenizer import build_char_tokenizer

    build_char_tokenizer().save_pretrained(str(tmp_path))
    code = (
        "import sys\n"
        "from areal.data.tokenizer import load_tokenizer\n"
        f"tok = load_tokenizer({str(tmp_path)!r})\n"
        "assert tok.decode(tok.encode('12+3=', add_special_tokens=False)) == '12+3='\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
