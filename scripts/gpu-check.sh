#!/usr/bin/env bash
# The device check, one command for a machine with an NVIDIA GPU and driver, in under 8 minutes
# on one GPU:
#   scripts/gpu-check.sh [gpu-check flags, e.g. --device 1 --slot-mib 512: the data step's;
#                         --json is set here. The other steps use GPU 0, so pick another
#                         with CUDA_VISIBLE_DEVICES]
# Exit status: 0 every step passed, 1 a step failed (named at the end), 2 no driver or GPU, or
# no coreutils timeout (nothing checked), 64 a usage error (gpu-check's flags, GPU_CHECK_STEPS,
# GPU_CHECK_DFLASH_ROUNDS, GPU_CHECK_BUDGET, GPU_CHECK_E2E_TIMEOUT), 130 and 143 stopped by
# SIGINT and SIGTERM. Figures go to stdout and, as JSON, to $GPU_CHECK_OUT (default
# target/gpu-check/).
#
# Time: the check keeps to GPU_CHECK_BUDGET seconds (default 450), counted from its start, so a
# GPU machine's scarce time is never overrun by a slow or wedged run. A run still going when
# the budget is spent is stopped (SIGTERM, SIGKILL 20 s later: coreutils' `timeout`), and a
# step run out of time fails, saying so; a run that only adds figures (the DFlash step's rounds
# after the first and its extra runs of ours, the attention's kernel profile, run after every
# step) is skipped, with a `skipped` line in its log, when the time its kind last took would
# pass the budget, less what a dflash-tf32 step named after dflash needs (one run of each
# side). The check itself then still passes, on fewer figures. Ctrl-C or SIGTERM stops the run
# in progress in order (SIGTERM to it: the launcher stops its workers and removes its ring) and
# the check exits 130 or 143.
#
# Steps (GPU_CHECK_STEPS, default "data e2e speed dflash"):
#   data   `gpu-check`: the ring's arena registered as pinned memory, copy bandwidth from the
#          ring against pageable and driver-pinned memory, batches intact on the device, copies
#          overlapping compute, the GPU's busy share in the drafter's double-buffered loop and
#          the target's write-back loop, NCCL one-rank.
#   e2e    the tiny real model end to end: `launcher make-model` (2 layers), then 1 target and 1
#          drafter sharing GPU 0 (`--share-gpus --backend cuda`); every batch trained once, the
#          loss falls, each worker's items, tokens and busy share printed
#          (scripts/py/e2e_check.py). Then the same run on a copy whose layer 1 computes
#          infinities (scripts/py/infinite_weights.py) must end 3, its target refusing the
#          forward ("NaN or infinite" in its log: on a GPU the check on the device). On cuda the group's gradient goes through NCCL (one rank:
#          `[drafter] collective = "nccl"`), the path two or more GPUs take, and each worker's
#          device time from CUDA events (per phase, busy share, largest gap: the line "the
#          device's time" its log ends with) is printed, and required.
#   speed  first the fused attention kernel on a whole model: an 8-layer Qwen3-8B shape's captured
#          states and greedy tokens with it against candle's blocked matrix products, on the
#          same batch (bench-target --compare-attention; a layer more than 5% off, or under 90%
#          of the tokens agreeing, fails the step), in attention.log. Then a random-initialised
#          Qwen3-8B-shaped target in bf16 (scripts/shapes/qwen3-8b, weights made on the
#          device): our forward + capture tokens/s, with the fused attention and with the
#          blocked one, beside HF
#          transformers' forward with output_hidden_states, same GPU, interleaved
#          (scripts/py/bench_target.py --blocked-too --plain-too: ours with the kernel's
#          ldmatrix form, with its plain form and blocked; the goal is at least 0.9x: reported, not
#          a failure). A side of ours that fails is dropped from the rounds, not the others:
#          named in the JSON's `failed`, the step failed. After every step, if the budget has
#          room, the attention comparison once more with each forward's device time kernel by
#          kernel (--kernels: CUPTI), in attention-kernels.log: a figure, not a check (a
#          failure is logged), in a run of its own so CUPTI cannot cost the comparison.
#   dflash one DFlash drafter step
#          (5 layers on 5 captured layers, block 16, 512 anchors in a 4096-token sequence: forward,
#          loss, backward, AdamW) beside the same step in torch (scripts/py/dflash_step.py bench),
#          interleaved, 3 rounds each (GPU_CHECK_DFLASH_ROUNDS); ours in the first round also
#          traces one gradient pass by pass (`--trace`: each part's forward, loss and backward
#          timed, the memory after each, each pass's device time kernel by kernel from CUPTI;
#          summed in its JSON's `traced`), where its time goes,
#          and, after torch's, runs once more with HSPIPE_CUDA_FREED_MEMORY=release
#          (`ours-released`): the device's pool handing freed memory back at each synchronize,
#          the driver's default; and once with parts of 2^28 scores (`ours-parts-2^28`, four
#          times the default). These two are figures, not checks: a failure (say, out of
#          memory) is logged and does not fail the step. If ours fails in the first round, the
#          step fails, and ours runs again without --trace, and if that fails too, with
#          candle's autograd for its attention (HSPIPE_DFLASH_ATTENTION=autograd; the
#          hand-written backward is a custom op new to the GPU) in this and every later run:
#          the machine's time still brings figures back.
#   dflash-tf32 (not run unless named, about a minute) the same step once each side with f32
#          products on TF32 tensor cores (HSPIPE_CUDA_TF32=on; torch's --tf32), to
#          dflash-tf32.log; named after dflash (GPU_CHECK_STEPS="dflash dflash-tf32"), the
#          same run has the f32 figures beside it.
#
# Binaries: $HSPIPE_BIN (default target/cuda/release, what scripts/build-cuda.sh makes). When
# they are missing: unpacked from target/cuda/carry/hspipe-cuda.tar.xz if it is there (a GPU
# machine without Rust: build elsewhere and carry target/cuda/carry), else built if cargo is.
# GPU_CHECK_BIN names gpu-check alone (the tests' way to run the data step on the CPU build). The CUDA build's libraries are found by
# scripts/cuda-env.sh (PyTorch's nvidia-* packages and the driver). The e2e step runs on the CPU
# with GPU_CHECK_BACKEND=candle (CI does, to keep it working).
set -euo pipefail
cd "$(dirname "$0")/.."

