# cmake -DBUILD_DIR=... -DWORK_DIR=... -DCONSUMER_DIR=... -DGENERATOR=... -P check_install.cmake
file(REMOVE_RECURSE ${WORK_DIR})
function(run step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "${step} failed (${result}):\n${out}\n${err}")
  endif()
  message(STATUS "${step}: ok\n${out}")
endfunction()
run("install" ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${WORK_DIR}/prefix)
# Only public headers are installed: no internals (detail/, the kernels in ops/cpu/ and ops/cuda/).
file(GLOB_RECURSE internals RELATIVE ${WORK_DIR}/prefix ${WORK_DIR}/prefix/include/tandem/*/detail/*
     ${WORK_DIR}/prefix/include/tandem/ops/cpu/* ${WORK_DIR}/prefix/include/tandem/ops/cuda/*)
if(internals)
  message(FATAL_ERROR "internal headers were installed:\n${internals}")
endif()
run("configure consumer" ${CMAKE_COMMAND} -S ${CONSUMER_DIR} -B ${WORK_DIR}/build -G ${GENERATOR}
    -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCMAKE_BUILD_TYPE=Release)
# Builds the program and compiles every installed header on its own.
run("build consumer" ${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run("run consumer" ${WORK_DIR}/build/consumer)
