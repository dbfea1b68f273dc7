#!/usr/bin/env bash
# On the GPU machine: several vLLM releases in one sitting, one after the other, without re-carrying the wheels.
#
#   bash tests/on_gpu/use_release.sh stage DEST     keep the CUDA-extension parts DEST/a*/ carried by this call in
#                                                    /tmp/cc-RELEASE (DEST: a build-carry folder, .device-carry-X.Y.Z)
#   bash tests/on_gpu/use_release.sh switch DEST    make that release the one in /tmp/site: its extension (from the
#                                                    parts staged by earlier calls, all of them) and its Python
#                                                    package (DEST/b, carried by this call), the wheels of the first
#                                                    install kept; prints the release now importable
#
# The first release of a sitting is installed as ../shared/device/README.md says (stage a, then stage b, which also
# installs the wheels). A later release's parts can travel in the calls that run the earlier release's tests (a
# call carries at most 64 MiB with the tree): `stage` in those calls, `switch` in the call that carries its b.
# Every call must come within ~30 s of the previous one (the machine is given back when idle): send them in one
# batch, after `status` shows no `none_now` (a refused start costs 15 s of device time per call of the batch).
set -euo pipefail
action=$1 DEST=${2:?usage: use_release.sh stage|switch DEST}
release=${DEST##*-carry-}
site=${MARLIN_PACK_DEVICE_SITE:-/tmp/site} staged=${MARLIN_PACK_DEVICE_STAGE_ROOT:-/tmp}/cc-$release
case $action in
  stage)
    mkdir -p "$staged"
    cp "$DEST"/a[0-9]*/c.part.* "$staged"/ 2>/dev/null || true
    echo "staged for $release: $(find "$staged" -maxdepth 1 -name 'c.part.*' | wc -l) of $(cat "$DEST/b/parts" 2>/dev/null || echo '?') part(s)" ;;
  switch)
    mkdir -p "$staged"
    cp "$DEST"/a[0-9]*/c.part.* "$staged"/ 2>/dev/null || true
    want=$(cat "$DEST/b/parts") have=$(find "$staged" -maxdepth 1 -name 'c.part.*' | wc -l)
    if [ "$have" -lt "$want" ]; then
      echo "$release: $have of $want extension parts staged on this machine (given back in between?): send the calls again" >&2
      exit 3
    fi
    rm -rf "$site"/vllm "$site"/vllm-*.dist-info "${VLLM_CACHE_ROOT:-$HOME/.cache/vllm}"
    mkdir -p "$site"
    cat "$staged"/c.part.* | tar xz -C "$site"
    tar xzf "$DEST/b/vllm-py.tgz" -C "$site"
    PYTHONPATH=$site python3 -c "import vllm; print('vllm', vllm.__version__, 'in', vllm.__path__[0])" ;;
  *) echo "usage: use_release.sh stage|switch DEST" >&2; exit 2 ;;
esac
