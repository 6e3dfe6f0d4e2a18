# cmake -DCXX=... -DMODULE=<module> -DHEADER=tandem/<other>/<name>.h -DEXPECT=FAIL|COMPILE
#       -DINCLUDES=<dir>|<dir>... -DIMPLICIT=<dir>|<dir>... -DWORK_DIR=... -P probe.cmake
#
# Compiles a one-line source of module MODULE, `#include <HEADER>`, with MODULE's include path
# (INCLUDES, the module's object library's). EXPECT=FAIL: the header must not be found, because
# MODULE does not declare HEADER's module. EXPECT=COMPILE: the positive control, it must compile.
cmake_minimum_required(VERSION 3.25)
string(REPLACE "|" ";" include_dirs "${INCLUDES}")
string(REPLACE "|" ";" implicit_dirs "${IMPLICIT}")
list(REMOVE_DUPLICATES include_dirs)
# The compiler's own folders stay implicit, as in CMake's compile lines (-I/usr/include would
# break libstdc++'s #include_next).
list(REMOVE_ITEM include_dirs ${implicit_dirs})
set(flags -std=c++20 -fsyntax-only)
foreach(dir IN LISTS include_dirs)
  list(APPEND flags -I${dir})
endforeach()
string(REGEX REPLACE "^tandem/([a-z_]+)/.*" "\\1" other ${HEADER})

file(MAKE_DIRECTORY ${WORK_DIR})
set(source ${WORK_DIR}/${MODULE}_includes_${other}.cc)
file(WRITE ${source} "// Layering probe: a ${MODULE}/ source including a ${other}/ header.\n#include <${HEADER}>\n")
execute_process(COMMAND ${CXX} ${flags} ${source} RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE out)
# The probe's own line 2 must be the error, GCC: "<source>:2:10: fatal error: tandem/x/y.h: No
# such file or directory"; Clang: "... fatal error: 'tandem/x/y.h' file not found". An error
# further in means the header was found.
string(REGEX MATCH "_includes_${other}\\.cc:2:[0-9]+: fatal error: (${HEADER}: No such file or directory|'${HEADER}' file not found)"
       not_found "${out}")

if(EXPECT STREQUAL "FAIL")
  if(NOT not_found)
    message(FATAL_ERROR "layering hole: a ${MODULE}/ source reached <${HEADER}>, but ${MODULE} does not depend on "
                        "${other}/ (docs/ARCHITECTURE.md). ${MODULE}'s include path:\n  ${include_dirs}\n"
                        "compiler (exit ${result}):\n${out}")
  endif()
  message(STATUS "ok: ${MODULE}/ cannot include <${HEADER}> (${MODULE} does not depend on ${other}/):\n${out}")
else()
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "positive control failed: a ${MODULE}/ source including <${HEADER}> (${MODULE} depends on "
                        "${other}/) does not compile with ${MODULE}'s include path:\n${out}")
  endif()
  message(STATUS "ok: ${MODULE}/ includes <${HEADER}>")
endif()