steps=${GPU_CHECK_STEPS:-data e2e speed dflash}
for s in $steps; do
    case $s in
    data | e2e | speed | dflash | dflash-tf32) ;;
    *)
        echo "error: unknown step '$s' in GPU_CHECK_STEPS (data, e2e, speed, dflash, dflash-tf32)" >&2
        exit 64
        ;;
    esac
done
# The DFlash step's shape, the same for both sides and both dflash steps.
shape=(--shape scripts/shapes/qwen3-8b --device cuda --layers 5 --captured 5 --block 16
    --anchors 512 --tokens 4096 --steps 3)
# `count NAME DEFAULT WHAT`: the positive whole number $NAME says, else DEFAULT; anything else
# is a usage error.
count() {
    local v=${!1:-$2}
    if ! [[ $v =~ ^[1-9][0-9]*$ ]]; then
        echo "error: $1 must be $3, not '$v'" >&2
        exit 64
    fi
    echo "$v"
}
rounds=$(count GPU_CHECK_DFLASH_ROUNDS 3 "a positive count") || exit 64
budget=$(count GPU_CHECK_BUDGET 450 "a positive count of seconds") || exit 64
e2e_cap=$(count GPU_CHECK_E2E_TIMEOUT 300 "a positive count of seconds") || exit 64
backend=${GPU_CHECK_BACKEND:-cuda}
bins=${HSPIPE_BIN:-target/cuda/release}
out=${GPU_CHECK_OUT:-target/gpu-check}
mkdir -p "$out"
failed=()
step() { echo; echo "=== $1 ($(date +%T), ${SECONDS} s of ${budget})"; }
if ! command -v timeout >/dev/null; then
    echo "gpu-check: needs coreutils' timeout (to keep to the budget, and to stop a run with what it started): nothing checked" >&2
    exit 2
