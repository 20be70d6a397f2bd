#!/usr/bin/env bash
# Re-cut the staged vLLM payload (../shared/gpu/stage_vllm.sh: .gpu_stage/c1..cN, payload.tar.00..) into
# parts of at most SIZE_MB MB, one folder each, for calls whose carry must stay small (the tree rides
# in every call, and a 45 MiB part broke off in transfer three times in a row on 2026-12-07):
#
#   bash tests/gpu/split_payload.sh SIZE_MB [SRC_DIR (.gpu_stage)] [DEST_PREFIX (.gpu_stage/p)]
#
# writes DEST_PREFIX1 .. DEST_PREFIXn, each with one payload.tar.NN; the last also holds NPARTS and
# PAYLOAD_SHA256 (the checksum of the whole payload, checked here against the staged one). The machine
# side is unchanged: `bash /root/rzbin/device_install.sh stash <folder>` for each, then `install`.
# Refuses to overwrite existing parts.
set -euo pipefail
size_mb=${1:?usage: split_payload.sh SIZE_MB [SRC_DIR] [DEST_PREFIX]}
src=${2:-.gpu_stage}
dest=${3:-.gpu_stage/p}
case "$size_mb" in ''|*[!0-9]*) echo "split_payload: SIZE_MB must be a whole number of MB, got '$size_mb'"; exit 2;; esac
sha_file=$(ls "$src"/*/PAYLOAD_SHA256 2>/dev/null | head -1)
[ -n "$sha_file" ] || { echo "split_payload: no PAYLOAD_SHA256 under $src/*/ (stage with ../shared/gpu/stage_vllm.sh first)"; exit 2; }
parts=$(for f in "$src"/c*/payload.tar.*; do [ -f "$f" ] && echo "$(basename "$f") $f"; done | sort | cut -d' ' -f2-)
[ -n "$parts" ] || { echo "split_payload: no $src/c*/payload.tar.* parts"; exit 2; }
if ls -d "$dest"[0-9]* >/dev/null 2>&1; then
  echo "split_payload: $(ls -d "$dest"[0-9]* | tr '\n' ' ')already exist: remove them or give another DEST_PREFIX"; exit 2
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# shellcheck disable=SC2086
cat $parts > "$tmp/payload.tar"
want=$(awk '{print $1}' "$sha_file")
got=$(sha256sum "$tmp/payload.tar" | awk '{print $1}')
[ "$want" = "$got" ] || { echo "split_payload: the staged parts do not make the staged payload (sha256 $got, want $want)"; exit 3; }
split -b $((size_mb * 1000000)) -d -a 2 "$tmp/payload.tar" "$tmp/payload.tar."
n=$(ls "$tmp"/payload.tar.[0-9]* | wc -l)
i=0
for p in $(ls "$tmp"/payload.tar.[0-9]* | sort); do
  i=$((i + 1))
  mkdir -p "$dest$i"
  mv "$p" "$dest$i/"
done
cp "$sha_file" "$dest$n/PAYLOAD_SHA256"
echo "$n" > "$dest$n/NPARTS"
echo "split_payload: $n parts of at most $size_mb MB: $(ls -d "$dest"[0-9]* | tr '\n' ' ')"
