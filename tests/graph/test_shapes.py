"""Shape propagation: shapes at the example and at every probe, quietly."""

import sys

import torch
import torch.fx as fx
from torch import nn

from opswap.graph.shapes import propagate, shapes_seen


@fx.wrap
def _talk(x):
    print("model says hi", file=sys.stderr)  # a call in the graph, run on every propagate
    return x


class Biased(nn.Module):
    """Adds a bias of fixed size 5: the graph runs at any batch, at one width only."""

    def __init__(self):
        super().__init__()
        self.b = nn.Parameter(torch.randn(5))

    def forward(self, x):
        return torch.relu(x + self.b)


def test_a_probe_the_graph_fails_at_is_returned_and_not_printed(capfd):
    gm = fx.symbolic_trace(Biased())
    x = torch.randn(3, 5)
    errors = propagate(gm, (x,), [(torch.randn(7, 5),), (torch.randn(3, 4),)])
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err
    assert errors[0] is None
    # the op's own error, not ShapeProp's wrapper that prints the whole node and its meta
    assert isinstance(errors[1], RuntimeError) and "ShapeProp" not in str(errors[1])
    assert "size of tensor" in str(errors[1])
    out_node = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert shapes_seen(out_node) == [(3, 5), (7, 5)]


def test_what_the_model_prints_still_reaches_stderr(capfd):
    class Talks(Biased):
        def forward(self, x):
            return super().forward(_talk(x))

    gm = fx.symbolic_trace(Talks())
    propagate(gm, (torch.randn(2, 5),), [(torch.randn(2, 4),)])  # the probe fails after _talk
    _, err = capfd.readouterr()
    assert err.count("model says hi") == 2 and "Traceback" not in err


def test_the_example_run_raises_the_ops_error_quietly(capfd):
    gm = fx.symbolic_trace(Biased())
    try:
        propagate(gm, (torch.randn(2, 4),))
    except RuntimeError as e:
        said = str(e)
    _, err = capfd.readouterr()
    assert "Traceback" not in err and "ShapeProp" not in said and "size of tensor" in said
