"""How many reply tokens the admissible action space forces (a script, not a test): the walkthrough
commands of a config's warm-start games, each against the admissible commands of the step it was
sent at, tokenised as the sampler constrains a reply (`Action: <command><end of turn>`,
`ChatRenderer.command_reply`). A token is forced where every command still alive continues with it:
the token loop runs a forward for it, jump-forward (`sampling.jump_forward`, sampling/jump.py) does
not. Prints tokens per reply, the forced share, the choices per reply (a histogram), and the
forwards a reply needs after the prefill in each loop (token loop: its length less one; jump-forward:
its choices after the first token, the first token's logits being the prefill's).

The replays come from the replay cache (`agentrl data replay --games N`, or any `agentrl sft` of
the config, fills it); games not in it are counted and left out.

Usage: python benchmarks/bench_forced_tokens.py [--config configs/default.yaml] [--games N]
"""

from __future__ import annotations

import argparse
import collections
import sys

from agentrl.config import load_config
from agentrl.env.replay import REPLAY_DIRNAME, Replay, ReplayCache, replay_key
from agentrl.models import cache_root, load_tokenizer
from agentrl.prompt import ChatRenderer
from agentrl.sampling.constraint import CommandSet
from agentrl.train.sft import select_games


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--games", type=int, default=None, help="the first N of the config's warm-start games (default: sft.games)")
    args = ap.parse_args()
    cfg = load_config(args.config)
    renderer = ChatRenderer(load_tokenizer(cfg.model.name))
    ids = lambda c: tuple(renderer.command_reply(c))  # noqa: E731
    cache = ReplayCache(cache_root() / REPLAY_DIRNAME)
    games = select_games(cfg, cfg.sft.split, args.games or cfg.sft.games)
    replies = tokens = forced = loop_forwards = jump_forwards = missing = outside = 0
    choices: collections.Counter = collections.Counter()
    for game in games:
        record = cache.get(replay_key(game, cfg.env.fuzzy_threshold))
        if not isinstance(record, Replay):
            missing += 1
            continue
        admissible = record.reset.get("admissible") or []
        for step in record.steps:
            if step["command"] not in admissible:  # a command the step did not list (none here so far)
                outside += 1
            else:
                reply = ids(step["command"])
                allowed = CommandSet.of({c: ids(c) for c in admissible}).allowed_along(reply)
                chosen = sum(len(a) > 1 for a in allowed)
                replies, tokens, forced = replies + 1, tokens + len(reply), forced + len(reply) - chosen
                choices[chosen] += 1
                loop_forwards += len(reply) - 1
                jump_forwards += chosen - (len(allowed[0]) > 1)
            admissible = step.get("admissible") or []
    if not replies:
        print(f"no replays of the {len(games)} games in {cache.root}: run `agentrl data replay --config {args.config}"
              f" --games {len(games)}` first", file=sys.stderr)
        return 1
    print(f"{replies} replies of {len(games) - missing} games ({missing} not in the replay cache, {outside} commands "
          f"not admissible at their step); model {cfg.model.name}")
    print(f"tokens per reply {tokens / replies:.1f}; forced {forced}/{tokens} = {forced / tokens:.1%}; "
          f"choices per reply {(tokens - forced) / replies:.2f} (histogram {dict(sorted(choices.items()))})")
    print(f"forwards after the prefill, per reply: token loop {loop_forwards / replies:.2f}, "
          f"jump-forward {jump_forwards / replies:.2f} ({loop_forwards / max(jump_forwards, 1):.1f}x fewer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
