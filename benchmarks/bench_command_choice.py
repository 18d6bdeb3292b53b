"""Greedy play under admissible actions, two ways of choosing the command (issue 48, item 2:
constrained decoding or scoring each admissible command, "whichever measures better"). A
script, not a test.

- `token`: what `--action-space admissible` does today: token by token, the argmax of the
  model's softmax renormalised over the tokens that continue some admissible command. Where
  many commands share a first token (`go to ...`: one per receptacle), that token carries their
  summed mass, so the walk can enter the `go to` branch and then pick one of its weak commands
  over a single stronger command elsewhere (`take apple 1`).
- `raw`: the argmax over the commands of the raw model's sequence log-prob (a globally
  normalised softmax over the commands: the issue's scoring alternative); `policy`: the argmax of
  the constrained policy's own sequence probability (the product of its renormalised token
  probabilities, the exact mode of what `token` approximates).

Each step's commands are scored in one forward: the episode's KV cache is kept per trajectory
(the new observation is the only prefill), the commands' reply tokens ride one sequence as a
trie (a shared prefix such as `Action: go to` runs once) under a tree mask (each token sees the
episode and its own ancestors, at its position in its reply), and the cache is cropped back after. All three choices come from the same logits, so every step
records whether they agree; the episode follows `--choose`. The first scored step is checked
against plain teacher-forced forwards of its commands (to 1e-4, fp32).

It runs the real `agentrl eval` (games, env, episodes.jsonl, summary.json; `agentrl compare`
pairs it with any other eval of the same games) with the sampler wrapped: constrained rows are
chosen here, unconstrained ones pass through. Greedy only. On the CPU, fp32; memory is bounded by
playing `--rows` games at a time.

Usage: python benchmarks/bench_command_choice.py --adapter WS --split valid_seen --out DIR
           [--choose raw|policy|token] [--limit N] [--rows 16] [--config configs/learning.yaml]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from pathlib import Path


class CommandChooser:
    """The Sampler contract around an hf sampler: constrained greedy rows get the `choose` command
    (see the module docstring); everything else is the wrapped sampler's."""

    def __init__(self, inner, choose: str, rows: int):
        self.inner, self.choose, self.rows = inner, choose, rows
        self.tokenizer, self.max_model_len = inner.tokenizer, inner.max_model_len
        self.caches: dict = {}  # key -> (ids the cache holds, DynamicCache)
        self.steps = 0
        self.agree = {"token=raw": 0, "token=policy": 0, "raw=policy": 0}
        self.commands_scored = 0
        self.checked = False
        self.score_s = 0.0

    @property
    def adapter_version(self):
        return self.inner.adapter_version

    @property
    def model(self):
        return self.inner.model

    def load(self, weights) -> None:
        self.caches.clear()
        self.inner.load(weights)

    def rows_that_fit(self, tokens_per_row: int):
        fit = self.inner.rows_that_fit(tokens_per_row)
        return self.rows if fit is None else min(fit, self.rows)

    def reserve(self, rows, tokens_per_row) -> None:
        pass

    def kv_memory(self):
        return None

    def release(self, keys) -> None:
        for k in keys:
            self.caches.pop(k, None)
        self.inner.release(keys)

    def sleep(self) -> None:
        pass

    def close(self) -> None:
        self.inner.close()

    def generate(self, requests, params):
        from agentrl.sampling.base import Completion

        if not params.greedy:
            raise SystemExit("bench_command_choice plays greedy episodes only (temperature 0)")
        free = [r for r in requests if r.constraint is None]
        passed = iter(self.inner.generate(free, params) if free else [])
        out = []
        for r in requests:
            if r.constraint is None:
                out.append(next(passed))
                continue
            ids, logprobs = self._choose(r)
            out.append(Completion(list(r.prompt_ids), list(ids), logprobs,
                                  self.tokenizer.decode(ids, skip_special_tokens=True), "stop",
                                  self.inner.adapter_version))
        return out

    def _prefix_logits(self, key, prompt):
        """The logits after `prompt` (the first reply token's), extending the key's cache."""
        import torch
        from transformers import DynamicCache

        held, cache = self.caches.get(key, ((), None))
        if cache is None or len(held) >= len(prompt) or tuple(prompt[:len(held)]) != held:
            held, cache = (), DynamicCache()
        new = torch.tensor([prompt[len(held):]])
        pos = torch.arange(len(held), len(prompt)).unsqueeze(0)
        logits = self.inner.model(input_ids=new, position_ids=pos, past_key_values=cache, use_cache=True).logits[0, -1]
        self.caches[key] = (tuple(prompt), cache)
        return logits.float()

    def _command_logits(self, key, prompt, commands):
        """[C][L_c] logits: row t of command c predicts its token t (row 0: the prefix's last). The
        commands' shared prefixes run once: one input token per trie node, attending to the
        episode and to its ancestors only."""
        import torch

        first = self._prefix_logits(key, prompt)
        _, cache = self.caches[key]
        p = len(prompt)
        node: dict[tuple, int] = {}  # a command's proper prefix -> its input position
        for c in commands:
            for t in range(1, len(c)):
                node.setdefault(tuple(c[:t]), len(node))
        prefixes = list(node)
        q = len(prefixes)
        allowed = torch.zeros(q, p + q, dtype=torch.bool)
        allowed[:, :p] = True
        for i, pre in enumerate(prefixes):
            allowed[i, [p + node[pre[:t]] for t in range(1, len(pre) + 1)]] = True  # its ancestors and itself
        logits = self.inner.model(input_ids=torch.tensor([[pre[-1] for pre in prefixes]]),
                                  position_ids=torch.tensor([[p + len(pre) - 1 for pre in prefixes]]),
                                  attention_mask=allowed[None, None], past_key_values=cache, use_cache=True).logits[0]
        cache.crop(-q)  # back to the episode: the commands were a look ahead
        logits = logits.float()
        return [torch.cat([first[None], logits[[node[tuple(c[:t])] for t in range(1, len(c))]]]) for c in commands]

    def _choose(self, r):
        import torch

        t0 = time.perf_counter()
        commands = [list(c) for c in r.constraint.commands]
        logits = self._command_logits(r.key, list(r.prompt_ids), commands)
        logp = [torch.log_softmax(x, -1) for x in logits]
        raw = [sum(float(lp[t, tok]) for t, tok in enumerate(c)) for c, lp in zip(commands, logp)]
        policy = []  # the constrained policy: renormalised over the tokens alive commands allow
        per_token = []
        for c, lp in zip(commands, logp):
            steps = []
            for t, tok in enumerate(c):
                ids = sorted({d[t] for d in commands if len(d) > t and d[:t] == c[:t]})
                steps.append(float(lp[t, tok] - torch.logsumexp(lp[t, ids], 0)))
            per_token.append(steps)
            policy.append(sum(steps))
        alive, t = list(range(len(commands))), 0  # token-by-token greedy over the same logits
        while all(len(commands[i]) > t for i in alive):  # every command ends with a stop token, no two alike
            ids = sorted({commands[i][t] for i in alive})
            best = max(ids, key=lambda tok: float(logp[alive[0]][t, tok]))  # the alive share this position's context
            alive = [i for i in alive if commands[i][t] == best]
            t += 1
        token = alive[0]
        chosen = {"token": token, "raw": max(range(len(commands)), key=raw.__getitem__),
                  "policy": max(range(len(commands)), key=policy.__getitem__)}
        self.steps += 1
        self.commands_scored += len(commands)
        for pair in self.agree:
            a, b = pair.split("=")
            self.agree[pair] += chosen[a] == chosen[b]
        if not self.checked:
            self._check(r, commands, raw)
        pick = chosen[self.choose]
        self.score_s += time.perf_counter() - t0
        if self.steps % 200 == 0:  # a long run says it is alive
            print(f"{self.steps} steps scored, {self.score_s:.0f} s; token=raw so far "
                  f"{100 * self.agree['token=raw'] / self.steps:.1f}%", flush=True)
        return commands[pick], per_token[pick]

    def _check(self, r, commands, raw) -> None:
        """The tree forward against one plain forward per command (no cache), to 1e-4."""
        import torch

        prompt = list(r.prompt_ids)
        for c, want in zip(commands[:4], raw[:4]):
            ids = torch.tensor([prompt + c])
            lp = torch.log_softmax(self.inner.model(input_ids=ids).logits[0].float(), -1)
            got = sum(float(lp[len(prompt) - 1 + t, tok]) for t, tok in enumerate(c))
            if abs(got - want) > 1e-4 * max(1.0, abs(got)):
                raise SystemExit(f"the tree forward's score {want:.6f} differs from a plain forward's {got:.6f}")
        self.checked = True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapter", required=True)
    ap.add_argument("--split", default="valid_seen")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--choose", choices=("raw", "policy", "token"), default="raw")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--rows", type=int, default=16, help="games played at a time (each keeps its KV cache)")
    ap.add_argument("--config", default="configs/learning.yaml")
    ap.add_argument("--data", default=None)
    a = ap.parse_args()

    import torch

    import agentrl.sampling as sampling
    from agentrl.config import load_config
    from agentrl.evaluate import run_eval

    over = {"model.adapter": a.adapter, "eval.split": a.split, "sampling.action_space": "admissible",
            "sampling.static_decode": "off", "model.dtype": "float32", "eval.limit": a.limit}
    if a.data:
        over["data.root"] = a.data
    cfg = load_config(a.config, {k: v for k, v in over.items() if v is not None})
    made = []
    real = sampling.make_sampler
    sampling.make_sampler = lambda *args, **kw: made.append(CommandChooser(real(*args, **kw), a.choose, a.rows)) or made[-1]
    print(f"choose {a.choose}, {a.split}, adapter {a.adapter}; torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"{platform.processor() or platform.machine()}")
    t0 = time.perf_counter()
    with torch.no_grad():
        result = run_eval(cfg, a.out)
    chooser = made[0]
    n = max(1, chooser.steps)
    stats = {"choose": a.choose, "split": a.split, "adapter": a.adapter, "games": len(result.trajectories),
             "won": sum(t.won for t in result.trajectories), "steps": chooser.steps,
             "mean_commands": chooser.commands_scored / n,
             "agreement": {k: v / n for k, v in chooser.agree.items()},
             "score_s": round(chooser.score_s, 1), "wall_s": round(time.perf_counter() - t0, 1)}
    (a.out / "choice.json").write_text(json.dumps(stats, indent=1) + "\n")
    won, games = stats["won"], stats["games"]
    z = 1.96
    centre = (won + z * z / 2) / (games + z * z)
    half = z * math.sqrt(won * (games - won) / games + z * z / 4) / (games + z * z)
    print(f"won {won}/{games} = {100 * won / games:.1f}% [{100 * (centre - half):.1f}, {100 * (centre + half):.1f}]; "
          f"{chooser.steps} steps, {stats['mean_commands']:.1f} commands a step; the choices agree: "
          + ", ".join(f"{k} {100 * v:.1f}%" for k, v in stats["agreement"].items())
          + f"; {stats['wall_s']:.0f} s ({stats['score_s']:.0f} s scoring)")


if __name__ == "__main__":
    main()
