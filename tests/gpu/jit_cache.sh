#!/usr/bin/env bash
# The engines' JIT caches, carried from one GPU lease to the next (docs/gpu.md "Next GPU session").
#
# A fresh machine compiles everything once: the aligned engine's Triton kernels (~66 s of its start on
# an H100) and stock vLLM's torch.compile graphs and Inductor kernels (~114 s). The caches are keyed by
# the kernels' sources, the GPU and the library versions, so a machine of the same image can reuse
# another's: bring them back once, carry them in later sessions.
#
#   bash tests/gpu/jit_cache.sh save DEST     tar + gzip the caches under $HOME into DEST/ as pieces of
#                                             PIECE_MB MiB (default 15) with SHA256SUMS; prints the size
#   bash tests/gpu/jit_cache.sh load SRC      check SRC/SHA256SUMS, unpack into $HOME (files already
#                                             there are kept: a cache entry is never overwritten)
#
# Caches: $HOME/.triton/cache (Triton) and $HOME/.cache/vllm (torch_compile_cache and the rest of vLLM's
# own cache directory); those that do not exist are left out.
set -euo pipefail
cmd=${1:-}
dir=${2:-}
if [ -z "$cmd" ] || [ -z "$dir" ]; then
  echo "usage: jit_cache.sh save DEST | load SRC" >&2
  exit 2
fi
CACHES=(.triton/cache .cache/vllm)
[ "$cmd" = save ] && mkdir -p "$dir"
[ -d "$dir" ] || { echo "jit_cache: $dir is not a directory" >&2; exit 1; }
dir=$(cd "$dir" && pwd)
NAME=jit_cache.tgz
case "$cmd" in
  save)
    if [ -e "$dir/SHA256SUMS" ] || ls "$dir/$NAME".part* >/dev/null 2>&1; then
      echo "jit_cache: $dir already holds a saved cache; give another DEST" >&2
      exit 1
    fi
    have=()
    for c in "${CACHES[@]}"; do [ -d "$HOME/$c" ] && have+=("$c"); done
    if [ ${#have[@]} -eq 0 ]; then
      echo "jit_cache: no cache under $HOME (${CACHES[*]}): nothing saved" >&2
      exit 1
    fi
    tmp=$(mktemp -d)
    tar -C "$HOME" -czf "$tmp/$NAME" "${have[@]}"
    (cd "$tmp" && sha256sum "$NAME") > "$dir/SHA256SUMS"
    split -b "${PIECE_MB:-15}M" -d -a 2 "$tmp/$NAME" "$dir/$NAME.part"
    echo "jit_cache: ${have[*]} -> $dir ($(du -b "$tmp/$NAME" | cut -f1) bytes, $(ls "$dir" | grep -c part) pieces)"
    rm -rf "$tmp" ;;
  load)
    [ -f "$dir/SHA256SUMS" ] || { echo "jit_cache: $dir has no SHA256SUMS" >&2; exit 1; }
    tmp=$(mktemp -d)
    cat "$dir/$NAME".part* > "$tmp/$NAME"
    (cd "$tmp" && sha256sum -c --quiet "$dir/SHA256SUMS") || { echo "jit_cache: $dir fails its checksum" >&2; rm -rf "$tmp"; exit 1; }
    tar -C "$HOME" --skip-old-files -xzf "$tmp/$NAME"
    echo "jit_cache: unpacked $(tar -tzf "$tmp/$NAME" | grep -vc '/$') files into $HOME"
    rm -rf "$tmp" ;;
  *)
    echo "jit_cache: unknown command $cmd (save or load)" >&2
    exit 2 ;;
esac
