#!/usr/bin/env bash
# On the GPU machine: the one way to install a vLLM release of a sitting into /tmp/site, the first one included,
# whatever an earlier call left there (docs/development.md, "Several releases in one sitting").
#
#   bash tests/on_gpu/use_release.sh stage DEST     keep what this call carries of DEST (a build-carry folder,
#                                                    .device-carry-X.Y.Z): its CUDA-extension parts DEST/a*/ in
#                                                    /tmp/cc-RELEASE, its wheels DEST/w*/ in /tmp/cc-wheels
#   bash tests/on_gpu/use_release.sh switch DEST    make that release the one in /tmp/site, in the call carrying
#                                                    DEST/b: vllm/, vllm-*.dist-info and vLLM's cache removed, the
#                                                    extension joined from the parts staged (all of them), DEST/b's
#                                                    Python package unpacked, the staged wheels not yet in /tmp/site
#                                                    installed; then tests/on_gpu/site_check.py and the import check
#
# Refused with one line and exit 3, nothing replaced: parts of the release missing (the machine was given back
# between the calls: send them again, in one batch), or no wheels staged for a site that has none. The wheels (w*)
# are the same for every release: the first switch of a sitting installs them, later ones find them there.
# MARLIN_PACK_DEVICE_SITE, MARLIN_PACK_DEVICE_STAGE_ROOT (/tmp) and MARLIN_PACK_DEVICE_WHEELS (STAGE_ROOT/cc-wheels)
# move the folders (the CPU tests: tests/on_gpu/test_use_release.py).
# Every call must come within ~30 s of the previous one (the machine is given back when idle): send them in one
# batch, after `status` shows no `none_now` (a refused start costs 15 s of device time per call of the batch).
set -euo pipefail
action=${1:-} DEST=${2:?usage: use_release.sh stage|switch DEST}
DEST=${DEST%/}
release=${DEST##*-carry-}
site=${MARLIN_PACK_DEVICE_SITE:-/tmp/site} stage_root=${MARLIN_PACK_DEVICE_STAGE_ROOT:-/tmp}
staged=$stage_root/cc-$release wheels=${MARLIN_PACK_DEVICE_WHEELS:-$stage_root/cc-wheels}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
keep() {  # what this call carries of DEST
  mkdir -p "$staged" "$wheels"
  cp "$DEST"/a[0-9]*/c.part.* "$staged"/ 2>/dev/null || true
  cp "$DEST"/w[0-9]*/*.whl "$wheels"/ 2>/dev/null || true
}
count() { find "$1" -maxdepth 1 -name "$2" | wc -l; }
installed() {  # NAME-VERSION, or '*' (any but vLLM's): its dist-info is in the site (names compared without case)
  local d found=1
  shopt -s nocasematch
  for d in "$site"/*.dist-info; do
    [ -e "$d" ] && [[ ${d##*/} == $1.dist-info ]] && [[ ${d##*/} != vllm-* ]] && { found=0; break; }
  done
  shopt -u nocasematch
  return $found
}
case $action in
  stage)
    keep
    echo "staged for $release: $(count "$staged" 'c.part.*') of $(cat "$DEST/b/parts" 2>/dev/null || echo '?') part(s);" \
      "$(count "$wheels" '*.whl') wheel(s) in $wheels" ;;
  switch)
    keep
    [ -f "$DEST/b/parts" ] && [ -f "$DEST/b/vllm-py.tgz" ] \
      || { echo "$release: $DEST/b is not here: carry it in the switching call" >&2; exit 3; }
    want=$(cat "$DEST/b/parts") have=$(count "$staged" 'c.part.*')
    if [ "$have" -lt "$want" ]; then
      echo "$release: $have of $want extension parts staged on this machine (given back in between?): send the calls again" >&2
      exit 3
    elif [ "$have" -gt "$want" ]; then
      echo "$release: $have extension parts in $staged, its b/parts says $want (a staging of another build): rm -rf $staged and send the calls again" >&2
      exit 3
    fi
    # wheels not yet in the site: NAME-VERSION-TAGS.whl installs NAME-VERSION.dist-info
    missing=()
    for whl in "$wheels"/*.whl; do
      [ -e "$whl" ] || continue
      nv=$(basename "$whl" | cut -d- -f1-2)
      installed "$nv" || missing+=("$whl")
    done
    if [ "$(count "$wheels" '*.whl')" -eq 0 ] && ! installed '*'; then
      echo "$release: no wheels staged in $wheels and none installed in $site: stage the carry's w* folders too (use_release.sh stage in the calls carrying them), then switch" >&2
      exit 3
    fi
    rm -rf "$site"/vllm "$site"/vllm-*.dist-info "${VLLM_CACHE_ROOT:-$HOME/.cache/vllm}"
    mkdir -p "$site"
    cat "$staged"/c.part.* | tar xz -C "$site"
    tar xzf "$DEST/b/vllm-py.tgz" -C "$site"
    if [ ${#missing[@]} -gt 0 ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${missing[@]}" \
        >"$stage_root/cc-pip.log" 2>&1 \
        || { echo "$release: pip could not install the staged wheels into $site (its log: $stage_root/cc-pip.log)" >&2; exit 3; }
      echo "$release: ${#missing[@]} wheel(s) installed into $site"
    fi
    python3 "$here/site_check.py" "$site"
    PYTHONPATH=$site python3 -c "import vllm; print('vllm', vllm.__version__, 'in', vllm.__path__[0])" ;;
  *) echo "usage: use_release.sh stage|switch DEST" >&2; exit 2 ;;
esac
