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
# Public headers keep their module folders: <tandem/graph/tensor.h>.
foreach(module base devices graph ops collective strategy data keras_like)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/${module}/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/tandem/${module}
          FILES_MATCHING PATTERN "*.h")
endforeach()
install(FILES ${PROJECT_SOURCE_DIR}/tandem.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/tandem)

install(EXPORT tandemTargets NAMESPACE tandem:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/tandem)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/tandemConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/tandemConfig.cmake
                              INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/tandem)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/tandemConfigVersion.cmake COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/tandemConfig.cmake ${PROJECT_BINARY_DIR}/tandemConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/tandem)
