"""Regenerate the Python stubs of every ``.proto`` file in ``proto/kvtier/v1/``.

Usage (from the repository root, with the dev extra installed)::

    python proto/generate.py            # writes *_pb2.py, *_pb2_grpc.py, *_pb2.pyi next to the .proto files
    python proto/generate.py --out DIR  # writes the same tree under DIR (the staleness test uses this)

It runs ``grpc_tools.protoc`` with ``-I proto`` so imports read ``kvtier/v1/x.proto`` and the generated
modules import each other as ``from kvtier.v1 import x_pb2``; type stubs come from mypy-protobuf's
``protoc-gen-mypy`` / ``protoc-gen-mypy_grpc`` plugins.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = PROTO_ROOT / "kvtier" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi", "_pb2_grpc.pyi")


def proto_files() -> list[Path]:
    """Every ``.proto`` file of package ``kvtier.v1``, sorted by name."""
    return sorted(PACKAGE_DIR.glob("*.proto"))


def _plugin(name: str) -> str:
    exe = shutil.which(name) or str(Path(sys.executable).parent / name)
    if not Path(exe).exists():
        raise SystemExit(f"{name} not found: install the dev extra (pip install -e '.[dev]') for mypy-protobuf")
    return exe


def generate(out_dir: Path = PROTO_ROOT) -> list[Path]:
    """Generate stubs for :func:`proto_files` under ``out_dir`` (``out_dir/kvtier/v1/...``).

    Returns:
        The generated files, sorted.

    Raises:
        SystemExit: protoc failed (its message is printed) or a plugin is missing.
    """
    import grpc_tools
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    protos = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    if not protos:
        raise SystemExit(f"no .proto files in {PACKAGE_DIR}")
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
        f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *[str(PROTO_ROOT / p) for p in protos],
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    return sorted(p for p in (out_dir / "kvtier" / "v1").iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_ROOT, help="root to write kvtier/v1/ under (default: proto/)")
    ns = parser.parse_args(argv)
    for path in generate(ns.out):
        print(path)


if __name__ == "__main__":
    main()
