"""Ways to run a model other than eager PyTorch, each one a variant the race can time:
the saved torch.export program (pt2), and later ONNX Runtime, OpenVINO, ExecuTorch."""
