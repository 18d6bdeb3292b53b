"""The transformers sampler (the slot KV engine): exactness against transformers' own forward and
generate, reproducible rows, cache reuse equal to no reuse, the store's slots and budget, and the
same on tiny random models of three architectures (Llama, Qwen2 with biases, Mistral)."""

import copy

import pytest
import torch

from agentrl.errors import UserError
from agentrl.sampling.base import SamplingParams
from agentrl.sampling.hf import HFSampler, row_uniforms
from agentrl.sampling.compat import kv_bytes_per_token
from agentrl.sampling.kv import KVBudgetError, SlotStore
from scripted import rows


@pytest.fixture
def prompts(tokenizer):
    texts = ["Thought: short", "a somewhat longer prompt so that left padding matters here"]
    return [tokenizer(t, add_special_tokens=False).input_ids for t in texts]


def _tiny(kind: str, tokenizer):
    """A 2-layer random model of another architecture with the default vocabulary (GQA: 4 query, 2 KV heads)."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    if kind == "qwen2":  # q/k/v biases, untied head
        return Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False)).eval()
    return MistralForCausalLM(MistralConfig(**common, sliding_window=2048)).eval()


@pytest.fixture(params=["llama", "qwen2", "mistral"])
def arch_model(request, tiny_model, tokenizer):
    return tiny_model if request.param == "llama" else _tiny(request.param, tokenizer)


def _teacher_forced(model, prompt, ids):
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + ids])).logits[0].float(), -1)
    return [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(ids)]


def test_greedy_matches_transformers_generate(arch_model, tokenizer, prompts):
    sampler = HFSampler(arch_model, tokenizer)
    out = sampler.generate(rows(prompts), SamplingParams(temperature=0, max_new_tokens=8))
    for p, c in zip(prompts, out):
        ref = arch_model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=list(sampler.stop_ids),
                                  pad_token_id=tokenizer.pad_token_id)
        assert c.token_ids == ref[0, len(p):].tolist()
        assert c.prompt_ids == p


def test_logprobs_equal_teacher_forced(arch_model, tokenizer, prompts):
    sampler = HFSampler(arch_model, tokenizer)
    params = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=6)
    for p, c in zip(prompts, sampler.generate(rows(prompts, seeds=[1, 2]), params)):
        assert c.logprobs == pytest.approx(_teacher_forced(arch_model, p, c.token_ids), abs=1e-4)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_multi_turn_reuse_is_exact_and_equals_no_reuse(arch_model, tokenizer, prompts):
    """Turn 2 continues turn 1 (reply + an observation of a different length per row): with keys
    the cached prefix is reused. Turn 3 is a prompt.history window, the opening then turn 2's reply
    only (turn 1 left out): not an extension of what the slot holds, so only the common prefix is
    reused and the rest re-run. Tokens and log-probs equal the run without keys and a
    teacher-forced forward."""
    params = SamplingParams(temperature=1.0, max_new_tokens=5)
    obs = tokenizer("an observation of some length", add_special_tokens=False).input_ids
    results = {}
    for reuse in (False, True):
        sampler = HFSampler(arch_model, tokenizer)
        keys = ["a", "b"] if reuse else None
        first = sampler.generate(rows(prompts, seeds=[1, 2], keys=keys), params)
        second_prompts = [p + c.token_ids + obs[: 3 + 4 * i] for i, (p, c) in enumerate(zip(prompts, first))]
        second = sampler.generate(rows(second_prompts, seeds=[3, 4], keys=keys), params)
        if reuse:
            assert sampler.reused_tokens == sum(len(p) + len(c.token_ids) - 1 for p, c in zip(prompts, first))
            assert sampler.store.live == 2
            for p, c in zip(second_prompts, second):
                assert c.logprobs == pytest.approx(_teacher_forced(arch_model, p, c.token_ids), abs=1e-4)
        else:
            assert sampler.store.live == 0  # unnamed rows hold nothing after their call
        window = [p + c.token_ids + obs[:2] for p, c in zip(prompts, second)]
        held = [p + c.token_ids[:-1] for p, c in zip(second_prompts, second)]  # the last token's keys are not computed
        before = sampler.reused_tokens
        third = sampler.generate(rows(window, seeds=[5, 6], keys=keys), params)
        if reuse:  # the opening at least (more only where two replies happen to start alike)
            assert sampler.reused_tokens - before == sum(_common_prefix(h, w) for h, w in zip(held, window))
            assert sampler.reused_tokens - before >= sum(len(p) for p in prompts)
            for p, c in zip(window, third):
                assert c.logprobs == pytest.approx(_teacher_forced(arch_model, p, c.token_ids), abs=1e-4)
        results[reuse] = first + second + third
    for a, b in zip(results[False], results[True]):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_seeds_reproduce_a_row_whatever_the_batch(arch_model, tokenizer, prompts):
    sampler = HFSampler(arch_model, tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=10)
    both = sampler.generate(rows(prompts, seeds=[11, 22]), params)
    alone = sampler.generate(rows(prompts[1:], seeds=[22]), params)
    assert both[1].token_ids == alone[0].token_ids
    other = sampler.generate(rows(prompts[1:], seeds=[23]), params)
    assert other[0].token_ids != alone[0].token_ids


def test_batch_size_chunks_do_not_change_results(tiny_model, tokenizer, prompts):
    params = SamplingParams(temperature=1.0, max_new_tokens=5)
    big = HFSampler(tiny_model, tokenizer, batch_size=8).generate(rows(prompts * 2, seeds=[1, 2, 3, 4]), params)
    small = HFSampler(tiny_model, tokenizer, batch_size=1).generate(rows(prompts * 2, seeds=[1, 2, 3, 4]), params)
    assert [c.token_ids for c in big] == [c.token_ids for c in small]


def test_sync_points_and_compaction_do_not_change_results(tiny_model, tokenizer, prompts):
    """Rows that stop early stay in the batch until a sync point, then leave it (gathered rows
    instead of a view): neither changes any row's tokens or log-probs."""
    params = SamplingParams(temperature=0, max_new_tokens=12)
    ref = HFSampler(tiny_model, tokenizer, sync_every=64).generate(rows(prompts * 3), params)
    stop = ref[0].token_ids[1]  # rows of prompt 0 now stop at their second token, the others run on
    for every in (1, 2, 64):
        sampler = HFSampler(tiny_model, tokenizer, sync_every=every)
        sampler.stop_ids = {stop}
        out = sampler.generate(rows(prompts * 3), params)
        for r, c in zip(ref, out):
            k = r.token_ids.index(stop) + 1 if stop in r.token_ids else len(r.token_ids)
            assert c.token_ids == r.token_ids[:k] and c.logprobs == pytest.approx(r.logprobs[:k], abs=1e-5)


