// y = gelu(x + b), erf form, for x [M, N] contiguous and b [N]; fp32 math for every
// input dtype (float, half, bfloat16). One read of x, one of b (cached: N values), one
// write of y: 2 + 2 bytes per element in half precision, against eager's add (2 + 2)
// then gelu (2 + 2).
//
// Where x, b and y are 4-byte aligned and N is even, each thread loads and stores pairs
// (half2 / __nv_bfloat162 / float2): half as many memory instructions.
//
// Backward: dx = dy * (Phi(z) + z phi(z)) with z = x + b, and db = dx summed over rows (in
// fp32, before dx is rounded). One read of dy and x, one write of dx: 6 bytes per element
// in half precision, where PyTorch ops on the saved input write and re-read fp32 temporaries
// (z, erf, exp, their products: over 40 bytes). Each thread owns one column (or pair of
// columns) and walks a chunk of rows, so the column sums for db stay in registers; a chunk's
// sums go to one row of an fp32 partial [chunks, N] that PyTorch adds up (a few hundred rows).

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/extension.h>

namespace {

__device__ __forceinline__ float gelu_erf(float v) {
  return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
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

// pairs of T, and how to split and join them in fp32
template <typename T> struct Pair;
template <> struct Pair<float> {
  using type = float2;
  static __device__ __forceinline__ float2 split(float2 p) { return p; }
  static __device__ __forceinline__ float2 join(float a, float b) { return make_float2(a, b); }
};
template <> struct Pair<__half> {
  using type = __half2;
  static __device__ __forceinline__ float2 split(__half2 p) { return __half22float2(p); }
  static __device__ __forceinline__ __half2 join(float a, float b) { return __floats2half2_rn(a, b); }
};
template <> struct Pair<__nv_bfloat16> {
  using type = __nv_bfloat162;
  static __device__ __forceinline__ float2 split(__nv_bfloat162 p) { return __bfloat1622float2(p); }
  static __device__ __forceinline__ __nv_bfloat162 join(float a, float b) {
    return __floats2bfloat162_rn(a, b);
  }
};

template <typename T>
__global__ void bias_gelu_scalar(const T* __restrict__ x, const T* __restrict__ b,
                                 T* __restrict__ y, int64_t total, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x) {
    y[i] = from_f<T>(gelu_erf(to_f<T>(x[i]) + to_f<T>(b[i % n])));
  }
}

template <typename T>
__global__ void bias_gelu_pairs(const T* __restrict__ x, const T* __restrict__ b,
                                T* __restrict__ y, int64_t pairs, int64_t n_pairs) {
  using P = typename Pair<T>::type;
  const P* xp = reinterpret_cast<const P*>(x);
  const P* bp = reinterpret_cast<const P*>(b);
  P* yp = reinterpret_cast<P*>(y);
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < pairs;
       i += (int64_t)gridDim.x * blockDim.x) {
    float2 v = Pair<T>::split(xp[i]);
    float2 c = Pair<T>::split(__ldg(bp + (i % n_pairs)));
    yp[i] = Pair<T>::join(gelu_erf(v.x + c.x), gelu_erf(v.y + c.y));
  }
}

__device__ __forceinline__ float gelu_erf_grad(float z) {
  // Phi(z) + z phi(z): the erf form's derivative
  return 0.5f * (1.0f + erff(z * 0.70710678118654752f)) +
         z * 0.39894228040143268f * expf(-0.5f * z * z);
}

template <typename T>
__global__ void bias_gelu_bwd_scalar(const T* __restrict__ dy, const T* __restrict__ x,
                                     const T* __restrict__ b, T* __restrict__ dx,
                                     float* __restrict__ part, int64_t rows, int64_t n,
                                     int64_t chunk) {
  const int64_t col = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (col >= n) return;
  const float bc = to_f<T>(b[col]);
  const int64_t r0 = blockIdx.y * chunk, r1 = min(rows, r0 + chunk);
  float acc = 0.0f;
#pragma unroll 4
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t i = r * n + col;
    const float d = to_f<T>(dy[i]) * gelu_erf_grad(to_f<T>(x[i]) + bc);
    dx[i] = from_f<T>(d);
    acc += d;
  }
  part[blockIdx.y * n + col] = acc;
}

