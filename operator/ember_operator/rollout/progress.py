"""The rollout's progress: last status + what the sites show now → next status, site revisions.

Pure: no API call and no clock of its own (`now` comes in), so every rule here is unit-tested
with no cluster. State lives in `status.rollout` (the operator keeps none of its own): after a
restart the next step reads where the rollout stood.

A site's life in one rollout:

    Pending → Staging → Updating → Baking → Passed
                 │          │         │
                 └──────────┴─────────┴──→ Failed  (the whole rollout rolls back)
    a site none of whose nodes is Ready: its clock stops; after `unreachableAfterSeconds` it is
    Unreachable, and the rollout halts or skips it (`onUnreachable`).

- **Staging**: its nodes are asked to fetch the new files (`stage` in the decision); the site's
  pods do not change until the bytes are on the site (`SiteView.staged`). A site that cannot
  fetch fails here, still serving the previous version.
- **Updating**: its Deployment runs the new revision; Failed on a pod failure (the model does not
  load, an OOM kill) or when its replicas are not all Ready within `readyTimeoutSeconds`.
- **Baking**: every new replica Ready; for `bakeSeconds` its health reports are compared with the
  previous version's on the same site (the baseline taken when the site's wave began).

A failed site rolls back every site on the new revision, from the files its nodes kept (the
node agent keeps the previous version while the stage request stands). The request stands on a
site that went back until its pods run the previous version again, Ready: between the new pod's
end and the old one's binding no pod on the node names the old files, and a cache over its
budget would evict them there (and fetch them again over the WAN).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ember_runtime.contract import reasons
from ember_runtime.contract.rollout import HealthReport

from ember_operator.api.models import (
    HealthGate,
    RolloutSpec,
    RolloutStatus,
    SiteHealth,
    SiteRollout,
    UnreachablePolicy,
    WaveRollout,
)
from ember_operator.rollout.waves import Wave

# Rollout phases
COMPLETE, PROGRESSING, PAUSED, HALTED, ROLLED_BACK = (
    "Complete",
    "Progressing",
    "Paused",
    "Halted",
    "RolledBack",
)
# Site phases
PENDING, STAGING, UPDATING, BAKING, PASSED = "Pending", "Staging", "Updating", "Baking", "Passed"
FAILED, UNREACHABLE, SKIPPED = "Failed", "Unreachable", "Skipped"
DONE = frozenset({PASSED, SKIPPED})
# A pod failure that is only a wait (prewarm reports the download's progress this way).
WAITING_REASONS = frozenset({reasons.MODEL_DOWNLOADING})


@dataclass(frozen=True)
class PodView:
    revision: str | None
    ready: bool
    failure: str | None = None  # "Reason: message" of a pod that failed
    health: HealthReport | None = None


@dataclass(frozen=True)
class SiteView:
    reachable: bool
    staged: bool  # the new revision's files are on the site (or need no fetch)
    pods: tuple[PodView, ...] = ()


@dataclass(frozen=True)
class World:
    """What the operator sees now: the revisions, the waves, each site, the clock."""

    update_revision: str
    spec: dict[str, Any]  # the spec as the API server holds it (what stableSpec keeps)
    rollout: RolloutSpec
    waves: Sequence[Wave]
    sites: Mapping[str, SiteView]
    replicas: Mapping[str, int]  # per site
    now: dt.datetime


@dataclass
class Decision:
    status: RolloutStatus
    revisions: dict[str, str]  # site -> the revision its Deployment runs
    stage: set[str]  # sites whose nodes carry the stage request
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    recheck_seconds: float | None = None  # when time alone changes something

    def event(self, kind: str, reason: str, message: str) -> None:
        self.events.append((kind, reason, message))

    def due(self, seconds: float) -> None:
        seconds = max(0.5, seconds)
        self.recheck_seconds = min(self.recheck_seconds or seconds, seconds)


def stamp(now: dt.datetime) -> str:
    return now.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse(text: str | None, now: dt.datetime) -> dt.datetime:
    if not text:
        return now
    return dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)


def site_health(pods: Sequence[PodView], revision: str | None) -> SiteHealth:
    """One version's figures on one site: requests and errors summed, the worst TTFT p99."""
    reports = [p.health for p in pods if p.health is not None and p.revision == revision]
    ttfts = [r.ttft_p99_ms for r in reports if r.ttft_p99_ms is not None]
    return SiteHealth(
        requests=sum(r.requests for r in reports),
        errors=sum(r.errors for r in reports),
        ttft_p99_ms=max(ttfts) if ttfts else None,
    )