def test_stop_token_ends_a_row_and_others_continue(tiny_model, tokenizer, prompts):
    sampler = HFSampler(tiny_model, tokenizer)
    params = SamplingParams(temperature=0, max_new_tokens=6)
    first = sampler.generate(rows(prompts), params)
    stop = first[0].token_ids[-1]
    k = first[0].token_ids.index(stop)  # row 0 now stops at the first occurrence of its last token
    sampler.stop_ids = {stop}
    out = sampler.generate(rows(prompts), params)
    assert out[0].finish_reason == "stop" and out[0].token_ids == first[0].token_ids[: k + 1]
    if stop not in first[1].token_ids:
        assert out[1].finish_reason == "length" and out[1].token_ids == first[1].token_ids


def test_peft_adapter_is_applied(tiny_model, tokenizer, prompts, tmp_path):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    peft_model = get_peft_model(copy.deepcopy(tiny_model), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "adapter")
    params = SamplingParams(temperature=0, max_new_tokens=6)
    base = HFSampler(copy.deepcopy(tiny_model), tokenizer).generate(rows(prompts), params)
    sampler = HFSampler(copy.deepcopy(tiny_model), tokenizer, adapter=str(tmp_path / "adapter"))
    adapted = sampler.generate(rows(prompts), params)
    assert adapted[0].logprobs == pytest.approx(_teacher_forced(peft_model, prompts[0], adapted[0].token_ids), abs=1e-4)
    assert [c.logprobs for c in adapted] != [c.logprobs for c in base]
    assert sampler.adapter_version == 0


