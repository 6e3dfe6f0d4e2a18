# cmake -DSOURCE_DIR=<repository> -DDEPENDENCIES_FILE=<build>/tandem_module_dependencies.txt -P check_includes.cmake
#
# Every #include of a tandem header in a module's files must name the module itself or one it
# declares in tandem_add_module(... DEPENDS ...): a header that a module reaches only through
# another module's public headers (keras_like -> strategy -> collective) is not one it may use.
# Relative includes ("../x/y.h") would bypass the include paths, so they are refused too.
cmake_minimum_required(VERSION 3.25)
file(STRINGS ${DEPENDENCIES_FILE} entries)
set(violations "")
set(files_checked 0)
foreach(entry IN LISTS entries)
  string(REGEX MATCH "^([a-z_]+):(.*)$" _ "${entry}")
  set(module ${CMAKE_MATCH_1})
  set(declared "${CMAKE_MATCH_2}")
  set(allowed ${module} ${declared})
  if(NOT declared)
    set(declared "nothing")
  endif()
  string(REPLACE ";" ", " declared "${declared}")
  file(GLOB_RECURSE files RELATIVE ${SOURCE_DIR} ${SOURCE_DIR}/${module}/*.h ${SOURCE_DIR}/${module}/*.cc
       ${SOURCE_DIR}/${module}/*.cu)
  foreach(file IN LISTS files)
    math(EXPR files_checked "${files_checked} + 1")
    file(STRINGS ${SOURCE_DIR}/${file} includes REGEX "^[ \t]*#[ \t]*include[ \t]*[<\"]")
    foreach(line IN LISTS includes)
      if(line MATCHES "[<\"]tandem/([a-z_]+)/")
        if(NOT CMAKE_MATCH_1 IN_LIST allowed)
          string(APPEND violations "  ${file}: ${line}  (${module} depends on: ${declared})\n")
        endif()
      elseif(line MATCHES "\"\\.\\./")
        string(APPEND violations "  ${file}: ${line}  (relative include: use <tandem/<module>/...>)\n")
      endif()
    endforeach()
  endforeach()
endforeach()
if(violations)
  message(FATAL_ERROR "modules include headers of modules they do not declare (docs/ARCHITECTURE.md):\n"
                      "${violations}")
endif()
message(STATUS "ok: ${files_checked} files include only their module's and its declared dependencies' headers "
               "(keras_like/ includes nothing from collective/)")
