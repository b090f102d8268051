"""opswap.llm.sampling against hand-computed distributions: temperature, top-k, top-p,
min-p and the repetition penalty; greedy; seeded draws the same alone and in a batch;
log-probabilities of the model's raw distribution; one-sentence errors."""

from __future__ import annotations

import math

import pytest
import torch

from opswap.llm import SamplingError, SamplingParams
from opswap.llm.sampling import Sampler, apply_penalty, make_generator, sampling_probs

#: probabilities 0.5, 0.3, 0.15, 0.05 as logits
LOGITS = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()


# small ops on 2 threads stall whenever another process holds a core (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _p(**kw):
    return SamplingParams(**kw)


def test_temperature_scales_the_logits():
    x = torch.tensor([1.0, 2.0, 4.0])
    got = sampling_probs(x, _p(temperature=0.5), [])
    assert torch.allclose(got, (x / 0.5).softmax(-1))


def test_top_k_keeps_the_k_most_likely():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 0.0])
    got = sampling_probs(x, _p(top_k=2), [])
    want = torch.zeros(5)
    want[2:4] = torch.tensor([3.0, 4.0]).softmax(-1)
    assert torch.allclose(got, want)


@pytest.mark.parametrize(
    "top_p, kept", [(0.5, [0]), (0.8, [0, 1]), (0.81, [0, 1, 2]), (1.0, [0, 1, 2, 3])]
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    got = sampling_probs(LOGITS, _p(top_p=top_p), [])
    full = torch.tensor([0.5, 0.3, 0.15, 0.05])
    want = torch.zeros(4)
    want[kept] = full[kept] / full[kept].sum()
    assert torch.allclose(got, want, atol=1e-6)


def test_min_p_drops_tokens_below_a_share_of_the_most_likely():
    got = sampling_probs(LOGITS, _p(min_p=0.2), [])  # threshold 0.1: 0.05 goes
    want = torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95
    assert torch.allclose(got, want, atol=1e-6)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    x = torch.tensor([2.0, -1.0, 0.5, 3.0])
    got = apply_penalty(x, [0, 1, 1], 2.0)
    assert torch.equal(got, torch.tensor([1.0, -2.0, 0.5, 3.0]))
    assert torch.equal(x, torch.tensor([2.0, -1.0, 0.5, 3.0]))  # the input is not changed
    # greedy sees the penalty: token 0 (3.0 -> 1.5) loses to token 1 (2.0)
    picks = Sampler()(
        torch.tensor([[3.0, 2.0, 0.0]]), [_p(temperature=0, repetition_penalty=2.0)], [[0]], [None]
    )
    assert picks[0].token == 1


def test_greedy_puts_everything_on_the_penalised_argmax():
    got = sampling_probs(
        torch.tensor([3.0, 2.0, 0.0]), _p(temperature=0, repetition_penalty=2.0), [0]
    )
    assert torch.equal(got, torch.tensor([0.0, 1.0, 0.0]))


def test_greedy_is_the_argmax_and_draws_stay_in_the_kept_set():
    logits = torch.randn(3, 37, generator=torch.Generator().manual_seed(0))
    params = [_p(temperature=0), _p(top_k=3, seed=1), _p(top_p=0.3, seed=2)]
    gens = [make_generator(p, torch.device("cpu")) for p in params]
    for _ in range(20):
        picks = Sampler()(logits, params, [[], [], []], gens)
        assert picks[0].token == int(logits[0].argmax())
        assert picks[1].token in logits[1].topk(3).indices.tolist()
        assert sampling_probs(logits[2], params[2], [])[picks[2].token] > 0


def test_a_seeded_request_draws_the_same_alone_and_in_a_batch():
    g = torch.Generator().manual_seed(3)
    steps = [torch.randn(4, 50, generator=g) for _ in range(8)]
    mine = _p(temperature=0.9, top_p=0.9, seed=42)
    others = [_p(temperature=1.2), _p(temperature=0.7, seed=7), _p(temperature=0)]

    alone_gen = make_generator(mine, torch.device("cpu"))
    alone = [Sampler()(s[2:3], [mine], [[]], [alone_gen])[0].token for s in steps]
    gens = [make_generator(p, torch.device("cpu")) for p in [others[0], others[1], mine, others[2]]]
    params = [others[0], others[1], mine, others[2]]
    batched = [Sampler()(s, params, [[]] * 4, gens)[2].token for s in steps]
    assert alone == batched
    again_gen = make_generator(mine, torch.device("cpu"))
    assert alone == [Sampler()(s[2:3], [mine], [[]], [again_gen])[0].token for s in steps]


def test_logprobs_are_the_raw_models_and_top_is_sorted():
    x = torch.tensor([[1.0, 3.0, 2.0, -1.0, 0.5]])
    p = _p(temperature=0, repetition_penalty=2.0, logprobs=2)
    pick = Sampler()(x, [p], [[1]], [None])[0]
    lp = torch.log_softmax(x[0], -1)
    assert pick.logprob is not None
    assert pick.token == 2  # the penalty moved the choice: 3.0 -> 1.5 < 2.0
    assert math.isclose(pick.logprob.logprob, float(lp[2]), rel_tol=1e-6)
    assert [t for t, _ in pick.logprob.top] == [1, 2]  # raw ranking, before the penalty
    assert math.isclose(pick.logprob.top[0][1], float(lp[1]), rel_tol=1e-6)
    none = Sampler()(x, [_p(temperature=0)], [[]], [None])[0]
    assert none.logprob is None


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"stop": [""]}, "a stop string must not be empty"),
        ({"logprobs": 21}, "logprobs must be None or 0 to 20"),
    ],
)
def test_bad_params_are_refused_in_one_sentence(kw, words):
    with pytest.raises(SamplingError, match=words) as e:
        SamplingParams(**kw)
    assert str(e.value).count(". ") == 0 and str(e.value).endswith(".")


def test_a_single_stop_string_is_a_list_of_one():
    assert SamplingParams(stop="END").stop == ("END",)
