# Warnings are on for everything we compile, and the build is kept free of them.
function(tandem_set_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor
                              -Wold-style-cast -Wcast-align -Woverloaded-virtual
                              -Wimplicit-fallthrough -Wno-missing-field-initializers>)
  if(TANDEM_WERROR)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Werror>)
  endif()
endfunction()
