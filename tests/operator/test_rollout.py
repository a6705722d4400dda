"""The rollout's pure parts: the wave planner, the revision, and the progress machine driven
step by step over a simulated clock (no cluster: what the sites show is given)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from ember_operator.api.models import RolloutSpec, RolloutStatus
from ember_operator.rollout import progress, waves
from ember_operator.rollout.observe import revision_of
from ember_operator.rollout.progress import PodView, SiteView, World
from ember_runtime.contract.rollout import HealthReport

T0 = dt.datetime(2026, 12, 5, 8, 0, tzinfo=dt.UTC)
SITES = {
    f"site-{i:02d}": [{"ember.dev/site": f"site-{i:02d}", "ring": "canary" if i < 2 else "main"}]
    for i in range(10)
}


def _rollout(**extra: Any) -> RolloutSpec:
    body: dict[str, Any] = {
        "waves": [
            {"name": "canary", "sites": ["site-00"], "bakeSeconds": 60},
            {"name": "early", "percent": 30, "bakeSeconds": 60},
        ],
        **extra,
    }
    return RolloutSpec.model_validate(body)


# ----------------------------------------------------------------------------- waves


def test_waves_take_names_then_shares_then_the_rest() -> None:
    planned = waves.plan(_rollout(), SITES)
    assert [(w.name, w.sites) for w in planned] == [
        ("canary", ("site-00",)),
        ("early", ("site-01", "site-02", "site-03")),  # 30 % of 10, in name order
        ("rest", tuple(f"site-{i:02d}" for i in range(4, 10))),
    ]
    assert planned[-1].bake_seconds == 60  # the last wave's


def test_a_selector_wave_takes_the_sites_of_matching_nodes() -> None:
    spec = RolloutSpec.model_validate(
        {
            "waves": [
                {"name": "ring0", "selector": {"matchLabels": {"ring": "canary"}}},
                {
                    "name": "ring1",
                    "selector": {
                        "matchExpressions": [
                            {"key": "ring", "operator": "NotIn", "values": ["canary"]}
                        ]
                    },
                },
            ]
        }
    )
    planned = waves.plan(spec, SITES)
    assert planned[0].sites == ("site-00", "site-01")
    assert len(planned[1].sites) == 8 and len(planned) == 2  # nothing left for `rest`


def test_names_that_are_not_sites_and_sites_already_taken_leave_a_wave_empty() -> None:
    spec = RolloutSpec.model_validate(
        {"waves": [{"name": "a", "count": 2}, {"name": "b", "sites": ["site-01", "nowhere"]}]}
    )
    planned = waves.plan(spec, SITES, wanted=["site-00", "site-01", "site-05"])
    assert [(w.name, w.sites) for w in planned] == [
        ("a", ("site-00", "site-01")),
        ("b", ()),
        ("rest", ("site-05",)),
    ]


def test_replicas_are_split_evenly_over_the_sites() -> None:
    assert waves.replicas_per_site(5, ["b", "a", "c"]) == {"a": 2, "b": 2, "c": 1}
    assert waves.replicas_per_site(3, []) == {}


def test_the_revision_ignores_replicas_sites_and_the_rollout_itself() -> None:
    spec = {"replicas": 1, "model": {"name": "m"}, "placement": {"sites": ["a"]}}
    same = {**spec, "replicas": 9, "placement": {"sites": ["a", "b"]}, "rollout": {"paused": True}}
    assert revision_of(spec) == revision_of(same)
    assert revision_of(spec) != revision_of({**spec, "model": {"name": "n"}})


# ----------------------------------------------------------------------------- progress


def _health(requests: int, errors: int = 0, ttft: int | None = 100) -> HealthReport:
    return HealthReport(requests, errors, ttft, False, 300)


class Fleet:
    """Ten sites of one replica each, on a clock; each step feeds `advance` what the sites
    show, the way the operator's pods and nodes would (new pods come up Ready at once unless
    told otherwise)."""

    def __init__(self, rollout: RolloutSpec | None = None) -> None:
        self.rollout = rollout or _rollout()
        self.now = T0
        self.status: RolloutStatus | None = None
        self.revisions: dict[str, str] = {}
        self.events: list[tuple[str, str, str]] = []
        self.staged: set[str] = set(SITES)
        self.offline: set[str] = set()
        self.broken: str | None = None  # a pod failure of the new revision
        self.health: dict[str, HealthReport] = {}  # by revision
        self.stage: set[str] = set()

    def _site(self, site: str) -> SiteView:
        rev = self.revisions.get(site)
        failed = self.broken if rev == self.update and rev != self.stable else None
        pod = PodView(rev, ready=failed is None, failure=failed, health=self.health.get(str(rev)))
        return SiteView(site not in self.offline, site in self.staged, (pod,) if rev else ())

    @property
    def update(self) -> str:
        return self.spec_rev

    @property
    def stable(self) -> str | None:
        return self.status.stable_revision if self.status else None

    def step(self, spec_rev: str, seconds: float = 0) -> progress.Decision:
        self.spec_rev = spec_rev
        self.now += dt.timedelta(seconds=seconds)
        world = World(
            update_revision=spec_rev,
            spec={"rev": spec_rev},
            rollout=self.rollout,
            waves=waves.plan(self.rollout, SITES),
            sites={s: self._site(s) for s in SITES},
            replicas=dict.fromkeys(SITES, 1),
            now=self.now,
        )
        old = (
            None
            if self.status is None
            else RolloutStatus.model_validate(self.status.model_dump(by_alias=True))
        )
        decision = progress.advance(old, world)
        self.status, self.revisions = decision.status, decision.revisions
        self.events += decision.events
        self.stage = decision.stage
        return decision

    def settle(self, rev: str, seconds: float, steps: int) -> None:
        for _ in range(steps):
            self.step(rev, seconds)

    def sites_on(self, rev: str) -> set[str]:
        return {s for s, r in self.revisions.items() if r == rev}

    def reasons(self) -> list[str]:
        return [reason for _, reason, _ in self.events]


def test_the_first_version_is_everywhere_at_once() -> None:
    fleet = Fleet()
    decision = fleet.step("v1")
    assert fleet.status is not None and fleet.status.phase == "Complete"
    assert fleet.sites_on("v1") == set(SITES) and not decision.stage
    assert fleet.status.stable_spec == {"rev": "v1"}


def test_a_good_version_goes_wave_by_wave_and_becomes_stable() -> None:
    fleet = Fleet()
    fleet.step("v1")
    fleet.step("v2")
    assert fleet.status is not None
    assert fleet.sites_on("v2") == {"site-00"}  # staged already: the canary changes first
    assert fleet.stage == {"site-00"}
    fleet.step("v2", 1)  # its pod is Ready: baking
    assert fleet.status.sites[0].phase == "Baking" and fleet.sites_on("v2") == {"site-00"}
    fleet.step("v2", 30)
    assert fleet.sites_on("v2") == {"site-00"}, "the next wave waits for the bake"
    fleet.step("v2", 31)
    assert fleet.sites_on("v2") == {"site-00", "site-01", "site-02", "site-03"}
    for _ in range(6):
        fleet.step("v2", 61)
        if fleet.status.phase == "Complete":
            assert not fleet.stage, "the step that completes lifts the stage requests"
    assert fleet.status.phase == "Complete" and fleet.status.stable_revision == "v2"
    assert fleet.sites_on("v2") == set(SITES) and not fleet.stage
    assert fleet.reasons().count("WavePassed") == 3 and "RolloutComplete" in fleet.reasons()
    assert fleet.status.summary == "3/3 waves, v2"


def test_the_next_wave_waits_until_the_bytes_are_on_the_site() -> None:
    fleet = Fleet()
    fleet.step("v1")
    fleet.staged = set()
    decision = fleet.step("v2")
    assert fleet.sites_on("v2") == set() and decision.stage == {"site-00"}
    assert fleet.status is not None and fleet.status.sites[0].phase == "Staging"
    assert decision.recheck_seconds == 600  # the stage's deadline
    fleet.staged = {"site-00"}
    fleet.step("v2", 5)
    assert fleet.sites_on("v2") == {"site-00"}


def test_a_site_that_cannot_fetch_fails_its_stage_still_serving_the_old_version() -> None:
    fleet = Fleet()
    fleet.step("v1")
    fleet.staged = set()
    fleet.step("v2")
    fleet.step("v2", 601)
    assert fleet.status is not None and fleet.status.phase == "RolledBack"
    assert fleet.status.sites[0].reason == "StageFailed"
    assert fleet.sites_on("v1") == set(SITES)


def test_a_version_that_fails_to_load_is_rolled_back_at_the_canary() -> None:
    fleet = Fleet()
    fleet.step("v1")
    fleet.broken = "ModelLoadFailed: llama_model_load: tensor data is not within bounds"
    fleet.step("v2")
    fleet.step("v2", 1)
    assert fleet.status is not None and fleet.status.phase == "RolledBack"
    canary = fleet.status.sites[0]
    assert (canary.phase, canary.reason) == ("Failed", "ModelLoadFailed")
    assert fleet.sites_on("v1") == set(SITES)  # back on v1, and no other site ever changed
    assert fleet.status.waves[0].phase == "Failed" and fleet.status.waves[1].phase == "Pending"
    assert fleet.reasons()[-2:] == ["WaveFailed", "RolledBack"]
    # Until the canary's pod runs v1 again its nodes keep v1's files: no pod names them between
    # the v2 pod's end and the v1 pod's start, and a full cache would evict them then.
    assert fleet.stage == {"site-00"}
    fleet.step("v2", 1)
    assert fleet.status.phase == "RolledBack" and not fleet.stage, "lifted once back"
    fleet.broken = None
    fleet.step("v2", 600)
    assert fleet.status.phase == "RolledBack", "held until the spec changes"
    fleet.step("v3", 1)
    assert fleet.status.phase == "Progressing" and fleet.sites_on("v3") == {"site-00"}


def test_replicas_that_never_become_ready_fail_the_gate_in_time() -> None:
    fleet = Fleet()
    fleet.step("v1")
    fleet.broken = "ModelDownloading: site-00: 1 of 2 GB"  # a wait, not a failure
    fleet.step("v2")
    fleet.step("v2", 300)
    assert fleet.status is not None and fleet.status.sites[0].phase == "Updating"
    fleet.step("v2", 301)
    assert fleet.status.sites[0].reason == "ReadyTimeout"
    assert fleet.status.phase == "RolledBack"


def test_a_first_token_three_times_slower_fails_the_health_gate() -> None:
    fleet = Fleet()
    fleet.health = {"v1": _health(50, ttft=120)}
    fleet.step("v1")
    fleet.step("v2")
    fleet.step("v2", 1)
    fleet.health["v2"] = _health(40, ttft=360)
    fleet.step("v2", 20)
    assert fleet.status is not None and fleet.status.phase == "RolledBack"
    canary = fleet.status.sites[0]
    assert canary.reason == "HealthGate" and "3.00x" in str(canary.message)
    assert canary.baseline is not None and canary.baseline.ttft_p99_ms == 120
    assert fleet.sites_on("v1") == set(SITES)


@pytest.mark.parametrize(
    ("new", "passes"),
    [
        (_health(40, ttft=170), True),  # 1.42x: inside 1.5x
        (_health(5, ttft=900), True),  # too few requests: readiness alone
        (_health(40, errors=2, ttft=120), False),  # 5 % server errors against 0
        (_health(100, errors=1, ttft=120), True),  # 1 %: inside +2 points
    ],
)
def test_the_gate_compares_with_the_previous_version_on_the_same_site(
    new: HealthReport, passes: bool
) -> None:
    fleet = Fleet()
    fleet.health = {"v1": _health(50, ttft=120)}
    fleet.step("v1")
    fleet.step("v2")
    fleet.health["v2"] = new
    fleet.settle("v2", 31, 3)
    assert fleet.status is not None
    assert (fleet.status.sites[0].phase == "Passed") is passes


def test_an_unreachable_site_halts_the_rollout_and_a_skip_policy_lets_it_go_on() -> None:
    fleet = Fleet()
    fleet.step("v1")
    fleet.offline = {"site-00"}
    fleet.step("v2")
    assert fleet.status is not None and fleet.status.sites[0].phase == "Staging"
    fleet.step("v2", 599)
    assert fleet.status.phase == "Progressing", "neither healthy nor failed yet"
    fleet.step("v2", 2)
    assert fleet.status.phase == "Halted" and fleet.status.sites[0].phase == "Unreachable"
    assert fleet.sites_on("v2") == set()  # nothing rolled back, nothing moved on
    fleet.rollout = _rollout(onUnreachable="Skip")
    fleet.step("v2", 1)
    assert fleet.status.sites[0].phase == "Skipped"
    assert fleet.status.waves[0].phase == "Passed"
    assert fleet.sites_on("v2") == {"site-00", "site-01", "site-02", "site-03"}
    fleet.settle("v2", 61, 4)
    assert fleet.status.phase == "Complete" and fleet.sites_on("v2") == set(SITES)
    assert fleet.status.sites[0].phase == "Skipped", "never gated: not Passed"
    fleet.step("v2", 1)  # the steps after completion keep the record
    assert fleet.status.sites[0].phase == "Skipped" and fleet.status.waves[0].passed == 0


def test_a_site_back_within_the_window_goes_on() -> None:
    fleet = Fleet()
    fleet.step("v1")
    fleet.offline = {"site-00"}
    fleet.step("v2")
    fleet.step("v2", 100)
    fleet.offline = set()
    fleet.step("v2", 1)
    assert fleet.sites_on("v2") == {"site-00"} and "SiteReachable" in fleet.reasons()


def test_pause_holds_resume_goes_on_and_rollback_by_hand_restores_the_old_version() -> None:
    fleet = Fleet()
    fleet.step("v1")
    fleet.step("v2")
    fleet.settle("v2", 61, 2)
    assert fleet.sites_on("v2") == {"site-00", "site-01", "site-02", "site-03"}
    fleet.rollout = _rollout(paused=True)
    fleet.settle("v2", 61, 5)
    assert fleet.status is not None and fleet.status.phase == "Paused"
    assert len(fleet.sites_on("v2")) == 4
    fleet.rollout = _rollout()
    fleet.settle("v2", 61, 2)  # the held wave bakes its full time, then the rest changes
    assert len(fleet.sites_on("v2")) == 10
    fleet.rollout = _rollout(rollback=True)
    fleet.step("v2", 1)
    assert fleet.status.phase == "RolledBack" and fleet.sites_on("v1") == set(SITES)


def test_a_spec_put_back_to_the_stable_version_ends_the_rollout() -> None:
    fleet = Fleet()
    fleet.step("v1")
    fleet.step("v2")
    fleet.step("v1", 1)
    assert fleet.status is not None and fleet.status.phase == "Complete"
    assert fleet.sites_on("v1") == set(SITES) and "RolloutReverted" in fleet.reasons()


def test_no_site_to_roll_out_to_is_reported_not_a_crash() -> None:
    rollout = _rollout()
    world = World("v1", {}, rollout, waves.plan(rollout, {}), {}, {}, T0)
    decision = progress.advance(None, world)
    assert decision.status.phase == "Halted" and decision.revisions == {}
    assert "no node carries ember.dev/site" in str(decision.status.message)