fi

# Ctrl-C and SIGTERM (a runner stopping the check): the run in progress is sent SIGTERM, which
# `timeout` passes to it and to what it started (the launcher stops its workers in order and
# removes its ring), and the check exits once it has ended: 130 or 143. The runs are started in
# the background and waited for (`within`) because bash runs a trap only once a foreground
# command has ended, and `timeout` puts its run in a process group of its own, which a
# terminal's Ctrl-C does not reach.
# Its messages go to the check's own stderr (saved here), not a run's log. A second Ctrl-C sends
# SIGTERM again (the launcher takes a second signal more than 1 s after the first as the kill).
exec {stderr}>&2
running='' starting='' stopped_by='' work='' interrupted=''
on_signal() {
    stopped_by=$2 interrupted=1
    if [ -n "$running" ]; then
        echo "gpu-check: $1: stopping the run in progress" >&"$stderr"
        kill -TERM "$running" 2>/dev/null || true
    elif [ -z "$starting" ]; then
        echo "gpu-check: $1: stopped" >&"$stderr"
        exit "$2"
    fi
}
trap 'on_signal SIGINT 130' INT
trap 'on_signal SIGTERM 143' TERM
# A signal ignored when bash started cannot be trapped (a check started with `&` from a script).
[[ $(trap -p INT) == *on_signal* ]] ||
    echo "gpu-check: SIGINT is ignored here (started in the background?): Ctrl-C cannot stop the check; SIGTERM can" >&2
# `got`'s file, removed however the check ends.
got_file=$(mktemp)
trap 'rm -f "$got_file"' EXIT
# `within CAP CMD...`: CMD, stopped after CAP seconds or when the budget is spent, whichever is
# first (SIGTERM to CMD and what it started: the launcher stops its workers and removes its
# ring; SIGKILL 20 s later). Exit status CMD's, 124 when it was stopped (137 when it had to be
# killed), or 124 when not started because the budget was already spent. Called in the check's
# own shell (never in `$(...)` or a pipeline, where the traps above do not reach): output goes
# to a file (`got`) or a tee (`teed`).
within() {
    local cap=$1 left=$((budget - SECONDS)) rc=0
    shift
    [ "$cap" -lt "$left" ] && left=$cap
    if [ "$left" -le 0 ]; then
        echo "gpu-check: the budget of ${budget} s is spent: not run: $*" >&2
        return 124
    fi
    # A signal between the start and `running` is held for it (`starting`), then passed on.
    starting=1
    timeout -k 20 "$left" "$@" &
    running=$! starting=''
    [ -z "$stopped_by" ] || kill -TERM "$running" 2>/dev/null || true
    # A trapped signal ends `wait` early: wait on until the run ends. Told by the trap having
    # run, not by the pid: once bash has reaped the run its pid may be another process's (the
    # kernel reuses pids, soon on a busy machine with pid_max 32768), and `kill -0` on it kept
    # this loop spinning (`wait` on a pid not our child returns at once) until that one ended.
    while :; do
        rc=0 interrupted=''
        wait "$running" || rc=$?
        [ -n "$interrupted" ] || break
    done
    running=''
    if [ -n "$stopped_by" ]; then
        echo "gpu-check: stopped; figures so far in $out${work:+, the e2e run in $work}" >&"$stderr"
        exit "$stopped_by"
    fi
    return "$rc"
}
in_budget() { within "$budget" "$@"; }
# `got VAR CMD...`: CMD's stdout into VAR; its exit status.
got() {
    local var=$1 rc=0
    shift
    "$@" >"$got_file" || rc=$?
    printf -v "$var" '%s' "$(<"$got_file")"
    return "$rc"
}
# `teed FILE CMD...`: CMD in the budget, its stdout and stderr shown and written to FILE, whole
# when it returns (the tee waited for). The tee outlives Ctrl-C (it ends with its input), so a
# run being stopped can still write.
teed() {
    local file=$1 fd tee rc=0
    shift
    exec {fd}> >(tee_to "$file")
    tee=$!
    in_budget "$@" >&"$fd" 2>&1 || rc=$?
    exec {fd}>&-
    wait "$tee" 2>/dev/null || true
    return "$rc"
}
# `tee_to [-a] FILE`: tee, ignoring Ctrl-C and SIGTERM (it ends with its input).
tee_to() {
    trap '' INT TERM
    exec tee "$@"
}
# Whether a run of about $1 seconds (what its kind last took) ends within the budget, with
# `reserve` seconds left over.
reserve=0
fits() { [ $((SECONDS + $1 + reserve)) -le "$budget" ]; }
# Whether exit status $1 means the budget stopped the run (124: timeout's SIGTERM, or never
# started; 137: its SIGKILL 20 s later, once the budget is spent).
out_of_time() { [ "$1" -eq 124 ] || { [ "$1" -eq 137 ] && [ "$SECONDS" -ge "$budget" ]; }; }
# A run's failure, saying when it was the budget that stopped it.
why() {
    if out_of_time "$1"; then
        echo "out of time: the budget of ${budget} s"
    elif [ "$1" -eq 137 ]; then
        echo "killed: SIGKILL, 20 s after its time ran out, or out of memory"
    else
        echo "exit $1"
    fi
}