template <typename T>
__global__ void bias_gelu_bwd_pairs(const T* __restrict__ dy, const T* __restrict__ x,
                                    const T* __restrict__ b, T* __restrict__ dx,
                                    float* __restrict__ part, int64_t rows, int64_t n_pairs,
                                    int64_t chunk) {
  using P = typename Pair<T>::type;
  const int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (c >= n_pairs) return;
  const P* dyp = reinterpret_cast<const P*>(dy);
  const P* xp = reinterpret_cast<const P*>(x);
  P* dxp = reinterpret_cast<P*>(dx);
  const float2 bc = Pair<T>::split(reinterpret_cast<const P*>(b)[c]);
  const int64_t r0 = blockIdx.y * chunk, r1 = min(rows, r0 + chunk);
  float2 acc = make_float2(0.0f, 0.0f);
#pragma unroll 4
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t i = r * n_pairs + c;
    const float2 g = Pair<T>::split(dyp[i]);
    const float2 v = Pair<T>::split(xp[i]);
    const float d0 = g.x * gelu_erf_grad(v.x + bc.x), d1 = g.y * gelu_erf_grad(v.y + bc.y);
    dxp[i] = Pair<T>::join(d0, d1);
    acc.x += d0;
    acc.y += d1;
  }
  part[blockIdx.y * 2 * n_pairs + 2 * c] = acc.x;
  part[blockIdx.y * 2 * n_pairs + 2 * c + 1] = acc.y;
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
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % (2 * sizeof(T)) == 0; };
  if (n % 2 == 0 && aligned(xd) && aligned(bd) && aligned(yd)) {
    const int64_t pairs = total / 2;
    const int blocks = (int)std::min<int64_t>((pairs + threads - 1) / threads, 32LL * sms);
    bias_gelu_pairs<T><<<std::max(blocks, 1), threads, 0, stream>>>(xd, bd, yd, pairs, n / 2);
  } else {
    const int blocks = (int)std::min<int64_t>((total + threads - 1) / threads, 32LL * sms);
    bias_gelu_scalar<T><<<std::max(blocks, 1), threads, 0, stream>>>(xd, bd, yd, total, n);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void launch_bwd(const torch::Tensor& dy, const torch::Tensor& x, const torch::Tensor& b,
                torch::Tensor& dx, torch::Tensor& part, int64_t chunk) {
  const int64_t n = x.size(-1), rows = x.numel() / n;
  const T* dyd = reinterpret_cast<const T*>(dy.data_ptr());
  const T* xd = reinterpret_cast<const T*>(x.data_ptr());
  const T* bd = reinterpret_cast<const T*>(b.data_ptr());
  T* dxd = reinterpret_cast<T*>(dx.data_ptr());
  float* pd = part.data_ptr<float>();
  auto stream = at::cuda::getCurrentCUDAStream();
  const int threads = 128;
  const dim3 grid_chunks(1, (unsigned)part.size(0));
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % (2 * sizeof(T)) == 0; };
  if (n % 2 == 0 && aligned(dyd) && aligned(xd) && aligned(bd) && aligned(dxd)) {
    const dim3 grid((unsigned)((n / 2 + threads - 1) / threads), grid_chunks.y);
    bias_gelu_bwd_pairs<T><<<grid, threads, 0, stream>>>(dyd, xd, bd, dxd, pd, rows, n / 2, chunk);
  } else {
    const dim3 grid((unsigned)((n + threads - 1) / threads), grid_chunks.y);
    bias_gelu_bwd_scalar<T><<<grid, threads, 0, stream>>>(dyd, xd, bd, dxd, pd, rows, n, chunk);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
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
  // chunks of rows: about 4 blocks a multiprocessor in all, each walking >= 16 rows
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t col_blocks = std::max<int64_t>(1, (n / 2 + 127) / 128);
  const int64_t want = std::max<int64_t>(1, 4LL * sms / col_blocks);
  const int64_t chunk = std::max<int64_t>(16, (rows + want - 1) / std::max<int64_t>(want, 1));
  const int64_t chunks = rows ? (rows + chunk - 1) / chunk : 0;
  auto part = torch::empty({chunks, n}, xc.options().dtype(at::kFloat));
  if (rows == 0 || n == 0) return {dx, part};
  switch (xc.scalar_type()) {
    case at::kFloat: launch_bwd<float>(dyc, xc, bc, dx, part, chunk); break;
    case at::kHalf: launch_bwd<__half>(dyc, xc, bc, dx, part, chunk); break;
    case at::kBFloat16: launch_bwd<__nv_bfloat16>(dyc, xc, bc, dx, part, chunk); break;
    default: TORCH_CHECK(false, "bias_gelu_backward takes float32, float16 or bfloat16");
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
