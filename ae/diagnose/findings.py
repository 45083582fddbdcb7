"""What the verdict's rules find: a `Finding` per culprit or victim, and `Findings`, the record
one rule hands the next. Both are frozen: a rule returns a new record, it never changes the one
it was given (`ae.diagnose.verdict_rules`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ae.diagnose.collectives import Mismatch
from ae.diagnose.logscan import Evidence


@dataclass(frozen=True)
class Finding:
    rank: int
    phase: str | None
    cause: str
    rule: str
    evidence: list[Evidence] = field(default_factory=list)
    time: float | None = None


@dataclass(frozen=True)
class Findings:
    culprits: tuple[Finding, ...] = ()
    victims: tuple[Finding, ...] = ()
    states: Mapping[int, str] = field(default_factory=dict)  # rank -> crashed, stalled, ...
    mismatches: tuple[Mismatch, ...] = ()  # the collective mismatches found
    # Ends after training finished (`ae.diagnose.teardown`, the last rule): no culprits
    teardown: tuple[Finding, ...] = ()

    def plus(
        self,
        culprits: Iterable[Finding] = (),
        victims: Iterable[Finding] = (),
        states: Mapping[int, str] | None = None,
    ) -> Findings:
        """These findings and a rule's own; the rule's states replace earlier ones."""
        return Findings(
            (*self.culprits, *culprits),
            (*self.victims, *victims),
            {**self.states, **(states or {})},
            self.mismatches,
            self.teardown,
        )

    @property
    def first_failure(self) -> float | None:
        """When the first culprit found so far failed (or went)."""
        return min((f.time for f in self.culprits if f.time is not None), default=None)

    def blamed(self) -> set[int]:
        return {f.rank for f in (*self.culprits, *self.victims)}