def test_a_shared_model_keeps_its_own_attention(tiny_model, tokenizer, prompts):
    """The engine routes attention through its function only during its calls: a learner holding
    the same model object computes with transformers' attention before and after."""
    before = tiny_model.config._attn_implementation
    HFSampler(tiny_model, tokenizer).generate(rows(prompts), SamplingParams(temperature=0, max_new_tokens=3))
    assert tiny_model.config._attn_implementation == before != "agentrl_slots"


def test_bad_adapter_dirs_are_user_errors(tiny_model, tokenizer, tmp_path):
    with pytest.raises(UserError, match="not a PEFT adapter"):
        HFSampler(tiny_model, tokenizer, adapter=str(tmp_path))


def test_a_model_the_engine_cannot_serve_is_refused(tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(UserError, match="serves model types llama, qwen2, qwen3, mistral; this model is 'gpt2'") as e:
        HFSampler(model, tokenizer)
    assert "\n" not in str(e.value)


def test_a_sliding_window_caps_the_served_length(tokenizer):
    """Mistral's window equals full attention below its size: the sampler serves up to it (the rollout ends episodes there)."""
    assert HFSampler(_tiny("mistral", tokenizer), tokenizer).max_model_len == 2048


# ------------------------------------------------------------------ the store


def test_identical_prompts_are_prefilled_once(tiny_model, tokenizer, prompts):
    sampler = HFSampler(tiny_model, tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=4)
    group = sampler.generate(rows([prompts[1]] * 3 + [prompts[0]], seeds=[1, 2, 3, 4]), params)
    assert sampler.prefill_tokens == len(prompts[1]) + len(prompts[0])
    alone = HFSampler(tiny_model, tokenizer).generate(rows([prompts[1]], seeds=[2]), params)
    assert group[1].token_ids == alone[0].token_ids
    assert group[1].logprobs == pytest.approx(alone[0].logprobs, abs=1e-4)


def test_prompts_that_begin_alike_run_their_shared_prefix_once(tiny_model, tokenizer):
    """Fresh prompts of two families (a long shared opening each, then their own words): each
    family's opening runs once and is copied, and every row samples what it samples alone."""
    params = SamplingParams(temperature=1.0, max_new_tokens=5)
    ids = lambda t: tokenizer(t, add_special_tokens=False).input_ids  # noqa: E731
    opening = {"a": ids("you are an agent in a house. " * 6), "b": ids("clean the mug and put it in the cabinet. " * 5)}
    tails = [("a", "desk 1 is here"), ("b", "a sink"), ("a", "bed 1 and a lamp 2"), ("a", "ok"), ("b", "fridge 1")]
    prompts = [opening[f] + ids(t) for f, t in tails]
    shared = HFSampler(tiny_model, tokenizer)
    together = shared.generate(rows(prompts, seeds=[1, 2, 3, 4, 5]), params)
    assert shared.shared_prefix_tokens == 2 * len(opening["a"]) + len(opening["b"])
    assert shared.prefill_tokens == sum(map(len, prompts)) - shared.shared_prefix_tokens
    whole = HFSampler(tiny_model, tokenizer, share_prefixes=False)
    apart = whole.generate(rows(prompts, seeds=[1, 2, 3, 4, 5]), params)
    assert whole.shared_prefix_tokens == 0 and whole.prefill_tokens == sum(map(len, prompts))
    for i, p in enumerate(prompts):
        alone = HFSampler(tiny_model, tokenizer).generate(rows([p], seeds=[i + 1]), params)[0]
        assert together[i].token_ids == apart[i].token_ids == alone.token_ids
        assert together[i].logprobs == pytest.approx(alone.logprobs, abs=1e-5)


def test_shared_prefixes_choose_the_split_that_saves_most():
    from agentrl.sampling.prefixes import shared_prefixes

    sys_, ex1, ex2 = list(range(100, 120)), list(range(200, 260)), list(range(300, 340))
    prompts = [sys_ + ex1 + [1], sys_ + ex2 + [2], sys_ + ex1 + [3, 4], sys_ + ex2 + [5], sys_ + ex1 + [6]]
    groups = sorted((sorted(m), n) for m, n in shared_prefixes(prompts, 16))
    assert groups == [([0, 2, 4], 80), ([1, 3], 60)]  # apart: 2 x 80 + 60 saved, against 4 x 20 together
    # only the system message in common: one group of all
    assert shared_prefixes([sys_ + [3], sys_ + [1, 2], sys_ + [4, 5, 6]], 16) == [([1, 0, 2], 20)]
    # a prompt that is another's prefix: the shared part stops a token short of it (its last position runs)
    assert shared_prefixes([sys_, sys_ + [7, 8]], 16) == [([0, 1], 19)]
    # shorter than the minimum, or nothing in common: no group
    assert shared_prefixes([sys_[:10] + [1], sys_[:10] + [2]], 16) == []
    assert shared_prefixes([[1, 2, 3] * 10, [4, 5, 6] * 10], 16) == []
    assert shared_prefixes([sys_], 16) == []


def test_rows_of_unequal_lengths_batched_with_pads_sample_as_alone(tiny_model, tokenizer):
    """Prefill batches rows whose new tokens differ in length (pads first, never written nor
    attended): every row samples exactly what it samples alone, fresh and continued rows alike."""
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    texts = ["you are in the middle of a room", "you are in the middle of a big room", "you see a desk 1 and a bed 1 here"]
    fresh = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    assert len({len(p) for p in fresh}) > 1
    obs = tokenizer("you arrive at desk 1 and see a lamp", add_special_tokens=False).input_ids
    batched = HFSampler(tiny_model, tokenizer)
    first = batched.generate(rows(fresh, seeds=[1, 2, 3], keys=[0, 1, 2]), params)
    assert batched.prefill_pad_tokens > 0  # the fresh rows shared a bucket
    turn2 = [p + c.token_ids + obs[: len(obs) - i] for i, (p, c) in enumerate(zip(fresh, first))]
    pads = batched.prefill_pad_tokens
    second = batched.generate(rows(turn2, seeds=[4, 5, 6], keys=[0, 1, 2]), params)
    assert batched.prefill_pad_tokens > pads and batched.reused_tokens > 0  # continued rows, padded, cache reused
    for i in range(3):
        alone = HFSampler(tiny_model, tokenizer)
        a1 = alone.generate(rows([fresh[i]], seeds=[i + 1]), params)[0]
        a2 = alone.generate(rows([turn2[i]], seeds=[i + 4]), params)[0]
        assert (a1.token_ids, a2.token_ids) == (first[i].token_ids, second[i].token_ids)
        assert a1.logprobs + a2.logprobs == pytest.approx(first[i].logprobs + second[i].logprobs, abs=1e-4)
        assert alone.prefill_pad_tokens == 0


def test_released_slots_are_reused_and_the_store_stays_flat(tiny_model, tokenizer, prompts):
    """A long run of episodes that start and end: released slots are taken by the next episodes,
    so the store's size is that of the rows live at once, not of every episode ever run."""
    sampler = HFSampler(tiny_model, tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=4)
    obs = tokenizer("ok", add_special_tokens=False).input_ids
    sizes = []
    for episode in range(6):
        keys = [(episode, i) for i in range(4)]
        ids = [list(prompts[i % 2]) for i in range(4)]
        for turn in range(3):
            out = sampler.generate(rows(ids, seeds=[episode * 10 + turn] * 4, keys=keys), params)
            ids = [p + c.token_ids + obs for p, c in zip(ids, out)]
        assert sampler.store.live == 4 and sampler.store.slots == 4
        sizes.append(sampler.store.nbytes)
        sampler.release(keys[:2])  # two end; the other two end at the next episode's start
        assert sampler.store.live == 2
        sampler.release(keys[2:])
        assert sampler.store.live == 0 and sampler.store.nbytes == 0  # nothing live: memory given back
    assert len(set(sizes)) == 1


def test_a_batch_is_packed_into_consecutive_slots(tiny_model, tokenizer, prompts):
    """After rows in the middle end, the next call moves the live rows together, so decoding
    reads the store as a view; the moved rows continue exactly."""
    params = SamplingParams(temperature=1.0, max_new_tokens=4)
    obs = tokenizer("ok", add_special_tokens=False).input_ids
    sampler = HFSampler(tiny_model, tokenizer)
    sampler.stop_ids = set()  # no row stops mid-reply (that swaps slots too): only the packing moves rows
    keys = list(range(5))
    ids = [list(prompts[i % 2]) for i in range(5)]
    out = sampler.generate(rows(ids, seeds=list(range(5)), keys=keys), params)
    ids = [p + c.token_ids + obs for p, c in zip(ids, out)]
    sampler.release([1, 2])
    left = [0, 3, 4]
    second = sampler.generate(rows([ids[k] for k in left], seeds=[7, 8, 9], keys=left), params)
    packed = sorted(sampler.store.slot_of[k] for k in left)
    assert packed == list(range(packed[0], packed[0] + 3)) and sampler.store.moves == 1  # row 0 moved next to 3 and 4
    for k, c in zip(left, second):
        assert c.logprobs == pytest.approx(_teacher_forced(tiny_model, ids[k], c.token_ids), abs=1e-4)


def test_over_budget_the_store_drops_other_caches_then_refuses(tiny_model, tokenizer, prompts):
    """Under pressure the caches of rows not in the batch are dropped (re-run later: same tokens);
    a batch that alone cannot fit stops with one line naming the knobs."""
    params = SamplingParams(temperature=1.0, max_new_tokens=4)
    per_row = 128 * kv_bytes_per_token(tiny_model.config, torch.float32)  # one slot of 128 positions
    sampler = HFSampler(tiny_model, tokenizer, kv_budget_gb=2.5 * per_row / (1 << 30))
    a = sampler.generate(rows(prompts, seeds=[1, 2], keys=["a", "b"]), params)
    c = sampler.generate(rows([prompts[0]], seeds=[3], keys=["c"]), params)  # 3 slots do not fit: "a" is dropped
    assert sampler.store.dropped == 1 and "a" not in sampler.store.slot_of and sampler.store.nbytes <= 2.5 * per_row
    turn2 = prompts[0] + a[0].token_ids + prompts[1]
    again = sampler.generate(rows([turn2], seeds=[4], keys=["a"]), params)  # "a" re-runs its whole prompt
    fresh = HFSampler(tiny_model, tokenizer).generate(rows([turn2], seeds=[4]), params)
    assert again[0].token_ids == fresh[0].token_ids and c[0].token_ids
    with pytest.raises(KVBudgetError, match="over sampling.kv_budget_gb.*lower sampling.batch_size") as e:
        sampler.generate(rows(prompts * 2, seeds=[1, 2, 3, 4], keys=["w", "x", "y", "z"]), params)
    assert "\n" not in str(e.value)


def test_store_grows_one_layer_at_a_time_and_keeps_its_rows():
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=3)
    store = SlotStore(config, torch.float32, torch.device("cpu"), budget_bytes=None, grow_tokens=4)
    store.place(["x"], [3])
    store.storage.k[1][0, :, :3] = 7.0
    store.hold("x", [1, 2, 3])
    store.place(["x", "y"], [9, 2])  # more slots and more positions
    assert (store.slots, store.capacity) == (2, 12) and bool((store.storage.k[1][0, :, :3] == 7.0).all())
    with store.storage.pin(), pytest.raises(RuntimeError, match="under a running batch"):
        store.place(["z"], [20])  # a running batch's buffers are never reallocated
    assert (store.slots, store.capacity) == (2, 12)
    assert store.reusable("x", [1, 2, 3, 4]) == 3 and store.reusable("x", [9, 2, 3, 4]) == 0
    # the common prefix of a prompt that does not extend the held ids, at least one token left to run
    assert store.reusable("x", [1, 2, 9, 9]) == 2 and store.reusable("x", [1, 2, 3]) == 2 and store.reusable("x", [1]) == 0


