#!/usr/bin/env bash
# Runs the Python-driven tests (server contract tests with the official openai client) against the
# lily binary in build dir $1. Each test file under tests/python/ is a standalone script.
set -euo pipefail
build=${1:-build}
shopt -s nullglob
files=(tests/python/test_*.py)
if ((${#files[@]} == 0)); then exit 0; fi
passed=0; failed=0
for f in "${files[@]}"; do
  # A suite that hangs fails with a name instead of stalling the run (the slowest takes ~4 minutes on 2 cores).
  if LILY_BIN="$build/lily" timeout 900 python3 "$f"; then passed=$((passed + 1)); else failed=$((failed + 1)); echo "FAILED: $f"; fi
done
echo "python: $passed passed, $failed failed"
((failed == 0))
