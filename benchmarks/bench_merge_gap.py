"""The log-prob gap between the learner (PEFT's unmerged LoRA, teacher-forced) and the hf sampler
serving the same adapter merged and unmerged: mean |sampler - learner| log-prob per sampled
token, 24 sampled replies to six ALFWorld openings (a script, not a test; results in
docs/measurements/sampler.md).

Usage: python benchmarks/bench_merge_gap.py ADAPTER_DIR [bfloat16|float32]
"""
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from agentrl.models import load_model
from agentrl.sampling.hf import HFSampler
from agentrl.rollout.plan import TYPICAL_FIRST_OBSERVATION
from agentrl.sampling.base import GenRequest, SamplingParams
from agentrl.weights import WeightsRef
from agentrl.train.loss import token_logprobs
from agentrl.prompt import ChatRenderer
from agentrl.config import load_config
from agentrl.env import prompt_messages
from peft import PeftModel

adapter = sys.argv[1]
dtype = sys.argv[2] if len(sys.argv) > 2 else "bfloat16"
base, tok = load_model("default", dtype, "cpu")
cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "learning.yaml")
msgs = prompt_messages(cfg.env.kind, cfg.prompt)
r = ChatRenderer(tok)
obs = TYPICAL_FIRST_OBSERVATION.split("Your task is to:")[0] + "Your task is to: "
tasks = ["put a clean mug in coffeemachine.", "heat some egg and put it in countertop.", "look at bowl under the desklamp.",
         "put two cellphone in bed.", "cool some apple and put it in fridge.", "put a knife in drawer."]
prompts = [r.initial(msgs("pick_and_place_simple", obs + t, None)) for t in tasks for _ in range(4)]
learner = PeftModel.from_pretrained(copy.deepcopy(base), adapter).eval()
for merge in (True, False):
    s = HFSampler(copy.deepcopy(base), tok, merge_adapter=merge)
    s.load(WeightsRef(adapter, 1))
    comps = s.generate([GenRequest(p, seed=i) for i, p in enumerate(prompts)], SamplingParams(1.0, 1.0, 24))
    gaps, n = 0.0, 0
    for p, c in zip(prompts, comps):
        ids = torch.tensor([p + c.token_ids])
        with torch.no_grad():
            lp = token_logprobs(learner, ids, torch.ones_like(ids))[0]
        mine = lp[len(p): len(p) + len(c.token_ids)].float()
        gaps += float((mine - torch.tensor(c.logprobs)).abs().sum())
        n += len(c.token_ids)
    print(f"{dtype} {'merged' if merge else 'unmerged'}: mean |sampler - learner| log-prob per token = {gaps / n:.2e} over {n} tokens", flush=True)
