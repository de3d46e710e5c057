// The registry of the translation units' trace buffer setters (trace.cuh).
#include "cuda/kernels/trace.cuh"

#include <vector>

namespace lily::cuda::trace {

namespace {
std::vector<Setter>& setters() {
  static std::vector<Setter> s;  // filled during static initialisation, read afterwards
  return s;
}
}  // namespace

bool register_setter(Setter s) {
  setters().push_back(s);
  return true;
}

cudaError_t trace_set_buffer(const Buffer& b) {
#if defined(LILY_TRACE)
  for (Setter s : setters())
    if (cudaError_t e = s(b); e != cudaSuccess) return e;
  return cudaSuccess;
#else
  (void)b;
  return cudaErrorNotSupported;
#endif
}

}  // namespace lily::cuda::trace
