#!/usr/bin/env bash
# Fetch, here (where the package registries answer), the wheels of the project's
# dependencies that the GPU machine's image lacks, into .whl (ignored by git through
# .git/info/exclude), for bench/gpu_check.sh to install there into /tmp/site. The
# versions are this checkout's virtual environment's (pip freeze), so the two agree; the
# image has torch, triton, numpy, tokenizers, safetensors, grpcio, msgpack, jinja2,
# hypothesis, pytest, ... already (the device README's package list). Not carried: ray
# and nixl (their wheels alone pass the 64 MiB a call may carry): the steps that start a
# cluster or a NIXL agent cannot run there.
#
#   bash bench/gpu_wheels.sh [PYTHON]   # then: run(..., carry=[".whl"])
set -eu
PY="${1:-.venv/bin/python}"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
# grpcio too: the image's is older than the one our generated stubs were made with (they
# refuse to import under it). Found missing on the first loan: llguidance, OpenTelemetry,
# cryptography, jsonschema and their own needs.
NAMES="gguf pydantic pydantic_core annotated-types typing-inspection fastapi starlette uvicorn
httptools grpcio grpcio-health-checking grpcio-reflection protobuf msgspec filelock llguidance
opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions cryptography cffi
pycparser jsonschema jsonschema-specifications referencing rpds-py typing_extensions"
pins=()
for name in $NAMES; do
  pin=$("$PY" -m pip freeze 2>/dev/null | grep -i -E "^${name//[-_]/[-_]}==" || true)
  [ -n "$pin" ] || { echo "gpu_wheels: $name is not installed in $PY" >&2; exit 1; }
  pins+=("$pin")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 \
  --platform manylinux_2_34_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl "${pins[@]}"
du -sh .whl
