#!/usr/bin/env bash
# Which instructions each function of libtandem uses, against the instruction-set level it belongs
# to (ops/cpu/isa.h): the proof that the default build runs on any x86-64 CPU. A function of the
# AVX2 level has a name that starts with `tandem_avx2.` or mentions namespace isa_avx2 (the build
# renames every function of a level, cmake/TandemCpuIsaObject.cmake); likewise AVX-512; every
# other function is baseline code and may use no VEX or EVEX instruction at all (SSE2 and the
# like only), and AVX2-level code no AVX-512 one (zmm or mask registers, xmm16-31).
#   isa_instructions_check.sh <libtandem.so>      exit 0: clean; 1: violations, listed; 77: skipped
set -euo pipefail
library=${1:?usage: isa_instructions_check.sh <libtandem.so>}
if [[ $(uname -m) != x86_64 ]]; then
  echo "skipped: not an x86-64 build (one level only)"; exit 77
fi
if ! command -v objdump > /dev/null; then
  echo "skipped: objdump (binutils) is not installed"; exit 77
fi
objdump -d --no-show-raw-insn -M att "$library" | awk '
  function level_of(name) {
    if (name ~ /^tandem_avx512\./ || name ~ /10isa_avx512/) return "avx512"
    if (name ~ /^tandem_avx2\./ || name ~ /8isa_avx2/) return "avx2"
    return "baseline"
  }
  function finish() {
    if (fn == "") return
    functions[level]++
    if (vex) with_vex[level]++
    if (evex) with_evex[level]++
    if (level == "baseline" && (vex || evex)) { bad++; print "baseline code uses AVX: " fn " (" example ")" }
    if (level == "avx2" && evex) { bad++; print "AVX2-level code uses AVX-512: " fn " (" example ")" }
  }
  /^[0-9a-f]+ <.*>:$/ {
    finish()
    fn = substr($2, 2, length($2) - 3); level = level_of(fn); vex = 0; evex = 0; example = ""
    next
  }
  fn != "" && /^ +[0-9a-f]+:\t/ {
    split($0, parts, "\t"); insn = parts[2]; split(insn, words, " "); mnemonic = words[1]
    if (insn ~ /%zmm|%k[0-7]|%[xy]mm(1[6-9]|2[0-9]|3[01])/ || mnemonic ~ /^k(mov|and|or|xor|not|test|shift|add|unpck)/) {
      if (!evex) example = insn
      evex = 1
    } else if (mnemonic ~ /^v/ && mnemonic !~ /^ver[rw]/) {
      if (!vex && !evex) example = insn
      vex = 1
    }
  }
  END {
    finish()
    split("baseline avx2 avx512", order, " ")
    for (i = 1; i <= 3; i++) {
      l = order[i]
      printf "%-8s %6d functions, %5d with AVX/AVX2 instructions, %5d with AVX-512 ones\n", l, functions[l], with_vex[l], with_evex[l]
    }
    if (bad) { print bad " function(s) use instructions their level may not"; exit 1 }
    if (!with_evex["avx512"]) { print "the AVX-512 level has no AVX-512 instruction: is it built with its flags?"; exit 1 }
    print "ok: only the avx2 and avx512 levels use AVX, and only the avx512 level AVX-512"
  }'