if [ "$backend" = cuda ]; then
    # shellcheck source=scripts/cuda-env.sh
    source scripts/cuda-env.sh
    # The CUDA build links the driver: without it no binary of it starts.
    if [ -z "${GPU_CHECK_BIN:-}" ] && [[ " $HSPIPE_CUDA_MISSING " == *" libcuda.so.1 "* ]]; then
        echo "gpu-check: no NVIDIA driver (libcuda.so.1 is not on the loader's path): nothing to check on this machine" >&2
        exit 2
    fi
    bundle=target/cuda/carry/hspipe-cuda.tar.xz
    if [ -z "${GPU_CHECK_BIN:-}" ] &&
        { [ ! -x "$bins/launcher" ] || { [ -f "$bundle" ] && [ "$bundle" -nt "$bins/launcher" ]; }; }; then
        if [ -f "$bundle" ]; then
            # A newer bundle replaces binaries left by an earlier call (tar keeps the files' own
            # older times, so touch them).
            echo "== unpacking $bundle into $bins"
            mkdir -p "$bins" && tar -C "$bins" -xJf "$bundle" &&
                touch "$bins/launcher" "$bins/gpu-check" "$bins/bench-target" "$bins/bench-dflash-step"
        elif command -v cargo >/dev/null; then
            scripts/build-cuda.sh
        fi
    fi
fi
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader || true
fi
# The DFlash steps' ours: candle's autograd for its attention once the hand-written backward
# failed in the dflash step (its custom op has not run on a GPU before), in every later run of
# ours, the dflash-tf32 step's too.
attention=()

