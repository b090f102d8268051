"""Chapter 21: opswap as a torch.compile backend. A small Conv+BN+ReLU network with a
graph break in its forward is compiled with opswap's backend: each Dynamo graph gets
opswap's rules (BatchNorm folded, ReLU fused into the conv through the registered op
opswap::conv_relu), then Inductor's code generation. The outputs are checked against
the eager module, the report says what fired per graph, and weights loaded after
compiling are picked up (the graph is planned again for them).

    python examples/ch21_compile_backend.py
"""

import torch
from torch import nn

from opswap.backends.dynamo import backend


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True)
        )
        self.head = nn.Sequential(nn.Conv2d(8, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())

    def forward(self, x):
        x = self.features(x)
        if x.mean().item() > 10:  # a graph break: Dynamo compiles two graphs
            x = x / 10
        return self.head(x)


def main() -> None:
    torch.manual_seed(0)
    model = Net().eval()
    with torch.no_grad():  # statistics that make the BatchNorm folds change numbers
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 2.0)
    be = backend(rules="fusion.*", exactness="exact")
    compiled = torch.compile(model, backend=be)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        diff = (compiled(x) - model(x)).abs().max().item()
    print(be.summary())
    print(f"max |compiled - eager| = {diff:.2e}")
    assert diff < 1e-4 and sum(len(r.applied) > 0 for r in be.reports) == 2

    twin = Net().eval()  # other weights, loaded in place after compiling
    model.load_state_dict(twin.state_dict())
    with torch.no_grad():
        diff = (compiled(x) - twin(x)).abs().max().item()
    print(f"after load_state_dict: max |compiled - eager| = {diff:.2e}")
    print("notes:", [n for r in be.reports for n in r.notes])
    assert diff < 1e-4


if __name__ == "__main__":
    main()
