import pytest
import torch

from agentrl.errors import UserError
from agentrl.sampling.base import SamplingParams
from agentrl.sampling.hf import HFSampler


@pytest.fixture
def prompts(tokenizer):
    texts = ["Thought: short", "a somewhat longer prompt so that left padding matters here"]
    return [tokenizer(t, add_special_tokens=False).input_ids for t in texts]


def test_greedy_matches_transformers_generate(tiny_model, tokenizer, prompts):
    sampler = HFSampler(tiny_model, tokenizer)
    out = sampler.generate(prompts, SamplingParams(temperature=0, max_new_tokens=8))
    for p, c in zip(prompts, out):
        ref = tiny_model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=list(sampler.stop_ids),
                                  pad_token_id=tokenizer.pad_token_id)
        assert c.token_ids == ref[0, len(p):].tolist()
        assert c.prompt_ids == p


def test_logprobs_equal_teacher_forced(tiny_model, tokenizer, prompts):
    sampler = HFSampler(tiny_model, tokenizer)
    params = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=6)
    for p, c in zip(prompts, sampler.generate(prompts, params, seeds=[1, 2])):
        with torch.no_grad():
            logp = torch.log_softmax(tiny_model(torch.tensor([p + c.token_ids])).logits[0].float(), -1)
        expected = [logp[len(p) - 1 + j, t].item() for j, t in enumerate(c.token_ids)]
        assert c.logprobs == pytest.approx(expected, abs=1e-4)


def test_seeds_reproduce_a_row_whatever_the_batch(tiny_model, tokenizer, prompts):
    sampler = HFSampler(tiny_model, tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=10)
    both = sampler.generate(prompts, params, seeds=[11, 22])
    alone = sampler.generate(prompts[1:], params, seeds=[22])
    assert both[1].token_ids == alone[0].token_ids
    other = sampler.generate(prompts[1:], params, seeds=[23])
    assert other[0].token_ids != alone[0].token_ids


def test_batch_size_chunks_do_not_change_results(tiny_model, tokenizer, prompts):
    params = SamplingParams(temperature=1.0, max_new_tokens=5)
    big = HFSampler(tiny_model, tokenizer, batch_size=8).generate(prompts * 2, params, seeds=[1, 2, 3, 4])
    small = HFSampler(tiny_model, tokenizer, batch_size=1).generate(prompts * 2, params, seeds=[1, 2, 3, 4])
    assert [c.token_ids for c in big] == [c.token_ids for c in small]


def test_stop_token_ends_a_row_and_others_continue(tiny_model, tokenizer, prompts):
    sampler = HFSampler(tiny_model, tokenizer)
    params = SamplingParams(temperature=0, max_new_tokens=6)
    first = sampler.generate(prompts, params)
    stop = first[0].token_ids[-1]
    k = first[0].token_ids.index(stop)  # row 0 now stops at the first occurrence of its last token
    sampler.stop_ids = {stop}
    out = sampler.generate(prompts, params)
    assert out[0].finish_reason == "stop" and out[0].token_ids == first[0].token_ids[: k + 1]
    if stop not in first[1].token_ids:
        assert out[1].finish_reason == "length" and out[1].token_ids == first[1].token_ids


def test_peft_adapter_is_applied(tiny_model, tokenizer, prompts, tmp_path):
    from peft import LoraConfig, get_peft_model

    import copy

    torch.manual_seed(1)
    peft_model = get_peft_model(copy.deepcopy(tiny_model), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "adapter")
    params = SamplingParams(temperature=0, max_new_tokens=6)
    base = HFSampler(copy.deepcopy(tiny_model), tokenizer).generate(prompts, params)
    sampler = HFSampler(copy.deepcopy(tiny_model), tokenizer, adapter=str(tmp_path / "adapter"))
    adapted = sampler.generate(prompts, params)
    with torch.no_grad():
        p = prompts[0]
        ref = torch.log_softmax(peft_model(torch.tensor([p + adapted[0].token_ids])).logits[0].float(), -1)
    assert adapted[0].logprobs[0] == pytest.approx(ref[len(p) - 1, adapted[0].token_ids[0]].item(), abs=1e-4)
    assert [c.logprobs for c in adapted] != [c.logprobs for c in base]
    assert sampler.adapter_version == 0


def test_bad_adapter_dirs_are_user_errors(tiny_model, tokenizer, tmp_path):
    with pytest.raises(UserError, match="not a PEFT adapter"):
        HFSampler(tiny_model, tokenizer, adapter=str(tmp_path))