for s in $steps; do
    case $s in
    data)
        step "data path: gpu-check $*"
        bin=${GPU_CHECK_BIN:-$bins/gpu-check}
        rc=0
        in_budget "$bin" --json "$out/gpu-check.json" "$@" || rc=$?
        # No driver or device: nothing else can be checked either. 127: the loader could not
        # start it (a library of the CUDA build missing; cuda-env said which).
        [ $rc -eq 2 ] && exit 2
        [ $rc -eq 64 ] && exit 64
        if [ $rc -eq 127 ]; then
            echo "gpu-check: $bin could not start (a run-time library is missing): nothing checked" >&2
            exit 2
        fi
        [ $rc -eq 0 ] || failed+=("data (gpu-check $(why $rc))")
        ;;
    e2e)
        step "the tiny real model end to end on $backend (1 target + 1 drafter, one GPU)"
        rm -f "$out/e2e-run.tar.gz"
        work=$(mktemp -d) t=$SECONDS
        config=scripts/gpu-check-e2e.toml
        if [ "$backend" = cuda ]; then
            config=$work/e2e.toml
            sed '/^\[drafter\]/a collective = "nccl"' scripts/gpu-check-e2e.toml >"$config"
        fi
        rc=0
        # The launcher gets GPU_CHECK_E2E_TIMEOUT seconds (300) at most: a wedged run must not
        # take the other steps' time.
        {
            in_budget "$bins/launcher" make-model "$work/tiny" --layers 2 --seed 3 &&
                within "$e2e_cap" "$bins/launcher" --targets 0 --drafters 0 \
                    --share-gpus --backend "$backend" --model "$work/tiny" --config "$config" \
                    --run-dir "$work/run" --monitor 5 &&
                python3 scripts/py/e2e_check.py "$work/run" --json "$out/e2e.json"
        } || rc=$?
        # The same run on a copy of the model whose layer 1 computes infinities: the target's
        # forward must refuse it (on a GPU the check on the device: its greedy tokens marked,
        # refused at the batch's write-back), the target give up, and the run end degraded (3).
        if [ $rc -eq 0 ]; then
            python3 scripts/py/infinite_weights.py "$work/tiny" "$work/inf" \
                model.layers.1.mlp.down_proj.weight && {
                within "$e2e_cap" "$bins/launcher" --targets 0 --drafters 0 --share-gpus \
                    --backend "$backend" --model "$work/inf" --config "$config" \
                    --run-dir "$work/inf-run" --max-restarts 0 >"$work/inf.out" 2>&1 || rc=$?
            } || rc=$?
            if [ $rc -eq 3 ] && grep -q "NaN or infinite" "$work/inf-run/logs/target-0.log"; then
                echo "e2e: a target computing infinities is refused: $(grep -o "NaN or infinite values in [^:]*" "$work/inf-run/logs/target-0.log" | head -1)"
                rc=0
            else
                echo "error: the model computing infinities was not refused (exit $rc, want 3 and \"NaN or infinite\" in $work/inf-run/logs/target-0.log)" >&2
                tail -5 "$work/inf.out" >&2
                [ $rc -ne 0 ] && [ $rc -ne 3 ] || rc=1
            fi
        fi
        # Each GPU worker logs what its device did (CUDA events) as it ends: per-phase device
        # time, busy share, largest gap. A GPU run without them has lost its device timing.
        if [ $rc -eq 0 ] && [ "$backend" = cuda ]; then
            { grep -h "the device's time" "$work/run"/logs/*.log || true; } | tee "$out/device-time.log"
            [ "$(grep -c . "$out/device-time.log")" -ge 2 ] || {
                echo "error: the workers logged no device time (want the target's and the drafter's)" >&2
                rc=1
            }
        fi
        if [ $rc -ne 0 ]; then
            # The run's logs and report travel with the figures (a GPU machine is given back
            # with its disk): $out/e2e-run.tar.gz.
            where="run directory $work/run"
            if [ -d "$work/run" ] && tar -C "$work" -czf "$out/e2e-run.tar.gz" \
                --exclude='run/checkpoints' --exclude='*.safetensors' run; then
                where="$where, its logs in $out/e2e-run.tar.gz"
            fi
            said=$(why $rc)
            # Stopped before the budget was spent, and after the launcher's own cap: the cap.
            if { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && [ "$SECONDS" -lt "$budget" ] &&
                [ $((SECONDS - t)) -ge "$e2e_cap" ]; then
                said="out of time: the launcher's ${e2e_cap} s (GPU_CHECK_E2E_TIMEOUT)"
            fi
            failed+=("e2e ($said; $where)")
        else
            rm -rf "$work"
        fi
        work=''
        ;;
    speed)
        step "target speed against PyTorch: Qwen3-8B shape, bf16, random weights on the GPU"
        # Ours is the fused attention here, whatever the caller's environment says.
        unset HSPIPE_TARGET_ATTENTION
        compare=("$bins/bench-target" --device cuda --random --model scripts/shapes/qwen3-8b-8l
            --seq-len 2048 --batch 2 --reps 1 --compare-attention)
        rc=0 t=$SECONDS
        teed "$out/attention.log" "${compare[@]}" || rc=$?
        compare_s=$((SECONDS - t))
        [ $rc -eq 0 ] || failed+=("fused attention against blocked ($(why $rc))")
        # Timed even when the comparison failed: the blocked side and torch's are still figures.
        rc=0
        teed "$out/speed.log" python3 scripts/py/bench_target.py --device cuda --random \
            --model scripts/shapes/qwen3-8b --bin "$bins/bench-target" --shapes 2048x4 --rounds 3 \
            --reps 3 --blocked-too --plain-too || rc=$?
        [ $rc -eq 0 ] || failed+=("speed ($(why $rc))")
        ;;
    dflash)
        step "one DFlash drafter step against the same step in torch (Qwen3-8B shape, f32)"
        log=$out/dflash-step.log
        rc=0
        # Ours at its defaults against torch's (the part size, TF32 and attention this step
        # names where it wants them, not a caller's environment).
        unset HSPIPE_DFLASH_SCORES_PER_PART HSPIPE_CUDA_TF32 HSPIPE_DFLASH_ATTENTION
        ours_s=0 torch_s=0
        # `extra LABEL VAR=VALUE`: ours once more with one setting, in the first round, after
        # torch's (the round's pair stays side by side). A figure, not a check: its failure
        # (say, out of memory) is logged and the step goes on.
        extra() {
            if ! fits "$ours_s"; then
                echo "skipped $1 (it takes about ${ours_s} s; ${SECONDS} of the budget's ${budget} s spent)" | tee -a "$log"
                return
            fi
            local v x=0
            got v in_budget env "${attention[@]}" "$2" "$bins/bench-dflash-step" "${shape[@]}" \
                2>>"$out/dflash-ours.log" || x=$?
            if [ $x -eq 0 ]; then
                echo "$1 $v" | tee -a "$log"
            else
                echo "$1 failed ($(why $x); not the step's failure): see dflash-ours.log" | tee -a "$log"
            fi
        }
        # `ours_step [--trace]`: one run of ours, with `attention`'s environment, into `ours`.
        ours_step() {
            got ours in_budget env "${attention[@]}" "$bins/bench-dflash-step" "${shape[@]}" "$@" \
                2> >(tee_to -a "$out/dflash-ours.log" >&2)
        }
        for round in $(seq "$rounds"); do
            if [ "$round" -gt 1 ] && ! fits $((ours_s + torch_s)); then
                echo "skipped rounds $round-$rounds (a round takes about $((ours_s + torch_s)) s; ${SECONDS} of the budget's ${budget} s spent)" | tee -a "$log"
                break
            fi
            # Each side's status is checked. The first round's trace runs before the timed
            # steps, in the same process: CUPTI records nothing after the trace, but stays
            # loaded (the summary gives the traced round's step against the untraced rounds').
            first=$([ "$round" -eq 1 ] && echo 1 || true)
            t=$SECONDS x=0
            ours_step ${first:+--trace} || x=$?
            if [ $x -ne 0 ] && ! out_of_time $x && [ -n "$first" ]; then
                # One lent machine's run should still bring figures back: ours again without
                # the trace, then with candle's autograd for the attention (the hand-written
                # backward is a custom op none of whose GPU runs has been checked). The step
                # fails all the same, naming what failed.
                echo "ours failed ($(why $x)): see dflash-ours.log; ours again without --trace" | tee -a "$log"
                traced=$x t=$SECONDS x=0
                ours_step || x=$?
                if [ $x -eq 0 ]; then
                    failed+=("dflash step: ours with --trace ($(why $traced)); its figures are untraced")
                elif ! out_of_time $x; then
                    echo "ours failed ($(why $x)): ours again with HSPIPE_DFLASH_ATTENTION=autograd" | tee -a "$log"
                    hand=$x t=$SECONDS x=0
                    attention=(HSPIPE_DFLASH_ATTENTION=autograd)
                    ours_step || x=$?
                    if [ $x -eq 0 ]; then
                        failed+=("dflash step: ours with the attention's hand-written backward ($(why $hand)); its figures are autograd's")
                    fi
                fi
            fi
            [ $x -eq 0 ] || { rc=$x; break; }
            ours_s=$((SECONDS - t))
            echo "ours $ours" | tee -a "$log"
            t=$SECONDS
            got torch in_budget python3 scripts/py/dflash_step.py bench "${shape[@]}" || { rc=$?; break; }
            torch_s=$((SECONDS - t))
            echo "torch $torch" | tee -a "$log"
            # A dflash-tf32 step named after this one runs each side once: its time is kept
            # from the runs that only add figures.
            if [[ " $steps " == *" dflash "*"dflash-tf32 "* ]]; then
                reserve=$((ours_s + torch_s))
            fi
            if [ -n "$first" ]; then
                # The device's memory pool handing freed memory back at each synchronize (the
                # driver's default; hspipe keeps it): what keeping it gains.
                extra ours-released HSPIPE_CUDA_FREED_MEMORY=release
                # Parts of 2^28 scores, four times the default, which was set before the
                # attention's graph shrank and its anchors were grouped: whether fewer, larger
                # parts are faster, and whether they fit.
                extra ours-parts-2^28 HSPIPE_DFLASH_SCORES_PER_PART=268435456
            fi
        done
        reserve=0
        [ $rc -eq 0 ] || failed+=("dflash step ($(why $rc))")
        ;;
    dflash-tf32)
        step "the DFlash step with f32 products on TF32 tensor cores, both sides"
        rc=0
        unset HSPIPE_DFLASH_SCORES_PER_PART HSPIPE_CUDA_TF32 HSPIPE_DFLASH_ATTENTION
        got ours in_budget env "${attention[@]}" HSPIPE_CUDA_TF32=on "$bins/bench-dflash-step" "${shape[@]}" \
            2>>"$out/dflash-ours.log" || rc=$?
        [ $rc -eq 0 ] && echo "ours-tf32 $ours" | tee -a "$out/dflash-tf32.log"
        if [ $rc -eq 0 ]; then
            got torch in_budget python3 scripts/py/dflash_step.py bench "${shape[@]}" --tf32 || rc=$?
            [ $rc -eq 0 ] && echo "torch-tf32 $torch" | tee -a "$out/dflash-tf32.log"
        fi
        [ $rc -eq 0 ] || failed+=("dflash-tf32 step ($(why $rc))")
        ;;
    esac
done

# The attention comparison's forwards profiled kernel by kernel, in a run of their own after
# every step: a figure, not a check (CUPTI, new to the machine, must cost neither the
# comparison's verdict nor a step's time).
if [ -n "${compare_s:-}" ]; then
    step "the attention comparison's forwards, kernel by kernel (a figure)"
    if ! fits "$compare_s"; then
        echo "skipped the attention's kernel profile (it takes about ${compare_s} s; ${SECONDS} of the budget's ${budget} s spent)" |
            tee "$out/attention-kernels.log"
    else
        x=0
        teed "$out/attention-kernels.log" "${compare[@]}" --kernels || x=$?
        [ $x -eq 0 ] || echo "the kernel profile failed ($(why $x); not the check's failure)" |
            tee -a "$out/attention-kernels.log"
    fi
fi

echo
if [ ${#failed[@]} -gt 0 ]; then
    printf 'gpu-check: FAILED: %s\n' "${failed[@]}" >&2
    exit 1
fi
echo "gpu-check: every step passed ($steps); figures in $out (medians and ratios: python3 scripts/py/gpu_check_summary.py $out)"