def judge(gate: HealthGate, baseline: SiteHealth | None, now: SiteHealth) -> str | None:
    """Why the new version fails its gate on this site, or None. Too few requests is no
    evidence: only readiness is judged then. Heat never counts: the replicas leave requests
    served while throttled out of their TTFT."""
    if now.requests < gate.min_requests:
        return None
    known = baseline is not None and baseline.requests >= gate.min_requests
    base_rate = baseline.errors / baseline.requests if known and baseline else 0.0
    rate = now.errors / now.requests
    if (rate - base_rate) * 100 > gate.max_error_rate_increase_percent:
        return (
            f"server errors {rate:.1%} of {now.requests} requests, previous version "
            f"{base_rate:.1%} (allowed +{gate.max_error_rate_increase_percent} points)"
        )
    before, after = (baseline.ttft_p99_ms if known and baseline else None), now.ttft_p99_ms
    if before and after and after * 100 > before * gate.max_ttft_ratio_percent:
        return (
            f"TTFT p99 {after} ms, previous version {before} ms on this site "
            f"({after / before:.2f}x, allowed {gate.max_ttft_ratio_percent / 100:.2f}x)"
        )
    return None


# ----------------------------------------------------------------------------- the step


def advance(old: RolloutStatus | None, world: World) -> Decision:
    """The next rollout status and each site's revision."""
    rev = world.update_revision
    if not world.sites:
        return _nowhere(world, old)
    if old is None or old.stable_revision is None or old.stable_spec is None:
        return _complete(world, rev, world.spec, None)  # the first version: nothing to protect
    if rev == old.stable_revision:
        return _complete(world, rev, old.stable_spec, old)  # nothing new, or the spec reverted
    state = old if old.update_revision == rev else _fresh(old, world)
    decision = Decision(state, {}, set())
    if state is not old:
        decision.event("Normal", "RolloutStarted", f"revision {rev} over {_wave_list(world)}")
    _sync_sites(state, world)
    if world.rollout.rollback and state.phase != ROLLED_BACK:
        _roll_back(state, world, decision, "rolled back by hand (spec.rollout.rollback)")
    elif state.phase == ROLLED_BACK:
        pass  # held on the previous version until the spec changes
    elif world.rollout.paused:
        state.phase = PAUSED
    else:
        _step(state, world, decision)
    decision.revisions = _revisions(state)
    if state.phase in (PROGRESSING, PAUSED, HALTED):  # done: no request stands
        decision.stage = {s.name for s in state.sites if s.phase != PENDING}
    elif state.phase == ROLLED_BACK:  # until the sites that went back are back
        decision.stage = {s.name for s in state.sites if not _back(s, world, state)}
    _summarise(state, world)
    return decision


def _back(site: SiteRollout, world: World, state: RolloutStatus) -> bool:
    """The site runs the stable revision again: each of its pods on it and Ready."""
    if site.phase == PENDING or not world.replicas.get(site.name):
        return True  # never staged, or nothing to run there
    view = world.sites.get(site.name)
    pods = view.pods if view is not None else ()
    return bool(pods) and all(p.revision == state.stable_revision and p.ready for p in pods)


