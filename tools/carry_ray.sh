#!/usr/bin/env bash
# Ray for the lent GPU machine, whose image has no Ray and whose calls carry at most 64 MiB
# (the repository and every carried path together). Ray's wheel is ~79 MB; without its
# Java jars and RLlib, and as tar.xz, it is ~31 MB. Beside it travel the few needs of
# ray[serve] that the image lacks and a run of `benchmarks/ray_serve.py` (with the serving
# wheels in .whl) was found to need: jsonschema and its needs, grpcio-reflection.
# (Checked on the CPU in a fresh virtual environment holding the image's packages,
# Ray --no-deps and these: the whole benchmark ran with 2 replicas.)
#
# Here, in the repository's root (a machine with pip's index):
#   bash tools/carry_ray.sh                 # writes .ray/ (git-ignored)
# Then each device call names ".ray" (and ".whl") in carry and begins with:
#   rm -rf /tmp/site && mkdir -p /tmp/site && tar -xJf .ray/ray.tar.xz -C /tmp/site && python3 -m pip install -q --no-index \
#     --no-deps --no-compile --target /tmp/site .ray/*.whl .whl/*.whl && export PYTHONPATH=/tmp/site:. || exit
set -euo pipefail
RAY_VERSION=${RAY_VERSION:-2.60.0}
# the GPU image's grpcio: grpcio-reflection's generated code refuses a grpcio older than itself
GRPC_VERSION=${GRPC_VERSION:-1.84.0}
grep -qx "/.ray/" .git/info/exclude || echo "/.ray/" >> .git/info/exclude
rm -rf .ray && mkdir -p .ray
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
platform=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps "${platform[@]}" -d "$work" "ray==$RAY_VERSION"
(cd "$work" && unzip -q ray-*.whl -d tree && rm -rf tree/ray/jars tree/ray/rllib)  # (unzip keeps the binaries executable)
tar -cJf .ray/ray.tar.xz -C "$work/tree" .
python3 -m pip download -q --no-deps "${platform[@]}" -d .ray jsonschema jsonschema-specifications referencing \
  rpds-py "grpcio-reflection==$GRPC_VERSION"
du -sh .ray
echo "with the repository: $(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1) bytes tracked" \
     "+ $(du -sb .ray | cut -f1) in .ray + $(du -sb .whl 2>/dev/null | cut -f1 || echo 0) in .whl (limit 67108864)"
