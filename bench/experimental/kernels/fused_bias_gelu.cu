// Fused bias + GeLU, forward and backward, for CUDA tensors (megazoo.kernels.gelu).
//
//   forward:  y  = gelu(x + bias)
//   backward: dx = dy * gelu'(x + bias)      (the bias gradient, dx summed over rows, is a
//                                              torch reduction in the Python caller)
// x, dy, y, dx: [M, N] contiguous; bias: [N]; all float32, float16 or bfloat16 (one dtype).
// gelu is the tanh approximation (GPT-2 / Megatron) when approximate_tanh, else exact (erf).
// Math is float32. Each thread moves 16 bytes per access when N and the pointers allow it
// (8 bf16/fp16 or 4 fp32 elements), else one element; a grid-stride loop covers any size.
#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kCubic = 0.044715f;
constexpr float kInvSqrt2 = 0.7071067811865476f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;

template <bool kTanh>
__device__ __forceinline__ float gelu(float u) {
  if (kTanh) return 0.5f * u * (1.f + tanhf(kSqrt2OverPi * (u + kCubic * u * u * u)));
  return 0.5f * u * (1.f + erff(u * kInvSqrt2));
}

template <bool kTanh>
__device__ __forceinline__ float gelu_grad(float u) {
  if (kTanh) {
    const float t = tanhf(kSqrt2OverPi * (u + kCubic * u * u * u));
    return 0.5f * (1.f + t) + 0.5f * u * (1.f - t * t) * kSqrt2OverPi * (1.f + 3.f * kCubic * u * u);
  }
  return 0.5f * (1.f + erff(u * kInvSqrt2)) + u * kInvSqrt2Pi * expf(-0.5f * u * u);
}

// kVec consecutive elements moved as one aligned access.
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

template <typename T, int kVec, bool kTanh, bool kBackward>
__global__ void bias_gelu_kernel(const T* __restrict__ x, const T* __restrict__ bias,
                                 const T* __restrict__ dy, T* __restrict__ out,
                                 int64_t num_packs, int64_t packs_per_row) {
  using P = Pack<T, kVec>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < num_packs;
       p += stride) {
    const P xv = reinterpret_cast<const P*>(x)[p];
    const P bv = reinterpret_cast<const P*>(bias)[p % packs_per_row];
    P gv;
    if (kBackward) gv = reinterpret_cast<const P*>(dy)[p];
    P ov;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float u = static_cast<float>(xv.v[k]) + static_cast<float>(bv.v[k]);
      const float r = kBackward ? static_cast<float>(gv.v[k]) * gelu_grad<kTanh>(u) : gelu<kTanh>(u);
      ov.v[k] = static_cast<T>(r);
    }
    reinterpret_cast<P*>(out)[p] = ov;
  }
}

template <typename T, int kVec, bool kTanh, bool kBackward>
void launch_typed(const at::Tensor& x, const at::Tensor& bias, const at::Tensor& dy, at::Tensor& out) {
  const int64_t num_packs = x.numel() / kVec;
  const int64_t packs_per_row = bias.numel() / kVec;
  const int threads = 256;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t wanted = (num_packs + threads - 1) / threads;
  const int blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(wanted, sms * 16)));
  const T* dy_ptr = kBackward ? dy.data_ptr<T>() : nullptr;
  bias_gelu_kernel<T, kVec, kTanh, kBackward>
      <<<blocks, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
          x.data_ptr<T>(), bias.data_ptr<T>(), dy_ptr, out.data_ptr<T>(), num_packs, packs_per_row);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

bool aligned16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

template <typename T, bool kBackward>
void dispatch_width(const at::Tensor& x, const at::Tensor& bias, const at::Tensor& dy,
                    at::Tensor& out, bool approximate_tanh) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vec = bias.numel() % kVec == 0 && aligned16(x) && aligned16(bias) && aligned16(out) &&
                   (!kBackward || aligned16(dy));
  if (vec && approximate_tanh) launch_typed<T, kVec, true, kBackward>(x, bias, dy, out);
  else if (vec) launch_typed<T, kVec, false, kBackward>(x, bias, dy, out);
  else if (approximate_tanh) launch_typed<T, 1, true, kBackward>(x, bias, dy, out);
  else launch_typed<T, 1, false, kBackward>(x, bias, dy, out);
}

void check_inputs(const at::Tensor& x, const at::Tensor& bias) {
  TORCH_CHECK(x.is_cuda() && bias.is_cuda(), "fused bias_gelu: x and bias must be CUDA tensors");
  TORCH_CHECK(x.is_contiguous() && bias.is_contiguous(), "fused bias_gelu: inputs must be contiguous");
  TORCH_CHECK(x.scalar_type() == bias.scalar_type(), "fused bias_gelu: x and bias dtypes differ");
  TORCH_CHECK(bias.dim() == 1 && x.dim() >= 1 && x.size(-1) == bias.numel(),
              "fused bias_gelu: bias must be [N] with N = x.size(-1)");
}

template <bool kBackward>
at::Tensor run(const at::Tensor& x, const at::Tensor& bias, const at::Tensor& dy, bool approximate_tanh) {
  check_inputs(x, bias);
  if (kBackward) {
    TORCH_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type() && dy.is_contiguous(),
                "fused bias_gelu backward: dy must be contiguous, of x's shape and dtype");
  }
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  at::Tensor out = at::empty_like(x);
  if (x.numel() == 0) return out;
  switch (x.scalar_type()) {
    case at::kFloat: dispatch_width<float, kBackward>(x, bias, dy, out, approximate_tanh); break;
    case at::kHalf: dispatch_width<at::Half, kBackward>(x, bias, dy, out, approximate_tanh); break;
    case at::kBFloat16: dispatch_width<at::BFloat16, kBackward>(x, bias, dy, out, approximate_tanh); break;
    default: TORCH_CHECK(false, "fused bias_gelu: dtype must be float32, float16 or bfloat16");
  }
  return out;
}

at::Tensor forward(const at::Tensor& x, const at::Tensor& bias, bool approximate_tanh) {
  return run<false>(x, bias, x, approximate_tanh);
}

at::Tensor backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& bias,
                    bool approximate_tanh) {
  return run<true>(x, bias, dy, approximate_tanh);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megazoo fused CUDA kernels: bias + GeLU forward and backward";
  m.def("bias_gelu_forward", &forward, "y = gelu(x + bias)", py::arg("x"), py::arg("bias"),
        py::arg("approximate_tanh"));
  m.def("bias_gelu_backward", &backward, "dx = dy * gelu'(x + bias)", py::arg("dy"), py::arg("x"),
        py::arg("bias"), py::arg("approximate_tanh"));
}
