"""kvtier's native parts, or their pure-Python stand-ins where they were not built.

``pip install`` builds two C extensions (``setup.py``): ``kvtier.server.tiers._recordio`` (the disk
tier's window read: copy, header checks and xxh3_64 in one pass; needs Debian's ``libxxhash-dev``)
and ``kvtier._streamcopy`` (copies with streaming stores). Both are optional: where one could not be
built (a machine without the xxHash headers, such as a GPU machine reached with no internet), the
module of the same functions in pure Python (numpy, the ``xxhash`` package) stands in, with the same
results and errors, slower. ``KVTIER_NATIVE=0`` in the environment uses the stand-ins even where the
native parts exist (tests run both).
"""

from __future__ import annotations

import os
from importlib import import_module
from types import ModuleType

#: native module -> its pure-Python stand-in
PARTS = {
    "kvtier.server.tiers._recordio": "kvtier.server.tiers.recordio_py",
    "kvtier._streamcopy": "kvtier.streamcopy_py",
}


def load(native: str) -> ModuleType:
    """The native module ``native`` (a key of :data:`PARTS`), else its stand-in.

    Raises:
        KeyError: ``native`` is not one of kvtier's native parts.
    """
    fallback = PARTS[native]
    if os.environ.get("KVTIER_NATIVE", "1") != "0":
        try:
            return import_module(native)
        except ImportError:
            pass
    return import_module(fallback)


def status() -> dict[str, bool]:
    """Native module name -> True where it is built and used (False: its stand-in runs)."""
    return {name: load(name).__name__ == name for name in PARTS}
