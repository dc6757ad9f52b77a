#!/usr/bin/env bash
# Builds rknn-toolkit2 2.5.0's own venv (it pins numpy<=1.26.4, onnx<=1.18, protobuf<=4.25.4,
# torch<=2.4.0, so it cannot share npuprep's environment) and prints its python's path.
#
#   bash npuprep/vendors/make_rknn_venv.sh [DIR]      (default ~/.cache/npuprep/rknn-venv)
#   export NPUPREP_RKNN_PYTHON=DIR/bin/python
#
# The toolkit is installed with --no-deps plus the packages an ONNX build, the simulator and
# accuracy_analysis import: `pip install rknn-toolkit2` would pull torch 2.4.0 with its
# CUDA libraries (several GB). torch is only imported at load time, so a CPU wheel does:
# NPUPREP_RKNN_TORCH picks it (a pip requirement or a wheel path; default: a torch wheel in
# pip's configured --find-links, else torch 2.4.0 from PyPI).
set -euo pipefail
DIR="${1:-${NPUPREP_RKNN_VENV:-$HOME/.cache/npuprep/rknn-venv}}"
PY="${NPUPREP_RKNN_BASE_PYTHON:-python3}"
TOOLKIT="rknn-toolkit2==2.5.0"
if [ -x "$DIR/bin/python" ] && "$DIR/bin/python" -c "import rknn.api" >/dev/null 2>&1; then
  echo "$DIR/bin/python"
  exit 0
fi
"$PY" -m venv "$DIR"
PIP=("$DIR/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --no-deps "$TOOLKIT"
"${PIP[@]}" "numpy==1.26.4" "onnx==1.18.0" "protobuf==4.25.4" "onnxruntime>=1.17,<1.24" \
  "opencv-python-headless>=4.5.5.64,<4.11" "scipy>=1.9.3" "psutil>=5.9.0" \
  "ruamel.yaml>=0.17.21" "tqdm>=4.64.1" "fast-histogram>=0.11" typing_extensions sympy \
  filelock networkx jinja2 fsspec
if [ -n "${NPUPREP_RKNN_TORCH:-}" ]; then
  "${PIP[@]}" --no-deps "$NPUPREP_RKNN_TORCH"
elif "${PIP[@]}" --no-deps --no-index torch 2>/dev/null; then
  # A torch wheel in pip's configured --find-links (offline images ship a CPU build there).
  :
else
  "${PIP[@]}" "torch==2.4.0"
fi
"$DIR/bin/python" -c "import rknn.api" >/dev/null
echo "$DIR/bin/python"
