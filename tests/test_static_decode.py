"""The decode step over static buffers (sampling/static.py), run eagerly on the CPU: it equals the
eager engine (greedy tokens identical, log-probs within 1e-5 in fp32) on tiny Llama, Qwen2 and
Mistral, a sampled row's tokens depend on its seed only (not its bucket, place or the padding
rows), the step never waits on the host (what a CUDA graph capture needs), the store holds still
under it, and a swap keeps every data pointer while changing the outputs. The graph capture
itself needs CUDA: its test is skipped here."""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from agentrl.sampling.base import SamplingParams
from agentrl.sampling.hf import HFSampler
from agentrl.sampling.kv import batch_bucket
from agentrl.weights import WeightsRef
from scripted import rows
from test_sampler import _teacher_forced, _tiny


@pytest.fixture
def prompts(tokenizer):
    texts = ["Thought: short", "a somewhat longer prompt so that left padding matters here", "x y z", "go to the shelf 1"]
    return [tokenizer(t, add_special_tokens=False).input_ids for t in texts]


@pytest.fixture(params=["llama", "qwen2", "mistral"])
def arch_model(request, tiny_model, tokenizer):
    return tiny_model if request.param == "llama" else _tiny(request.param, tokenizer)


def _same(a, b):
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    for x, y in zip(a, b):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5) and x.finish_reason == y.finish_reason


def _two_turns(sampler, prompts, params, obs):
    keys = list(range(len(prompts)))
    first = sampler.generate(rows(prompts, seeds=[i + 1 for i in keys], keys=keys), params)
    turn2 = [p + c.token_ids + obs[: 2 + i] for i, (p, c) in enumerate(zip(prompts, first))]
    return first + sampler.generate(rows(turn2, seeds=[i + 9 for i in keys], keys=keys), params)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_new_tokens=10),
                                    SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=10),
                                    SamplingParams(temperature=0.7, max_new_tokens=10)], ids=["greedy", "top-p", "t0.7"])
def test_the_static_step_equals_the_eager_engine(arch_model, tokenizer, prompts, params):
    """Two turns with cached prefixes: identical tokens, log-probs within 1e-5, and both equal a
    teacher-forced forward."""
    obs = tokenizer("you see a shelf and a drawer", add_special_tokens=False).input_ids
    eager = _two_turns(HFSampler(arch_model, tokenizer, static_decode="off"), prompts, params, obs)
    sampler = HFSampler(arch_model, tokenizer, static_decode="on")
    static = _two_turns(sampler, prompts, params, obs)
    _same(eager, static)
    assert sampler.static.replays > 0 and sampler.static.captures == 0  # stepped eagerly: no CUDA here
    assert static[0].logprobs == pytest.approx(_teacher_forced(arch_model, prompts[0], static[0].token_ids), abs=1e-4)


@pytest.mark.parametrize("every", [1, 3, 64])
def test_rows_that_stop_leave_the_batch_without_changing_any_row(tiny_model, tokenizer, prompts, every):
    """Nine rows (bucket 16): those of one prompt stop at their second token, the rest run on; at
    sync points the finished rows leave and a bucket of 8 serves the others."""
    params = SamplingParams(temperature=0, max_new_tokens=12)
    nine = (prompts * 3)[:9]
    ref = HFSampler(tiny_model, tokenizer, static_decode="off", sync_every=64).generate(rows(nine), params)
    stop = ref[1].token_ids[1]
    eager = HFSampler(tiny_model, tokenizer, static_decode="off", sync_every=every)
    static = HFSampler(tiny_model, tokenizer, static_decode="on", sync_every=every)
    eager.stop_ids = static.stop_ids = {stop}
    a, b = eager.generate(rows(nine), params), static.generate(rows(nine), params)
    _same(a, b)
    assert any(c.finish_reason == "stop" for c in b) and any(c.finish_reason == "length" for c in b)
    assert {k.rows for k in static.static.steps} == ({16, 8} if every < 12 else {16})


def test_a_sampled_rows_tokens_depend_on_its_seed_only(tiny_model, tokenizer, prompts):
    """The same (prompt, seed) alone (bucket 1), third of three (bucket 4: one padding row) and
    among nine (bucket 16: seven padding rows) samples the same tokens, in fp32 on a CPU."""
    params = SamplingParams(temperature=1.0, max_new_tokens=10)
    sampler = HFSampler(tiny_model, tokenizer, static_decode="on")
    sampler.stop_ids = set()
    buckets = []

    def call(prompts_, seeds):
        out = sampler.generate(rows(prompts_, seeds=seeds), params)
        buckets.append(max(k.rows for k in sampler.static.steps))
        return out

    alone = call([prompts[1]], [42])[0]
    third = call([prompts[0], prompts[2], prompts[1]], [5, 6, 42])[2]
    among = call((prompts * 3)[:8] + [prompts[1]], list(range(8)) + [42])[8]
    assert alone.token_ids == third.token_ids == among.token_ids
    assert alone.logprobs == pytest.approx(among.logprobs, abs=1e-5)
    assert buckets == [1, 4, 16]


