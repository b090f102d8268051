import onnx


def test_exports_have_symbolic_batch_and_sequence(exported):
    for kind, want in (("bert", ["batch", "sequence"]), ("vit", ["batch", 3, 32, 32])):
        m = onnx.load(exported(kind), load_external_data=False)
        dims = [d.dim_param or d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim]
        assert dims == want, (kind, dims)
