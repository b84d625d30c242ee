#!/bin/sh
# Ask kvstream serve where a prompt should go, the way a gateway would.
#   KVSTREAM=http://127.0.0.1:8080 sh examples/gateway/route.sh
# Prints the chosen engine's name (the "engine" field), e.g. "e1".
set -eu
KVSTREAM="${KVSTREAM:-http://127.0.0.1:8080}"

# The token ids of the prompt (or {"prompt": "..."} when kvstream serve has --tokenizer),
# plus the load this gateway knows about (optional; scraped loads are used otherwise).
BODY='{"token_ids": [1000, 1001, 1002, 1003, 1004, 1005, 1006, 1007, 1008, 1009, 1010, 1011, 1012, 1013, 1014, 1015],
       "loads": {}}'

curl -sS --fail-with-body -X POST "$KVSTREAM/v1/route" \
     -H 'Content-Type: application/json' -d "$BODY" |
  sed -n 's/^{"engine":"\{0,1\}\([^",]*\)"\{0,1\},.*/\1/p'
