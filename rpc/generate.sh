#!/usr/bin/env bash
# Regenerates rpc/kitex_gen from rpc/fitcache.thrift with the Kitex generator pinned in go.mod.
set -euo pipefail
cd "$(dirname "$0")"
rm -rf kitex_gen
go tool kitex -module github.com/fitcache/fitcache -gen-path kitex_gen fitcache.thrift
