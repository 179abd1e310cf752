#!/usr/bin/env bash
# Fuzz the whole management API against its own OpenAPI schema, on a live server backed by a
# scratch PostgreSQL database holding the demo fleet (plus instances, edges and the fuzzing admin:
# tests/fuzz/seed.py). Fails on any 5xx or schema violation, and when an operation was never
# reached (tests/fuzz/reach.py: only 401/404 answers). The hooks draw path parameters from the
# seeded objects; the stateful phase chains create -> read -> update -> delete over the links
# schemathesis infers from the schema.
# Every check runs except positive_data_acceptance: a schema cannot say "this deployment fits
# its pool", "this id exists" or "this password is not too common", so schema-valid bodies
# that break a business rule are rightly refused with a 400 that names the rule.
#   FUZZ_SECONDS (default 300)   time budget;   FUZZ_DB (default fedinfer_fuzz)
#   further arguments go to `schemathesis run` (make schemathesis-short: --max-examples ...)
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=.venv/bin
DB=${FUZZ_DB:-fedinfer_fuzz}
export DATABASE_URL=postgres://postgres@127.0.0.1:5432/$DB
export FEDINFER_LOG_LEVEL=WARNING
psql -q -h 127.0.0.1 -U postgres -c "DROP DATABASE IF EXISTS $DB" -c "CREATE DATABASE $DB" postgres
$BIN/fedinfer migrate -v0
$BIN/fedinfer loaddemo > /dev/null
$BIN/python -m tests.fuzz.seed fleet
PORT=$($BIN/python -c 'from regions.supervisor import free_port; print(free_port())')
$BIN/fedinfer serve --no-migrate --port "$PORT" > "var/fuzz-$DB-server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
HAR=var/fuzz-$DB.har.json
rm -f "$HAR"
status=0
SCHEMATHESIS_HOOKS=tests.fuzz.schemathesis_hooks $BIN/schemathesis --no-color run \
  "http://127.0.0.1:$PORT/api/schema/" \
  --wait-for-schema 60 --checks all --exclude-checks positive_data_acceptance --max-time "${FUZZ_SECONDS:-300}" --workers "${FUZZ_WORKERS:-2}" \
  --request-timeout 30 \
  --seed "${FUZZ_SEED:-1}" --report har --report-har-path "$HAR" "$@" || status=$?
$BIN/python -m tests.fuzz.reach "http://127.0.0.1:$PORT/api/schema/" "$HAR" || status=$((status ? status : 1))
exit $status
