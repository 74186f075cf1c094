"""Importing the user's code named by a `pkg.module:attr` spec (reward functions, tools,
workflows), the same way everywhere.

Where a module is looked up (`CWD_RULE`): the installed packages and `PYTHONPATH` first, then
the current working directory. `areal run` and its workers share one working directory, so a
`my_module.py` next to the YAML you run from works without `PYTHONPATH=.`; a worker on another
host needs the module in its own working directory or on its path.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType
from typing import Any

CWD_RULE = "installed packages and PYTHONPATH first, then the current working directory"


def import_user_module(module_name: str) -> ModuleType:
    """Import `module_name` by `CWD_RULE`: when it is not found on the path as it is, the
    current working directory is appended to `sys.path` (last, so it never shadows an installed
    package) and the import is tried once more. Process pools started later inherit the path."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        top = module_name.split(".")[0]
        cwd = os.getcwd()
        on_path = {os.path.abspath(p or os.curdir) for p in sys.path}
        if e.name not in (module_name, top) or cwd in on_path:
            raise
        sys.path.append(cwd)
        importlib.invalidate_caches()
        return importlib.import_module(module_name)


def load_user_attr(module_name: str, attr: str, what: str) -> Any:
    """The object `module_name:attr` names (`attr` may be dotted), imported by `CWD_RULE`; any
    failure is one `ValueError` line starting with `what` (e.g. "reward spec 'm:f'") that names
    the fix: a module not found, a module that fails to import (its own bug), a missing
    attribute."""
    try:
        obj: Any = import_user_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"{what}: cannot import module {module_name!r} ({e}); looked in the {CWD_RULE} "
            f"({os.getcwd()}): run from the directory that holds it, or add its directory to "
            "PYTHONPATH"
        ) from None
    except Exception as e:  # the module itself fails to import: its own bug, in one line
        raise ValueError(
            f"{what}: importing module {module_name!r} raised {type(e).__name__}: {e}; fix "
            "that module"
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(
                f"{what}: module {module_name!r} has no attribute {attr!r}; check the name "
                "after the ':'"
            )
        obj = getattr(obj, part)
    return obj
