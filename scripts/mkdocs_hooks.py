"""MkDocs hook (mkdocs.yml ``hooks:``): let mkdocstrings find kvtier's sub-packages.

The import package ``kvtier`` is assembled from several folders (``kvtier/``, ``client/`` as
``kvtier.client``, ``server/`` as ``kvtier.server``, ``proto/kvtier/v1`` as ``kvtier.v1``; see
pyproject's ``package-dir``). Griffe, which reads the sources for mkdocstrings, looks for a package's
sub-packages inside its folder, so this hook lays the package out as Python sees it -- a temporary
folder of symbolic links -- and puts it first on ``sys.path``, which mkdocstrings searches after its
``paths`` (``scripts``, which holds no package: the default, the repository root, holds ``kvtier/``).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from mkdocs.plugins import event_priority

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = {"client": ROOT / "client", "server": ROOT / "server", "v1": ROOT / "proto" / "kvtier" / "v1"}
_tmp: Path | None = None


@event_priority(100)  # before mkdocstrings reads sys.path
def on_config(config, **_kw):  # noqa: ANN001, ANN201 (MkDocs' hook signature)
    global _tmp
    _tmp = Path(tempfile.mkdtemp(prefix="kvtier-griffe-"))
    pkg = _tmp / "kvtier"
    pkg.mkdir()
    for entry in (ROOT / "kvtier").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    for name, target in SUBPACKAGES.items():
        (pkg / name).symlink_to(target)
    sys.path.insert(0, str(_tmp))
    return config


def on_shutdown(**_kw):  # noqa: ANN201
    if _tmp is not None:
        if str(_tmp) in sys.path:
            sys.path.remove(str(_tmp))
        shutil.rmtree(_tmp, ignore_errors=True)
