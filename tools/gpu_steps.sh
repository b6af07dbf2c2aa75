# Shared by the multi-GPU device scripts (sourced, not run): timed steps under one whole-run budget.
#
# The caller sets LOGS (step logs), OUT (what comes back from the device), BUDGET_S (seconds for all
# steps), ONLY (optional bash regex: run only the steps whose name matches) and T0 (the start time),
# and creates "$LOGS/steps.tsv". Each step writes $LOGS/NAME.log and a line "NAME<TAB>rc<TAB>seconds<TAB>note"
# to steps.tsv; after every step the logs are packed into $OUT/logs.tar.gz (a device run brings back
# a few files, not a folder tree), so a run cut short still returns what it did.

snapshot() {  # the logs so far, in one file
  tar czf "$OUT/logs.tar.gz.part" -C "$LOGS" . 2>/dev/null && mv -f "$OUT/logs.tar.gz.part" "$OUT/logs.tar.gz"
}

step() {  # step NAME MAX_S MIN_S CMD... : skipped when less than MIN_S of the budget is left; sets LAST_RC
  local name=$1 max=$2 min=$3; shift 3
  if [ -n "$ONLY" ] && ! [[ $name =~ $ONLY ]]; then LAST_RC=0; return; fi  # not selected: no trace
  local left=$(( BUDGET_S - ($(date +%s) - T0) ))
  if (( left < min )); then
    echo "=== $name skipped: ${left}s of the ${BUDGET_S}s budget left, needs ${min}s"
    printf '%s\tskipped\t0\t%s\n' "$name" "${left}s of the budget left, needs ${min}s" >> "$LOGS/steps.tsv"
    LAST_RC=skipped
    return
  fi
  local t=$(( left < max ? left : max )) s=$(date +%s)
  echo "=== $name (timeout ${t}s)"
  timeout -k 10 "$t" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  LAST_RC=$rc
  grep -E "^step |rc=|Error|error:|out of memory" "$LOGS/$name.log" | tail -n "${TAIL:-3}" | cut -c1-220
  local dt=$(( $(date +%s) - s )) note=""
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then note="timed out at ${t}s"; fi
  echo "=== $name rc=$rc ${dt}s"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$dt" "$note" >> "$LOGS/steps.tsv"
  snapshot
}
