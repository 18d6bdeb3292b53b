"""Memory known before a run: the learner's estimate against what backward really keeps (a real
LoRA on a tiny random Llama), and the process heap giving freed tensors back (glibc)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agentrl.config import LearnerConfig
from agentrl.train import memory
from agentrl.train.learner import LocalLearner
from agentrl.train.loss import token_logprobs

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def saved_for_backward(model, ids) -> int:
    """Bytes of the tensors autograd saves for backward in one forward, each storage once, the
    model's own parameters excluded (they are not new memory)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs(model, ids, torch.ones_like(ids))
    return sum(seen.values())


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_activation_estimate_bounds_what_backward_keeps(tiny_model, checkpointing):
    """Per token, the estimate (without its safety margin) is at least what autograd keeps, and
    not a wild overestimate: within 1.5x without checkpointing. With it, a layer keeps only its
    input and output (the recomputed layer is transient), so less than a quarter as much is kept."""
    import copy

    rows, tokens = 2, 384
    learner = LocalLearner(copy.deepcopy(tiny_model), LearnerConfig(lora_r=4, target_modules=ALL_LINEAR,
                                                               gradient_checkpointing=checkpointing))
    learner.model.train()  # as in an update: checkpointing is on only in train mode
    ids = torch.randint(0, tiny_model.config.vocab_size, (rows, tokens), generator=torch.Generator().manual_seed(0))
    kept = saved_for_backward(learner.model, ids)
    estimate = memory.activation_bytes_per_token(tiny_model.config, 4, checkpointing) / memory.SAFETY * rows * tokens
    assert kept <= estimate
    if not checkpointing:
        assert estimate <= 1.5 * kept
    else:
        learner_plain = LocalLearner(copy.deepcopy(tiny_model), LearnerConfig(lora_r=4, target_modules=ALL_LINEAR))
        learner_plain.model.train()
        assert kept < saved_for_backward(learner_plain.model, ids) / 4


def test_lora_params_counts_the_adapters_trainable_parameters(tiny_model):
    import copy

    for modules in (ALL_LINEAR, ["q_proj", "v_proj"]):
        learner = LocalLearner(copy.deepcopy(tiny_model), LearnerConfig(lora_r=8, target_modules=modules))
        assert memory.lora_params(tiny_model.config, 8, modules) == sum(p.numel() for p in learner.params)


def test_the_memory_estimate_adds_up_and_the_kv_cache_takes_turns_with_the_learner():
    m = memory.LearnerMemory(weights=10, train_state=2, activations=30, logits=5, kv_cache=20, rows=2, row_tokens=100)
    assert m.total == 10 + 2 + 35
    m.kv_cache = 50
    assert m.total == 10 + 2 + 50


FRAGMENT = """
import sys, torch
if sys.argv[1] == "fixed":
    from agentrl.procmem import return_freed_memory
    assert return_freed_memory()
def rss_mib():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) // 1024
big = torch.ones(16 << 18); del big   # a 16 MiB block freed: glibc's dynamic threshold rises to it
base = rss_mib()
ts = [torch.ones(1 << 20) for _ in range(100)]   # 100 x 4 MiB
del ts[::2]                                       # half freed, between live ones
print(rss_mib() - base)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_tensors_go_back_to_the_system_with_the_fixed_threshold():
    """200 MiB live of 400 MiB allocated: glibc's dynamic threshold keeps the freed half in the
    heap (RSS ~400 MiB); agentrl's fixed threshold gives it back (RSS ~200 MiB)."""
    def held(mode):
        env = {"PATH": "/usr/bin:/bin", "AGENTRL_MALLOC": "", "PYTHONPATH": ":".join(sys.path)}
        out = subprocess.run([sys.executable, "-c", FRAGMENT, mode], capture_output=True, text=True, env=env, timeout=120)
        assert out.returncode == 0, out.stderr
        return int(out.stdout.split()[-1])

    assert held("dynamic") >= 350
    assert held("fixed") <= 250


REUSED = """
import sys, torch
from agentrl import procmem
assert procmem.return_freed_memory()
def rss_mib():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) // 1024
def faults():
    return int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[7])
def churn():  # the same 2 MiB tensors made and freed over and over, as a decode loop does
    f = faults()
    for _ in range(200):
        t = torch.ones(1 << 19); del t
    return faults() - f
fixed = churn()
base = rss_mib()
with procmem.reused_heap():
    with procmem.reused_heap():  # nested: only the outer block switches back
        reused = churn()
    ts = [torch.ones(1 << 19) for _ in range(100)]   # 100 x 2 MiB from the heap
    del ts[::2]
    inside = rss_mib() - base
    del ts
after = rss_mib() - base
print(fixed, reused, inside, after)
"""


