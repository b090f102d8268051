"""kernels._cache_key: Inductor's cache keys carry a digest of opswap's kernel sources, so a
graph compiled with an older fake kernel is compiled again, not reused."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from opswap.backends.int8_inductor import compile_module
from opswap.kernels import _cache_key
from opswap.kernels._cache_key import KernelsKey, digest, inductor_options


def test_the_digest_follows_every_kernel_source(tmp_path):
    root = tmp_path / "kernels"
    shutil.copytree(Path(_cache_key.__file__).parent, root)
    before = digest(root)
    assert before == digest(Path(_cache_key.__file__).parent)  # the same bytes, the same key
    path = root / "conv_relu.py"
    path.write_text(path.read_text() + "\n# a fake kernel changed\n")
    digest.cache_clear()
    assert digest(root) != before


def test_opswap_compiles_set_the_key_and_keep_a_users_pass(monkeypatch):
    opts = inductor_options({"max_autotune": False})
    assert opts["max_autotune"] is False
    assert isinstance(opts["post_grad_custom_post_pass"], KernelsKey)
    assert opts["post_grad_custom_post_pass"].uuid() == digest()

    class Mine(KernelsKey):
        def uuid(self) -> str:
            return "mine"

    assert (
        inductor_options({"post_grad_custom_post_pass": Mine()})[
            "post_grad_custom_post_pass"
        ].uuid()
        == "mine"
    )
    monkeypatch.setattr(torch._inductor.config, "post_grad_custom_post_pass", Mine())
    assert "post_grad_custom_post_pass" not in inductor_options()


@pytest.mark.skipif(
    not torch._inductor.config.fx_graph_cache, reason="Inductor's FX graph cache is off"
)
def test_a_cached_graph_is_not_reused_once_the_kernels_change(monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 5), torch.nn.ReLU())
    x = torch.randn(3, 8)

    def compile_once() -> dict:
        torch._dynamo.reset()
        counters.clear()
        with torch.no_grad():
            torch.testing.assert_close(compile_module(model)(x), model(x))
        return dict(counters["inductor"])

    compile_once()  # written to the cache, if it was not there
    assert compile_once().get("fxgraph_cache_hit") == 1
    changed = f"changed-{uuid.uuid4()}"  # a digest no earlier run cached a graph under
    monkeypatch.setattr(KernelsKey, "uuid", lambda self: changed)
    again = compile_once()
    assert again.get("fxgraph_cache_miss") == 1 and not again.get("fxgraph_cache_hit")
    torch._dynamo.reset()
