#!/usr/bin/env bash
# Build the wheels an offline GPU node needs to install this project, beside the CUDA torch its image has.
#
#   scripts/wheelhouse.sh PYVER DIR       e.g. scripts/wheelhouse.sh 3.12 wheelhouse
#
# Run it on a machine that reaches PyPI; PYVER is the node's Python (major.minor); the wheels are for this
# machine's platform unless WHEELHOUSE_PLATFORM names another (a pip --platform tag, e.g.
# manylinux_2_28_x86_64). Then copy DIR and the repository to the node and, there:
#
#   pip install --no-index --find-links DIR -e '.[dev]'
#
# What goes in: everything `pip install -e '.[dev]'` resolves to (pyproject.toml's dependencies, the dev extra
# and the build backend), less what the image has already (IMAGE_HAS below). Wheels PyPI has only as source
# (SDIST_ONLY) are built here; they are pure Python, so they serve any Python 3. Pins (PINS) keep the set
# installable together: transformers at least the release the harness needs (kvtransfer.core.cache.MIN_TRANSFORMERS).
#
# DIR also gets requirements.txt (what was resolved for the node, one name==version a line, wheelhouse and image
# alike) and image-has.txt (the IMAGE_HAS packages the resolve chose: the versions the image should have; pip on
# the node uses the image's own and says so if one is out of range).
set -euo pipefail

if [ $# -ne 2 ]; then
  echo "usage: $0 PYVER DIR   (e.g. $0 3.12 wheelhouse: the node's Python and a new or empty directory)" >&2
  exit 2
fi
PYVER=$1
DIR=$2
if ! [[ $PYVER =~ ^3\.[0-9]+$ ]]; then
  echo "PYVER must be the node's Python as major.minor (e.g. 3.12), not '$PYVER'" >&2
  exit 2
fi
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}

# A CUDA torch image has torch, what installing torch brings with it (its Requires-Dist: triton, the nvidia-*
# CUDA libraries, filelock, typing-extensions, sympy and mpmath, networkx, jinja2 and markupsafe, fsspec) and
# numpy (every PyTorch image ships it). These are left out; nvidia-* and cuda-* are matched by prefix below.
IMAGE_HAS=(torch triton filelock typing-extensions sympy mpmath networkx jinja2 markupsafe fsspec numpy)
# Packages PyPI has as source only: built into wheels here.
SDIST_ONLY=(sqlitedict word2number "antlr4-python3-runtime==4.9.3")
# The release the harness needs, read where the code checks it (a different one fails at the first prefill).
MIN_TRANSFORMERS=$(sed -n 's/^MIN_TRANSFORMERS = "\(.*\)"$/\1/p' "$ROOT/kvtransfer/core/cache.py")
if [ -z "$MIN_TRANSFORMERS" ]; then
  echo "could not read MIN_TRANSFORMERS from $ROOT/kvtransfer/core/cache.py" >&2
  exit 1
fi
PINS=(
  "transformers>=$MIN_TRANSFORMERS,<6"
  "antlr4-python3-runtime==4.9.3"   # hydra-core 1.3 reads grammars generated with 4.9 (its own pin: 4.9.*)
  "typepy<2"                        # pytablewriter 1.x (lm-eval's tables) needs typepy 1.x
  "chardet<7"                       # mbstrdecoder (under typepy) needs chardet < 7
)
# The stand-in for the image's torch while resolving: a metadata-only wheel, so the resolve never fetches a CUDA
# build (GBs) and never adds torch's own dependencies beyond what other packages ask for. Never copied to DIR.
TORCH_STUB_VERSION=${TORCH_STUB_VERSION:-2.13.0}

mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
if ls "$DIR"/*.whl >/dev/null 2>&1; then
  echo "$DIR already holds wheels: give a new or empty directory" >&2
  exit 2
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

"$PY" - "$ROOT" "$TMP" "$TORCH_STUB_VERSION" <<'EOF'
"""Write TMP/requirements.in (pyproject's dependencies + dev extra + build backend, torch left to the stub) and
the torch stub wheel TMP/stub/torch-<v>+image-py3-none-any.whl."""
import sys
import zipfile
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

root, tmp, version = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] + "+image"
project = tomllib.loads((root / "pyproject.toml").read_text())
reqs = [*project["project"]["dependencies"], *project["project"]["optional-dependencies"]["dev"],
        *project["build-system"]["requires"]]
reqs = [r for r in reqs if r.split(">")[0].split("=")[0].split("<")[0].strip().lower() != "torch"]
(tmp / "requirements.in").write_text("\n".join(reqs) + "\n")
stub = tmp / "stub"
stub.mkdir()
info = f"torch-{version}.dist-info"
with zipfile.ZipFile(stub / f"torch-{version}-py3-none-any.whl", "w") as z:
    z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: wheelhouse.sh\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    z.writestr(f"{info}/RECORD", "")
EOF
printf '%s\n' "${PINS[@]}" > "$TMP/constraints.txt"

echo "== building wheels of the source-only packages: ${SDIST_ONLY[*]}"
"$PY" -m pip wheel --quiet --no-deps --wheel-dir "$DIR" "${SDIST_ONLY[@]}"

platform=()
[ -n "${WHEELHOUSE_PLATFORM:-}" ] && platform=(--platform "$WHEELHOUSE_PLATFORM")
echo "== resolving and downloading for Python $PYVER (torch: the image's)"
"$PY" -m pip download --quiet --only-binary=:all: --python-version "$PYVER" "${platform[@]}" \
  --dest "$DIR" --find-links "$DIR" --find-links "$TMP/stub" -c "$TMP/constraints.txt" \
  -r "$TMP/requirements.in" "torch==$TORCH_STUB_VERSION+image"

# Sort the downloads: the image's packages out (recorded), the rest listed.
"$PY" - "$DIR" "${IMAGE_HAS[@]}" <<'EOF'
import re
import sys
from pathlib import Path

directory, image = Path(sys.argv[1]), {re.sub(r"[-_.]+", "-", n).lower() for n in sys.argv[2:]}
kept, dropped = [], []
for wheel in sorted(directory.glob("*.whl")):
    name, version = wheel.name.split("-")[:2]
    norm = re.sub(r"[-_.]+", "-", name).lower()
    line = f"{norm}=={version}"
    if norm in image or norm.startswith(("nvidia-", "cuda-")):
        wheel.unlink()
        if not version.endswith("+image"):
            dropped.append(line)
    else:
        kept.append(line)
(directory / "requirements.txt").write_text("\n".join(kept) + "\n")
(directory / "image-has.txt").write_text("\n".join(dropped) + "\n")
size = sum(p.stat().st_size for p in directory.glob("*.whl"))
print(f"== {len(kept)} wheels, {size / 2**20:.0f} MiB in {directory}; left to the image: "
      f"{', '.join(dropped) or 'nothing'}")
EOF
