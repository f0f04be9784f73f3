"""Makes `train` mean this project's package for the entry points (diloco.py, edt.py, the simulators, the
launcher), which import it first: a notebook folder with its own `train.py` (or `train/`) comes first on sys.path
and would otherwise shadow it (`No module named 'train.diloco'; 'train' is not a package`, after running the
user's script). The package beside this file is loaded as `train`; the user's module is never executed by us.

When the user's module was already imported as `train` (e.g. `import train` earlier in the notebook), it is replaced
in sys.modules with a warning saying so; names already bound to it keep it. Renaming it (e.g. `my_train.py`) is the
lasting fix. Nothing here reads a config or touches BASE_DIR."""
from __future__ import annotations

import importlib.util
import os
import sys
import warnings

PACKAGE = "train"
PACKAGE_DIR = os.path.join(os.path.dirname(os.path.realpath(__file__)), PACKAGE)


def _ours(paths) -> bool:
    here = os.path.realpath(PACKAGE_DIR)
    return any(os.path.realpath(p) == here for p in paths or ())


def ensure_train_package() -> None:
    """`train` in sys.modules is (or, imported, will be) the package beside this file."""
    mod = sys.modules.get(PACKAGE)
    if mod is not None:
        if _ours(getattr(mod, "__path__", None)):
            return
        shadow = getattr(mod, "__file__", None) or repr(mod)
    else:
        try:
            spec = importlib.util.find_spec(PACKAGE)
        except (ImportError, ValueError):
            spec = None
        if spec is None or _ours(spec.submodule_search_locations):
            return  # ours, or none at all (then the import fails with its own message)
        shadow = spec.origin or ", ".join(spec.submodule_search_locations or ()) or PACKAGE
    init = os.path.join(PACKAGE_DIR, "__init__.py")
    if not os.path.isfile(init):
        raise ImportError(f"`import train` finds {shadow}, which shadows EDT's package `train`, and EDT's train/ is "
                          f"not beside {os.path.realpath(__file__)}: rename {shadow} (e.g. my_train.py) or run from "
                          f"another folder")
    spec = importlib.util.spec_from_file_location(PACKAGE, init, submodule_search_locations=[PACKAGE_DIR])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = pkg
    try:
        spec.loader.exec_module(pkg)
    except BaseException:
        if mod is not None:
            sys.modules[PACKAGE] = mod
        else:
            sys.modules.pop(PACKAGE, None)
        raise
    if mod is not None:
        warnings.warn(f"{shadow} was imported as `train` and shadows EDT's package: sys.modules['train'] is now "
                      f"EDT's ({PACKAGE_DIR}); names already bound to yours keep it. Rename yours (e.g. my_train.py) "
                      f"to avoid this", stacklevel=3)


ensure_train_package()
