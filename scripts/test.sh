#!/usr/bin/env bash
# Runs every test: Go vet and unit tests (with the race detector), a check that the
# generated Kitex code matches the IDL, a type check of the Python package (mypy), then the
# Python and C tests against the installed package. Installs what it needs
# (scripts/setup-env.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== Repository: no build output tracked"
# Files over 1 MB are build outputs (binaries, test executables, profiles) unless they are
# the documented plots in docs/.
large=$(git ls-files -z | xargs -0 -r stat -c '%s %n' 2>/dev/null | awk '$1 > 1000000 && $2 !~ /^docs\/.*\.png$/ {print $2}')
if [ -n "$large" ]; then
  echo "tracked files over 1 MB (build outputs belong in .gitignore): $large" >&2
  exit 1
fi

echo "== Go: vet and unit tests"
unformatted=$(git ls-files -z '*.go' | grep -zv '^rpc/kitex_gen/' | xargs -0 -r gofmt -l)
if [ -n "$unformatted" ]; then
  echo "not gofmt-formatted (run gofmt -w): $unformatted" >&2
  exit 1
fi
go vet ./...
# Unused code and the other checks of staticcheck (the version go.mod pins as a tool).
go tool staticcheck ./...
go test -race -count=1 ./...

echo "== Kitex: generated code matches rpc/fitcache.thrift"
bash rpc/generate.sh >/dev/null
if ! git diff --quiet -- rpc/kitex_gen || [ -n "$(git status --porcelain -- rpc/kitex_gen)" ]; then
  echo "rpc/kitex_gen is out of date: run rpc/generate.sh and commit the result" >&2
  git status --short -- rpc/kitex_gen >&2
  exit 1
fi

echo "== Python and C: pytest against the installed package"
bash scripts/setup-env.sh
# The package ships py.typed, so type checkers trust its hints: they must hold.
echo "== Python: type hints (mypy)"
.venv/bin/python -m mypy --cache-dir .mypy_cache bindings/python/fitcache
cd tests
set +e
../.venv/bin/python -m pytest -v "$@"
status=$?
set -e
if [ "$status" = 5 ]; then
  echo "pytest collected no tests: the test setup is broken" >&2
  exit 1
fi
exit "$status"
