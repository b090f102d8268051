"""The CLI's summary names a dynamic axis by its inputs' names and dims, in words."""

from opswap.cli.run import _where


def test_an_axis_is_named_by_its_inputs_and_dims():
    axis = {"name": "seq", "inputs": ["input 0 dim 1", "input 1 dim 1"]}
    assert _where(axis, ["input_ids", "attention_mask"]) == "dim 1 of input_ids and attention_mask"
    image = {"name": "dim0_2", "inputs": ["input 0 dim 2", "input 0 dim 3"]}
    assert _where(image, ["x"]) == "dim 2 of x; dim 3 of x"
    assert _where({"inputs": ["input 3 dim 0"]}, ["x"]) == "dim 0 of input 3"


def test_sites_skipped_for_one_reason_are_one_line_counted():
    from opswap.cli.render import skipped_lines
    from opswap.rules.base import Skipped

    why = "predicted slower on cpu: the Triton kernel runs on CUDA"
    lines = skipped_lines(
        [Skipped("norm.layer_norm", f"layer_norm_{i}", why) for i in range(5)]
        + [Skipped("softmax.softmax", "log_softmax", why)]
    )
    assert lines == [
        f"norm.layer_norm at 5 sites (layer_norm_0, ...): {why}",
        f"softmax.softmax at log_softmax: {why}",
    ]


def test_a_decoder_run_says_where_generation_goes():
    from opswap.cli.run import generation_note

    assert "StaticDecoder" in generation_note("hf:llama")
    assert "no KV cache" in generation_note("hf:gpt2")
    assert generation_note("hf:bert") is None and generation_note("zoo:resnet") is None
