"""Regenerate the Python code for proto/baton/v1/*.proto (run from anywhere).

    python proto/generate.py          # write the *_pb2*.py files beside the .proto files
    python proto/generate.py --check  # exit 1 if the committed files are stale

Uses grpcio-tools' bundled protoc (a `dev` dependency), so every machine generates the
same code. Generated with the repository root as the import root, so the modules import
each other as ``proto.baton.v1.…`` while the protobuf package stays ``baton.v1``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto" / "baton" / "v1"


def generate(out_root: Path) -> list[Path]:
    from grpc_tools import protoc  # dev dependency; imported here so --help stays light

    protos = sorted(PROTO_DIR.glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto
    args = [
        "protoc",
        f"-I{ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(str(p.relative_to(ROOT)) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted(p.relative_to(out_root) for p in (out_root / "proto/baton/v1").glob("*_pb2*.py*"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if the generated code is stale")
    args = ap.parse_args()
    if not args.check:
        for rel in generate(ROOT):
            print(f"wrote {rel}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        stale = [
            str(rel)
            for rel in generate(Path(tmp))
            if not (ROOT / rel).exists()
            or (ROOT / rel).read_bytes() != (Path(tmp) / rel).read_bytes()
        ]
    if stale:
        print("stale generated code (run python proto/generate.py): " + ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
