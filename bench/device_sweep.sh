#!/usr/bin/env bash
# bench_cores.py's sweep in one call on a borrowed many-core machine with no network (the
# project's device machine: python3 with PyTorch, no pip index): the wheel of
# scripts/wheel.sh goes into a folder of its own on PYTHONPATH (that python3 is itself a
# virtualenv, so a virtualenv over it would not see its torch), the datasets are generated
# first, then each section runs under its own time limit and writes its own JSON and log
# lines under $OUT, so that a section that overruns leaves the others' results.
#
#   bash scripts/wheel.sh .device && cp bench/device_sweep.sh .device/   # here; .device ignored
#   OUT=/tmp/out bash .device/device_sweep.sh [quick]                       # there
#
# The run of 2026-11-28 (bench/results/cores16-intel-xeon/cores-2026-11-28-ba34d04-*):
#   OLD_WHEEL=.device/old/fitcache-*.whl OLD_WORKERS=2,16,64 REPEATS=1 COLD_REPEATS=2 WARM_EPOCHS=2 \
#   LWARM=230 LCOLD=110 LTHREADS=40 LCLUSTER=120 bash .device/device_sweep.sh   (379 s)
#
# Sizes and limits come from the environment: FILES (20000), WORKERS (1,2,4,8,16,32,64),
# THREADS (1,2,4,8,16), CWORKERS (8), CFILES (10000), CREADS (item,batched), REPEATS (2; per
# section WARM_REPEATS, COLD_REPEATS), WARM_EPOCHS (1: timed warm epochs per round), LWARM,
# LCOLD, LTHREADS, LCLUSTER, LFIRST (seconds), FIRST_BUDGET (16GiB: bench_first_read.py's
# second tier), WHEEL (.device/fitcache-*.whl), PYTHON (python3).
# With OLD_WHEEL, the cold section runs again over that wheel (an older build, for a
# before/after in the same run) at OLD_WORKERS, and bench_first_read.py's large tier. The
# warm section logs every garbage collection of its processes to $OUT/gc-warm.log. PERF_SECTIONS (say warm,threads) runs those
# sections under perf (see perf_start below).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
t0=$(date +%s)
py=${PYTHON:-python3}
# Each wheel into a new private folder: pip --target leaves a package that is there already
# (a folder of an earlier run: its old build was what ran), and /tmp is anyone's.
install() { # wheel; prints the folder
    local dir
    dir=$(mktemp -d /tmp/fcsite.XXXXXX) || exit 1
    $py -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check --target "$dir" $1 >&2 || exit 1
    echo "$dir"
}
site=$(install "${WHEEL:-.device/fitcache-*.whl}") || exit 1
site_old=
if [ -n "${OLD_WHEEL:-}" ]; then site_old=$(install "$OLD_WHEEL") || exit 1; fi
trap 'rm -rf "$site" ${site_old:+"$site_old"}' EXIT
export PYTHONPATH=$site
{ nproc; $py -c 'import torch, fitcache, sys; print(sys.version, torch.__version__, fitcache.__file__)'
  df -h /dev/shm /tmp /var/tmp; head -3 /proc/meminfo; cat /proc/self/cgroup; } 2>&1 | tee "$OUT/machine.txt"
if [ "${1:-}" = quick ]; then
    size="--quick"; W=1,2; T=1,2; CW=2; R=1; CF=500
else
    size="--files ${FILES:-20000}"; W=${WORKERS:-1,2,4,8,16,32,64}; T=${THREADS:-1,2,4,8,16}
    CW=${CWORKERS:-8}; R=${REPEATS:-2}; CF=${CFILES:-10000}
