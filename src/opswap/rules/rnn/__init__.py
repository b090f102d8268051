"""Chapter 19: recurrent networks. A Python loop over an LSTMCell / GRUCell / RNNCell,
unrolled by the capture into T calls of the same cell, becomes one nn.LSTM / nn.GRU /
nn.RNN (cuDNN on CUDA, oneDNN or ATen's fused loop on the CPU); a sequence RNN becomes
opswap's own fused Triton kernel where the measured crossover says it beats cuDNN.

A cell loop is launch-bound: each step runs two GEMMs and a handful of elementwise
kernels, each its own dispatch, and the input projection, which does not depend on the
previous step, is computed T times as small GEMMs. A fused RNN projects every step's
input in one GEMM up front and runs the recurrence in one call.
"""