def test_row_uniforms_are_a_function_of_seed_and_index_only():
    seeds = torch.tensor([0, 1, 2**40 + 5, 2**62 - 1])
    u = row_uniforms(seeds, 3)
    assert bool(((u > 0) & (u < 1)).all())
    assert torch.equal(u[2:3], row_uniforms(seeds[2:3], 3))  # alone or in a batch
    assert not torch.equal(u, row_uniforms(seeds, 4))
    # the values are pinned: a change of the noise source changes every seeded sample
    assert row_uniforms(torch.tensor([12345, 7]), 0).tolist() == pytest.approx([0.12284095453103738, 0.7086193114347186], abs=1e-15)
    many = row_uniforms(torch.arange(20000), 0)
    assert abs(many.mean().item() - 0.5) < 0.01 and abs(many.var().item() - 1 / 12) < 0.005


def test_length_buckets_bound_the_padding():
    from agentrl.sampling.hf import _length_buckets

    lengths = {0: 10, 1: 11, 2: 12, 3: 40, 4: 41, 5: 200}
    buckets = _length_buckets(sorted(lengths, key=lengths.get), lengths.get)
    assert buckets == [[0, 1, 2], [3, 4], [5]]
    for b in buckets:
        real = sum(lengths[i] for i in b)
        assert len(b) * max(lengths[i] for i in b) - real <= 0.25 * real


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_engine_equals_a_teacher_forced_forward(tiny_model, tokenizer, prompts):
    model = copy.deepcopy(tiny_model).cuda()
    sampler = HFSampler(model, tokenizer)
    out = sampler.generate(rows(prompts, seeds=[1, 2], keys=["a", "b"]), SamplingParams(temperature=1.0, max_new_tokens=6))
    for p, c in zip(prompts, out):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([p + c.token_ids], device="cuda")).logits[0].float(), -1)
        assert c.logprobs == pytest.approx([logp[len(p) - 1 + j, t].item() for j, t in enumerate(c.token_ids)], abs=1e-4)
    cpu = HFSampler(tiny_model, tokenizer).generate(rows(prompts, seeds=[1, 2]), SamplingParams(temperature=1.0, max_new_tokens=6))
    assert [c.token_ids for c in out] == [c.token_ids for c in cpu]  # the same noise on every device