fi
timeout 180 $py -c "import sys; sys.path.insert(0, 'bench'); import bench_scale as b
b.generate('/var/tmp/fitcache-bench-scale', ${FILES:-20000}, 1); b.generate('/var/tmp/fitcache-bench-scale', $CF, 1)"
echo "datasets ready at $(( $(date +%s) - t0 )) s"
# perf of the whole machine while a section of PERF_SECTIONS runs, from the kit of
# bench/perf_kit.sh (PERF_KIT, default .device/perf): its libraries for perf alone, never for
# what it watches. The reports (by process and library, and by process and symbol) go to
# $OUT/profile.txt; the recordings stay on the machine.
kit=${PERF_KIT:-.device/perf}
perf_start() { # section
    case ",${PERF_SECTIONS:-}," in *",$1,"*) ;; *) return 0 ;; esac
    [ -x "$kit/perf" ] || { echo "no perf kit at $kit" >&2; return 0; }
    LD_LIBRARY_PATH="$kit/lib" "$kit/perf" record -a -g -F 499 -o "/tmp/perf-$1.data" >/dev/null 2>&1 &
    perf_pid=$!
    sleep 1
}
perf_stop() { # section
    [ -n "${perf_pid:-}" ] || return 0
    kill -INT "$perf_pid"
    wait "$perf_pid"
    perf_pid=
    for sort in comm,dso comm,dso,sym; do
        echo "== $1: perf report --sort $sort" >>"$OUT/profile.txt"
        LD_LIBRARY_PATH="$kit/lib" "$kit/perf" report -i "/tmp/perf-$1.data" --no-children --sort $sort \
            --stdio -g none --percent-limit 0.2 2>/dev/null | grep -v '^#' | grep -v '^$' | head -250 >>"$OUT/profile.txt"
    done
}
section() { # name, limit in seconds, bench_cores.py arguments
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit $limit s) at $(( $(date +%s) - t0 )) s"
    perf_start "$name"
    timeout -s TERM -k 20 "$limit" $py bench/bench_cores.py $size --repeats $R --out "$OUT/$name.json" "$@" 2>&1 |
        tee -a "$OUT/all.log" | grep -v '^\s*$'
    perf_stop "$name"
}
section warm "${LWARM:-230}" --sections warm --workers $W --repeats ${WARM_REPEATS:-$R} --epochs ${WARM_EPOCHS:-1} \
    --gc-log "$OUT/gc-warm.log"
section cold "${LCOLD:-100}" --sections cold --workers $W --repeats ${COLD_REPEATS:-$R}
if [ -n "${OLD_WHEEL:-}" ]; then
    PYTHONPATH=$site_old section cold-old "${LCOLD:-100}" --sections cold --workers ${OLD_WORKERS:-$W} \
        --repeats ${COLD_REPEATS:-$R}
fi
section threads "${LTHREADS:-40}" --sections threads --threads $T
section cluster "${LCLUSTER:-110}" --sections cluster --cluster-workers $CW --cluster-files $CF --cluster-repeats 1 \
    --cluster-reads "${CREADS:-item,batched}"
# A fresh worker's first and later reads (bench_first_read.py), on a tier of twice the
# dataset and on one of FIRST_BUDGET: the index grows with the files (BENCHMARKS section
# 28), so its page faults should not follow the budget; with OLD_WHEEL, the large tier again
# over that wheel (an index sized by the budget before 2026-11-29).
first() { # budget or "", name
    echo "== first-read $2 (limit ${LFIRST:-60} s) at $(( $(date +%s) - t0 )) s"
    timeout -s TERM -k 20 "${LFIRST:-60}" $py bench/bench_first_read.py --files 2000 --children 16 \
        ${1:+--budget "$1"} --out "$OUT/first-read-$2.json" 2>&1 | tee -a "$OUT/all.log" | grep -v '^\s*$'
}
first "" default
first "${FIRST_BUDGET:-16GiB}" large
[ -n "$site_old" ] && PYTHONPATH=$site_old first "${FIRST_BUDGET:-16GiB}" large-old
echo "== done at $(( $(date +%s) - t0 )) s"
