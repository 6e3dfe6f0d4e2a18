# cmake -DOBJECTS=<a.o;b.o> -DOUTPUT=<level.o> -DLEVEL=<level> -DLINKER=ld -DNM=nm -DREADELF=readelf
#       -DOBJCOPY=objcopy -P <this>
#
# One instruction-set level's kernel objects -> one relocatable object (ld -r) in which every
# global symbol (and local function) defined outside namespace tandem::ops::cpu::isa_<level> is renamed
# `tandem_<level>.<name>` (objcopy --redefine-syms). Inline functions and template instances
# (Eigen, the standard library, tandem's headers) are weak symbols: without the renaming the
# final link keeps one copy of each, possibly the AVX-512 one, for every caller. Renamed, each
# level calls only its own copies, and the rest of tandem the baseline ones. COMDAT groups' signatures
# are renamed too, so that no group is shared (or dropped) across levels either.
# Writes <OUTPUT minus .o>.renamed.txt: the data symbols renamed (each level has its own copy:
# typeinfo, vtables, constants). Fails on mutable state outside the level's namespace, which must
# not be duplicated.
cmake_policy(VERSION 3.25)

# The signatures of the COMDAT groups in `object`, into `out`.
function(comdat_signatures object out)
  execute_process(COMMAND ${READELF} -g -W ${object} OUTPUT_VARIABLE groups RESULT_VARIABLE rc ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "readelf of the ${LEVEL} kernels failed: ${err}")
  endif()
  string(REGEX MATCHALL "COMDAT group section [^\n]*\\] contains" group_lines "${groups}")
  set(signatures "")
  foreach(group IN LISTS group_lines)
    string(REGEX MATCH "\\[([A-Za-z0-9_.$]+)\\] contains$" _ "${group}")
    list(APPEND signatures ${CMAKE_MATCH_1})
  endforeach()
  set(${out} ${signatures} PARENT_SCOPE)
endfunction()

set(partial ${OUTPUT}.partial)
execute_process(COMMAND ${LINKER} -r -o ${partial} ${OBJECTS} RESULT_VARIABLE rc ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "ld -r of the ${LEVEL} kernels failed: ${err}")
endif()
execute_process(COMMAND ${NM} --defined-only --format=posix ${partial}
                OUTPUT_VARIABLE listing RESULT_VARIABLE rc ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "nm of the ${LEVEL} kernels failed: ${err}")
endif()
string(LENGTH "isa_${LEVEL}" tag_length)
set(own_namespace "${tag_length}isa_${LEVEL}")  # as it appears in mangled names
string(REPLACE "\n" ";" lines "${listing}")
set(map "")
set(data "")
set(shared_state "")
set(renamed "")
foreach(line IN LISTS lines)
  if(line STREQUAL "")
    continue()
  endif()
  string(REGEX MATCH "^([^ ]+) ([A-Za-z])" _ "${line}")
  set(name ${CMAKE_MATCH_1})
  set(type ${CMAKE_MATCH_2})
  string(FIND "${name}" "${own_namespace}" at)
  # Local functions are renamed too, though no other object can reach them: every function of
  # the level then carries its name in a disassembly (tests/ops/isa_instructions_check.sh).
  # (nm: lower case is local, except u, a unique global.)
  if(NOT at EQUAL -1 OR type MATCHES "^[a-sv-z]$")
    continue()
  endif()
  list(APPEND renamed ${name})
  if(type MATCHES "^[BDRVuG]$")
    string(APPEND data "${type} ${name}\n")
  endif()
  # State that must exist once per process (a function-local static of an inline function, its
  # guard, a writable global) would exist once per level after the renaming.
  if(type MATCHES "^[BDG]$" OR type MATCHES "^[VuR]$" AND name MATCHES "^_Z(Z|GV)")
    string(APPEND shared_state "  ${type} ${name}\n")
  endif()
endforeach()
# COMDAT groups are deduplicated by their signature, which need not be a symbol nm lists (the
# group of a constructor's or destructor's variants is keyed by a local `...C5Ev`/`...D5Ev`).
# Unrenamed, the final link would keep the baseline group and drop this level's, leaving this
# level's calls pointing at nothing.
comdat_signatures(${partial} signatures)
foreach(signature IN LISTS signatures)
  string(FIND "${signature}" "${own_namespace}" at)
  if(at EQUAL -1)
    list(APPEND renamed ${signature})
  endif()
endforeach()
# A local function's name may repeat (one per source file): one line of the map each.
list(REMOVE_DUPLICATES renamed)
foreach(name IN LISTS renamed)
  string(APPEND map "${name} tandem_${LEVEL}.${name}\n")
endforeach()
if(NOT shared_state STREQUAL "")
  message(FATAL_ERROR "the ${LEVEL} CPU kernels define state that every level would then hold its own copy of "
                      "(move it out of the kernel sources, or into a non-inline function of a module):\n${shared_state}")
endif()
file(WRITE ${OUTPUT}.map "${map}")
string(REGEX REPLACE "\\.o$" ".renamed.txt" data_file "${OUTPUT}")
file(WRITE ${data_file} "${data}")
execute_process(COMMAND ${OBJCOPY} --redefine-syms=${OUTPUT}.map ${partial} ${OUTPUT} RESULT_VARIABLE rc
                ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "objcopy of the ${LEVEL} kernels failed: ${err}")
endif()
file(REMOVE ${partial})
# Every COMDAT group must now be this level's alone.
comdat_signatures(${OUTPUT} signatures)
foreach(signature IN LISTS signatures)
  string(FIND "${signature}" "tandem_${LEVEL}." prefix)
  string(FIND "${signature}" "${own_namespace}" own)
  if(NOT prefix EQUAL 0 AND own EQUAL -1)
    file(REMOVE ${OUTPUT})
    message(FATAL_ERROR "the ${LEVEL} CPU kernels' COMDAT group ${signature} kept its name: the final link could "
                        "share it with another level")
  endif()
endforeach()
