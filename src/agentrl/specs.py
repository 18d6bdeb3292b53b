"""The config's string settings parsed and checked: the gate spec (`K,d_L`) and the `--select`
stage list. The bottom layer, beside config: config validates with these, so the config tree
imports nothing above it. A spec is a plain record; what decides (the gate's rule) lives in
`agentrl.select.gate_rule`, and the selection package (`agentrl.select`) re-exports the stage list."""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass

from agentrl.errors import UserError

_SPEC = re.compile(r"^\s*(\d+)\s*,\s*([0-9]*\.?[0-9]+(?:[eE][-+]?\d+)?)\s*$")
_AUTO = re.compile(r"^\s*(\d+)\s*,\s*auto\s*(?::\s*([a-z_+ ]+?)\s*)?$")
_NOWIN = re.compile(r"^\s*(\d+)\s*,\s*nowin\s*$")

# the signals (agentrl.rollout.signals.SIGNALS): the seed paper's seven, then two of issue 49 (the
# share of invalid actions, the replies' mean negative log-prob). A group has converged when a
# divergence is low or, for termination_fraction and invalid_action_fraction, when much of it has
# finished or gone invalid: the gate scores "converged" as a low value (`convergence_score`)
SIGNAL_NAMES = ("prefix_edit_distance_mean", "action_bigram_jaccard_mean", "unique_prefix_ratio", "unique_action_ratio",
                "action_entropy", "obs_unique_ratio", "termination_fraction", "invalid_action_fraction",
                "reply_nll_mean")
PAPER_SIGNALS = SIGNAL_NAMES[:7]  # every groups.csv has these; tables written before issue 49 lack the other two
HIGH_IS_CONVERGED = ("termination_fraction", "invalid_action_fraction")
_SHORT = {"d": "prefix_edit_distance_mean", "d_k": "prefix_edit_distance_mean", "bigram": "action_bigram_jaccard_mean", "prefixes": "unique_prefix_ratio",
          "actions": "unique_action_ratio", "entropy": "action_entropy", "obs": "obs_unique_ratio",
          "tau": "termination_fraction", "invalid": "invalid_action_fraction", "nll": "reply_nll_mean"}


def convergence_score(signal: str, signals: Mapping[str, float]) -> float:
    """The value a threshold rule compares with d_L (lower = more converged)."""
    v = signals[signal]
    return 1.0 - v if signal in HIGH_IS_CONVERGED else v


@dataclass(frozen=True)
class GateSpec:
    """`--gate K,d_L | K,auto[:SIGNAL]` (and `--gate-or-tau`) parsed and checked: a plain record.
    The decision itself is a rule (`agentrl.select.gate_rule`) built from it."""

    K: int
    d_L: float
    tau_H: float | None = None  # OR-rule threshold on termination_fraction; None = off
    auto: bool = False  # `K,auto`: d_L is re-fitted online from labelled groups (agentrl.select.auto_gate)
    signal: str = "prefix_edit_distance_mean"  # what d_L thresholds (`K,auto:SIGNAL`; d_K by default)
    signals: tuple[str, ...] = ()  # `K,auto:S1+S2+...`: the signals a classifier gate reads (select/classifier_gate.py)
    nowin: bool = False  # `K,nowin`: cut a group none of whose rows has ended (won) by K (gate_rule.NoWin)

    def __post_init__(self):
        if self.K < 1:
            raise UserError(f"gate K must be >= 1, got {self.K}")
        if not 0.0 <= self.d_L <= 1.0 + 1e-9:
            raise UserError(f"gate d_L must be in [0, 1], got {self.d_L}")
        if self.tau_H is not None and not 0.0 <= self.tau_H <= 1.0:
            raise UserError(f"gate tau_H must be in [0, 1], got {self.tau_H}")
        if self.signal not in SIGNAL_NAMES:
            raise UserError(f"unknown gate signal {self.signal!r}; choose from {', '.join(SIGNAL_NAMES)}")
        if self.nowin and self.tau_H is not None:
            raise UserError("--gate K,nowin cuts groups none of whose rows has ended; the OR-rule (--gate-or-tau) "
                            "cuts groups whose rows have: give one of them")
        if len(self.signals) == 1 or len(set(self.signals)) != len(self.signals):
            raise UserError(f"a classifier gate reads two or more distinct signals, got {'+'.join(self.signals)}")

    def __str__(self) -> str:
        if self.nowin:
            return f"{self.K},nowin"
        # an auto gate's threshold is fitted as it runs: its rule says the one in force (`str(rule)`)
        return gate_text(self.K, None if self.auto else self.d_L, self.tau_H, self.auto, "+".join(self.signals) or self.signal)


