#!/usr/bin/env bash
# Wheels for the GPU machine (Python 3.12, x86_64, torch 2.11 preinstalled, no network), into .whl/
# (git-ignored): our package, deepspeed, megatron-core, trl, and what they need that its image lacks
# (shared/design/environment.md, "Measured 2026-11-27"): DeepSpeed's hjson and pydantic (with
# pydantic-core, annotated-types, typing-inspection, and typing-extensions: pydantic 2.14 needs
# >= 4.16, newer than the image may hold), TRL's datasets (with dill, multiprocess). There:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# then the GPU check (README, "GPU check"). The folder must stay under the 64 MiB a device call carries.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
rm -rf .whl build && mkdir .whl  # build/: setuptools would ship a stale build/lib's old modules in the wheel
"$PY" -m pip wheel -q --no-deps -w .whl .                     # vescale-zero (pure Python)
"$PY" -m pip wheel -q --no-deps -w .whl deepspeed==0.19.8     # from its sdist, no ops built (~30 s): pure Python
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    megatron-core==0.16.1 trl==1.16.0 hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
    typing-inspection==0.4.5 typing-extensions==4.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
ls -1 .whl
size=$(du -sb .whl | cut -f1)
echo ".whl: $((size / 1024)) KiB in $(ls .whl | wc -l) wheels"
if [ "$size" -ge $((64 * 1024 * 1024)) ]; then
    echo "over the 64 MiB a device call carries" >&2
    exit 1
fi
