// y = gelu(x + b), erf form, for x [M, N] contiguous and b [N]; fp32 math for every
// input dtype (float, half, bfloat16). One read of x, one of b (cached: N values), one
// write of y: 2 + 2 bytes per element in half precision, against eager's add (2 + 2)
// then gelu (2 + 2).
//
// Each thread moves packs of K elements: 16 bytes (8 halves, 4 floats) where N is a
// multiple of that and every pointer is 16-byte aligned, so each access is one 128-bit
// load or store (the width Inductor's generated kernels use); 2 elements where N is even
// and the pointers 2-element aligned; else 1. The arithmetic is per element in fp32.
//
// Backward: dx = dy * (Phi(z) + z phi(z)) with z = x + b, and db = dx summed over rows (in
// fp32, before dx is rounded). One read of dy and x, one write of dx: 6 bytes per element
// in half precision, where PyTorch ops on the saved input write and re-read fp32 temporaries
// (z, erf, exp, their products: over 40 bytes). Each thread owns one pack of columns and
// walks a chunk of rows, so the column sums for db stay in registers; a chunk's sums go to
// one row of an fp32 partial [chunks, N] that PyTorch adds up (a few hundred rows).

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/extension.h>

namespace {

__device__ __forceinline__ float gelu_erf(float v) {
  return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
}

__device__ __forceinline__ float gelu_erf_grad(float z) {
  // Phi(z) + z phi(z): the erf form's derivative
  return 0.5f * (1.0f + erff(z * 0.70710678118654752f)) +
         z * 0.39894228040143268f * expf(-0.5f * z * z);
}

template <typename T>
__device__ __forceinline__ float to_f(T v) { return static_cast<float>(v); }
template <>
__device__ __forceinline__ float to_f<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_f(float v) { return static_cast<T>(v); }
template <>
__device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// K consecutive elements, aligned to their size: one load or store instruction of K * sizeof(T)
template <typename T, int K>
struct alignas(sizeof(T) * K) Pack {
  T v[K];
};

template <typename T, int K>
__global__ void bias_gelu_fwd(const T* __restrict__ x, const T* __restrict__ b,
                              T* __restrict__ y, int64_t packs, int64_t n_packs) {
  using P = Pack<T, K>;
  const P* xp = reinterpret_cast<const P*>(x);
  const P* bp = reinterpret_cast<const P*>(b);
  P* yp = reinterpret_cast<P*>(y);
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < packs;
       i += (int64_t)gridDim.x * blockDim.x) {
    const P v = xp[i];
    const P c = bp[i % n_packs];  // N values: cached
    P o;
#pragma unroll
    for (int k = 0; k < K; ++k) o.v[k] = from_f<T>(gelu_erf(to_f<T>(v.v[k]) + to_f<T>(c.v[k])));
    yp[i] = o;
  }
}

template <typename T, int K>
__global__ void bias_gelu_bwd(const T* __restrict__ dy, const T* __restrict__ x,
                              const T* __restrict__ b, T* __restrict__ dx,
                              float* __restrict__ part, int64_t rows, int64_t n_packs,
                              int64_t chunk) {
  using P = Pack<T, K>;
  const int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (c >= n_packs) return;
  const P* dyp = reinterpret_cast<const P*>(dy);
  const P* xp = reinterpret_cast<const P*>(x);
  P* dxp = reinterpret_cast<P*>(dx);
  const P bp = reinterpret_cast<const P*>(b)[c];
  float bc[K], acc[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    bc[k] = to_f<T>(bp.v[k]);
    acc[k] = 0.0f;
  }
  const int64_t r0 = blockIdx.y * chunk, r1 = min(rows, r0 + chunk);
#pragma unroll 4
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t i = r * n_packs + c;
    const P g = dyp[i];
    const P v = xp[i];
    P o;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const float d = to_f<T>(g.v[k]) * gelu_erf_grad(to_f<T>(v.v[k]) + bc[k]);
      o.v[k] = from_f<T>(d);
      acc[k] += d;
    }
    dxp[i] = o;
  }
  float* out = part + blockIdx.y * n_packs * K + c * K;
#pragma unroll
  for (int k = 0; k < K; ++k) out[k] = acc[k];
}

// the widest pack every pointer and N allow: 16 bytes, 2 elements, or 1
template <typename T>
int pack_width(int64_t n, std::initializer_list<const void*> ptrs) {
  auto aligned = [&](int k) {
    for (const void* p : ptrs)
      if (reinterpret_cast<uintptr_t>(p) % (k * sizeof(T)) != 0) return false;
    return n % k == 0;
  };
  const int wide = 16 / (int)sizeof(T);
  return aligned(wide) ? wide : aligned(2) ? 2 : 1;
}