def _nowhere(world: World, old: RolloutStatus | None) -> Decision:
    """No site to roll out to: nothing runs, and status says why (Degraded, RolloutHalted)."""
    stable = old.stable_revision if old else None
    status = RolloutStatus(
        phase=HALTED,
        stable_revision=stable,
        update_revision=world.update_revision,
        stable_spec=old.stable_spec if old else None,
        # placement.sites are covered whether or not a node carries them (unreachable then):
        # only a spec without them and a cluster without sites comes here.
        message="no site to roll out to: no node carries ember.dev/site",
        summary="no sites",
    )
    return Decision(status, {}, set())


def _wave_list(world: World) -> str:
    return ", ".join(f"{w.name} ({len(w.sites)} sites)" for w in world.waves)


def _complete(world: World, rev: str, spec: dict[str, Any], old: RolloutStatus | None) -> Decision:
    # A site skipped while unreachable stays Skipped in the record of the rollout that
    # completed without its gate (until the next rollout), not Passed.
    skipped = {
        s.name: s
        for s in (old.sites if old is not None and old.update_revision == rev else [])
        if s.phase == SKIPPED
    }
    sites = [
        skipped.get(s) or SiteRollout(name=s, wave=w.name, revision=rev, phase=PASSED)
        for w in world.waves
        for s in w.sites
    ]
    waves = [
        WaveRollout(
            name=w.name,
            phase=PASSED,
            sites=len(w.sites),
            passed=sum(site.wave == w.name and site.phase == PASSED for site in sites),
        )
        for w in world.waves
    ]
    status = RolloutStatus(
        phase=COMPLETE,
        stable_revision=rev,
        update_revision=rev,
        stable_spec=spec,
        waves=waves,
        sites=sites,
    )
    decision = Decision(status, {s: rev for w in world.waves for s in w.sites}, set())
    if old is not None and old.update_revision not in (None, rev):
        decision.event("Normal", "RolloutReverted", f"the spec is back at revision {rev}")
    _summarise(status, world)
    return decision


def _fresh(old: RolloutStatus, world: World) -> RolloutStatus:
    """A new revision: every site starts Pending on the previous version."""
    sites = [
        SiteRollout(name=s, wave=w.name, revision=old.stable_revision, phase=PENDING)
        for w in world.waves
        for s in w.sites
    ]
    return RolloutStatus(
        phase=PROGRESSING,
        stable_revision=old.stable_revision,
        update_revision=world.update_revision,
        stable_spec=old.stable_spec,
        waves=[WaveRollout(name=w.name, phase=PENDING, sites=len(w.sites)) for w in world.waves],
        sites=sites,
    )


def _sync_sites(state: RolloutStatus, world: World) -> None:
    """Sites that appeared since the rollout began join their wave Pending (or Passed, if
    that wave has passed: a new site simply runs the new version); sites gone are dropped."""
    wave_of = {s: w.name for w in world.waves for s in w.sites}
    known = {s.name: s for s in state.sites}
    passed = {w.name for w in state.waves if w.phase == PASSED}
    sites = []
    for name, wave in wave_of.items():
        site = known.get(name)
        if site is None:
            phase = PASSED if wave in passed else PENDING
            rev = state.update_revision if phase == PASSED else state.stable_revision
            site = SiteRollout(name=name, wave=wave, revision=rev, phase=phase)
        sites.append(site.model_copy(update={"wave": wave}))
    state.sites = sites
    old_waves = {w.name: w for w in state.waves}
    state.waves = [
        old_waves.get(w.name, WaveRollout(name=w.name, phase=PENDING)).model_copy(
            update={"sites": len(w.sites)}
        )
        for w in world.waves
    ]


def _revisions(state: RolloutStatus) -> dict[str, str]:
    """Each site's revision as its entry records it: set to the new one when it starts
    Updating (or is skipped), back to the previous one when the rollout rolls back."""
    return {s.name: str(s.revision or state.stable_revision) for s in state.sites}