def gate_text(K: int, d_L: float | None, tau_H: float | None, auto: bool = False, signal: str = SIGNAL_NAMES[0]) -> str:
    """How a gate reads in reports and on the console: `K,d_L`, or `K,auto[:SIGNAL] (d_L x)` with
    the threshold in force, plus ` or tau>=t` with the OR-rule."""
    if auto:
        head = f"{K},auto" + ("" if signal == SIGNAL_NAMES[0] else f":{signal}") + ("" if d_L is None else f" (d_L {d_L:.3g})")
    else:
        head = f"{K},{d_L:g}"
    return head + (f" or tau>={tau_H:g}" if tau_H is not None else "")


def parse_gate(spec: str | None, tau_H: float | None = None) -> GateSpec | None:
    """'K,d_L' -> GateSpec; 'K,auto' or 'K,auto:SIGNAL' -> an auto gate (cuts nothing until fitted);
    'K,auto:S1+S2+...' -> a classifier gate on those signals; 'K,nowin' -> cut groups with no row
    ended (won) by K; 'off' / None -> no gate."""
    if spec is None or spec.strip().lower() in ("off", "none", ""):
        if tau_H is not None:
            raise UserError("--gate-or-tau needs a gate (--gate K,d_L)")
        return None
    auto = _AUTO.match(spec.strip().lower())
    if auto:
        names = [n.strip() for n in (auto.group(2) or SIGNAL_NAMES[0]).split("+")]
        names = [_SHORT.get(n, n) for n in names]
        for given, name in zip((auto.group(2) or "").split("+"), names):
            if name not in SIGNAL_NAMES:
                raise UserError(f"unknown gate signal {given.strip()!r} in {spec!r}; choose from "
                                f"{', '.join(SIGNAL_NAMES)} (or d, d_K, bigram, prefixes, actions, entropy, obs, tau, invalid, nll)")
        return GateSpec(int(auto.group(1)), 0.0, tau_H, auto=True, signal=names[0],
                        signals=tuple(names) if len(names) > 1 else ())
    nowin = _NOWIN.match(spec.strip().lower())
    if nowin:
        return GateSpec(int(nowin.group(1)), 0.0, tau_H, nowin=True)
    m = _SPEC.match(spec)
    if not m:
        raise UserError(f"malformed gate {spec!r}; expected K,d_L (e.g. 10,0.12), K,auto, K,nowin or off")
    return GateSpec(int(m.group(1)), float(m.group(2)), tau_H)


# every stage, in the order the loop applies them (by stage point: before, step, after)
STAGES = ("greso", "pilot-commit", "cut", "arrol", "dapo")


def stage_names(cfg) -> list[str]:
    """The configured stages in application order; without `select.stages`, the gate's cut when
    rollout.gate is on."""
    spec = cfg.select.stages
    if spec is None:
        names = ["cut"] if cfg.rollout.parsed_gate() is not None else []
    else:
        names = [n.strip().lower() for n in spec.split(",") if n.strip() and n.strip().lower() not in ("none", "off")]
    for n in names:
        if n not in STAGES:
            hint = [s for s in STAGES if s.startswith(n)] or difflib.get_close_matches(n, STAGES, n=1)
            raise UserError(f"unknown selection stage {n!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
                            + f"; choose from {', '.join(STAGES)}")
    return sorted(set(names), key=STAGES.index)


