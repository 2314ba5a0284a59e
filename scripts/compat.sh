#!/usr/bin/env bash
# The compatibility matrix: `reshard demo` and the tests per (torch, transformers) pair, each in its own venv.
#
# One venv per torch version (torch installed first, then the project with that torch kept: a constraint file pins
# the installed torch distribution's version, from importlib.metadata, never torch.__version__, which reads
# 2.14.1+cu130 on a CUDA build whose distribution is 2.14.1). Each transformers version is then installed into that
# venv in turn, so a torch venv is built once and reused. Per cell: `reshard demo`, then the test suite (`--suite
# core`: the files of tests/transformers_core.txt, what CI runs at the other end of the transformers range;
# `--suite full`: every test), then a Markdown table of the measured cells on stdout (progress on stderr).
#
# usage: scripts/compat.sh [--dir DIR] [--torch "2.13.0 2.14.1 2.15.0"] [--transformers "5.23.0 5.24.0"]
#                          [--suite core|full] [--tests "FILE ..."] [--lift-constraint "2.15.0"] [--results FILE]
#                          [--setup-only]
#
#   --dir DIR              where the venvs live (default: .compat in the repository, which git ignores)
#   --torch VERSIONS       torch versions, one venv each (default: 2.13.0 2.14.1 2.15.0)
#   --transformers VERS    transformers versions, installed in turn into each venv (default: 5.23.0 5.24.0)
#   --suite core|full      the core test files (default) or the whole suite
#   --tests "FILE ..."     these test files instead (the table names them "custom")
#   --lift-constraint VERS torch versions to install with PIP_CONSTRAINT=/dev/null: a machine whose pip
#                          configuration caps torch below them (the cap is lifted for those commands only; the
#                          project's install in that venv is then constrained by the pin of the installed torch alone)
#   --results FILE         also append one tab-separated line per cell to FILE
#   --setup-only           build the venvs and install the project; run nothing
#
# A cell that fails to install is reported as such and the matrix goes on; the exit status is 1 when any cell
# failed (install, demo or a test), else 0.
set -uo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
dir="$repo/.compat"
torches="2.13.0 2.14.1 2.15.0"
transformers_versions="5.23.0 5.24.0"
suite="core"
lift=""
results=""
setup_only=0
tests_given=""

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
    case "$1" in
        --dir) dir="$2"; shift 2 ;;
        --torch) torches="$2"; shift 2 ;;
        --transformers) transformers_versions="$2"; shift 2 ;;
        --suite) suite="$2"; shift 2 ;;
        --tests) tests_given="$2"; suite="custom"; shift 2 ;;
        --lift-constraint) lift="$2"; shift 2 ;;
        --results) results="$2"; shift 2 ;;
        --setup-only) setup_only=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "compat.sh: unknown argument '$1'; see --help. Nothing was built or run." >&2; exit 2 ;;
    esac
done
case "$suite" in
    core|full|custom) ;;
    *) echo "compat.sh: --suite '$suite' is not 'core' or 'full'; nothing was built or run." >&2; exit 2 ;;
esac
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
export PIP_DISABLE_PIP_VERSION_CHECK=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false

log() { echo "[compat $(date +%H:%M:%S)] $*" >&2; }

