#!/usr/bin/env bash
# One piece of a served study on one H200 (conf/experiment/h200_*.yaml: LongSWE C24, the
# long-context pair, shared-prefix working sets), at most PIECE_S seconds of serving, so
# that a study longer than a device call runs over several calls:
#   - the sweep resumes by config and request-stream fingerprint: cells whose run.json in
#     multirun/$STUDY is completed are skipped, the cell a piece's limit stops is run again;
#   - what comes back is small: $OUT/$STUDY.tgz, every cell's run.json, requests.jsonl and
#     .hydra/ (and the server.log of a cell that did not complete).
# Device call, from the repository root, with .whl/ (runners/device/setup_h200.sh) and,
# after the first piece, the study's directory in the call's carry list:
#   STUDY=h200_longswe_c24 REMNANT_GIT_COMMIT=<hash> bash runners/device/study_h200.sh
# then here, before the next piece:   tar -xzf <files_at>/$STUDY.tgz -C multirun
# multirun/ is git-ignored: a fresh checkout seeds the sweep from the study's curated runs,
#   mkdir -p multirun/$STUDY && cp -r benchmarks/<collection>/runs/. multirun/$STUDY/
# (their run.json is all that resuming reads).
# A cell must fit in one piece: a piece that completes no cell says so (make the preset's
# cells smaller). RUN_ARGS: more remnant-run overrides (the same on every piece, or the
# cells' configs differ and run again).
set -u
STUDY=${STUDY:?set STUDY to a study preset, e.g. STUDY=h200_longswe_c24}
PIECE_S=${PIECE_S:-480}
source runners/device/setup_h200.sh || exit 1
SWEEP=multirun/$STUDY
mkdir -p "$SWEEP"

completed() {
  python3 - "$SWEEP" <<'EOF'
import json, pathlib, sys
done = []
for path in sorted(pathlib.Path(sys.argv[1]).glob("*/run.json")):
    try:
        if json.loads(path.read_text()).get("status") == "completed":
            done.append(path.parent.name)
    except ValueError:
        pass
print(len(done), " ".join(done))
EOF
}

before=$(completed | cut -d' ' -f1)
# SIGTERM stops the sweep after the running cell is recorded (as stopped); the kill is for
# a server that does not go.
timeout --signal=TERM --kill-after=90 "$PIECE_S" python3 -m remnant.cli -m experiment="$STUDY" \
    hydra.sweep.dir="$SWEEP" ${RUN_ARGS:-} > "$OUT/remnant-run.log" 2>&1
rc=$?
grep -v "^\s*$" "$OUT/remnant-run.log" | tail -25
read -r after cells <<< "$(completed)"
echo "== $STUDY: $after cells completed ($(( after - before )) in this piece): $cells"
if [ "$rc" = 0 ]; then
  echo "== $STUDY: every cell completed"
elif [ "$after" -le "$before" ]; then
  echo "== no cell completed in this piece (exit $rc): a cell must fit in PIECE_S=$PIECE_S s"
fi
(cd multirun && {
  find "$STUDY" \( -name run.json -o -name requests.jsonl -o -name multirun.yaml -o -path "*/.hydra/*" \) -type f
  for log in "$STUDY"/*/server.log; do
    [ -e "$log" ] || continue
    grep -qs '"status": "completed"' "$(dirname "$log")/run.json" || echo "$log"
  done
} | tar -czf "$OUT/$STUDY.tgz" -T -)
ls -l "$OUT/$STUDY.tgz"
