#!/usr/bin/env bash
# Installs what lily needs to build and test on Debian, idempotently: only what is missing.
set -euo pipefail

apt_pkgs=(build-essential cmake pkg-config python3 python3-pip nlohmann-json3-dev libpcre2-dev
          libutf8proc-dev libcli11-dev libgtest-dev libbenchmark-dev libcurl4-openssl-dev)
# `lily chat`'s line editing (libedit, BSD); the chat page's markdown and code highlighting, compiled into the
# binary from /usr/share/javascript; headless Chromium for the chat page's test (tests/python/test_chat_page.py).
apt_pkgs+=(libedit-dev libjs-marked libjs-highlight.js chromium)
# --fuzz: also clang with its sanitizer/libFuzzer runtime (scripts/fuzz.sh).
if [ "${1:-}" = "--fuzz" ]; then apt_pkgs+=(clang libclang-rt-14-dev); fi
missing=()
for p in "${apt_pkgs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "install_deps: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# Python tools used by the test suite: the official openai and anthropic clients (server contract tests) and huggingface_hub
# (lily pull and the Hugging Face cache checked against the reference client). pip name:import name.
py_pkgs=(openai:openai huggingface_hub:huggingface_hub anthropic:anthropic)
py_missing=()
for p in "${py_pkgs[@]}"; do
  python3 -c "import ${p#*:}" >/dev/null 2>&1 || py_missing+=("${p%%:*}")
done
if ((${#py_missing[@]})); then
  echo "install_deps: pip installing ${py_missing[*]}"
  python3 -m pip install -q "${py_missing[@]}" 2>/dev/null ||
    python3 -m pip install -q --break-system-packages "${py_missing[@]}"
fi