template <typename T>
void launch(const torch::Tensor& x, const torch::Tensor& b, torch::Tensor& y) {
  const int64_t total = x.numel(), n = x.size(-1);
  const T* xd = reinterpret_cast<const T*>(x.data_ptr());
  const T* bd = reinterpret_cast<const T*>(b.data_ptr());
  T* yd = reinterpret_cast<T*>(y.data_ptr());
  auto stream = at::cuda::getCurrentCUDAStream();
  const int threads = 256;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int k = pack_width<T>(n, {xd, bd, yd});
  const int64_t packs = total / k;
  const int blocks = (int)std::max<int64_t>(
      1, std::min<int64_t>((packs + threads - 1) / threads, 32LL * sms));
  if (k == 16 / (int)sizeof(T)) {
    bias_gelu_fwd<T, 16 / sizeof(T)><<<blocks, threads, 0, stream>>>(xd, bd, yd, packs, n / k);
  } else if (k == 2) {
    bias_gelu_fwd<T, 2><<<blocks, threads, 0, stream>>>(xd, bd, yd, packs, n / k);
  } else {
    bias_gelu_fwd<T, 1><<<blocks, threads, 0, stream>>>(xd, bd, yd, packs, n / k);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void launch_bwd(const torch::Tensor& dy, const torch::Tensor& x, const torch::Tensor& b,
                torch::Tensor& dx, torch::Tensor& part, int k, int64_t chunk) {
  const int64_t n = x.size(-1), rows = x.numel() / n;
  const T* dyd = reinterpret_cast<const T*>(dy.data_ptr());
  const T* xd = reinterpret_cast<const T*>(x.data_ptr());
  const T* bd = reinterpret_cast<const T*>(b.data_ptr());
  T* dxd = reinterpret_cast<T*>(dx.data_ptr());
  float* pd = part.data_ptr<float>();
  auto stream = at::cuda::getCurrentCUDAStream();
  const int threads = 128;
  const dim3 grid((unsigned)((n / k + threads - 1) / threads), (unsigned)part.size(0));
  if (k == 16 / (int)sizeof(T)) {
    bias_gelu_bwd<T, 16 / sizeof(T)><<<grid, threads, 0, stream>>>(dyd, xd, bd, dxd, pd, rows,
                                                                      n / k, chunk);
  } else if (k == 2) {
    bias_gelu_bwd<T, 2><<<grid, threads, 0, stream>>>(dyd, xd, bd, dxd, pd, rows, n / k, chunk);
  } else {
    bias_gelu_bwd<T, 1><<<grid, threads, 0, stream>>>(dyd, xd, bd, dxd, pd, rows, n / k, chunk);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
int width_of(const torch::Tensor& dy, const torch::Tensor& x, const torch::Tensor& b,
             const torch::Tensor& dx) {
  return pack_width<T>(x.size(-1), {dy.data_ptr(), x.data_ptr(), b.data_ptr(), dx.data_ptr()});
}

}  // namespace

std::vector<torch::Tensor> bias_gelu_backward(torch::Tensor dy, torch::Tensor x, torch::Tensor b) {
  TORCH_CHECK(dy.is_cuda() && x.is_cuda() && b.is_cuda(), "bias_gelu_backward takes CUDA tensors");
  TORCH_CHECK(x.dim() >= 1 && b.dim() == 1 && b.size(0) == x.size(-1) && dy.sizes() == x.sizes(),
              "bias_gelu_backward takes dy and x [..., N] and b [N]");
  TORCH_CHECK(x.scalar_type() == b.scalar_type() && dy.scalar_type() == x.scalar_type(),
              "dy, x and b must have one dtype");
  const c10::cuda::CUDAGuard guard(x.device());
  auto xc = x.contiguous();
  auto dyc = dy.contiguous();
  auto bc = b.contiguous();
  auto dx = torch::empty_like(xc);
  const int64_t n = xc.size(-1), rows = n ? xc.numel() / n : 0;
  int k = 1;
  switch (xc.scalar_type()) {
    case at::kFloat: k = width_of<float>(dyc, xc, bc, dx); break;
    case at::kHalf: k = width_of<__half>(dyc, xc, bc, dx); break;
    case at::kBFloat16: k = width_of<__nv_bfloat16>(dyc, xc, bc, dx); break;
    default: TORCH_CHECK(false, "bias_gelu_backward takes float32, float16 or bfloat16");
  }
  // chunks of rows: about 8 blocks of 128 threads a multiprocessor in all, each walking
  // at least 16 rows (a few hundred partial rows of db at most)
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t col_blocks = std::max<int64_t>(1, (n / k + 127) / 128);
  const int64_t want = std::max<int64_t>(1, 8LL * sms / col_blocks);
  const int64_t chunk = std::max<int64_t>(16, (rows + want - 1) / want);
  const int64_t chunks = rows ? (rows + chunk - 1) / chunk : 0;
  auto part = torch::empty({chunks, n}, xc.options().dtype(at::kFloat));
  if (rows == 0 || n == 0) return {dx, part};
  switch (xc.scalar_type()) {
    case at::kFloat: launch_bwd<float>(dyc, xc, bc, dx, part, k, chunk); break;
    case at::kHalf: launch_bwd<__half>(dyc, xc, bc, dx, part, k, chunk); break;
    default: launch_bwd<__nv_bfloat16>(dyc, xc, bc, dx, part, k, chunk); break;
  }
  return {dx, part};
}

torch::Tensor bias_gelu(torch::Tensor x, torch::Tensor b) {
  TORCH_CHECK(x.is_cuda() && b.is_cuda(), "bias_gelu takes CUDA tensors");
  TORCH_CHECK(x.dim() >= 1 && b.dim() == 1 && b.size(0) == x.size(-1),
              "bias_gelu takes x [..., N] and b [N]");
  TORCH_CHECK(x.scalar_type() == b.scalar_type(), "x and b must have one dtype");
  const c10::cuda::CUDAGuard guard(x.device());
  auto xc = x.contiguous();
  auto bc = b.contiguous();
  auto y = torch::empty_like(xc);
  if (xc.numel() == 0) return y;
  switch (xc.scalar_type()) {
    case at::kFloat: launch<float>(xc, bc, y); break;
    case at::kHalf: launch<__half>(xc, bc, y); break;
    case at::kBFloat16: launch<__nv_bfloat16>(xc, bc, y); break;
    default: TORCH_CHECK(false, "bias_gelu takes float32, float16 or bfloat16");
  }
  return y;
}