def _step(state: RolloutStatus, world: World, decision: Decision) -> None:
    state.phase = PROGRESSING
    for wave, spec in zip(state.waves, world.waves, strict=True):
        if wave.phase == PASSED:
            continue
        if wave.phase == PENDING:
            wave.phase, wave.started_at = PROGRESSING, stamp(world.now)
            decision.event("Normal", "WaveStarted", f"wave {wave.name}: {len(spec.sites)} sites")
        state.current_wave = wave.name
        sites = [s for s in state.sites if s.wave == wave.name]
        for site in sites:
            _step_site(site, state, world, decision, spec)
            if site.phase == FAILED:
                why = f"site {site.name} failed: {site.message}"
                decision.event("Warning", "WaveFailed", f"wave {wave.name}: {why}")
                _roll_back(state, world, decision, why)
                return
        wave.passed = sum(s.phase == PASSED for s in sites)
        if any(s.phase == UNREACHABLE for s in sites) and (
            world.rollout.on_unreachable == UnreachablePolicy.HALT
        ):
            state.phase = HALTED
            state.message = "an unreachable site holds the rollout (onUnreachable: Halt)"
            return
        if not all(s.phase in DONE for s in sites):
            return
        wave.phase, wave.finished_at = PASSED, stamp(world.now)
        decision.event("Normal", "WavePassed", f"wave {wave.name}: {wave.passed} sites passed")
    state.phase, state.current_wave = COMPLETE, None
    state.stable_revision, state.stable_spec = state.update_revision, world.spec
    decision.event(
        "Normal", reasons.ROLLOUT_COMPLETE, f"revision {state.update_revision} everywhere"
    )


def _step_site(
    site: SiteRollout, state: RolloutStatus, world: World, decision: Decision, wave: Wave
) -> None:
    if site.phase in DONE:
        return
    step = _SiteStep(site, state, world, decision, wave)
    if site.phase == PENDING:
        step.enter(STAGING, "waiting for the new files on the site")
        site.baseline = site_health(step.view.pods, state.stable_revision)
    if not step.reachable():
        return
    if site.phase == STAGING:
        step.staging()
    if site.phase == UPDATING:
        step.updating()
    if site.phase == BAKING:
        step.baking()


