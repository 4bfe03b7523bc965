"""Judgement: which targets agree, and whether a target's error is more than its dtype's rounding.

Exact numbers are not yet an answer. Two readings of a finished run give one:

- **Agreement groups.** Per check, the run's targets (the reference is no member) partitioned by
  bitwise equality of every tensor both hold: the pairwise table's `bitwise_equal` (content hashes,
  or the values where both captures kept them). Bitwise equality is transitive, so the pairs that
  agree on every tensor join their targets into groups.
- **Anomalies.** Each target's distance to the reference is set against its *peer's* on the same
  tensor (`core.spec.peer_of`: the CPU target of its dtype without flags):
  `peer_ratio = rel_l2 ÷ max(the peer's rel_l2, ε)`. A row whose ratio exceeds `ANOMALY_RATIO` is an
  anomaly; the rest of a dtype's drift is what its own rounding gives. ε is the machine epsilon of the
  row's dtype for computed tensors (deltas, outputs, merge, activations): an exact CPU peer does not
  make a GPU's ordinary rounding infinite. Loaded weights keep the strict rule (ε = 0): a load that
  should be bitwise and is not is ∞. Where both are exact, 1.

Pure functions of the tables (pandas); nothing here loads a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

# A row is an anomaly when its rel_l2 exceeds its peer's on the same tensor by more than this factor.
# Chosen from measured spreads (docs/metrics.md, "Judgement"; `python -m bench.judgement`): ordinary
# variants (thread counts, +deterministic, the peer in another process) stay under 4× on every
# tensor of the demo, the packaged MiniLM and the families the tests build, and the perturbations
# they must catch sit at 100× and more.
ANOMALY_RATIO = 16.0
# The keys a peer row is found by: the same tensor of the same check against the same reference.
PEER_KEY = ("check", "reference", "adapter", "tensor")
# Settings of a capture's environment that change numerics, each with how a sentence names it.
_NUMERICS = (
    ("tf32_matmul", lambda v: "TF32 on" if v else "TF32 off"),
    ("float32_matmul_precision", lambda v: f"float32 matmul precision {v!r}"),
    (
        "deterministic_algorithms",
        lambda v: "deterministic algorithms" if v else "non-deterministic algorithms",
    ),
    ("num_threads", lambda v: f"{v} CPU thread{'s' if v != 1 else ''}"),
    ("device", lambda v: f"on {v}"),
    ("gpu_name", lambda v: f"GPU {v}"),
    ("torch", lambda v: f"torch {v}"),
    ("transformers", lambda v: f"transformers {v}"),
    ("peft", lambda v: f"PEFT {v}"),
    ("cpu", lambda v: f"CPU {v}"),
)


def add_peer_columns(
    table: pd.DataFrame, peers: dict[str, str | None], judged: set[str], strict: frozenset[str] = frozenset()
) -> pd.DataFrame:
    """`table` with `peer` (the peer's target name; null where there is none or the check is not
    judged) and `peer_ratio` (this row's rel_l2 ÷ the peer's on the same tensor, floored at the row
    dtype's machine epsilon except for the `strict` checks; null where either is missing and for the
    peer's own rows)."""
    out = table.copy()
    if out.empty:
        out["peer"], out["peer_ratio"] = pd.Series(dtype=object), pd.Series(dtype=float)
        return out
    peer = out["target"].map(lambda t: peers.get(t)).where(out["check"].isin(judged), None)
    keys = out[list(PEER_KEY)].astype(object).where(out[list(PEER_KEY)].notna(), "")
    # a reference that names the row's own target (`unmerged (cpu/float32)`) is the peer's own one
    keys["reference"] = [
        str(r).replace(str(t), "·") for r, t in zip(keys["reference"], out["target"], strict=True)
    ]
    rel = pd.to_numeric(out["rel_l2"], errors="coerce").astype(float)
    lookup = (
        keys.assign(peer=out["target"], _peer_rel=rel)
        .drop_duplicates([*PEER_KEY, "peer"])
        .set_index([*PEER_KEY, "peer"])["_peer_rel"]
    )
    index = pd.MultiIndex.from_frame(keys.assign(peer=peer.fillna("")))
    peer_rel = pd.Series(lookup.reindex(index).to_numpy(), index=out.index)
    own = peer.notna() & (peer == out["target"])
    out["peer"] = peer.astype(object).where(peer.notna(), None)
    floors = [0.0 if c in strict else dtype_floor(d) for c, d in zip(out["check"], out["dtype"], strict=True)]
    out["peer_ratio"] = [
        math.nan if o else ratio(t, p, f) for o, t, p, f in zip(own, rel, peer_rel, floors, strict=True)
    ]
    return out


def dtype_floor(dtype: Any) -> float:
    """The machine epsilon of a row's dtype (`torch.finfo(dtype).eps`; a quantized target's rows carry
    its compute dtype): the smallest peer error a computed tensor is judged against. 0 where the dtype
    is no float dtype torch knows."""
    return _EPS.get(str(dtype).removeprefix("torch."), 0.0)


# torch.finfo(dtype).eps, written out: judgement is pure pandas and imports no torch
_EPS = {
    "float64": 2.220446049250313e-16,
    "float32": 1.1920928955078125e-07,
    "bfloat16": 0.0078125,
    "float16": 0.0009765625,
}


def ratio(error: float, peer_error: float, floor: float = 0.0) -> float:
    """`error ÷ max(peer_error, floor)` for two rel_l2 values: 1 where both are 0, ∞ where the
    denominator is 0 and the error not (or only this one is not finite), NaN where the peer's is
    unknown."""
    if peer_error is None or math.isnan(peer_error):
        return math.nan
    if not math.isfinite(error):
        return math.inf if math.isfinite(peer_error) else math.nan
    if error == 0.0 and peer_error == 0.0:
        return 1.0
    below = max(peer_error, floor)
    if below == 0.0:
        return math.inf
    return error / below


def anomalies(table: pd.DataFrame, k: float = ANOMALY_RATIO) -> pd.DataFrame:
    """The rows whose error exceeds their peer's by more than `k` (the table's rows, worst first)."""
    if table.empty or "peer_ratio" not in table:
        return table.iloc[0:0]
    ratios = pd.to_numeric(table["peer_ratio"], errors="coerce")
    found = table[ratios > k]
    return (
        found.assign(_r=ratios[ratios > k])
        .sort_values("_r", ascending=False, kind="stable")
        .drop(columns="_r")
    )


# What a judged row is called where it is not identical, within tolerance or broken (`judged_verdicts`)
AS_EXPECTED = "as expected for its dtype"
ANOMALY = "anomaly"


def judged_verdicts(table: pd.DataFrame, k: float = ANOMALY_RATIO) -> pd.Series:
    """Each row's verdict read with the judgement, as the Overview reads it: a judged row beyond
    tolerance is `anomaly` when its error exceeds `k`× its peer's, else `as expected for its dtype`
    (the peer's own rows too: their drift is their dtype's rounding); `identical`, `within tolerance`
    and `broken` stay, and so does every verdict of a row with no peer."""
    if table.empty or "peer" not in table or "peer_ratio" not in table:
        return table["verdict"] if "verdict" in table else pd.Series(dtype=object)
    verdict = table["verdict"].astype(object)
    judged = table["peer"].notna()
    over = pd.to_numeric(table["peer_ratio"], errors="coerce") > k
    out = verdict.where(~(judged & (verdict == "drift")), AS_EXPECTED)
    return out.where(~(judged & over & verdict.isin(["drift", "within tolerance"])), ANOMALY)


def anomaly_records(table: pd.DataFrame, k: float = ANOMALY_RATIO) -> list[dict[str, Any]]:
    """`--json`'s `anomalies`: one {target, check, tensor, ratio, peer} per anomalous row, worst first.
    An infinite ratio (the peer bitwise exact, this target not) is written as null: JSON has no ∞."""
    return [
        {
            "target": r["target"],
            "check": r["check"],
            "tensor": r["tensor"],
            "ratio": float(r["peer_ratio"]) if math.isfinite(r["peer_ratio"]) else None,
            "peer": r["peer"],
        }
        for r in anomalies(table, k).to_dict(orient="records")
    ]


@dataclass
class Group:
    """Targets that agree bitwise on every tensor of a check that they hold."""

    members: list[str]
    # how this group differs from the check's first group (empty for the first)
    differs: str = ""
    n_differing: int = 0


@dataclass
class Groups:
    """A check's agreement groups, first the group of the run's first target."""

    check: str
    groups: list[Group] = field(default_factory=list)

    def sentence(self) -> str:
        """`weights: {a, b} bitwise equal; {c} differs from the first group in 28 adapter tensors (…)`."""
        parts = []
        for i, g in enumerate(self.groups):
            names = "{" + ", ".join(g.members) + "}"
            together = " bitwise equal" if len(g.members) > 1 else ""
            if i == 0:
                parts.append(f"{names}{together}")
                continue
            also = " equal to each other," if len(g.members) > 1 else ""
            parts.append(f"{names}{also} {g.differs}")
        if len(self.groups) == 1 and len(self.groups[0].members) > 1:
            parts[0] = "{" + ", ".join(self.groups[0].members) + "} all bitwise equal"
        return f"{self.check}: " + "; ".join(parts)


def agreement_groups(pairwise: pd.DataFrame, targets: list[str], checks: list[str]) -> dict[str, Groups]:
    """Per check, `targets` (the reference left out by the caller) partitioned by bitwise equality on
    every tensor both hold (`pairwise.parquet`); a pair with no tensor in common stays apart."""
    out: dict[str, Groups] = {}
    for check in checks:
        rows = pairwise[pairwise["check"] == check] if len(pairwise) else pairwise
        parent = {t: t for t in targets}
        if len(rows):
            equal = rows["bitwise_equal"].astype("boolean").fillna(False)
            agree = equal.groupby([rows["target"], rows["other"]], sort=False).all()
            for (a, b), same in agree.items():
                if same and a in parent and b in parent:
                    parent[_root(parent, b)] = _root(parent, a)
        members: dict[str, list[str]] = {}
        for t in targets:
            members.setdefault(_root(parent, t), []).append(t)
        groups = [Group(m) for m in members.values()]
        for g in groups[1:]:
            g.n_differing, g.differs = _difference(rows, groups[0].members[0], g.members[0])
        out[check] = Groups(check, groups)
    return out


def _root(parent: dict[str, str], t: str) -> str:
    """The representative of `t`'s group (union-find with path halving)."""
    while parent[t] != t:
        parent[t] = parent[parent[t]]
        t = parent[t]
    return t


def _difference(rows: pd.DataFrame, a: str, b: str) -> tuple[int, str]:
    """How many tensors targets `a` and `b` differ in, and which, in words."""
    if not len(rows):
        return 0, "differs from the first group (no tensor in common to compare)"
    pair = rows[
        ((rows["target"] == a) & (rows["other"] == b)) | ((rows["target"] == b) & (rows["other"] == a))
    ]
    if pair.empty:
        return 0, "differs from the first group (no tensor in common to compare)"
    diff = pair[~pair["bitwise_equal"].astype("boolean").fillna(False)]
    n, total = len(diff), len(pair)
    adapters = diff["adapter"].notna()
    kind = "adapter " if adapters.all() else "base-model " if not adapters.any() else ""
    roles = sorted({str(r) for r in diff["role"].dropna()})
    if roles == ["base"]:  # a base-model weight's role says nothing: its modules do
        roles = sorted({str(m) for m in diff["module"].dropna()}) if "module" in diff else []
    roles = "/".join(roles[:4]) + ("/…" if len(roles) > 4 else "")
    layers, all_layers = set(diff["layer"].dropna()), set(pair["layer"].dropna())
    where = ""
    if layers:
        where = (
            " of every layer" if layers == all_layers else f" in {len(layers)} of {len(all_layers)} layers"
        )
    what = f" ({roles}{where})" if roles else ""
    if n == total:
        return n, f"differs from the first group in all {n} {kind}tensors{what}"
    return n, f"differs from the first group in {n} of {total} {kind}tensors{what}"


@dataclass
class Rewrite:
    """An adapter that rewrites base weights when it loads (PiSSA's SVD, OLoRA's QR, on the load
    device), and the targets whose rewritten weights differ from their peer's (or, without peers,
    from the run's first target's)."""

    adapter: str
    n: int
    how: str
    differing: list[tuple[str, str]] = field(default_factory=list)  # (target, the target it differs from)
    compared: int = 0  # how many (target, peer) pairs were set against each other

    def sentence(self) -> str:
        """`pissa rewrites 12 base weights at load (SVD on the load device): cuda:0/float32 differs from
        cpu/float32 in them`."""
        head = (
            f"{self.adapter} rewrites {self.n} base weight{'s' if self.n != 1 else ''} at load ({self.how})"
        )
        if not self.compared:
            return f"{head}: no target here has a peer besides itself to set them against"
        if not self.differing:
            return f"{head}: every target is bitwise its peer in them"
        return f"{head}: " + "; ".join(f"{t} differs from {o} in them" for t, o in self.differing)


def rewrites(table: pd.DataFrame, pairwise: pd.DataFrame, targets: list[str]) -> list[Rewrite]:
    """The adapters whose rows carry a `rewrite` (base weights rewritten at load: the weights check's
    `rewritten base` rows), each with the targets that differ in those weights from their peer."""
    if table.empty or "rewrite" not in table:
        return []
    rows = table[table["rewrite"].notna() & table["target"].isin(targets)]
    out = []
    for adapter, mine in rows.groupby("adapter", sort=False):
        tensors = set(mine["tensor"])
        pairs = (
            pairwise[pairwise["adapter"].eq(adapter) & pairwise["tensor"].isin(tensors)]
            if len(pairwise)
            else pairwise
        )
        against = _peers_or_first(mine, targets)
        differing = []
        for target, other in against:
            pair = (
                pairs[
                    ((pairs["target"] == target) & (pairs["other"] == other))
                    | ((pairs["target"] == other) & (pairs["other"] == target))
                ]
                if len(pairs)
                else pairs
            )
            if len(pair) and not pair["bitwise_equal"].astype("boolean").fillna(False).all():
                differing.append((target, other))
        out.append(Rewrite(str(adapter), len(tensors), str(mine["rewrite"].iloc[0]), differing, len(against)))
    return out


def _peers_or_first(rows: pd.DataFrame, targets: list[str]) -> list[tuple[str, str]]:
    """(target, what it is set against) for the targets of `rows`: its peer where the rows name one,
    else the run's first target."""
    present = [t for t in targets if t in set(rows["target"])]
    peer = rows.drop_duplicates("target").set_index("target")["peer"] if "peer" in rows else None
    out = []
    for t in present:
        other = peer.get(t) if peer is not None else None
        other = other if isinstance(other, str) else present[0]
        if other != t and other in present:
            out.append((t, other))
    return out


def explain(target_env: dict[str, Any], peer_env: dict[str, Any]) -> str:
    """The settings that differ between a target's environment and its peer's, in words
    (`TF32 on, float32 matmul precision 'high'`); empty where none does."""
    said = []
    for key, words in _NUMERICS:
        mine, theirs = target_env.get(key), peer_env.get(key)
        if mine != theirs and mine is not None:
            said.append(
                f"{words(mine)} (peer: {theirs})" if key in ("num_threads", "device") else words(mine)
            )
    return ", ".join(said)


@dataclass
class AnomalySummary:
    """One target's anomalies in one check, for a sentence."""

    target: str
    check: str
    peer: str
    n: int
    of: int
    worst_ratio: float
    worst_tensor: str
    why: str = ""
    only_adapter: str | None = None  # the one adapter every anomalous row belongs to, if one does

    def sentence(self) -> str:
        """`cuda:1/float32: outputs 310× the error of cpu/float32 (3 of 4 tensors; worst logits) — TF32 on`;
        `(59 of 630 tensors, all pissa; …)` where one adapter holds every anomalous row."""
        times = "∞×" if math.isinf(self.worst_ratio) else f"{self.worst_ratio:.3g}×"
        exact = " (exact there)" if math.isinf(self.worst_ratio) else ""
        why = f" — {self.why}" if self.why else ""
        only = f", all {self.only_adapter}" if self.only_adapter else ""
        return (
            f"{self.target}: {self.check} {times} the error of {self.peer}{exact} "
            f"({self.n} of {self.of} tensors{only}; worst {self.worst_tensor}){why}"
        )


def summarise_anomalies(
    table: pd.DataFrame, environments: dict[str, dict[str, Any]] | None = None, k: float = ANOMALY_RATIO
) -> list[AnomalySummary]:
    """Anomalous rows gathered per target and check, worst first, each with what differs from its peer."""
    found = anomalies(table, k)
    envs = environments or {}
    out = []
    for (target, check), rows in found.groupby(["target", "check"], sort=False):
        judged = table[(table["target"] == target) & (table["check"] == check) & table["peer_ratio"].notna()]
        worst = rows.iloc[0]
        out.append(
            AnomalySummary(
                target=target,
                check=check,
                peer=worst["peer"],
                n=len(rows),
                of=len(judged),
                worst_ratio=float(worst["peer_ratio"]),
                worst_tensor=str(worst["tensor"])
                + (f" · {worst['adapter']}" if pd.notna(worst["adapter"]) else ""),
                why=explain(envs.get(target, {}), envs.get(worst["peer"], {})),
                only_adapter=_only_adapter(rows, judged),
            )
        )
    return out


def _only_adapter(found: pd.DataFrame, judged: pd.DataFrame) -> str | None:
    """The adapter every anomalous row belongs to, where the judged rows hold others too (PiSSA alone
    on a GPU); None where the rows span several, the bare base, or the run has one adapter."""
    names = set(found["adapter"].astype(object).where(found["adapter"].notna(), ""))
    if len(names) != 1 or "" in names:
        return None
    others = set(judged["adapter"].astype(object).where(judged["adapter"].notna(), "")) - names
    return str(names.pop()) if others else None


def expected_drift(table: pd.DataFrame, k: float = ANOMALY_RATIO) -> dict[str, int]:
    """Per dtype, the rows beyond tolerance whose error is within `k`× their peer's (or that are the
    peer's own): drift that dtype's rounding gives."""
    if table.empty or "peer_ratio" not in table:
        return {}
    beyond = table[table["verdict"].isin(["drift"]) & table["peer"].notna()]
    ratios = pd.to_numeric(beyond["peer_ratio"], errors="coerce")
    ok = beyond[~(ratios > k)]
    counts = ok.groupby(ok["dtype"].astype(str)).size()
    return {str(d): int(n) for d, n in counts.items()}


def unjudged_reason(spec_peers: bool, table: pd.DataFrame) -> str | None:
    """Why a run's rows carry no judgement, or None when they do."""
    if not spec_peers:
        return "peers were turned off for this run (--no-peers): no anomaly judgement is made"
    if "peer_ratio" not in table:
        return "this run was stored before peers existed: no anomaly judgement is made"
    if table.empty or not table["peer"].notna().any():
        return "no target of this run has a peer (the CPU target of its dtype) it could be judged against"
    return None


@dataclass
class Judgement:
    """A run's answer: agreement groups per check, anomalies, the drift each dtype's rounding explains."""

    groups: dict[str, Groups]
    anomalies: list[AnomalySummary]
    expected: dict[str, int]  # dtype → rows beyond tolerance that its rounding explains
    unjudged: str | None  # why no row was judged against a peer, or None
    k: float = ANOMALY_RATIO
    rewrites: list[Rewrite] = field(default_factory=list)  # adapters that rewrite base weights at load

    def groups_json(self) -> dict[str, list[list[str]]]:
        """`--json`'s `groups`: per check, the members of each group."""
        return {check: [g.members for g in gs.groups] for check, gs in self.groups.items()}

    def answer_json(self, table: pd.DataFrame) -> dict[str, Any]:
        """`--json`'s answer: `groups`, `rewrites` (sentences) and `anomalies` (`anomaly_records`)."""
        return {
            "groups": self.groups_json(),
            "rewrites": [r.sentence() for r in self.rewrites],
            "anomalies": anomaly_records(table, self.k) if self.unjudged is None else [],
        }

    def lines(self) -> list[str]:
        """The answer in sentences, groups first, for the CLI summary."""
        out = ["agreement groups:"] if self.groups else []
        out += [f"  {g.sentence()}" for g in self.groups.values()]
        out += [f"  {r.sentence()}" for r in self.rewrites]
        if self.unjudged:
            out.append(f"no anomaly judgement: {self.unjudged}")
        elif self.anomalies:
            out.append(f"anomalies (rel_l2 over {self.k:g}× the peer's on the same tensor):")
            out += [f"  {a.sentence()}" for a in self.anomalies]
        else:
            out.append(f"no anomaly: every target's error is within {self.k:g}× its peer's on every tensor")
        out += [f"drift as expected for {dtype}: {line}" for dtype, line in self.expected_lines().items()]
        return out

    def expected_lines(self) -> dict[str, str]:
        """Per dtype with drift rows its rounding explains, that count in words."""
        return {
            dtype: f"{n} row{'s' if n != 1 else ''} beyond tolerance, each within {self.k:g}× the error of "
            f"cpu/{dtype}, its rounding on the same computation"
            for dtype, n in self.expected.items()
        }


def judge(
    table: pd.DataFrame,
    pairwise: pd.DataFrame,
    targets: list[str],
    grouped_checks: list[str],
    peers: bool = True,
    environments: dict[str, dict[str, Any]] | None = None,
    k: float = ANOMALY_RATIO,
) -> Judgement:
    """The judgement of a run from its metrics table (with peer columns) and pairwise table.

    `targets`: the run's targets but its reference; `grouped_checks`: the checks whose tensors are
    compared across targets (the pairwise table's)."""
    present = [c for c in grouped_checks if len(table) and c in set(table["check"])]
    unjudged = unjudged_reason(peers, table)
    return Judgement(
        groups=agreement_groups(pairwise, targets, present),
        anomalies=[] if unjudged else summarise_anomalies(table, environments, k),
        expected={} if unjudged else expected_drift(table, k),
        unjudged=unjudged,
        k=k,
        rewrites=rewrites(table, pairwise, targets),
    )