def test_kv_reuse_across_turns_gives_the_same_samples(tiny_model, tokenizer, prompts):
    """Multi-turn: the second call continues the first; reusing the cache must not change results."""
    params = SamplingParams(temperature=1.0, max_new_tokens=5)
    obs = tokenizer("an observation of some length", add_special_tokens=False).input_ids
    results = {}
    for reuse in (False, True):
        sampler = HFSampler(tiny_model, tokenizer)
        keys = ["a", "b"] if reuse else None
        first = sampler.generate(prompts, params, seeds=[1, 2], keys=keys)
        second_prompts = [p + c.token_ids + obs[: 3 + 4 * i] for i, (p, c) in enumerate(zip(prompts, first))]
        second = sampler.generate(second_prompts, params, seeds=[3, 4], keys=keys)
        results[reuse] = (first, second)
        if reuse:
            assert sampler.reused_tokens == sum(len(p) + len(c.token_ids) - 1 for p, c in zip(prompts, first))
            assert set(sampler._kv) == {"a", "b"}
            third = sampler.generate(second_prompts[:1], params, seeds=[5], keys=["a"])
            assert set(sampler._kv) == {"a"} and set(sampler._kv_older) == {"b"}  # "b" may be the other wave
            assert third[0].prompt_ids == second_prompts[0]
            sampler.generate(second_prompts[:1], params, seeds=[5], keys=["a"])
            assert set(sampler._kv) == {"a"} and not sampler._kv_older  # "b" missed two calls: dropped
    for (f0, s0), (f1, s1) in [(results[False], results[True])]:
        for a, b in zip(f0 + s0, f1 + s1):
            assert a.token_ids == b.token_ids
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_two_waves_taking_turns_keep_their_caches(tiny_model, tokenizer, prompts):
    """The rollout alternates two waves of trajectories: each wave's next turn reuses its cache."""
    params = SamplingParams(temperature=1.0, max_new_tokens=4)
    obs = tokenizer("an observation", add_special_tokens=False).input_ids
    sampler = HFSampler(tiny_model, tokenizer)
    a1 = sampler.generate(prompts[:1], params, seeds=[1], keys=["a"])[0]
    b1 = sampler.generate(prompts[1:], params, seeds=[2], keys=["b"])[0]
    before = sampler.reused_tokens
    sampler.generate([prompts[0] + a1.token_ids + obs], params, seeds=[3], keys=["a"])
    sampler.generate([prompts[1] + b1.token_ids + obs], params, seeds=[4], keys=["b"])
    assert sampler.reused_tokens - before == len(prompts[0]) + len(a1.token_ids) - 1 + len(prompts[1]) + len(b1.token_ids) - 1


def test_identical_prompts_are_prefilled_once(tiny_model, tokenizer, prompts):
    sampler = HFSampler(tiny_model, tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=4)
    group = sampler.generate([prompts[1]] * 3 + [prompts[0]], params, seeds=[1, 2, 3, 4])
    assert sampler.prefill_tokens == len(prompts[1]) + len(prompts[0])
    alone = HFSampler(tiny_model, tokenizer).generate([prompts[1]], params, seeds=[2])
    assert group[1].token_ids == alone[0].token_ids
    assert group[1].logprobs == pytest.approx(alone[0].logprobs, abs=1e-4)


def test_rows_of_unequal_lengths_batched_with_pads_sample_as_alone(tiny_model, tokenizer):
    """Prefill batches rows whose new tokens differ in length (pads between each row's cached
    prefix and its new tokens, masked out): every row must sample exactly what it samples alone,
    fresh prompts and continued ones (different cached lengths) alike."""
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    texts = ["you are in the middle of a room", "you are in the middle of a big room", "you see a desk 1 and a bed 1 here"]
    fresh = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    assert len({len(p) for p in fresh}) > 1
    obs = tokenizer("you arrive at desk 1 and see a lamp", add_special_tokens=False).input_ids
    batched = HFSampler(tiny_model, tokenizer)
    first = batched.generate(fresh, params, seeds=[1, 2, 3], keys=[0, 1, 2])
    assert batched.prefill_pad_tokens > 0  # the fresh rows shared a bucket
    turn2 = [p + c.token_ids + obs[: len(obs) - i] for i, (p, c) in enumerate(zip(fresh, first))]
    pads = batched.prefill_pad_tokens
    second = batched.generate(turn2, params, seeds=[4, 5, 6], keys=[0, 1, 2])
    assert batched.prefill_pad_tokens > pads and batched.reused_tokens > 0  # continued rows, padded, cache reused
    for i in range(3):
        alone = HFSampler(tiny_model, tokenizer)
        a1 = alone.generate([fresh[i]], params, seeds=[i + 1])[0]
        a2 = alone.generate([turn2[i]], params, seeds=[i + 4])[0]
        assert (a1.token_ids, a2.token_ids) == (first[i].token_ids, second[i].token_ids)
        assert a1.logprobs + a2.logprobs == pytest.approx(first[i].logprobs + second[i].logprobs, abs=1e-4)
        assert alone.prefill_pad_tokens == 0


def test_length_buckets_bound_the_padding():
    from agentrl.sampling.hf import _length_buckets

    lengths = {0: 10, 1: 11, 2: 12, 3: 40, 4: 41, 5: 200}
    buckets = _length_buckets(sorted(lengths, key=lengths.get), lengths.get)
    assert buckets == [[0, 1, 2], [3, 4], [5]]
    for b in buckets:
        real = sum(lengths[i] for i in b)
        assert len(b) * max(lengths[i] for i in b) - real <= 0.25 * real