# ---------------------------------------------------------------- prefill at bucketed shapes (sampling.prefill_buckets)


def _turns(sampler, fresh, obs, params):
    """Two turns of three rows whose new tokens differ in length at each turn (fresh, then continued)."""
    first = sampler.generate(rows(fresh, seeds=[1, 2, 3], keys=[0, 1, 2]), params)
    turn2 = [p + c.token_ids + obs[: len(obs) - 3 * i] for i, (p, c) in enumerate(zip(fresh, first))]
    return first + sampler.generate(rows(turn2, seeds=[4, 5, 6], keys=[0, 1, 2]), params)


@pytest.mark.parametrize("static", ["off", "on"])
def test_bucketed_prefill_shapes_change_no_token(arch_model, tokenizer, static):
    """`prefill_buckets` (on by default on CUDA, forced here) pads a prefill forward to a bucketed
    shape (padding rows after the real ones, more new tokens, a longer KV read) and packs rows of
    unequal length into fewer forwards: every row samples what it samples with exact shapes (fp32,
    three architectures), with the captured step's store (a scratch slot) and without."""
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    texts = ["you are in the middle of a room", "you are in the middle of a big room looking quickly around you",
             "you see a desk 1 and a bed 1 here, and on the desk 1 there is a lamp 1 and a pen 2 and a mug"]
    fresh = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    obs = tokenizer("you arrive at desk 1. on the desk 1, you see a lamp 1, a cd 2, a pencil 3 and a mug 1",
                    add_special_tokens=False).input_ids
    exact = HFSampler(arch_model, tokenizer, static_decode=static, prefill_buckets="off", share_prefixes=False)
    bucketed = HFSampler(arch_model, tokenizer, static_decode=static, prefill_buckets="on", share_prefixes=False)
    spans, forward = [], bucketed._forward
    bucketed._forward = lambda ids, qpos, meta: spans.append(meta.span) or forward(ids, qpos, meta)
    a, b = _turns(exact, fresh, obs, params), _turns(bucketed, fresh, obs, params)
    if static == "on":  # the captured step's store has room after the batch: its rows, padding rows included, read as a view
        assert spans[:2] == [0, 0]
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids and x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
    assert bucketed.prefill_forwards == 2 < exact.prefill_forwards  # one forward a turn: rows of every length together
    assert bucketed.prefill_tokens == exact.prefill_tokens  # the same real tokens, more pads
    for rows_, new, kv in bucketed.prefill_shapes:
        assert rows_ == 4 and new % 16 == 0 and (kv % 256 == 0 or kv == bucketed.store.capacity)
    assert exact.kv_memory()["prefill_shapes"] == len(exact.prefill_shapes) > 2


