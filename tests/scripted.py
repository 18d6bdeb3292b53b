"""A sampler that makes the events a test needs happen by construction (issue 13).

What a barely trained tiny model samples depends on float results, which differ from one CPU
(or thread count, or BLAS path) to another, so a test must not hope that its samples produce
reward variance, a gate cut or a prune. `ScriptedSampler` wraps the real `HFSampler`: on the
synthetic task (whose winning command follows from the game id) it writes the reply of some
trajectories itself and leaves the others to the real model. It is a fake only in that choice:
a scripted reply's token ids and log-probs are the real model's (teacher-forced through the
sampler's current model, adapter included), so the learner's log-prob check, the adapter swap
and the loss see exactly what they would see from a real sample.

The script of a game is picked by its number (`choice-N`, N % len(modes)); the games a run
draws come from numpy's integer generator, which is the same on every machine. Modes:

- `split`:  trajectory 0 replies the winning command, trajectory 1 a losing one, the rest are
            sampled -> every group has reward variance, every iteration updates the learner.
- `stall`:  every trajectory replies without an `Action:` line at every step (an invalid no-op,
            all the same symbol) -> d_K = 0 while all still run: a gate cuts the group (with
            the gate off it is a zero-variance all-fail group).
- `wander`: at step 1 trajectory 0 wins and the others stall, so 3 of 4 still run with
            d_1 = 0.5 (not below a d_L of 0.5: the gate leaves it; ARRoL at K = 1 has a full group
            to prune); at step 2 trajectory 1 wins, 2 loses, 3 is sampled.

(Any reply with an `Action:` line ends a synthetic episode when env.fuzzy_threshold is 0: it maps
to the closest command. Only a reply without one keeps a trajectory running.)

Greedy calls (evaluation) are never scripted: they go to the real sampler unchanged.
"""

from __future__ import annotations

import torch

from agentrl.env.synthetic import task
from agentrl.sampling.base import Completion, GenRequest, SamplingParams

MODES = ("split", "stall", "wander")


class ScriptedSampler:
    def __init__(self, inner, modes: tuple[str, ...] = ("split",)):
        assert modes and set(modes) <= set(MODES), modes
        self.inner, self.modes = inner, modes
        self.tokenizer = inner.tokenizer
        self.scripted = self.sampled = 0  # replies written by the script / by the real model

    def __getattr__(self, name):  # model, adapter_version, load, ...: the real sampler's
        return getattr(self.inner, name)

    def mode(self, game_id: str) -> str:
        return self.modes[int(game_id.rsplit("-", 1)[1]) % len(self.modes)]

    def reply(self, prompt: list[int], key) -> str | None:
        """The scripted reply of one row, or None: let the real model sample it."""
        game_id, index = key
        _, commands, target = task(game_id)
        wrong = next(c for c in commands if c != target)
        text = self.tokenizer.decode(prompt)
        step = text.count("<|im_start|>assistant") - 2  # the in-context example's reply and this turn's header
        assert step >= 0, "the scripted sampler reads the synthetic task's chat prompt"
        mode = self.mode(game_id)
        win, lose, wait = f"Thought: This is it.\nAction: {target}", f"Thought: Try this.\nAction: {wrong}", "Thought: I wait."
        if mode == "stall":
            return wait
        if mode == "wander":
            return ({0: win} if step == 0 else {1: win, 2: lose}).get(index, wait if step == 0 else None)
        return {0: win, 1: lose}.get(index)

    def generate(self, requests: list[GenRequest], params: SamplingParams) -> list[Completion]:
        if params.greedy or any(r.key is None for r in requests):
            return self.inner.generate(requests, params)
        replies = [self.reply(list(r.prompt_ids), r.key) for r in requests]
        free = [i for i, r in enumerate(replies) if r is None]
        sampled = self.inner.generate([requests[i] for i in free], params) if free else []
        out: list[Completion | None] = [None] * len(requests)
        for i, c in zip(free, sampled):
            out[i] = c
        for i, r in enumerate(replies):
            if r is not None:
                out[i] = self._forced(list(requests[i].prompt_ids), r)
        self.scripted += len(requests) - len(free)
        self.sampled += len(free)
        return out

    @torch.no_grad()
    def _forced(self, prompt: list[int], reply: str) -> Completion:
        end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        ids = self.tokenizer.encode(reply, add_special_tokens=False) + [end]
        model = self.inner.model
        device = next(model.parameters()).device
        logits = model(input_ids=torch.tensor([prompt + ids], device=device)).logits[0, len(prompt) - 1:-1].float()
        logprobs = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids, device=device)[:, None])[:, 0]
        return Completion(list(prompt), ids, logprobs.tolist(), reply, "stop", self.inner.adapter_version)


def wrap_make_sampler(modes: tuple[str, ...] = ("split",)) -> None:
    """Make `agentrl.sampling.make_sampler` return scripted samplers (before agentrl.cli is imported)."""
    import agentrl.sampling as sampling

    real = sampling.make_sampler
    sampling.make_sampler = lambda cfg, *a, **k: ScriptedSampler(real(cfg, *a, **k), modes)


def rows(prompts, seeds=None, keys=None) -> list[GenRequest]:
    """GenRequests of parallel lists (tests written row-wise read shorter this way)."""
    return [GenRequest(p, seed=None if seeds is None else seeds[i], key=None if keys is None else keys[i])
            for i, p in enumerate(prompts)]


def lora_adapters(model, root, seeds=(1, 2)) -> list[str]:
    """Real PEFT LoRA adapters (r=4 on q,v; B non-zero, so each changes outputs) for `model`, one
    per seed, saved as the learner saves them under `root`/v{seed}."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    paths = []
    for seed in seeds:
        torch.manual_seed(seed)
        peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                                    init_lora_weights=False))
        peft_model.save_pretrained(root / f"v{seed}")
        paths.append(str(root / f"v{seed}"))
    return paths
