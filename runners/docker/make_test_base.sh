#!/usr/bin/env bash
# Make the CPU test base image for runners/docker/Dockerfile, with no registry:
# a minimal Debian bookworm root (debootstrap) with Python 3.11, pip, CPU torch and
# remnant's dependencies, imported with `docker import`. It stands where the SGLang image
# stands in production (a Python with torch and most of remnant's dependencies), so the
# Dockerfile's own steps run the same on both; the embedded engine serves from it.
#
#   runners/docker/make_test_base.sh [TAG]        (default remnant-test-base:bookworm)
#
# Needs root, debootstrap, a Docker Engine, a Debian mirror (DEBIAN_MIRROR) and a pip
# that finds torch==2.13.0's CPU wheel (these machines' pip config does; elsewhere set
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu). Does nothing when TAG exists
# and was made for today's requirements (its label remnant.requirements, a hash of
# pyproject.toml's requirements and torch's pin); an image made for others is replaced, so
# that a dependency added to pyproject.toml reaches the image (builds on it run offline).
set -euo pipefail
cd "$(dirname "$0")/../.."

tag=${1:-remnant-test-base:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
torch_req=${TORCH_REQ:-torch==2.13.0}

requirements() {
  python3 -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb")); print("\n".join(p["build-system"]["requires"] + p["project"]["dependencies"] + ["wheel"]))'
}
wanted=$( { requirements; echo "$torch_req"; } | sha256sum | cut -c1-16)

if docker image inspect "$tag" >/dev/null 2>&1; then
  made_for=$(docker image inspect --format '{{ index .Config.Labels "remnant.requirements" }}' "$tag" 2>/dev/null || true)
  if [ "$made_for" = "$wanted" ]; then
    echo "make_test_base: $tag exists"
    exit 0
  fi
  echo "make_test_base: $tag was made for other requirements (${made_for:-no label}); rebuilding it"
  docker image rm -f "$tag" >/dev/null
fi
command -v debootstrap >/dev/null || { echo "make_test_base: debootstrap is not installed (apt-get install debootstrap)" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || { echo "make_test_base: debootstrap needs root" >&2; exit 1; }

root=$(mktemp -d /tmp/remnant-test-base.XXXXXX)
trap 'rm -rf "$root"' EXIT

# minbase: apt, dpkg and coreutils only; Python and pip from Debian's own archive.
debootstrap --variant=minbase --include=python3,python3-pip,ca-certificates \
  bookworm "$root" "$mirror" >"$root.debootstrap.log" 2>&1 \
  || { tail -20 "$root.debootstrap.log" >&2; exit 1; }
rm -f "$root.debootstrap.log"

# Packages for the image's Python, fetched by this machine's pip (so run it on a Linux
# x86_64 host with Python 3.11, as CI's), then installed offline inside the root.
requirements >"$root/tmp/requirements.txt"
python3 -m pip download --quiet --dest "$root/tmp/wheels" "$torch_req" -r "$root/tmp/requirements.txt"
chroot "$root" python3 -m pip install --quiet --no-cache-dir --break-system-packages --no-index \
  --find-links /tmp/wheels "$torch_req" -r /tmp/requirements.txt
rm -rf "$root/tmp/wheels" "$root/tmp/requirements.txt" "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*

tar -C "$root" --numeric-owner -c . | docker import \
  --change 'ENV PIP_BREAK_SYSTEM_PACKAGES=1' --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["/bin/bash"]' --change "LABEL remnant.requirements=$wanted" - "$tag" >/dev/null
echo "make_test_base: built $tag"
