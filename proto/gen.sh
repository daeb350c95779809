#!/usr/bin/env bash
# Regenerate transfer/kv_transfer_pb2*.py from proto/kv_transfer.proto.
# Needs grpcio-tools (pip install -e '.[dev]'). OUT defaults to transfer/.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/../transfer}
python -m grpc_tools.protoc -I "$here" --python_out="$out" --grpc_python_out="$out" "$here/kv_transfer.proto"
# protoc writes a top-level import; the package is pdcluster.transfer.
sed -i 's/^import kv_transfer_pb2 as/from pdcluster.transfer import kv_transfer_pb2 as/' "$out/kv_transfer_pb2_grpc.py"