class _HostSyncs(TorchDispatchMode):
    """Records every op that waits on the device or builds a tensor from host data: each breaks a
    CUDA graph capture (item/tolist/bool -> _local_scalar_dense; boolean indexing -> nonzero;
    torch.tensor(list) -> lift_fresh)."""

    FORBIDDEN = ("_local_scalar_dense", "nonzero", "masked_select", "lift_fresh", "unique", "equal", "is_nonzero")

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in self.FORBIDDEN:
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_new_tokens=4),
                                    SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=4)], ids=["greedy", "top-p"])
def test_the_step_never_waits_on_the_host(kind, tiny_model, tokenizer, prompts, params):
    model = tiny_model if kind == "llama" else _tiny(kind, tokenizer)
    sampler = HFSampler(model, tokenizer, static_decode="on")
    sampler.generate(rows(prompts, seeds=[1, 2, 3, 4]), params)
    (step,) = sampler.static.steps.values()
    step.t.zero_()
    from agentrl.sampling.kv import use_slot_attention

    with torch.no_grad(), use_slot_attention(sampler.model), _HostSyncs() as mode:
        step.run()
    assert mode.seen == []


def test_the_store_holds_still_under_the_step(tiny_model, tokenizer, prompts):
    """Released sequences leave the buffers as they are; the scratch slot is never a sequence's;
    a batch sits in consecutive slots; a reallocation (growth) rebuilds the steps built on the old buffers."""
    sampler = HFSampler(tiny_model, tokenizer, static_decode="on")
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    sampler.generate(rows(prompts, seeds=[1, 2, 3, 4], keys=["a", "b", "c", "d"]), params)
    store = sampler.store
    assert store.scratch == store.slots - 1 and store.scratch not in store.slot_of.values()
    assert sorted(store.slot_of.values()) == list(range(4)) and store.slots >= batch_bucket(4) + 1
    before = (store.storage.generation, store.slots, store.capacity, store.storage.k[0].data_ptr())
    sampler.release(["a", "b", "c", "d"])
    assert (store.storage.generation, store.slots, store.capacity, store.storage.k[0].data_ptr()) == before
    sampler.generate(rows(prompts[:2], seeds=[1, 2]), params)
    assert store.storage.generation == before[0]
    long = [prompts[1] * 60]  # past the capacity: the store grows, the steps are rebuilt on the new buffers
    out = sampler.generate(rows(long, seeds=[3]), params)
    assert store.storage.generation > before[0]
    (step,) = [s for k, s in sampler.static.steps.items() if k.rows == 1]
    assert step.generation == store.storage.generation
    ref = HFSampler(tiny_model, tokenizer, static_decode="off").generate(rows(long, seeds=[3]), params)
    _same(ref, out)


def _adapter(tiny_model, path, seed):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(tiny_model), LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                                 target_modules=["q_proj", "v_proj", "up_proj"]))
    model.save_pretrained(path)
    return path


def test_a_swap_keeps_every_data_pointer_and_changes_the_outputs(tiny_model, tokenizer, prompts, tmp_path):
    """A captured graph replays the addresses it recorded: a swap must write the new merged
    weights in place. Every parameter and KV buffer keeps its storage, the outputs change, and
    they equal the eager engine serving the same adapter."""
    a, b = _adapter(tiny_model, tmp_path / "a", 1), _adapter(tiny_model, tmp_path / "b", 2)
    params = SamplingParams(temperature=0, max_new_tokens=8)
    sampler = HFSampler(copy.deepcopy(tiny_model), tokenizer, static_decode="on")
    sampler.load(WeightsRef(str(a), 1))
    first = sampler.generate(rows(prompts), params)
    pointers = {n: p.data_ptr() for n, p in sampler.model.named_parameters() if "lora_" not in n}
    kv = [t.data_ptr() for t in sampler.store.storage.k + sampler.store.storage.v]
    sampler.load(WeightsRef(str(b), 2))
    second = sampler.generate(rows(prompts), params)
    assert {n: p.data_ptr() for n, p in sampler.model.named_parameters() if "lora_" not in n} == pointers
    assert [t.data_ptr() for t in sampler.store.storage.k + sampler.store.storage.v] == kv
    assert [c.logprobs for c in first] != [c.logprobs for c in second]
    _same(HFSampler(copy.deepcopy(tiny_model), tokenizer, adapter=str(b), static_decode="off").generate(rows(prompts), params),
          second)


def test_an_unmerged_adapter_is_served_by_the_eager_loop(tiny_model, tokenizer, prompts, tmp_path):
    a = _adapter(tiny_model, tmp_path / "a", 1)
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    sampler = HFSampler(copy.deepcopy(tiny_model), tokenizer, adapter=str(a), merge_adapter=False, static_decode="on")
    out = sampler.generate(rows(prompts, seeds=[1, 2, 3, 4]), params)
    assert sampler.static.replays == 0
    ref = HFSampler(copy.deepcopy(tiny_model), tokenizer, adapter=str(a), merge_adapter=False, static_decode="off")
    _same(ref.generate(rows(prompts, seeds=[1, 2, 3, 4]), params), out)


