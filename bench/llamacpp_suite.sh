#!/usr/bin/env bash
# llama.cpp's own server test suite (tools/server/tests of the llama-cpp-python 0.3.36
# sdist) against trio-llm, as a user would run it: its default LLAMA_SERVER_BIN_PATH
# (../../../build/bin/llama-server) is a small wrapper that runs `trio-llm serve` with
# the model download flags (--hf-repo, --hf-file, --model-url) mapped to one local tiny
# model (of the kind asked for: an embedding model, a reranker, a FIM vocabulary, else
# tiny-spm). Two departures, both needed to read the failures one by one: the suite's
# session fixture (which first starts every preset, to download them) is replaced by a no-op, and slow tests are left out.
#   bash bench/llamacpp_suite.sh [WORKDIR] [pytest args, e.g. unit/test_template.py]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-/tmp/lcpp}; shift || true
py=${PYTHON:-$root/.venv/bin/python}
mkdir -p "$work"; cd "$work"
[ -f llama_cpp_python-0.3.36.tar.gz ] || python3 -m pip download -q --no-deps --no-binary=:all: llama-cpp-python==0.3.36 -d .
v=llama_cpp_python-0.3.36/vendor/llama.cpp
[ -d $v/tools/server/tests ] || tar xzf llama_cpp_python-0.3.36.tar.gz $v/tools/server/tests $v/models/templates
[ -x venv/bin/python ] || { python3 -m venv venv; venv/bin/pip install -q "aiohttp~=3.9" "pytest~=8.3" filelock numpy "openai~=2.14" prometheus-client "requests~=2.32" wget; }
for p in tiny-spm tiny-qwen3 tiny-qwen3-embd tiny-qwen3-rerank; do
  [ -f $p.gguf ] || PYTHONPATH=$root/src "$py" -c "from trio_llm.model.synth import make_model; make_model('$p', 'Q8_0', '$work/$p.gguf', seed=0)"
done
mkdir -p $v/build/bin
# each download is one local tiny model of the same kind: an embedding model (a pooling
# type), a reranker (a rank head), a FIM vocabulary for the infill model, else tiny-spm
cat > $v/build/bin/llama-server <<WRAP
#!/usr/bin/env python3
import os, sys
args, out, i, wanted = sys.argv[1:], [], 0, ""
while i < len(args):
    if args[i] in ("--hf-repo", "-hf", "-hfr", "--hf-file", "-hff", "--model-url", "-mu"):
        wanted += " " + (args[i + 1] if i + 1 < len(args) else "")
        i += 2
        continue
    out.append(args[i]); i += 1
if wanted:
    kinds = {"bge": "tiny-qwen3-embd", "reranker": "tiny-qwen3-rerank", "infill": "tiny-qwen3"}
    name = next((m for k, m in kinds.items() if k in wanted), "tiny-spm")
    out = ["-m", "$work/" + name + ".gguf", *out]
os.execve("$py", ["$py", "-m", "trio_llm", "serve", *out], dict(os.environ, PYTHONPATH="$root/src"))
WRAP
chmod +x $v/build/bin/llama-server
cat > $v/tools/server/tests/unit/conftest.py <<'CONF'
import pytest

@pytest.fixture(scope="session", autouse=True)
def load_server_presets():
    yield  # no downloads: the wrapper serves one local model
CONF
cd $v/tools/server/tests
exec "$work/venv/bin/python" -m pytest -q -m "not slow" -p no:cacheprovider "${@:-unit}"
