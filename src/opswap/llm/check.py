"""The hand-written decoder judged by the same verification as the graph-rewrite route.

`verify_decoder(model, decoder, input_ids)` runs greedy decoding twice from each prompt: by
`decoder` (a StaticDecoder: its own prefill, cache and step, on the CPU or with CUDA graphs,
as `generate` runs them) and by the transformers model itself (a full forward per new
token, no cache: the reference). The output compared is the logits of every new token,
[B, n, vocab]: the decoder's must match the model's within the tolerance, and since each
side feeds back its own argmax, a token the decoder chose differently shows at once as
logits far apart. The verdict is opswap.verify's (`Verification`), on the prompt given and
on fresh prompts of the same shape (and of the other shapes in `variants`), with the
logits judged as class scores: their top-1 agreement over every row is held to the
tolerance too. So the two routes (docs/two-routes.md) answer to one definition of
"the numbers still match".
"""

from __future__ import annotations

from typing import Any

import torch

from opswap.llm.decode import StaticDecoder
from opswap.llm.static_cache import DecodeError
from opswap.verify.outputs import Verification, verify
from opswap.verify.tolerance import Tolerance


def verify_decoder(
    model: Any,
    decoder: StaticDecoder,
    input_ids: torch.Tensor,
    max_new_tokens: int = 8,
    *,
    samples: int = 3,
    tolerance: Tolerance | str | None = None,
    seed: int = 0,
    variants: tuple = (),
) -> Verification:
    """Greedy decoding of `max_new_tokens` tokens by `decoder` against `model` (the
    transformers causal LM it was built from), on `input_ids` and `samples` - 1 fresh
    prompts like it (and one like each (label, (ids,)) of `variants`); `tolerance` as
    opswap.verify takes it (default: exact, which allows the rounding of the model's
    dtype). The user's model is neither changed nor left in another mode."""
    n = int(max_new_tokens)
    device, dtype = decoder.device, decoder.dtype

    def reference(ids: torch.Tensor) -> dict[str, torch.Tensor]:
        seq = ids.to(device)
        out = []
        for _ in range(n):
            logits = model(input_ids=seq, use_cache=False).logits[:, -1]
            out.append(logits.float())
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], 1)
        return {"logits": torch.stack(out, 1)}

    def candidate(ids: torch.Tensor) -> dict[str, torch.Tensor]:
        _, prefill, steps = decoder.generate_with_logits(ids.to(device), n)
        return {"logits": torch.cat([prefill[:, -1:], steps], 1).float()}

    first = next(iter(model.parameters()), None)
    if first is not None and (first.device != device or first.dtype != dtype):
        raise DecodeError(
            f"the model runs in {first.dtype} on {first.device} and the decoder in {dtype} on "
            f"{device}; verify the decoder against the model in the decoder's dtype and device."
        )
    return verify(
        reference,
        candidate,
        (input_ids,),
        samples=samples,
        tolerance=tolerance,
        seed=seed,
        variants=variants,
    )
