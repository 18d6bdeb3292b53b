"""Teacher-forced, action-masked GRPO loss.

`token_logprobs` runs one forward pass over the exact token ids a trajectory was sampled with
and returns log p(token t | tokens < t) at every position. `grpo_loss` weights the log-probs
of action tokens (action_mask == 1) by the trajectory's (or the step's) advantage; prompt and observation
tokens get exactly zero gradient.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from agentrl.config import LOSS_AGGREGATIONS as AGGREGATIONS


def _chunk_logprobs(lm_head, hidden: torch.Tensor, targets: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
    logits = lm_head(hidden).float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if allowed is None:
        return logp
    # constrained positions (admissible actions, sampling/constraint.py): the softmax renormalised over the
    # allowed ids, as the sampler drew them: logit(target) - logsumexp(logits of the allowed ids)
    some = allowed >= 0
    picked = logits.gather(-1, allowed.clamp(min=0)).masked_fill(~some, float("-inf"))
    constrained = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(picked, dim=-1)
    return torch.where(some.any(dim=-1), constrained, logp)


def chunked_logprobs(lm_head, hidden: torch.Tensor, targets: torch.Tensor, chunk: int = 512,
                     allowed: torch.Tensor | None = None) -> torch.Tensor:
    """[R, W] log p(targets) from final hidden states [R, W, h]: the vocabulary projection in chunks of
    `chunk` positions, recomputed in backward, so memory stays O(chunk x vocab), not O(W x vocab).
    `allowed` [R, W, A] (-1 padded): where a position lists ids, the log-prob is renormalised over them."""
    pieces = []
    for start in range(0, hidden.shape[1], chunk):
        h, y = hidden[:, start : start + chunk], targets[:, start : start + chunk]
        a = None if allowed is None else allowed[:, start : start + chunk]
        if torch.is_grad_enabled():
            pieces.append(checkpoint(_chunk_logprobs, lm_head, h, y, a, use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(lm_head, h, y, a))
    return torch.cat(pieces, dim=1) if pieces else hidden.new_zeros((hidden.shape[0], 0))


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """[N, T] log-probs; entry t = log p(input_ids[:, t] | input_ids[:, :t]); entry 0 = 0.

    Rows are right-padded (attention_mask 0 on the pad). The vocabulary projection runs in
    chunks of `chunk` positions (recomputed in backward) so memory stays O(chunk x vocab)
    instead of O(T x vocab) for long multi-turn trajectories.
    """
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, logits_to_keep=1)
    hidden = out.hidden_states[-1][:, :-1]  # final-norm hidden state at t predicts token t+1
    logp = chunked_logprobs(model.get_output_embeddings(), hidden, input_ids[:, 1:], chunk)
    logp = logp * attention_mask[:, 1:].to(logp.dtype)
    return torch.cat([logp.new_zeros((input_ids.shape[0], 1)), logp], dim=1)


def grpo_loss(
    token_logp: torch.Tensor,
    action_mask: torch.Tensor,
    advantages: torch.Tensor,
    agg: str = "seq-sum",
    n_total: int | None = None,
    tokens_total: int | None = None,
) -> torch.Tensor:
    """Policy-gradient loss of a (micro-)batch.

    `advantages`: [N] (one per trajectory: GRPO) or [N, T] (one per token: GiGPO's per-step
    advantage on each step's reply tokens); A_it below, A_i broadcast over t for [N].
    seq-sum (paper):        -(1/N) sum_i sum_{t in actions_i} A_it logp_it
    token-mean:             -(sum_i sum_t m_it A_it logp_it) / sum_i sum_t m_it
    seq-mean-token-mean:    -(1/N) sum_i (sum_t m_it A_it logp_it) / sum_t m_it
    For micro-batches pass the whole batch's N (`n_total`) and action-token count
    (`tokens_total`): the summed micro-batch gradients then equal the full batch's.
    """
    mask = action_mask.to(token_logp.dtype)
    adv = advantages.to(token_logp.dtype)
    if adv.dim() == 2:  # per token: weight before summing (masked entries contribute exactly 0, and 0 gradient)
        weighted = (token_logp * mask * adv).sum(dim=1)
    else:
        weighted = adv * (token_logp * mask).sum(dim=1)
    return -aggregate(weighted, mask, agg, n_total, tokens_total)


def aggregate(per_seq: torch.Tensor, mask: torch.Tensor, agg: str, n_total: float | None = None,
              tokens_total: float | None = None) -> torch.Tensor:
    """Per-sequence sums over action tokens [N] -> the batch's term, as `loss_agg` says: seq-sum
    sum / N, token-mean sum / action tokens, seq-mean-token-mean per-sequence token mean / N (the
    whole batch's N and token count when given: micro-batches)."""
    if agg == "seq-sum":
        return per_seq.sum() / (n_total or mask.shape[0])
    if agg == "token-mean":
        return per_seq.sum() / max(1, tokens_total or float(mask.sum()))
    if agg == "seq-mean-token-mean":
        return (per_seq / mask.sum(dim=1).clamp(min=1)).sum() / (n_total or mask.shape[0])
    raise ValueError(f"unknown loss aggregation {agg!r}; choose one of {', '.join(AGGREGATIONS)}")


def clipped_loss(
    token_logp: torch.Tensor,
    old_logp: torch.Tensor,
    action_mask: torch.Tensor,
    advantages: torch.Tensor,
    clip: float,
    agg: str = "seq-sum",
    n_total: float | None = None,
    tokens_total: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate in place of A logp, aggregated as `grpo_loss`: per action token
    r = exp(logp - logp_old), term = min(r A, clip(r, 1 - eps, 1 + eps) A). Where logp_old is the
    current policy (the first minibatch of an update) r = 1 and the gradient is exactly
    `grpo_loss`'s (d r / d logp = 1). Returns (loss, share of action tokens whose ratio was clipped)."""
    mask = action_mask.to(token_logp.dtype)
    adv = advantages.to(token_logp.dtype)
    if adv.dim() == 1:
        adv = adv[:, None].expand_as(token_logp)
    ratio = torch.exp((token_logp - old_logp) * mask)  # masked positions: r = 1, weight 0
    term = torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    weighted = (term * mask).sum(dim=1)
    clipped = (((ratio < 1 - clip) | (ratio > 1 + clip)).to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1)
    return -aggregate(weighted, mask, agg, n_total, tokens_total), clipped


def kl_to_reference(token_logp: torch.Tensor, ref_logp: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """Sum over action tokens of the k3 estimator of KL(policy || reference) (Schulman's
    low-variance estimator, verl's low_var_kl): exp(ref - logp) - (ref - logp) - 1 >= 0."""
    mask = action_mask.to(token_logp.dtype)
    d = (ref_logp - token_logp) * mask
    return ((torch.exp(d) - d - 1) * mask).sum()


def kl_penalty(
    token_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    action_mask: torch.Tensor,
    agg: str = "seq-sum",
    n_total: float | None = None,
    tokens_total: float | None = None,
) -> torch.Tensor:
    """The k3 KL to the reference aggregated exactly as `grpo_loss` aggregates A logp (verl's
    agg_loss of its kl_loss): each action token's KL gets the weight its policy term gets per unit
    of advantage, so the coefficient on it is per action token, the field's unit
    (`learner.kl_unit: per-token`). seq-sum: sum / N; token-mean: sum / tokens;
    seq-mean-token-mean: per-sequence token mean, then / N."""
    mask = action_mask.to(token_logp.dtype)
    d = (ref_logp - token_logp) * mask
    return aggregate(((torch.exp(d) - d - 1) * mask).sum(dim=1), mask, agg, n_total, tokens_total)


def field_kl_coef(kl_coef: float, agg: str, n_total: float, tokens_total: float, kl_tokens: int,
                  seq_tokens: list[int]) -> float:
    """`learner.kl_unit: trained-mean`'s beta in the field's unit: the per-token coefficient a
    loss with the KL aggregated as its policy term (`kl_penalty`) would need for the same update.
    The trained-mean term gives each KL token the weight beta / kl_tokens (the trained action
    tokens of the step); the policy term gives each token, per unit of A, 1 / N (seq-sum),
    1 / tokens (token-mean) or 1 / (N T_i) (seq-mean-token-mean, T_i = sequence i's action
    tokens). Their ratio: beta N / kl_tokens, beta tokens / kl_tokens, and beta N T_i / kl_tokens,
    here averaged over the step's sequences (`seq_tokens`). `n_total` and `tokens_total` are the
    step's share of the batch's trajectories (A = 0 ones included) and action tokens."""
    kl_tokens = max(1, kl_tokens)
    if agg == "seq-sum":
        return kl_coef * n_total / kl_tokens
    if agg == "token-mean":
        return kl_coef * tokens_total / kl_tokens
    if agg == "seq-mean-token-mean":
        return kl_coef * n_total * sum(seq_tokens) / max(1, len(seq_tokens)) / kl_tokens
    raise ValueError(f"unknown loss aggregation {agg!r}; choose one of {', '.join(AGGREGATIONS)}")
