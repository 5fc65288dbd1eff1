# Sourced by tools/gpu_check.sh and tools/gpu_multi_check.sh: `step NAME
# COMMAND...` runs COMMAND with its output in $out/NAME.log (out: $OUT, else
# the caller's default in $1) and prints its exit status and the log's last
# ${TAIL:-12} lines, unless NAME is among the words of $skip.
out=${OUT:-$1}
mkdir -p "$out"
step() {
  local name=$1; shift
  case " ${skip:-} " in *" $name "*) echo "=== $name: skipped"; return ;; esac
  echo "=== $name"
  "$@" > "$out/$name.log" 2>&1
  echo "(exit $?)"
  tail -n "${TAIL:-12}" "$out/$name.log"
}
