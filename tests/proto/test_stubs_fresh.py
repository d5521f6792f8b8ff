"""The committed stubs in proto/kvtier/v1/ are exactly what `python proto/generate.py` makes now."""

from __future__ import annotations

import importlib.util
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parents[2] / "proto"
PACKAGE_DIR = PROTO_ROOT / "kvtier" / "v1"


def _generator():
    spec = importlib.util.spec_from_file_location("kvtier_proto_generate", PROTO_ROOT / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_proto_has_committed_stubs():
    """Each .proto file has its _pb2.py, _pb2_grpc.py and .pyi stubs next to it."""
    protos = sorted(PACKAGE_DIR.glob("*.proto"))
    assert PACKAGE_DIR / "pool.proto" in protos
    for proto in protos:
        stem = proto.stem
        for suffix in ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi", "_pb2_grpc.pyi"):
            assert (PACKAGE_DIR / f"{stem}{suffix}").is_file(), f"{stem}{suffix} missing: run python proto/generate.py"


def test_committed_stubs_are_not_stale(tmp_path):
    """Regenerating every .proto into a temp dir gives byte-identical files (else: run python proto/generate.py)."""
    generated = _generator().generate(tmp_path)
    assert generated, "the generator produced nothing"
    names = {p.name for p in generated}
    for proto in PACKAGE_DIR.glob("*.proto"):
        assert f"{proto.stem}_pb2.py" in names
    stale = [p.name for p in generated if not (PACKAGE_DIR / p.name).is_file()
             or (PACKAGE_DIR / p.name).read_bytes() != p.read_bytes()]
    assert not stale, f"stale generated stubs {stale}: run python proto/generate.py and commit the result"
    committed = {p.name for p in PACKAGE_DIR.iterdir() if p.name.endswith(("_pb2.py", "_pb2_grpc.py", "_pb2.pyi", "_pb2_grpc.pyi"))}
    orphans = committed - names
    assert not orphans, f"generated files without a .proto: {sorted(orphans)}"
