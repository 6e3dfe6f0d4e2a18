# The build enforces the layering of docs/ARCHITECTURE.md. Each module is an OBJECT library whose
# sources see, through their include path, only their own headers and those of the modules they
# declare: an #include of any other module's header fails to compile ("No such file or
# directory"). All module objects go into the one library `tandem` (tandem::tandem), whose users
# (programs, tests, installed consumers) see every header through the full include root.
#
# tandem_add_module(NAME <module> [DEPENDS <module>...] SOURCES <file>...)
#   DEPENDS: the modules this one's sources and public headers include, every one named (not
#   only the direct ones); each must have been added before. Their headers propagate to modules
#   that depend on this one, as public headers need them.
#   Third-party libraries, compile definitions and CUDA sources are attached afterwards to the
#   target tandem_<module>, PRIVATE unless a public header needs them.

# Every module's declared dependencies, for the include scan (tests/layering/check_includes.cmake).
set(TANDEM_MODULE_DEPENDENCIES_FILE ${PROJECT_BINARY_DIR}/tandem_module_dependencies.txt)
file(WRITE ${TANDEM_MODULE_DEPENDENCIES_FILE} "")

# A symbolic link `link` -> `target`, made (or corrected) at configure time.
function(tandem_link_folder link target)
  if(IS_SYMLINK ${link})
    file(READ_SYMLINK ${link} current)
    if(NOT current STREQUAL target)
      file(REMOVE ${link})
    endif()
  endif()
  if(NOT IS_SYMLINK ${link})
    get_filename_component(parent ${link} DIRECTORY)
    file(MAKE_DIRECTORY ${parent})
    file(CREATE_LINK ${target} ${link} SYMBOLIC)
  endif()
endfunction()

function(tandem_add_module)
  cmake_parse_arguments(M "" "NAME" "DEPENDS;SOURCES" ${ARGN})
  set(target tandem_${M_NAME})
  add_library(${target} OBJECT ${M_SOURCES})
  # build/include/<module>/tandem/<module> -> <source>/<module>: this module's headers only.
  set(root ${PROJECT_BINARY_DIR}/include/${M_NAME})
  tandem_link_folder(${root}/tandem/${M_NAME} ${CMAKE_CURRENT_SOURCE_DIR})
  target_include_directories(${target} PUBLIC ${root})
  foreach(dependency IN LISTS M_DEPENDS)
    if(NOT TARGET tandem_${dependency})
      message(FATAL_ERROR "tandem_add_module(${M_NAME}): dependency '${dependency}' is not a module added before it")
    endif()
    target_link_libraries(${target} PUBLIC tandem_${dependency})
  endforeach()
  set_property(GLOBAL APPEND PROPERTY TANDEM_MODULES ${M_NAME})
  file(APPEND ${TANDEM_MODULE_DEPENDENCIES_FILE} "${M_NAME}:${M_DEPENDS}\n")

  # What every module's sources are compiled with (formerly set on `tandem` itself).
  target_compile_features(${target} PUBLIC cxx_std_20)
  target_link_libraries(${target} PUBLIC fmt::fmt Threads::Threads)
  tandem_set_warnings(${target})
  if(TANDEM_NATIVE_ARCH)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-march=native>)
  endif()
  # Math functions need not set errno: without this, GCC keeps sqrt/exp in loops scalar.
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-fno-math-errno>
                                           # nvcc: constexpr std:: helpers in device code; warnings on.
                                           $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -Xcompiler=-Wall,-Wextra>)

  # Into the one library. BUILD_INTERFACE: the module targets are build-time pieces, not part of
  # the installed package (a static libtandem would otherwise export links to them).
  target_link_libraries(tandem PRIVATE $<BUILD_INTERFACE:${target}>)
endfunction()
