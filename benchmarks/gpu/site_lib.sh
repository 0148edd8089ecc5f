# Sourced by setup_site.sh (vLLM 0.25.1) and setup_site_0320.sh (vLLM 0.32.0): the chunk reassembly and the
# plugin's install into a site folder, the way pip would install it.

# cat_parts DIR NAME: the chunks NAME.part00, NAME.part01, ... in DIR (split -d), concatenated to stdout.
cat_parts() {
  cat "$1/$2".part??
}

# unpack_bundle DIR NAME SITE: the tar.gz bundle NAME carried in chunks in DIR, unpacked into SITE.
unpack_bundle() {
  cat_parts "$1" "$2" | tar -C "$3" -xzf -
}

# install_rlpatch ROOT SITE PY: the checkout ROOT's vllm-rlpatch into SITE (the package, its dist-info with the
# vllm.general_plugins entry point, the start-up .pth hook, activated through a sitecustomize that makes SITE a
# site dir); PY reads the version. Replaces an earlier install.
install_rlpatch() {
  local root=$1 site=$2 py=$3 ver d
  rm -rf "$site/vllm_rlpatch" "$site"/vllm_rlpatch-*.dist-info
  cp -r "$root/src/vllm_rlpatch" "$site/"
  cp "$root/src/vllm_rlpatch_startup.pth" "$site/"
  ver=$("$py" -c "import re;print(re.search(r'__version__ = \"([^\"]+)\"', open('$root/src/vllm_rlpatch/__init__.py').read()).group(1))")
  d="$site/vllm_rlpatch-$ver.dist-info"
  mkdir -p "$d"
  printf 'Metadata-Version: 2.1\nName: vllm-rlpatch\nVersion: %s\n' "$ver" > "$d/METADATA"
  printf '[vllm.general_plugins]\nrlpatch = vllm_rlpatch.plugin:register\n\n[console_scripts]\nvllm-rlpatch = vllm_rlpatch.tools.cli:main\n' > "$d/entry_points.txt"
  : > "$d/RECORD"
  printf 'import site\nsite.addsitedir("%s")\n' "$site" > "$site/sitecustomize.py"
}
