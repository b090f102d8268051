// The Python binding of bias_gelu.cu: opswap's op (kernels/bias_gelu_cuda.py) calls
// `bias_gelu(x, b)` and `bias_gelu_backward(dy, x, b)` of the module that
// torch.utils.cpp_extension builds from the two files.
#include <torch/extension.h>

torch::Tensor bias_gelu(torch::Tensor x, torch::Tensor b);
std::vector<torch::Tensor> bias_gelu_backward(torch::Tensor dy, torch::Tensor x, torch::Tensor b);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bias_gelu", &bias_gelu, "gelu(x + b), erf form, fp32 math (CUDA)");
  m.def("bias_gelu_backward", &bias_gelu_backward,
        "(dx, fp32 partial column sums of dx) of gelu(x + b), erf form (CUDA)");
}
