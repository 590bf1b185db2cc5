// torch ops for the CUDA kernels in saguaro_ops.cu (built only where a CUDA toolkit and a
// CUDA torch are both present: setup.py). Schemas here; the CUDA implementations check
// their inputs and call the plain C launchers on the current stream; the fake (meta)
// implementations are registered from Python (vllm_saguaro/ops/cuda.py).
//
// The Python wrappers (ops/cuda.py) convert dtypes first; these checks are the contract.
// The stream is c10::cuda::getCurrentCUDAStream() (what at::cuda::getCurrentCUDAStream()
// forwards to) from c10/cuda/CUDAStream.h: ATen/cuda/CUDAContext.h would also pull in the
// cuBLAS/cuSPARSE/cuSOLVER headers, which a minimal (pip) CUDA toolkit lacks.
#include <Python.h>

#include <cstdint>
#include <tuple>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

extern "C" int saguaro_cache_lookup_launch(const int64_t* keys, int64_t n,
                                           const int64_t* queries, int64_t b, int64_t* out,
                                           cudaStream_t stream);

extern "C" int saguaro_sample_launch(const float* logits, int64_t stride,
                                     const float* temperature, const int32_t* top_k,
                                     const float* top_p, const int32_t* fanout,
                                     const int64_t* seeds, int64_t rows, int64_t vocab, float c,
                                     int64_t* tokens, float* q, int32_t* steps_scratch,
                                     cudaStream_t stream);

namespace {

void check_launch(int err, const char* op) {
  TORCH_CHECK(err == static_cast<int>(cudaSuccess), "saguaro::", op, ": kernel launch failed: ",
              cudaGetErrorString(static_cast<cudaError_t>(err)));
}

void check_cuda(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK(t.is_cuda(), "saguaro: ", name, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.device() == device, "saguaro: ", name, " is on ", t.device(),
              ", the other inputs on ", device);
}

void check_vector(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t rows,
                  const at::Device& device) {
  check_cuda(t, name, device);
  TORCH_CHECK(t.scalar_type() == dtype, "saguaro::saguaro_sample: ", name, " must be ",
              dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == rows, "saguaro::saguaro_sample: ", name,
              " must have shape [", rows, "] (one per row), got ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), "saguaro::saguaro_sample: ", name, " must be contiguous");
}

at::Tensor cache_lookup_cuda(const at::Tensor& keys, const at::Tensor& queries) {
  const at::Device device = queries.device();
  check_cuda(queries, "queries", device);
  check_cuda(keys, "keys", device);
  TORCH_CHECK(keys.scalar_type() == at::kLong && queries.scalar_type() == at::kLong,
              "saguaro::cache_lookup: keys and queries must be int64, got ",
              keys.scalar_type(), " and ", queries.scalar_type());
  TORCH_CHECK(keys.dim() == 2 && keys.size(1) == 3, "saguaro::cache_lookup: keys must be [N, 3] "
              "(row, k, token), got ", keys.sizes());
  TORCH_CHECK(queries.dim() == 2 && queries.size(1) == 3, "saguaro::cache_lookup: queries "
              "must be [B, 3] (row, k, token), got ", queries.sizes());
  TORCH_CHECK(keys.is_contiguous() && queries.is_contiguous(),
              "saguaro::cache_lookup: keys and queries must be contiguous");
  const c10::cuda::CUDAGuard guard(device);
  const int64_t b = queries.size(0);
  at::Tensor out = at::empty({b}, queries.options());
  if (b == 0) return out;
  check_launch(saguaro_cache_lookup_launch(keys.data_ptr<int64_t>(), keys.size(0),
                                           queries.data_ptr<int64_t>(), b,
                                           out.data_ptr<int64_t>(),
                                           c10::cuda::getCurrentCUDAStream()),
               "cache_lookup");
  return out;
}

std::tuple<at::Tensor, at::Tensor> saguaro_sample_cuda(
    const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
    const at::Tensor& top_p, const at::Tensor& fanout, double c, const at::Tensor& seeds) {
  const at::Device device = logits.device();
  check_cuda(logits, "logits", device);
  TORCH_CHECK(logits.scalar_type() == at::kFloat,
              "saguaro::saguaro_sample: logits must be float32 (convert bf16/fp16 first), got ",
              logits.scalar_type());
  TORCH_CHECK(logits.dim() == 2, "saguaro::saguaro_sample: logits must be [R, V], got ",
              logits.sizes());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(rows == 0 || vocab > 0, "saguaro::saguaro_sample: logits has an empty vocabulary");
  TORCH_CHECK(vocab <= 1 || logits.stride(1) == 1,
              "saguaro::saguaro_sample: logits rows must be contiguous (stride(1) == 1), got "
              "strides ", logits.strides());
  check_vector(temperature, "temperature", at::kFloat, rows, device);
  check_vector(top_k, "top_k", at::kInt, rows, device);
  check_vector(top_p, "top_p", at::kFloat, rows, device);
  check_vector(fanout, "fanout", at::kInt, rows, device);
  check_vector(seeds, "seeds", at::kLong, rows, device);
  const c10::cuda::CUDAGuard guard(device);
  at::Tensor tokens = at::empty({rows}, logits.options().dtype(at::kLong));
  at::Tensor q = at::empty({rows, vocab}, logits.options().dtype(at::kFloat));
  if (rows == 0) return {tokens, q};
  at::Tensor steps = at::empty({rows, vocab}, logits.options().dtype(at::kInt));
  check_launch(saguaro_sample_launch(
                   logits.data_ptr<float>(), logits.stride(0), temperature.data_ptr<float>(),
                   top_k.data_ptr<int32_t>(), top_p.data_ptr<float>(),
                   fanout.data_ptr<int32_t>(), seeds.data_ptr<int64_t>(), rows, vocab,
                   static_cast<float>(c), tokens.data_ptr<int64_t>(), q.data_ptr<float>(),
                   steps.data_ptr<int32_t>(), c10::cuda::getCurrentCUDAStream()),
               "saguaro_sample");
  return {tokens, q};
}

}  // namespace

TORCH_LIBRARY(saguaro, m) {
  m.def("cache_lookup(Tensor keys, Tensor queries) -> Tensor");
  m.def("saguaro_sample(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, "
        "Tensor fanout, float c, Tensor seeds) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(saguaro, CUDA, m) {
  m.impl("cache_lookup", &cache_lookup_cuda);
  m.impl("saguaro_sample", &saguaro_sample_cuda);
}

// `import vllm_saguaro._C` loads this library, whose static initialisers above register
// the ops; the module itself is empty.
PyMODINIT_FUNC PyInit__C(void) {  // PyMODINIT_FUNC: extern "C", exported
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr,
                                      nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module);
}
