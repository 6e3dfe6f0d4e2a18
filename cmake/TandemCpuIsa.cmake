# The CPU kernels, built once per instruction-set level (base/cpu_isa.h, ops/cpu/isa.h).
#
# tandem_add_cpu_isa_levels(MODULE <module> SOURCES <file>...)
#   Compiles SOURCES once per level in TANDEM_CPU_ISA_LEVELS, with that level's flags and with
#   TANDEM_CPU_ISA_NS=isa_<level> (the namespace of the level's entry points) and
#   TANDEM_CPU_ISA_LEVEL (its tandem::CpuIsa), against the include path and dependencies of
#   tandem_<module>. Each level's objects are linked into one relocatable object whose global
#   symbols outside the level's namespace get the prefix `tandem_<level>.` (TandemCpuIsaObject.cmake),
#   so that no function compiled for one level can stand in for another's; the objects go into
#   `tandem`. <build>/cpu_isa/<module>_<level>.renamed.txt lists the renamed data symbols (each
#   level holds its own copy of them), which tests/ops checks.
#
# Levels: x86-64 builds have baseline, avx2 and avx512; other architectures the baseline only.
# TANDEM_NATIVE_ARCH=ON compiles the rest of tandem with -march=native, never these: each level
# keeps exactly its own flags, so TANDEM_CPU_ISA=baseline stays a baseline path.

if(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64)$")
  set(TANDEM_CPU_ISA_LEVELS baseline avx2 avx512)
  set(TANDEM_CPU_ISA_VARIANTS 1)
  set(tandem_isa_flags_baseline -march=x86-64 -mtune=generic)
  set(tandem_isa_flags_avx2 -march=x86-64 -mtune=generic -mavx2 -mfma -mf16c)
  # Generic tuning would keep auto-vectorised loops at 256 bits; the level exists for 512.
  set(tandem_isa_flags_avx512 -march=x86-64 -mtune=generic -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512dq
                              -mavx512vl -mprefer-vector-width=512)
else()
  set(TANDEM_CPU_ISA_LEVELS baseline)
  set(TANDEM_CPU_ISA_VARIANTS 0)
  set(tandem_isa_flags_baseline "")
endif()
set(tandem_isa_enum_baseline kBaseline)
set(tandem_isa_enum_avx2 kAvx2)
set(tandem_isa_enum_avx512 kAvx512)

function(tandem_add_cpu_isa_levels)
  cmake_parse_arguments(L "" "MODULE" "SOURCES" ${ARGN})
  set(module tandem_${L_MODULE})
  set(out_dir ${PROJECT_BINARY_DIR}/cpu_isa)
  set(outputs "")
  foreach(level IN LISTS TANDEM_CPU_ISA_LEVELS)
    set(objects ${module}_isa_${level})
    add_library(${objects} OBJECT ${L_SOURCES})
    # The module's include path, public dependencies and standard; its private settings too.
    target_link_libraries(${objects} PRIVATE ${module})
    get_target_property(definitions ${module} COMPILE_DEFINITIONS)
    if(definitions)
      target_compile_definitions(${objects} PRIVATE ${definitions})
    endif()
    get_target_property(libraries ${module} LINK_LIBRARIES)
    foreach(library IN LISTS libraries)
      if(TARGET ${library} AND NOT library MATCHES "^tandem_")
        target_link_libraries(${objects} PRIVATE ${library})
      endif()
    endforeach()
    target_compile_definitions(${objects} PRIVATE TANDEM_CPU_ISA_NS=isa_${level}
                                                  TANDEM_CPU_ISA_LEVEL=::tandem::CpuIsa::${tandem_isa_enum_${level}}
                                                  TANDEM_CPU_ISA_VARIANTS=${TANDEM_CPU_ISA_VARIANTS})
    tandem_set_warnings(${objects})
    target_compile_options(${objects} PRIVATE ${tandem_isa_flags_${level}} -fno-math-errno)

    set(output ${out_dir}/${L_MODULE}_${level}.o)
    add_custom_command(
      OUTPUT ${output} ${out_dir}/${L_MODULE}_${level}.renamed.txt
      COMMAND ${CMAKE_COMMAND} "-DOBJECTS=$<TARGET_OBJECTS:${objects}>" -DOUTPUT=${output} -DLEVEL=${level}
              -DLINKER=${CMAKE_LINKER} -DNM=${CMAKE_NM} -DREADELF=${CMAKE_READELF}
              -DOBJCOPY=${CMAKE_OBJCOPY}
              -P ${PROJECT_SOURCE_DIR}/cmake/TandemCpuIsaObject.cmake
      DEPENDS ${objects} $<TARGET_OBJECTS:${objects}> ${PROJECT_SOURCE_DIR}/cmake/TandemCpuIsaObject.cmake
      COMMENT "Linking the ${level} CPU kernels of ${L_MODULE} into one object"
      VERBATIM)
    list(APPEND outputs ${output})
  endforeach()
  add_custom_target(${module}_isa_levels DEPENDS ${outputs})
  set_source_files_properties(${outputs} DIRECTORY ${PROJECT_SOURCE_DIR} PROPERTIES EXTERNAL_OBJECT TRUE GENERATED TRUE)
  target_sources(tandem PRIVATE ${outputs})
  add_dependencies(tandem ${module}_isa_levels)
  target_compile_definitions(${module} PRIVATE TANDEM_CPU_ISA_VARIANTS=${TANDEM_CPU_ISA_VARIANTS})
endfunction()
