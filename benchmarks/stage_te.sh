#!/usr/bin/env bash
# Stage Transformer Engine 2.20.2 (PyTorch) for the GPU machine, which takes at most 64 MiB along per
# call (the project tree included): download, cut the core library to sm_90, compress, split.
#
#   bash benchmarks/stage_te.sh                 (from the project root; ~45 s on 2 cores after the downloads)
#
# Result: .gpu_stage/te_c1 [, te_c2 ...]: one part of <= PART_MB MiB (default 44) per folder, each
# carried by one call; the last folder also holds PAYLOAD_SHA256 and NPARTS. The device side is
# tests/gpu/te_install.sh (it travels with the tree); docs/gpu.md "Transformer Engine" has the calls.
#
# What goes in (pinned: version, file, sha256; downloads kept in .gpu_stage/te/, git-ignored):
#   transformer_engine_cu13 2.20.2   the core library (276 MB wheel; libtransformer_engine.so is 328 MiB
#                                    unpacked, 251 MiB of it cubins for sm_75 ... sm_120). Cut to the sm_90
#                                    cubins (H100 / H200) by benchmarks/te_stage.py prune: the same wheel
#                                    with 234 MiB of other architectures' cubins zeroed in place, stored
#                                    uncompressed; it xz-compresses to ~24 MB.
#   transformer_engine 2.20.2        the meta package (1.2 MB, py3-none-any): TE checks at import that its
#                                    dist-info is there and that its version is the core's.
#   transformer_engine_torch 2.20.2  the PyTorch extension, a source archive only on PyPI (0.5 MB):
#                                    te_install.sh compiles it on the machine against the image's torch;
#                                    once a built wheel has come back from there, put it (or its pieces
#                                    and SHA256SUMS) in .gpu_stage/te/built/ and it is staged instead, so
#                                    the machine installs it without compiling.
# Environment: TE_DIR (downloads, .gpu_stage/te), PART_MB (44), TE_KEEP_ARCHS (90), PY (python3),
# CUOBJDUMP (a cuobjdump binary: lists the pruned library's cubins as a check; optional).
set -euo pipefail
TE_VER=2.20.2
STAGE=${STAGE:-.gpu_stage}
TE_DIR=${TE_DIR:-$STAGE/te}
PART_MB=${PART_MB:-44}
KEEP=${TE_KEEP_ARCHS:-90}
PY=${PY:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
EXCLUDE="$(git rev-parse --git-common-dir)/info/exclude"  # a worktree's .git is a file: the common dir's
grep -qx '/.gpu_stage/' "$EXCLUDE" 2>/dev/null || echo '/.gpu_stage/' >> "$EXCLUDE"
mkdir -p "$TE_DIR"
STAGE=$(cd "$STAGE" && pwd); TE_DIR=$(cd "$TE_DIR" && pwd)
t0=$SECONDS

# 1. downloads (PyPI's file URLs are permanent), checked against the pinned sha256
PYPI=https://files.pythonhosted.org/packages
FILES=(
  "transformer_engine_cu13-$TE_VER-py3-none-manylinux_2_28_x86_64.whl|20/1e/8f51aefcfec3cf7dc9dd3e28084ea6131fec020ef233ebd0532ee08cbc28|30063d3699e779cce63617c3458804f7a504ce8279f2749c98313db9daae273e"
  "transformer_engine-$TE_VER-py3-none-any.whl|28/f7/46d701a17b9d6124cbc1abd31c336e0c12eefeede7f7386a4e999fe6a254|7dcfad943a1a55b2612db9a0e43697fe98c70f4c42ec391ba3a0f872f6ce2094"
  "transformer_engine_torch-$TE_VER.tar.gz|3d/fb/c9ce298a38c22ed1059923a01cac7e1f4e4f7281d39a8679c8118febe079|4c40ced8a6261649e689076f198d4feaf02277b1ba18931a66eccdaceb33c43e"
)
for f in "${FILES[@]}"; do
  IFS='|' read -r name path sha <<< "$f"
  [ -f "$TE_DIR/$name" ] || curl -fsS --retry 3 -o "$TE_DIR/$name" "$PYPI/$path/$name"
  echo "$sha  $TE_DIR/$name" | sha256sum -c --quiet || { echo "stage_te: $name: sha256 mismatch"; exit 1; }
done
echo "downloads ok ($((SECONDS - t0)) s)"

# 2. the payload: the core wheel cut to sm_$KEEP, the meta wheel, the extension's source (or its built wheel)
WORK=$TE_DIR/.work
rm -rf "$WORK" && mkdir -p "$WORK/payload"
CORE=transformer_engine_cu13-$TE_VER-py3-none-manylinux_2_28_x86_64.whl
"$PY" "$HERE/te_stage.py" inspect "$TE_DIR/$CORE" | tail -9
"$PY" "$HERE/te_stage.py" prune "$TE_DIR/$CORE" "$WORK/payload/$CORE" --keep "$KEEP"
if [ -n "${CUOBJDUMP:-}" ]; then
  (cd "$WORK" && unzip -q -o "payload/$CORE" "transformer_engine/wheel_lib/libtransformer_engine.so" -d lib \
   && "$CUOBJDUMP" --list-elf lib/transformer_engine/wheel_lib/libtransformer_engine.so \
      | awk -F. '{print $(NF-1)}' | sort | uniq -c | sed 's/^/  cuobjdump: /' && rm -rf lib)
fi
cp "$TE_DIR/transformer_engine-$TE_VER-py3-none-any.whl" "$TE_DIR/transformer_engine_torch-$TE_VER.tar.gz" "$WORK/payload/"
BUILT=$TE_DIR/built
if ls "$BUILT"/transformer_engine_torch-$TE_VER-cp312-*.whl.part* >/dev/null 2>&1; then  # came back in pieces
  w=$(ls "$BUILT"/transformer_engine_torch-$TE_VER-cp312-*.whl.part00 | sed 's/\.part00$//')
  cat "$w".part* > "$w"
fi
if ls "$BUILT"/transformer_engine_torch-$TE_VER-cp312-*.whl >/dev/null 2>&1; then
  [ -f "$BUILT/SHA256SUMS" ] && (cd "$BUILT" && sha256sum -c --quiet --ignore-missing SHA256SUMS)
  cp "$BUILT"/transformer_engine_torch-$TE_VER-cp312-*.whl "$WORK/payload/"
  echo "staged the built extension: $(ls "$WORK"/payload/transformer_engine_torch-*.whl)"
else
  echo "no built extension in $BUILT: te_install.sh compiles it on the machine (and sends the wheel back)"
fi
(cd "$WORK/payload" && sha256sum * > MANIFEST.sha256)

# 3. one xz stream, split into parts of <= PART_MB MiB, one part per carry folder
(cd "$WORK/payload" && tar -cf - * | xz -6 -T0 > "$WORK/te_payload.tar.xz")
rm -rf "$STAGE"/te_c[0-9]* && mkdir -p "$WORK/split"
split -b "${PART_MB}M" -d -a 2 "$WORK/te_payload.tar.xz" "$WORK/split/te_payload.tar.xz."
i=0
for p in "$WORK"/split/te_payload.tar.xz.*; do
  i=$((i + 1)); mkdir -p "$STAGE/te_c$i"; mv "$p" "$STAGE/te_c$i/"
done
(cd "$WORK" && sha256sum te_payload.tar.xz > "$STAGE/te_c$i/PAYLOAD_SHA256")
echo "$i" > "$STAGE/te_c$i/NPARTS"
echo "payload: $(du -b "$WORK/te_payload.tar.xz" | cut -f1) bytes ($(du -m "$WORK/te_payload.tar.xz" | cut -f1) MiB) in $i part(s):"
(cd "$WORK/payload" && ls -l | tail -n +2 | awk '{printf "  %12d  %s\n", $5, $9}')
du -b "$STAGE"/te_c*/te_payload.tar.xz.* | awk '{printf "  part %s: %d bytes\n", $2, $1}'
rm -rf "$WORK"
echo "stage_te: done in $((SECONDS - t0)) s"
