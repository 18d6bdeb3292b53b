"""Token sequences that begin alike: the split into groups with a shared prefix that saves the most
tokens. The hf sampler runs each group's prefix once per batch (`sampling.share_prefixes`, as vLLM's
prefix caching), and the learner forwards it once per micro-batch (`learner.share_prefixes`)."""

from __future__ import annotations


def common_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for k in range(n):
        if a[k] != b[k]:
            return k
    return n


def shared_prefixes(prompts: list[list[int]], min_tokens: int) -> list[tuple[list[int], int]]:
    """Groups of distinct prompts that begin with the same tokens, as (indices, shared length): the
    split that saves the most prefill tokens, (rows - 1) x shared length summed over groups. Sorted
    prompts put each group together; a run of them splits at its weakest common length wherever the
    two halves save more apart. A shared length stops one token short of the group's shortest prompt
    (each row's last position still runs, for its logits); shorter than `min_tokens`, no group."""
    order = sorted(range(len(prompts)), key=lambda i: prompts[i])
    common = [common_length(prompts[a], prompts[b]) for a, b in zip(order, order[1:])]

    def best(lo: int, hi: int) -> tuple[int, list[tuple[list[int], int]]]:  # order[lo:hi+1]
        if lo == hi:
            return 0, []
        members = order[lo:hi + 1]
        n = min(min(common[lo:hi]), min(len(prompts[i]) for i in members) - 1)
        whole = (n * (len(members) - 1), [(members, n)]) if n >= min_tokens else (0, [])
        cut = lo + min(range(hi - lo), key=lambda k: common[lo + k])  # split after the weakest link
        left, right = best(lo, cut), best(cut + 1, hi)
        apart = (left[0] + right[0], left[1] + right[1])
        return apart if apart[0] > whole[0] else whole

    return best(0, len(order) - 1)[1] if len(order) > 1 else []