lifted() { case " $lift " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

# pip in the venv of torch $1; lifted versions drop the machine's constraint (PIP_CONSTRAINT beats the config file)
vpip() {
    local version="$1"; shift
    if lifted "$version"; then
        PIP_CONSTRAINT=/dev/null "$dir/torch-$version/bin/python" -m pip "$@"
    else
        "$dir/torch-$version/bin/python" -m pip "$@"
    fi
}

installed_torch() {  # the torch distribution's version in venv $1 without its local part (2.13.0+cpu: 2.13.0)
    "$dir/torch-$1/bin/python" -c 'import importlib.metadata as m; print(m.version("torch").split("+")[0])' \
        2>/dev/null
}

# Build (or reuse) the venv of torch $1 with the project installed; the constraint pins the installed torch.
setup_venv() {
    local version="$1" venv="$dir/torch-$1"
    if [ "$(installed_torch "$version")" != "$version" ]; then
        log "torch $version: creating $venv"
        rm -rf "$venv"
        python3 -m venv "$venv" || return 1
        vpip "$version" install --quiet "torch==$version" >"$venv.install.log" 2>&1 || {
            log "torch $version: pip install torch failed (see $venv.install.log)"; return 1; }
    fi
    "$venv/bin/python" -c 'import importlib.metadata as m; print("torch==" + m.version("torch"))' \
        >"$venv/torch-constraint.txt" || return 1
    if ! "$venv/bin/python" -c 'import reshard, pytest' 2>/dev/null; then
        log "torch $version: installing the project ($(cat "$venv/torch-constraint.txt") kept)"
        vpip "$version" install --quiet -c "$venv/torch-constraint.txt" -e "$repo[test]" >>"$venv.install.log" 2>&1 \
            || { log "torch $version: pip install -e . failed (see $venv.install.log)"; return 1; }
    fi
}

test_files() {
    if [ "$suite" = full ]; then
        echo tests
    elif [ "$suite" = custom ]; then
        echo "$tests_given"
    else
        grep -v -e '^#' -e '^[[:space:]]*$' "$repo/tests/transformers_core.txt"
    fi
}

count() {  # count WORD LOG: the number before WORD in pytest's summary line (0 when absent)
    local n
    n="$(tail -n 5 "$2" | grep -oE "[0-9]+ $1" | tail -n 1 | grep -oE '^[0-9]+')"
    echo "${n:-0}"
}

rows=()
status=0
for tv in $torches; do
    if ! setup_venv "$tv"; then
        for xv in $transformers_versions; do rows+=("$tv|$xv|install failed|-|-"); done
        status=1
        continue
    fi
    [ "$setup_only" = 1 ] && continue
    venv="$dir/torch-$tv"
    for xv in $transformers_versions; do
        cell="$dir/cell-torch$tv-transformers$xv"
        log "torch $tv, transformers $xv: installing transformers"
        if ! vpip "$tv" install --quiet -c "$venv/torch-constraint.txt" "transformers==$xv" \
                >"$cell.install.log" 2>&1; then
            rows+=("$tv|$xv|install failed (see $cell.install.log)|-|-"); status=1; continue
        fi
        torch_shown="$("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
        xv_shown="$("$venv/bin/python" -c 'import transformers; print(transformers.__version__)')"
        log "torch $torch_shown, transformers $xv_shown: reshard demo"
        start=$SECONDS
        if (cd "$repo" && PATH="$venv/bin:$PATH" "$venv/bin/reshard" demo) >"$cell.demo.log" 2>&1; then
            demo="ok"
        else
            demo="FAILED"; status=1
        fi
        demo="$demo, $((SECONDS - start)) s"
        log "torch $torch_shown, transformers $xv_shown: demo $demo; pytest ($suite)"
        start=$SECONDS
        # shellcheck disable=SC2046 - one argument per test file
        (cd "$repo" && PATH="$venv/bin:$PATH" "$venv/bin/python" -m pytest -q -p no:cacheprovider $(test_files)) \
            >"$cell.tests.log" 2>&1
        rc=$?
        seconds=$((SECONDS - start))
        passed="$(count passed "$cell.tests.log")"
        failed=$(( $(count failed "$cell.tests.log") + $(count error "$cell.tests.log") ))  # "error" counts "errors"
        skipped="$(count skipped "$cell.tests.log")"
        [ "$rc" -eq 0 ] || status=1
        [ "$rc" -eq 0 ] || [ "$failed" -gt 0 ] || failed="pytest exit $rc"
        tests="$passed passed, $failed failed, $skipped skipped"
        log "torch $torch_shown, transformers $xv_shown: $tests in $seconds s"
        rows+=("$torch_shown|$xv_shown|$demo|$tests|$seconds s")
        if [ -n "$results" ]; then
            printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$torch_shown" "$xv_shown" "$demo" "$tests" "$seconds" "$suite" \
                >>"$results"
        fi
    done
done

[ "$setup_only" = 1 ] && { log "venvs ready under $dir"; exit "$status"; }
echo "| torch | transformers | reshard demo | tests ($suite) | tests time |"
echo "|---|---|---|---|---|"
for row in "${rows[@]}"; do
    IFS='|' read -r a b c d e <<<"$row"
    echo "| $a | $b | $c | $d | $e |"
done
exit "$status"
