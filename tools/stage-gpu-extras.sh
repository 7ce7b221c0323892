#!/usr/bin/env bash
# The GPU machine has torch but no network; ../shared/device/stage-gpu-stack.sh brings Megatron-Core and TE
# (.gpu0-.gpu5). This adds what mcorekit and its tests need besides them (transformers, safetensors, pytest...)
# as one more carry, .gpu6: carry [".gpu6"], command: bash .gpu6/install.sh && export PYTHONPATH=/root/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.gpu\*/' .git/info/exclude 2>/dev/null || echo '/.gpu*/' >> .git/info/exclude
rm -rf .gpu6 && mkdir .gpu6
pkgs=$(grep -vE '^\s*#|^\s*$' requirements.lock | sed 's/ .*//' \
  | grep -vE '^(torch|nvidia-|triton|megatron-core|sympy|mpmath|networkx|jinja2|markupsafe|cuda-|setuptools|numpy)' \
  | grep -vE '^(matplotlib|pillow|fonttools|kiwisolver|contourpy|cycler|pyparsing)=' \
  | grep -vE '^(wandb|opentelemetry-[a-z-]+|cwevals|googleapis-common-protos|xxhash|distro|sniffio|httpcore|httpx|requests|urllib3|certifi|charset-normalizer|platformdirs)=')
# plots are drawn here, not there; wandb (and what only it needs) is tested here in offline mode: the GPU runs use none
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu6 $pkgs 2>/dev/null
cat > .gpu6/install.sh <<'INSTALL'
#!/usr/bin/env bash
set -euo pipefail
src=$(cd "$(dirname "$0")" && pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /root/site "$src"/*.whl
PYTHONPATH=/root/site python3 -c 'import transformers, safetensors, pytest; print("extras ready: transformers", transformers.__version__)'
INSTALL
du -sh .gpu6
