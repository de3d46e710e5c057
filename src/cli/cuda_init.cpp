// Registers the CUDA backend with the engine's factory when lily is built with CUDA (the engine and the server
// never link CUDA themselves).
#ifdef LILY_HAVE_CUDA
#include "cuda/cuda_backend.h"

namespace {
const int kRegistered = (lily::cuda::register_cuda_backend(), 0);
}  // namespace
#endif
