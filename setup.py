"""kvtier's native parts (metadata lives in pyproject.toml): the disk tier's window read,
``kvtier.server.tiers._recordio`` (copy, header checks and xxh3_64 of a window of records in one call,
one pass over each record), linked against the system's xxHash library (Debian: ``libxxhash-dev``);
and ``kvtier._streamcopy`` (copies with streaming stores: the client's ReadKV receive and WriteKV's
in-place write that keeps the rows it replaces). Both are optional: where one cannot be built (no
compiler, no xxHash headers) the install goes on and its pure-Python stand-in serves
(``kvtier/native.py``; ``python -c "import kvtier.native as n; print(n.status())"`` says which)."""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("kvtier.server.tiers._recordio", ["server/tiers/_recordio.c", "server/tiers/_copy_xxh3.c"],
              depends=["server/tiers/_copy_xxh3.h"], libraries=["xxhash"],
              extra_compile_args=["-O3", "-std=c11", "-Wall"], optional=True),
    Extension("kvtier._streamcopy", ["kvtier/_streamcopy.c"],
              extra_compile_args=["-O3", "-std=c11", "-Wall"], optional=True),
])