def _fault_kib() -> int:
    """KiB one page fault maps into anonymous memory: 4, or the smallest transparent huge page size
    set to `always` (a 6.x kernel may map 16 KiB folios: a fresh 2 MiB tensor then costs 128
    faults, not 512)."""
    root = Path("/sys/kernel/mm/transparent_hugepage")
    try:
        top_always = "[always]" in (root / "enabled").read_text()
        sizes = [int(p.parent.name.removeprefix("hugepages-").removesuffix("kB"))
                 for p in root.glob("hugepages-*kB/enabled")
                 if "[always]" in p.read_text() or (top_always and "[inherit]" in p.read_text())]
    except (OSError, ValueError):
        sizes = []
    return min(sizes, default=4)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_a_reused_heap_saves_the_faults_and_gives_the_memory_back_at_its_end():
    """Inside `reused_heap()` a tensor made and freed again is not faulted in afresh each time (a
    2 MiB tensor under the fixed threshold costs 512 faults at 4 KiB pages, 2048 / the kernel's
    folio size in general); at its end the freed heap is given back (malloc_trim) and the fixed
    threshold holds again."""
    per_tensor = 2048 // _fault_kib()
    if per_tensor < 32:
        pytest.skip(f"the kernel maps anonymous memory in {_fault_kib()} KiB folios: too few faults per tensor to count")
    env = {"PATH": "/usr/bin:/bin", "AGENTRL_MALLOC": "", "PYTHONPATH": ":".join(sys.path)}
    out = subprocess.run([sys.executable, "-c", REUSED], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    fixed, reused, inside, after = map(int, out.stdout.split())
    assert fixed >= 200 * per_tensor * 3 // 4 and reused <= fixed // 10, (fixed, reused, per_tensor)
    assert inside >= 90 and after <= 20, (inside, after)


def test_the_threshold_reaches_child_processes_and_can_be_left_alone(monkeypatch):
    from agentrl import procmem

    monkeypatch.delenv(procmem.ENV, raising=False)
    monkeypatch.setenv("AGENTRL_MALLOC", "glibc")
    assert procmem.return_freed_memory() is False and procmem.ENV not in os.environ
    monkeypatch.delenv("AGENTRL_MALLOC")
    if sys.platform.startswith("linux"):
        assert procmem.return_freed_memory() is True
        assert os.environ[procmem.ENV] == str(procmem.THRESHOLD_BYTES)


# ---------------------------------------------------------------- the allocator a command runs under
ENTRY = [sys.executable, "-m", "agentrl.cli"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD")
def test_sft_starts_again_under_mimalloc_and_other_commands_only_when_asked():
    """`agentrl sft` is started again through the CLI's entry with the cmeel-mimalloc wheel's
    library preloaded and freed pages kept (no purge); other commands run as they are unless
    AGENTRL_MALLOC=mimalloc; AGENTRL_MALLOC=glibc, or the command already started again, never."""
    from agentrl import procmem

    library = procmem.mimalloc_library()
    assert library is not None and Path(library).is_file()  # a dependency on Linux (pyproject.toml)
    argv, env = procmem.allocator_exec(["-v", "sft", "--out", "x"], {"LD_PRELOAD": "/other.so"}, ENTRY)
    assert argv == [*ENTRY, "-v", "sft", "--out", "x"]
    assert env["LD_PRELOAD"] == f"{library} /other.so" and env["MIMALLOC_PURGE_DELAY"] == "-1"
    assert procmem.allocator_exec(["sft"], {"MIMALLOC_PURGE_DELAY": "100"}, ENTRY)[1]["MIMALLOC_PURGE_DELAY"] == "100"
    assert procmem.allocator_exec(["train", "--sft"], {}, ENTRY) is None  # a flag is not the command
    assert procmem.allocator_exec(["train"], {"AGENTRL_MALLOC": "mimalloc"}, ENTRY) is not None
    assert procmem.allocator_exec(["sft"], {"AGENTRL_MALLOC": "glibc"}, ENTRY) is None
    assert procmem.allocator_exec(["sft"], {"AGENTRL_MALLOC": "fixed"}, ENTRY) is None  # what sft ran on before
    assert procmem.allocator_exec(["sft"], {procmem.EXEC_MARK: "1"}, ENTRY) is None


STARTED_AGAIN = """
import sys
from agentrl import procmem
before = procmem.allocator()
procmem.exec_allocator([sys.executable, "-c", "from agentrl import procmem; import sys; "
                        "print(procmem.allocator(), procmem.return_freed_memory(), sys.argv[1:])"])
print("ran as it was", before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD")
def test_the_command_started_again_runs_on_mimalloc_and_leaves_glibcs_threshold_alone():
    """A real exec: the process `sft` starts runs on mimalloc with its arguments, where glibc's
    mmap threshold would not reach malloc (return_freed_memory: False); `eval` runs as it was."""
    env = {"PATH": "/usr/bin:/bin", "AGENTRL_MALLOC": "", "PYTHONPATH": ":".join(sys.path)}

    def run(*args):
        out = subprocess.run([sys.executable, "-c", STARTED_AGAIN, *args], capture_output=True, text=True,
                             env=env, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert run("sft", "--out", "x") == "mimalloc False ['sft', '--out', 'x']"
    assert run("eval") == "ran as it was glibc"
    env["AGENTRL_MALLOC"] = "jemalloc"  # not a choice: one line, exit 1
    out = subprocess.run([sys.executable, "-c", STARTED_AGAIN, "sft"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 1 and out.stderr.strip().splitlines() == [
        "error: AGENTRL_MALLOC=jemalloc is not one of fixed, glibc, mimalloc (or unset)"]
