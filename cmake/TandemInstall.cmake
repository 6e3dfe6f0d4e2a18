# Installs libtandem, its public headers and a CMake package, so another project can write
#   find_package(tandem REQUIRED)
#   target_link_libraries(app PRIVATE tandem::tandem)
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS tandem EXPORT tandemTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
# Public headers only, in their module folders: <tandem/graph/tensor.h>. Internals stay out:
# every detail/ folder and the kernels (ops/cpu/, ops/cuda/). tests/install compiles each
# installed header on its own against the install, so none may include an internal one.
get_property(tandem_modules GLOBAL PROPERTY TANDEM_MODULES)
foreach(module IN LISTS tandem_modules)
  set(internal PATTERN detail EXCLUDE)
  if(module STREQUAL "ops")
    list(APPEND internal PATTERN cpu EXCLUDE PATTERN cuda EXCLUDE)
  endif()
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/${module}/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/tandem/${module}
          FILES_MATCHING PATTERN "*.h" ${internal})
endforeach()
install(FILES ${PROJECT_SOURCE_DIR}/tandem.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/tandem)

install(EXPORT tandemTargets NAMESPACE tandem:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/tandem)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/tandemConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/tandemConfig.cmake
                              INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/tandem)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/tandemConfigVersion.cmake COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/tandemConfig.cmake ${PROJECT_BINARY_DIR}/tandemConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/tandem)