def test_batch_buckets():
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 8, 9, 17, 64, 65, 100, 128)] == [1, 2, 4, 8, 8, 16, 24, 64, 96, 128, 128]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_new_tokens=12),
                                    SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=12)], ids=["greedy", "top-p"])
def test_on_cuda_a_graph_replay_equals_the_same_step_run_eagerly(tiny_model, tokenizer, prompts, params):
    model = copy.deepcopy(tiny_model).cuda()
    graphs = HFSampler(model, tokenizer, static_decode="on", sync_every=4)
    eager = HFSampler(model, tokenizer, static_decode="on", sync_every=4)
    eager.static.capture = False
    obs = tokenizer("you see a shelf", add_special_tokens=False).input_ids
    a, b = _two_turns(graphs, prompts, params, obs), _two_turns(eager, prompts, params, obs)
    assert graphs.static.captures > 0
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    for x, y in zip(a, b):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_graphs_are_captured_again_after_the_store_grows(tiny_model, tokenizer, prompts):
    """A turn longer than the store's capacity reallocates it: every graph is dropped with its pool
    and captured again into a new one (reusing the old pool's handle fails inside torch's allocator),
    and the replays still equal the same static step run eagerly."""
    model = copy.deepcopy(tiny_model).cuda()
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    graphs = HFSampler(model, tokenizer, static_decode="on", sync_every=4)
    eager = HFSampler(model, tokenizer, static_decode="on", sync_every=4)
    eager.static.capture = False
    long_obs = tokenizer("you see a shelf", add_special_tokens=False).input_ids * 200  # past the first capacity

    def three_turns(sampler):
        keys = list(range(len(prompts)))
        out = sampler.generate(rows(prompts, seeds=[i + 1 for i in keys], keys=keys), params)
        before = (sampler.store.storage.generation, sampler.static.captures)
        turn2 = [p + c.token_ids + long_obs for p, c in zip(prompts, out)]
        out2 = sampler.generate(rows(turn2, seeds=[i + 9 for i in keys], keys=keys), params)
        turn3 = [p + c.token_ids + long_obs[:7] for p, c in zip(turn2, out2)]
        return out + out2 + sampler.generate(rows(turn3, seeds=[i + 17 for i in keys], keys=keys), params), before

    a, (generation, captures) = three_turns(graphs)
    b, _ = three_turns(eager)
    assert graphs.store.storage.generation > generation and graphs.static.captures > captures
    _same(a, b)


def test_a_reserved_store_holds_still_and_changes_no_token(tiny_model, tokenizer, prompts):
    """`reserve` sizes a store that holds still once (within the budget): turns that stay inside
    it reallocate nothing, build no step twice, and sample the same tokens as a store that grows;
    past the budget it does nothing. An eager store takes the plan too, and gives its memory back
    when no key is live."""
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    obs = tokenizer("you see a shelf", add_special_tokens=False).input_ids * 200  # past the first 512 positions

    def turns(sampler):  # two turns of a batch, its second long; then a new batch (the next rollout)
        keys = list(range(len(prompts)))
        out = sampler.generate(rows(prompts, seeds=[i + 1 for i in keys], keys=keys), params)
        turn2 = [p + c.token_ids + obs for p, c in zip(prompts, out)]
        out += sampler.generate(rows(turn2, seeds=[i + 9 for i in keys], keys=keys), params)
        sampler.release(keys)
        return out + sampler.generate(rows(prompts, seeds=[i + 17 for i in keys], keys=[k + 10 for k in keys]), params)

    reserved = HFSampler(tiny_model, tokenizer, static_decode="on")
    reserved.reserve(len(prompts), 1000)
    assert (reserved.store.slots, reserved.store.capacity, reserved.store.storage.generation) == (5, 1024, 1)
    grown = HFSampler(tiny_model, tokenizer, static_decode="on")
    _same(turns(reserved), turns(grown))
    assert reserved.store.storage.generation == 1 and grown.store.storage.generation > 1
    # the new batch's step (short contexts) was built before the store grew: dropped with its buffers, built again
    assert reserved.static.built == 2 and grown.static.built == 3

    small = HFSampler(tiny_model, tokenizer, static_decode="on", kv_budget_gb=1000 * reserved.store.bytes_per_token / 2**30)
    small.reserve(len(prompts), 1000)  # 5 slots x 1024 tokens: over a budget of 1000 tokens
    assert small.store.storage.generation == 0
    # the eager store (the CPU's) takes the plan too: each reallocation there copies the whole store
    plain = HFSampler(tiny_model, tokenizer, static_decode="off")
    plain.reserve(len(prompts), 1000)
    assert (plain.store.slots, plain.store.capacity, plain.store.storage.generation) == (len(prompts), 1024, 1)
    grown_plain = HFSampler(tiny_model, tokenizer, static_decode="off")
    _same(turns(plain), turns(grown_plain))
    # inside the plan nothing was reallocated; releasing every key gave the memory back (the learner may
    # want it) and the next batch, unplanned, grew the store again
    assert plain.store.storage.generation == 3 and grown_plain.store.storage.generation > 3
