"""The teacher-forced GRPO loss on a tiny random Llama."""

import pytest
import torch

from agentrl.train.loss import grpo_loss, token_logprobs


@pytest.fixture
def batch(tiny_model):
    torch.manual_seed(0)
    ids = torch.randint(5, 1000, (3, 12))
    attn = torch.ones_like(ids)
    attn[2, 9:] = 0  # right padding
    mask = torch.zeros_like(ids)
    mask[0, 4:7] = 1
    mask[1, 2:4] = 1
    mask[1, 8:11] = 1
    mask[2, 5:9] = 1
    adv = torch.tensor([1.5, -0.5, -1.0])
    return ids, attn, mask, adv


def test_token_logprobs_match_a_direct_forward(tiny_model, batch):
    ids, attn, _, _ = batch
    with torch.no_grad():
        got = token_logprobs(tiny_model, ids, attn, chunk=5)
        ref = torch.log_softmax(tiny_model(input_ids=ids, attention_mask=attn).logits.float(), -1)
    expected = ref[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1) * attn[:, 1:]
    assert got.shape == ids.shape and torch.all(got[:, 0] == 0)
    assert torch.allclose(got[:, 1:], expected, atol=1e-5)


@pytest.mark.parametrize("agg", ["seq-sum", "token-mean", "seq-mean-token-mean"])
def test_loss_matches_direct_computation(agg):
    logp = torch.tensor([[0.0, -1.0, -2.0, -3.0], [0.0, -0.5, -0.25, -4.0]])
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1]])
    adv = torch.tensor([2.0, -1.0])
    s0, s1 = -3.0, -4.25  # masked sums
    expected = {
        "seq-sum": -(2 * s0 - 1 * s1) / 2,
        "token-mean": -(2 * s0 - 1 * s1) / 4,
        "seq-mean-token-mean": -(2 * s0 / 2 - 1 * s1 / 2) / 2,
    }[agg]
    assert grpo_loss(logp, mask, adv, agg).item() == pytest.approx(expected)


def test_non_action_tokens_get_exactly_zero_gradient(batch):
    _, _, mask, adv = batch
    logp = torch.randn(mask.shape, requires_grad=True)
    grpo_loss(logp, mask, adv, "token-mean").backward()
    assert torch.all(logp.grad[mask == 0] == 0)
    assert torch.all(logp.grad[mask == 1] != 0)


@pytest.mark.parametrize("agg", ["seq-sum", "token-mean", "seq-mean-token-mean"])
def test_micro_batches_give_the_full_batch_gradient(tiny_model, batch, agg):
    ids, attn, mask, adv = batch
    params = [p for p in tiny_model.parameters() if p.requires_grad]

    def grads(slices):
        tiny_model.zero_grad()
        for sl in slices:
            lp = token_logprobs(tiny_model, ids[sl], attn[sl], chunk=4)
            grpo_loss(lp, mask[sl], adv[sl], agg, n_total=3, tokens_total=int(mask.sum())).backward()
        return [p.grad.clone() for p in params]

    full = grads([slice(0, 3)])
    micro = grads([slice(0, 1), slice(1, 3)])
    tiny_model.zero_grad()
    for a, b in zip(full, micro):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)


def test_unknown_aggregation():
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        grpo_loss(torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1), "mean")
