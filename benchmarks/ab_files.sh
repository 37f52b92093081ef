#!/usr/bin/env bash
# A/B of some files in one device call: a stage of h200.sh on this tree, then with those files as
# an older commit had them, then on this tree again (new / old / new2: drift between rounds shows).
#   here, first:  bash benchmarks/ab_files.sh stage OLD_COMMIT PATH...   # copies into .cache/stage/ab/
#   device:       bash benchmarks/ab_files.sh run STAGE                  # carry .cache/stage and .whl
set -u
cd "$(dirname "$0")/.."
case ${1:-} in
  stage)
    old=$2; shift 2
    rm -rf .cache/stage/ab && mkdir -p .cache/stage/ab
    for path in "$@"; do mkdir -p ".cache/stage/ab/$(dirname "$path")"; git show "$old:$path" > ".cache/stage/ab/$path"; done
    echo "$old" > .cache/stage/ab/COMMIT ;;
  run)
    stage=$2
    OUT=${OUT:-/tmp/out}
    files=$(cd .cache/stage/ab && find . -name '*.py' | sed 's|^\./||')
    mkdir -p /tmp/ab-new
    for f in $files; do mkdir -p "/tmp/ab-new/$(dirname "$f")"; cp "$f" "/tmp/ab-new/$f"; done
    for round in new old new2; do
      [ "$round" = old ] && for f in $files; do cp ".cache/stage/ab/$f" "$f"; done
      [ "$round" = new2 ] && for f in $files; do cp "/tmp/ab-new/$f" "$f"; done
      OUT=$OUT/$round bash benchmarks/h200.sh "ab-$round" "$stage" > /dev/null 2>&1
      echo "$round ($([ "$round" = old ] && cat .cache/stage/ab/COMMIT || echo this tree)):"
      grep -h "figure:" "$OUT/$round"/*.txt | cut -c 60-200
    done ;;
  *) echo "usage: $0 stage OLD_COMMIT PATH... | $0 run STAGE" >&2; exit 2 ;;
esac