def test_bucketed_prefill_padding_rows_write_nothing(tiny_model, tokenizer):
    """A bucketed prefill of 3 rows runs 4, the fourth reading the slot after them (another live
    sequence's): no key or value of any slot but the real rows' new positions changes, and that
    sequence continues exactly as it does without buckets."""
    params = SamplingParams(temperature=1.0, max_new_tokens=4)
    texts = ["you are in the middle of a room", "a desk 1 is here", "you see a bed 1", "on the shelf 2 is a key"]
    fresh = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    obs = tokenizer("nothing happens.", add_special_tokens=False).input_ids
    out = {}
    for mode in ("off", "on"):
        s = HFSampler(tiny_model, tokenizer, prefill_buckets=mode, share_prefixes=False)
        first = s.generate(rows(fresh, seeds=[1, 2, 3, 4], keys=[0, 1, 2, 3]), params)
        assert [s.store.slot_of[k] for k in range(4)] == [0, 1, 2, 3]
        held = [torch.cat([s.store.storage.k[layer][3], s.store.storage.v[layer][3]]).clone()
                for layer in range(s.store.storage.n_layers)]
        turn2 = [p + c.token_ids + obs for p, c in zip(fresh, first)]
        pads = s.prefill_pad_tokens
        s.generate(rows(turn2[:3], seeds=[5, 6, 7], keys=[0, 1, 2]), params)
        assert (s.prefill_pad_tokens - pads >= 16) == (mode == "on")  # the three rows ran as four: a whole row of pads
        for layer in range(s.store.storage.n_layers):
            assert torch.equal(torch.cat([s.store.storage.k[layer][3], s.store.storage.v[layer][3]]), held[layer])
        out[mode] = s.generate(rows([turn2[3]], seeds=[8], keys=[3]), params)[0]
    assert out["on"].token_ids == out["off"].token_ids
    assert out["on"].logprobs == pytest.approx(out["off"].logprobs, abs=1e-5)


def test_prefill_shapes_are_buckets():
    from agentrl.sampling.hf import prefill_shape

    assert prefill_shape(3, 14, 700, 4096) == (4, 16, 768)
    assert prefill_shape(100, 17, 1900, 4096) == (128, 32, 2048)
    assert prefill_shape(1, 300, 2000, 2048) == (1, 384, 2048)  # never past the store's capacity
    assert prefill_shape(140, 256, 256, 512) == (160, 256, 256)


def test_length_buckets_may_pad_a_number_of_tokens():
    from agentrl.sampling.hf import _length_buckets

    lengths = {0: 10, 1: 11, 2: 12, 3: 40, 4: 41, 5: 200}
    order = sorted(lengths, key=lengths.get)
    assert _length_buckets(order, lengths.get, pad_tokens=1000) == [[0, 1, 2, 3, 4, 5]]
    assert _length_buckets(order, lengths.get, pad_tokens=300) == [[0, 1, 2, 3, 4], [5]]  # 200 x 6 - 314 > 300
    assert _length_buckets(order, lengths.get, fits=lambda r: len(r) <= 2, pad_tokens=1000) == [[0, 1], [2, 3], [4, 5]]