def pilot_count(cfg) -> int:
    """select.pilot_commit.n_pilot resolved: auto = G / 4 (at least 1), the authors' pilot:commit split."""
    n = cfg.select.pilot_commit.n_pilot
    return max(1, cfg.rollout.group_size // 4) if n == "auto" else n


def _auto(cfg) -> bool:
    gate = cfg.rollout.parsed_gate()
    return gate is not None and gate.auto


def check_select(cfg) -> None:
    """One-line errors for a bad `select` section (called by Config.validate)."""
    s, names = cfg.select, stage_names(cfg)
    t_max = cfg.t_max("rollout")
    for ok, message in [
        ("cut" not in names or cfg.rollout.parsed_gate() is not None, "--select cut needs a gate (--gate K,d_L)"),
        (0.0 <= s.gate_audit <= 1.0, f"select.gate_audit must be in [0, 1], got {s.gate_audit}"),
        (s.gate_audit == 0.0 or "cut" in names, "select.gate_audit audits the gate: select cut too"),
        (0.0 < cfg.gate.precision <= 1.0, f"gate.precision must be in (0, 1], got {cfg.gate.precision}"),
        (cfg.gate.min_labels >= 1, f"gate.min_labels must be >= 1, got {cfg.gate.min_labels}"),
        (cfg.gate.window >= 0, f"gate.window must be >= 0 (0: all iterations), got {cfg.gate.window}"),
        (not _auto(cfg) or s.gate_audit > 0,
         "--gate K,auto fits d_L from the groups it let run, and below d_L only audited groups run: "
         "give --gate-audit a (e.g. 0.2)"),
        (s.dapo_refill >= 0, f"select.dapo_refill must be >= 0, got {s.dapo_refill}"),
        (s.dapo_refill == 0 or "dapo" in names, "select.dapo_refill refills what the DAPO filter drops: select dapo too"),
        ("arrol" not in names or cfg.sampling.backend == "hf",
         "--select arrol reads the policy's hidden states: it needs the hf sampler (--sampler hf)"),
    ]:
        if not ok:
            raise UserError(message)
    per_stage = {"greso": [
        (0.0 < s.greso.p_min <= s.greso.p_init <= s.greso.p_max <= 1.0,
         f"select.greso needs 0 < p_min <= p_init <= p_max <= 1, got {s.greso.p_min}, {s.greso.p_init}, {s.greso.p_max}"),
        (0.0 <= s.greso.target <= 1.0, f"select.greso.target must be in [0, 1], got {s.greso.target}"),
        (0.0 < s.greso.step <= 1.0, f"select.greso.step must be in (0, 1], got {s.greso.step}"),
    ], "pilot-commit": [
        (s.pilot_commit.pilot_factor >= 1, f"select.pilot_commit.pilot_factor must be >= 1, got {s.pilot_commit.pilot_factor}"),
        (s.pilot_commit.n_pilot == "auto" or (not isinstance(s.pilot_commit.n_pilot, str)
                                               and 1 <= s.pilot_commit.n_pilot < cfg.rollout.group_size),
         f"select.pilot_commit.n_pilot must be auto or in [1, G={cfg.rollout.group_size}), got {s.pilot_commit.n_pilot}"),
        (pilot_count(cfg) < cfg.rollout.group_size if s.pilot_commit.n_pilot == "auto" else True,
         f"select.pilot_commit needs G >= 2 (a pilot and a commit), got G={cfg.rollout.group_size}"),
        (s.pilot_commit.evict_at is None or 0 < s.pilot_commit.evict_at <= 1,
         f"select.pilot_commit.evict_at must be in (0, 1] or null, got {s.pilot_commit.evict_at}"),
        (s.pilot_commit.max_rounds >= 1, f"select.pilot_commit.max_rounds must be >= 1, got {s.pilot_commit.max_rounds}"),
        (s.pilot_commit.max_age >= 0, f"select.pilot_commit.max_age must be >= 0, got {s.pilot_commit.max_age}"),
        (s.pilot_commit.sampling in ("max_variance", "random"),
         f"select.pilot_commit.sampling must be max_variance or random, got {s.pilot_commit.sampling!r}"),
        (0.0 <= s.pilot_commit.low < s.pilot_commit.high <= 1.0,
         f"select.pilot_commit needs 0 <= low < high <= 1, got {s.pilot_commit.low}, {s.pilot_commit.high}"),
    ], "arrol": [
        (1 <= s.arrol.K <= t_max, f"select.arrol.K must be in [1, T_max={t_max}], got {s.arrol.K}"),
        (0.0 < s.arrol.kappa <= 1.0, f"select.arrol.kappa must be in (0, 1], got {s.arrol.kappa}"),
        (s.arrol.cold_start >= 0, f"select.arrol.cold_start must be >= 0, got {s.arrol.cold_start}"),
    ]}
    for name in names:  # a stage's parameters are checked when it is selected
        for ok, message in per_stage.get(name, []):
            if not ok:
                raise UserError(message)


HOST_PORT = re.compile(r"^(?:ray://)?(?P<host>[^:/\s]+):(?P<port>\d{1,5})$")


def check_ray_address(address: str) -> str:
    """`--ray-address` as given (local | auto | HOST:PORT), or a one-line UserError."""
    if address in ("local", "auto") or HOST_PORT.match(address):
        return address
    raise UserError(f"--ray-address must be local, auto or HOST:PORT (e.g. 10.0.0.1:6379), got {address!r}")


# `agentrl rollout --verify-logprobs`: the statistics of |sampler log p - learner log p| over action
# tokens a tolerance may bound, and the bounds when none is given. fp32 is exact up to the order of
# float sums (~1e-6): its largest gap is held to 1e-4. In bf16 both sides round the logits to 8 bits
# (a step of 0.06-0.125 at the logits sampled tokens have), and where the hidden states differ in
# the last bit a token's log-prob flips by a step: a few tokens in a hundred (mean gap ~2e-3 on a
# GPU), so the largest gap and the p99.9 sit on a flip (measured 0.22 on the CPU). The mean is held
# to 5e-3 (a stale adapter moves every token), the p99.9 to 0.5 (a re-tokenised or mis-masked token
# is off by nats, a flip by a fraction of one).
GAP_STATISTICS = ("max", "p99.9", "mean")
DEFAULT_TOLERANCE = {"fp32": {"max": 1e-4}, "low": {"mean": 5e-3, "p99.9": 0.5}}


def parse_tolerance(spec: str | float | None) -> dict[str, float] | None:
    """`rollout.verify_tolerance`: auto (None: the precision's default) | `max=1e-4` |
    `mean=5e-3,p99.9=0.5` (any of max, p99.9, mean) | a bare number (a bound on the largest gap)."""
    if spec is None or (isinstance(spec, str) and spec.strip() == "auto"):
        return None
    text = str(spec).strip()
    bounds: dict[str, float] = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        name, value = (name.strip(), value.strip()) if sep else ("max", name.strip())
        if name not in GAP_STATISTICS:
            raise UserError(f"rollout.verify_tolerance: unknown statistic {name!r} in {text!r}; use "
                            f"{', '.join(GAP_STATISTICS)} (e.g. mean=5e-3,p99.9=0.5), a number (the largest gap) or auto")
        try:
            bound = float(value)
        except ValueError:
            bound = float("nan")
        if not bound >= 0 or bound == float("inf"):
            raise UserError(f"rollout.verify_tolerance: {name} must be a number >= 0, got {value!r}")
        if name in bounds:
            raise UserError(f"rollout.verify_tolerance: {name} given twice in {text!r}")
        bounds[name] = bound
    return bounds