@dataclass
class _SiteStep:
    """One site's step: what it sees and the rules that move its phase."""

    site: SiteRollout
    state: RolloutStatus
    world: World
    decision: Decision
    wave: Wave

    @property
    def view(self) -> SiteView:
        return self.world.sites.get(self.site.name, SiteView(reachable=False, staged=False))

    @property
    def gate(self) -> HealthGate:
        return self.world.rollout.gate

    def enter(self, phase: str, message: str, reason: str | None = None) -> None:
        _enter(self.site, phase, self.world, message, reason)

    def elapsed(self) -> float:
        return (self.world.now - _parse(self.site.since, self.world.now)).total_seconds()

    def wait_or_fail(self, limit: float, reason: str, message: str) -> None:
        left = limit - self.elapsed()
        if left <= 0:
            self.enter(FAILED, message, reason)
        else:
            self.decision.due(left)

    def reachable(self) -> bool:
        """A site none of whose nodes is Ready is neither healthy nor failed: its clock stops,
        and after `unreachableAfterSeconds` it is Unreachable (the wave halts or skips it)."""
        site, world = self.site, self.world
        if self.view.reachable:
            if site.unreachable_since is not None:
                site.unreachable_since = None
                self.enter(STAGING, "reachable again: staging checked anew")
                self.decision.event("Normal", "SiteReachable", f"site {site.name} is back")
            return True
        site.unreachable_since = site.unreachable_since or stamp(world.now)
        away = (world.now - _parse(site.unreachable_since, world.now)).total_seconds()
        limit = world.rollout.unreachable_after_seconds
        if away < limit:
            self.decision.due(limit - away)
            return False
        skip = world.rollout.on_unreachable == UnreachablePolicy.SKIP
        if site.phase != UNREACHABLE:
            self.enter(UNREACHABLE, f"no node Ready for {int(away)}s", "SiteUnreachable")
            action = "skipped" if skip else "holds the rollout"
            self.decision.event("Warning", "SiteUnreachable", f"site {site.name}: {action}")
        if skip:
            site.phase = SKIPPED  # it takes the new version, ungated, when it comes back
            site.revision = self.state.update_revision
        return False

    def staging(self) -> None:
        if self.view.staged:
            self.enter(UPDATING, "new files on the site; replicas changing")
            self.site.revision = self.state.update_revision
            return
        limit = self.gate.ready_timeout_seconds
        self.wait_or_fail(limit, "StageFailed", "the new files did not reach the site in time")

    def new_pods(self) -> list[PodView]:
        return [p for p in self.view.pods if p.revision == self.state.update_revision]

    def broken(self) -> bool:
        """A new replica failed (the model does not load, an OOM kill): the site fails."""
        pod = next((p for p in self.new_pods() if p.failure and not _waiting(p.failure)), None)
        if pod is not None:
            self.enter(FAILED, str(pod.failure), str(pod.failure).split(":", 1)[0])
        return pod is not None

    def updating(self) -> None:
        if self.broken():
            return
        want = self.world.replicas.get(self.site.name, 0)
        ready = sum(p.ready for p in self.new_pods())
        old_left = any(p.revision != self.state.update_revision for p in self.view.pods)
        if ready >= want and not old_left:
            self.enter(BAKING, f"{want} replicas Ready on the new version; baking")
            return
        limit = self.gate.ready_timeout_seconds
        self.wait_or_fail(limit, "ReadyTimeout", f"{ready}/{want} new replicas Ready in time")

    def baking(self) -> None:
        if self.broken():
            return
        site = self.site
        site.observed = site_health(self.view.pods, self.state.update_revision)
        why = judge(self.gate, site.baseline, site.observed)
        if why is not None:
            self.enter(FAILED, why, "HealthGate")
            return
        left = self.wave.bake_seconds - self.elapsed()
        if left <= 0:
            self.enter(PASSED, "healthy for the whole bake time")
        else:
            self.decision.due(left)


def _waiting(failure: str) -> bool:
    return failure.split(":", 1)[0] in WAITING_REASONS


def _enter(
    site: SiteRollout, phase: str, world: World, message: str, reason: str | None = None
) -> None:
    site.phase, site.since, site.message, site.reason = phase, stamp(world.now), message, reason


def _roll_back(state: RolloutStatus, world: World, decision: Decision, why: str) -> None:
    """Every site on the new revision goes back to the previous one (its nodes kept its files);
    the rollout holds there until the spec changes."""
    back = [s for s in state.sites if s.revision == state.update_revision]
    for site in back:
        if site.phase != FAILED:
            _enter(site, ROLLED_BACK, world, "back on the previous version")
        site.revision = state.stable_revision
    for wave in state.waves:
        if wave.phase == PROGRESSING:
            wave.phase, wave.finished_at = FAILED, stamp(world.now)
    state.phase, state.message = ROLLED_BACK, why
    decision.event(
        "Warning", reasons.ROLLED_BACK, f"{why}; {len(back)} sites back on {state.stable_revision}"
    )


def _summarise(state: RolloutStatus, world: World) -> None:
    """The one line `kubectl get infd` shows: `canary 1/1 Baking`, `3/3 waves Complete`."""
    total = len(state.waves)
    done = sum(w.phase == PASSED for w in state.waves)
    if state.phase == COMPLETE:
        state.summary = f"{done}/{total} waves, {state.update_revision}"
        return
    wave = next((w for w in state.waves if w.name == state.current_wave), None)
    where = f"{wave.name} {wave.passed}/{wave.sites}" if wave else f"{done}/{total} waves"
    state.summary = f"{where} {state.phase}"
